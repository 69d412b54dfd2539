"""Engine memory the daemon opens: the CUDA IPC cache (with a driver over
host memory standing in for the GPU's), in-flight protection, and engines
unregistered when their process exits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.helpers import SPEC, Harness
from tierd.core.cuda_ipc import IpcCache, IpcRegion
from tierd.core.engines import EngineRegistry, process_alive, process_identity
from tierd.core.store import make_key
from tierd.errors import FailedPrecondition, InvalidArgument, NotFound
from tierd.layout import EngineLayout

GPU = "GPU-test-0"
BLOCKS = 32


class HostMemoryDriver:
    """The CUDA calls IpcCache makes, over numpy "allocations" an exporting
    engine shares with the daemon: a handle names one of them."""

    def __init__(self) -> None:
        self.allocations: dict[bytes, np.ndarray] = {}
        self.opened: dict[int, bytes] = {}
        self.opens = 0
        self.closes: list[bytes] = []

    def allocate(self, name: str, size: int, seed: int) -> bytes:
        handle = name.encode().ljust(64, b"\0")
        self.allocations[handle] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        return handle

    def device_index(self, device_uuid: str) -> int:
        if device_uuid != GPU:
            raise FailedPrecondition(f"GPU {device_uuid} is not visible to the daemon", field="regions")
        return 0

    def open(self, handle: bytes, device: int) -> tuple[int, int]:
        if handle not in self.allocations:
            raise RuntimeError("cudaErrorInvalidValue")
        array = self.allocations[handle]
        self.opens += 1
        self.opened[array.ctypes.data] = handle
        return array.ctypes.data, array.nbytes

    def close(self, address: int, device: int) -> None:
        self.closes.append(self.opened.pop(address))

    def tensor(self, address: int, size: int, device: int) -> np.ndarray:
        for base, handle in self.opened.items():
            if base <= address < base + self.allocations[handle].nbytes:
                return self.allocations[handle][address - base : address - base + size]
        raise AssertionError("address outside every open allocation")


@pytest.fixture
def driver():
    return HostMemoryDriver()


def _regions(handle: bytes, layout: EngineLayout) -> list[IpcRegion]:
    """vLLM-like: one K and one V tensor per layer, all carved out of one allocation."""
    sizes = [s.offset + BLOCKS * s.stride for s in layout.segments]
    out, offset = [], 4096
    for size in sizes:
        out.append(IpcRegion(handle, offset, size, GPU))
        offset += -(-size // 512) * 512
    return out


def test_one_open_per_allocation_shared_by_regions_and_engines_closed_by_the_last(driver):
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    handle = driver.allocate("kv", 4 << 20, seed=1)
    registry = EngineRegistry(ipc=IpcCache(driver))
    a = registry.register("t", SPEC, _regions(handle, layout), layout)
    b = registry.register("t", SPEC, _regions(handle, layout), layout)
    assert driver.opens == 1 and len(registry.ipc) == 1
    # The regions are views of the engine's bytes at their offsets, not copies.
    assert np.shares_memory(a.memory.regions[3], driver.allocations[handle])
    first = _regions(handle, layout)[3]
    exported = driver.allocations[handle][first.offset : first.offset + first.size]
    assert a.memory.regions[3].tobytes() == exported.tobytes()
    registry.unregister("t", a.engine_id)
    assert driver.closes == []  # b still uses it
    registry.unregister("t", b.engine_id)
    assert driver.closes == [handle] and len(registry.ipc) == 0


def test_bad_ipc_regions_get_clear_errors_and_leave_nothing_open(driver):
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    handle = driver.allocate("small", 1 << 20, seed=2)
    registry = EngineRegistry(ipc=IpcCache(driver))
    regions = _regions(handle, layout)
    with pytest.raises(InvalidArgument, match="runs past its 1048576-byte allocation"):
        registry.register("t", SPEC, regions[:-1] + [IpcRegion(handle, 1 << 20, regions[-1].size, GPU)], layout)
    with pytest.raises(InvalidArgument, match="64 bytes, not 3"):
        registry.register("t", SPEC, [IpcRegion(b"abc", 0, r.size, GPU) for r in regions], layout)
    with pytest.raises(FailedPrecondition, match="GPU GPU-other is not visible"):
        registry.register("t", SPEC, [IpcRegion(handle, r.offset, r.size, "GPU-other") for r in regions], layout)
    with pytest.raises(FailedPrecondition, match="cannot open the CUDA IPC handle"):
        registry.register("t", SPEC, [IpcRegion(b"x" * 64, r.offset, r.size, GPU) for r in regions], layout)
    with pytest.raises(InvalidArgument, match="all shared memory or all CUDA IPC"):
        registry.register("t", SPEC, regions[:-1] + [("some-shm", regions[-1].size)], layout)
    assert len(registry) == 0 and len(registry.ipc) == 0 and driver.opened == {}


def test_ipc_regions_on_a_daemon_without_gpu_are_refused():
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    regions = [IpcRegion(b"h" * 64, 0, s.offset + BLOCKS * s.stride, GPU) for s in layout.segments]
    with pytest.raises(FailedPrecondition, match="need a daemon running on a GPU machine"):
        EngineRegistry().register("t", SPEC, regions, layout)


def test_save_and_restore_move_the_bytes_of_opened_engine_memory(driver, tmp_path):
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    handle = driver.allocate("kv", 4 << 20, seed=3)
    registry = EngineRegistry(ipc=IpcCache(driver))
    engine = registry.register("t", SPEC, _regions(handle, layout), layout)
    h = Harness(str(tmp_path))
    store = h.open()
    try:
        key = make_key("t", "s")
        before = [engine.memory.regions[s.region][s.offset + 5 * s.stride : s.offset + 5 * s.stride + s.nbytes].copy()
                  for s in layout.segments]
        store.save(key, engine.memory, SPEC, [5], 16)
        for r in engine.memory.regions:
            r[:] = 0
        store.restore(key, engine.memory, SPEC, [9])
        after = [engine.memory.regions[s.region][s.offset + 9 * s.stride : s.offset + 9 * s.stride + s.nbytes]
                 for s in layout.segments]
        assert all(np.array_equal(x, y) for x, y in zip(before, after))
    finally:
        h.close()
        registry.close()
    assert driver.closes == [handle]


def test_unregister_waits_for_calls_using_the_engine(driver):
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    handle = driver.allocate("kv", 4 << 20, seed=4)
    registry = EngineRegistry(ipc=IpcCache(driver))
    engine = registry.register("t", SPEC, _regions(handle, layout), layout)
    done = threading.Event()
    with registry.use("t", engine.engine_id):
        t = threading.Thread(target=lambda: (registry.unregister("t", engine.engine_id), done.set()))
        t.start()
        time.sleep(0.2)
        assert not done.is_set() and driver.closes == []  # a copy may still be reading the memory
        with pytest.raises(NotFound):
            with registry.use("t", engine.engine_id):
                pass
    t.join(5)
    assert done.is_set() and driver.closes == [handle]


def test_engines_of_an_exited_process_are_unregistered(driver):
    layout = EngineLayout.layer_major(SPEC, BLOCKS)
    handle = driver.allocate("kv", 4 << 20, seed=5)
    registry = EngineRegistry(ipc=IpcCache(driver))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        engine = registry.register("t", SPEC, _regions(handle, layout), layout, pid=child.pid)
        mine = registry.register("t", SPEC, _regions(handle, layout), layout)  # not watched
        assert registry.reap() == [] and len(registry) == 2
        child.kill()
        deadline = time.monotonic() + 10
        while process_alive(engine.process):  # killed: a zombie until waited for, and that counts as exited
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert registry.reap() == [engine]
        child.wait()
        with pytest.raises(NotFound):
            registry.get("t", engine.engine_id)
        assert registry.get("t", mine.engine_id) is mine and driver.closes == []
    finally:
        child.kill()
        registry.close()


def test_process_identity_tells_a_reused_pid_apart():
    import os

    me = process_identity(os.getpid())
    assert process_alive(me)
    assert not process_alive((me[0], me[1] + 1))  # same pid, another start time
    with pytest.raises(InvalidArgument, match="not visible to the daemon"):
        process_identity(2**31 - 1)
