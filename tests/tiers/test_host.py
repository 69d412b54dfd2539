import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import arena_name, host_tier
from tierd.tiers.host import HostTier

MiB = 1 << 20


@pytest.fixture
def host():
    tier = host_tier(8 * MiB, 4 * MiB)
    yield tier
    tier.close()


def test_slabs_are_private_shared_memory_files(host):
    pieces = host.alloc_pages(1, 4096)
    path = host.slab_path(0)
    assert os.path.exists(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    host.free(pieces[0])
    host.close()
    assert not os.path.exists(path)


def test_another_process_sees_the_bytes_by_name(host):
    (piece,) = host.alloc_pages(4, 4096)
    host.view(piece.offset, 4 * 4096)[:] = np.arange(4 * 4096, dtype=np.uint64).astype(np.uint8)
    slab, off = host.locate(piece.offset)
    code = (
        "import mmap,os,sys,hashlib\n"
        f"fd=os.open('/dev/shm/{host.slab_name(slab)}', os.O_RDONLY)\n"
        f"m=mmap.mmap(fd, {host.slab_bytes}, prot=mmap.PROT_READ)\n"
        f"sys.stdout.write(hashlib.sha256(m[{off}:{off + 4 * 4096}]).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import hashlib

    assert out == hashlib.sha256(host.view(piece.offset, 4 * 4096).tobytes()).hexdigest()


def test_budget_is_enforced_and_quiet_free_memory_goes_back(host):
    a = host.alloc_pages(1, 6 * MiB // 2)
    b = host.alloc_pages(1, 6 * MiB // 2)
    assert a and b and host.used == 6 * MiB
    assert host.alloc_pages(1, 4 * MiB) is None  # 6 + 4 > 8 MiB budget
    host.view(a[0].offset, 3 * MiB)[:] = 7
    blocks_before = os.stat(host.slab_path(host.locate(a[0].offset)[0])).st_blocks
    host.free(a[0])
    path = host.slab_path(host.locate(a[0].offset)[0])
    assert os.stat(path).st_blocks == blocks_before  # kept for reuse while the arena is busy
    assert host.maintain(quiet_seconds=60) == 0
    assert host.maintain(quiet_seconds=0) >= 3 * MiB
    assert os.stat(path).st_blocks < blocks_before  # punched out of /dev/shm once quiet
    assert host.alloc_pages(1, 4 * MiB) is not None


def test_shrinking_the_budget_closes_empty_slabs(host):
    a = host.alloc_pages(1, 4 * MiB)
    b = host.alloc_pages(1, 4 * MiB)
    assert host.capacity == 8 * MiB
    host.free(b[0])
    host.set_budget(4 * MiB)
    assert host.capacity == 4 * MiB and not os.path.exists(host.slab_path(1))
    host.free(a[0])


def test_remove_stale_clears_a_crashed_run(tmp_path):
    prefix = arena_name()
    for i in range(2):
        open(f"/dev/shm/{prefix}.{i}", "wb").close()
    assert HostTier.remove_stale(prefix) == 2
    assert not os.path.exists(f"/dev/shm/{prefix}.0")


def test_failed_pinning_falls_back_to_pageable_and_says_so(caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("pinning works here; this checks the fallback")
    tier = HostTier(4 * MiB, arena_name(), slab_bytes=4 * MiB, pin=True)
    try:
        with caplog.at_level("WARNING", logger="tierd.tiers.host"):
            assert tier.alloc_pages(1, 4096) is not None
        assert not tier.pinned and tier.backend == "shm-pageable"
        assert "cudaHostRegister failed" in caplog.text
    finally:
        tier.close()


def test_views_and_slots_never_cross_a_slab(host):
    host.alloc_pages(2, 4 * MiB)  # both slabs
    assert host.view(4 * MiB - 4096, 4096).nbytes == 4096
    with pytest.raises(ValueError, match="cross a slab boundary"):
        host.view(4 * MiB - 4096, 8192)  # would have been cut short at the slab's end
    with pytest.raises(ValueError, match="cross a slab boundary"):
        host.where(4 * MiB - 4096, 8192)
