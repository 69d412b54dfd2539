import pytest
import torch

from tierd.tiers.device import DeviceTier

MiB = 1 << 20


def _check_tier(device: str) -> None:
    tier = DeviceTier(4 * MiB, device, slab_bytes=2 * MiB)
    (a,) = tier.alloc_pages(1, 2 * MiB)
    tier.view(a.offset, 2 * MiB).fill_(3)
    (b,) = tier.alloc_pages(4, 4096)
    assert tier.used == 2 * MiB + 4 * 4096
    assert tier.alloc_pages(1, 2 * MiB) is None  # over budget
    assert int(tier.view(a.offset, 2 * MiB).sum()) == 3 * 2 * MiB
    tier.free(b)
    tier.set_budget(2 * MiB)  # slab 1 is empty now: it goes
    assert tier.capacity == 2 * MiB
    tier.free(a)
    tier.close()


def test_device_tier_logic_on_cpu():
    _check_tier("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tier_on_cuda():
    _check_tier("cuda")
