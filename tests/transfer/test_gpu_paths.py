"""The copy engine's GPU paths, run through the kernels' own source compiled
for the CPU (tests/transfer/emulated_gpu.py): the device tier is a CPU tensor
and engine memory is host memory, both of which the stand-in reaches."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, host_tier
from tests.transfer.emulated_gpu import EmulatedKernels, compile_kernels
from tierd.checksum import page_checksum
from tierd.core.store import make_key
from tierd.errors import DataLoss
from tierd.tiers.device import DeviceTier
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import Geometry, Span

MiB = 1 << 20


@pytest.fixture(scope="module")
def so(tmp_path_factory):
    return compile_kernels(tmp_path_factory.mktemp("kernels"))


@pytest.fixture
def tiers():
    host = host_tier(32 * MiB, 16 * MiB)
    device = DeviceTier(16 * MiB, "cpu", slab_bytes=8 * MiB)
    yield {"host": host, "device": device}
    device.close()
    host.close()


def _device_spans(device, n_pages, geom_pages=None):
    geom = Geometry(SPEC.page_bytes, geom_pages or n_pages, SPEC.page_bytes)
    pieces = device.alloc_pages(n_pages, geom.stride)
    return [Span(p.first_page, p.n_pages, "device", p.offset) for p in pieces], geom


@pytest.mark.parametrize("kind", ["layer_major", "cross_layer"])
def test_gather_and_scatter_are_one_launch_each_whatever_the_runs(so, tiers, kind):
    kernels = EmulatedKernels(so)
    copier = CopyEngine(tiers, kernels=kernels)
    src = HostEngine(SPEC, 64, kind, seed=1, device="cpu")
    blocks = np.array([9, 10, 11, 40, 2, 3, 60])  # 4 runs
    spans, geom = _device_spans(tiers["device"], len(blocks))
    sums = copier.gather(src.memory, blocks, spans, geom, 0)
    assert kernels.launches == 1 + 2  # the copy, then the checksum lanes and merge
    assert copier.copy_ops == 1
    want = [page_checksum(np.frombuffer(p, dtype=np.uint8)) for p in src.pages(blocks)]
    assert sums.tolist() == want

    dst = HostEngine(SPEC, 64, kind, seed=2)
    target = np.array([5, 6, 30, 31, 32, 50, 0])
    copier.scatter(spans, dst.memory, target, geom, sums, IOClass.PREFETCH)
    assert kernels.launches == 3 + 2 + 1  # the pages checked (lanes, merge), then every run copied in one
    assert copier.copy_ops == 2
    assert kernels.priorities == [IOClass.DEMAND, IOClass.PREFETCH]
    assert dst.pages(target) == src.pages(blocks)
    untouched = HostEngine(SPEC, 64, kind, seed=2)
    others = [b for b in range(64) if b not in set(target.tolist())]
    assert dst.pages(others) == untouched.pages(others)


def test_a_page_damaged_in_the_device_tier_is_caught_by_the_device_checksum(so, tiers):
    kernels = EmulatedKernels(so)
    copier = CopyEngine(tiers, verify_tiers=("device", "disk"), kernels=kernels)
    src = HostEngine(SPEC, 16, seed=3)
    spans, geom = _device_spans(tiers["device"], 3)
    sums = copier.gather(src.memory, np.arange(3), spans, geom, 0)
    tiers["device"].view(spans[0].offset + 2 * geom.stride + 77, 1)[0] ^= 0x40  # page 2
    launches = kernels.launches
    with pytest.raises(DataLoss, match="page 2 failed its checksum in the device tier"):
        copier.scatter(spans, HostEngine(SPEC, 16, seed=4).memory, np.arange(3), geom, sums)
    assert kernels.launches == launches + 2  # hashed by the kernels, and nothing was copied


def test_short_last_page_is_hashed_on_the_cpu(so, tiers):
    # An opaque snapshot ending in 100 bytes: XXH3 hashes so short an input another way.
    kernels = EmulatedKernels(so)
    copier = CopyEngine(tiers, kernels=kernels)
    geom = Geometry(8192, 3, 100)
    (piece,) = tiers["device"].alloc_pages(3, geom.stride)
    view = tiers["device"].view(piece.offset, 3 * geom.stride)
    view.copy_(view.new_tensor(np.random.default_rng(5).integers(0, 256, 3 * geom.stride, dtype=np.uint8)))
    sums = copier.checksums([Span(0, 3, "device", piece.offset)], geom)
    host = view.numpy()
    assert sums.tolist() == [page_checksum(host[0:8192]), page_checksum(host[geom.stride : geom.stride + 8192]),
                             page_checksum(host[2 * geom.stride : 2 * geom.stride + 100])]
    assert kernels.launches == 2


def test_store_round_trip_through_the_kernels(so, tmp_path):
    h = Harness(str(tmp_path), device_budget=16 * MiB)
    store = h.open()
    kernels = EmulatedKernels(so)
    store.copier.kernels = kernels
    key = make_key("default", "s")
    try:
        eng = HostEngine(SPEC, 64, seed=6, device="cpu")
        store.save(key, eng.memory, SPEC, [3, 4, 5, 20], 60, tier="device")
        assert store.stat(key).tier == "device"
        out = HostEngine(SPEC, 64, seed=7, device="cpu")
        launches = kernels.launches
        store.restore(key, out.memory, SPEC, [7, 8, 30, 31])
        assert kernels.launches == launches + 2 + 1  # checked (lanes, merge), then copied in one launch
        assert out.pages([7, 8, 30, 31]) == eng.pages([3, 4, 5, 20])
        # Tier moves go through the copy engines, on the stream of their priority.
        shrunk = store.set_budget("device", 0)  # the overflow goes to host at once
        assert shrunk.released_bytes > 0 and store.stat(key).tier == "host"
        assert kernels.dmas == [IOClass.DEMAND]  # the caller waits for the VRAM
        store.set_budget("device", 16 * MiB)
        store.prefetch(key, "device")
        assert store.wait_ready(key, "device", timeout=10) == (True, "device")
        assert kernels.dmas == [IOClass.DEMAND, IOClass.PREFETCH]
        out = HostEngine(SPEC, 64, seed=8, device="cpu")
        store.restore(key, out.memory, SPEC, [0, 1, 2, 3])
        assert out.pages([0, 1, 2, 3]) == eng.pages([3, 4, 5, 20])
    finally:
        h.close()


def test_disk_windows_for_a_gpu_engine_are_read_checked_and_scattered_on_the_gpu(so, tmp_path):
    # kvikio reads GPU memory: the windows of a disk restore land in GPU staging
    # buffers, are checked by the checksum kernels, and scattered in one launch each.
    from tests.tiers.test_kvikio import _demote_to_disk, stand_in
    from tierd.tiers import kvikio_io

    kv = stand_in()
    ops, _ = kvikio_io.probe(str(tmp_path), kvikio=kv, need_driver=False)
    h = Harness(str(tmp_path / "h"), disk_ops=ops, device_budget=16 * MiB)
    store = h.open()
    kernels = EmulatedKernels(so)
    store.copier.kernels = kernels
    store.copier.window_bytes = 2 * Geometry(SPEC.page_bytes, 1, SPEC.page_bytes).stride  # 2 pages a window
    key = make_key("default", "g")
    try:
        eng = HostEngine(SPEC, 64, seed=9, device="cpu")
        store.save(key, eng.memory, SPEC, [3, 4, 5, 20, 21], 80, tier="device")
        _demote_to_disk(store, key)
        kv.buffers.clear()
        launches = kernels.launches
        out = HostEngine(SPEC, 64, seed=10, device="cpu")
        store.restore(key, out.memory, SPEC, [40, 41, 42, 43, 44])
        assert out.pages([40, 41, 42, 43, 44]) == eng.pages([3, 4, 5, 20, 21])
        assert kv.buffers == {"Tensor"}  # read into GPU staging buffers, not host memory
        assert kernels.launches - launches == 3 * (2 + 1)  # 3 windows: checksum lanes and merge, then the scatter
        assert store.copier.bandwidth["disk->device"] > 0
    finally:
        h.close()
