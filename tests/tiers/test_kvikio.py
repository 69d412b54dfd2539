"""The kvikio disk backend's logic, on a machine without a CUDA driver.

kvikio itself cannot run here (it needs libcuda even in compatibility mode),
so the probe's refusal is tested for real, and the backend's wiring (two
descriptors per slab, reads and writes through CuFile futures, the self-test)
runs against a stand-in that has kvikio's CuFile interface over POSIX calls.
On a GPU machine bench/gpu_check.py runs the real kvikio through the same code.
"""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine
from tierd.core.store import make_key
from tierd.errors import DataLoss
from tierd.testing import ROOT
from tierd.tiers import kvikio_io
from tierd.tiers.disk import DiskTier
from tierd.tiers.ioqueue import IOExecutor


class _Future:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


def stand_in(corrupt_reads=False):
    """A module with kvikio's CuFile interface, doing POSIX I/O. Like kvikio it
    also takes tensors (here CPU tensors, standing in for GPU memory);
    `buffers` records the kinds it was given."""
    opened = []
    buffers = set()

    def host(buf):
        buffers.add(type(buf).__name__)
        return buf if isinstance(buf, np.ndarray) else buf.numpy()

    class CuFile:
        def __init__(self, path, flags="r"):
            assert flags == "r+"
            self.fd = os.open(path, os.O_RDWR)
            self.closed = False
            opened.append(self)

        def pread(self, buf, size, file_offset=0):
            buf = host(buf)
            n = os.preadv(self.fd, [buf[:size]], file_offset)
            if corrupt_reads:
                buf[:1] ^= 0xFF
            return _Future(n)

        def pwrite(self, buf, size, file_offset=0):
            return _Future(os.pwritev(self.fd, [host(buf)[:size]], file_offset))

        def close(self):
            os.close(self.fd)
            self.closed = True

    defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
    return types.SimpleNamespace(CuFile=CuFile, defaults=defaults, opened=opened, buffers=buffers)


def test_without_kvikio_or_a_driver_the_probe_keeps_posix(tmp_path):
    ops, why = kvikio_io.probe(str(tmp_path))
    assert ops is None
    assert why in ("kvikio is not installed", "no CUDA driver (libcuda), which kvikio needs even in compatibility mode")
    if not kvikio_io._driver_present():
        ops, why = kvikio_io.probe(str(tmp_path), kvikio=stand_in())
        assert ops is None and "no CUDA driver" in why
    assert os.listdir(tmp_path) == []  # the probe leaves nothing behind


def test_a_self_test_that_reads_back_other_bytes_keeps_posix(tmp_path):
    ops, why = kvikio_io.probe(str(tmp_path), kvikio=stand_in(corrupt_reads=True), need_driver=False)
    assert ops is None and "read back other bytes" in why
    assert os.listdir(tmp_path) == []


def test_the_disk_tier_reads_and_writes_through_cufile(tmp_path):
    kv = stand_in()
    ops, what = kvikio_io.probe(str(tmp_path), kvikio=kv, need_driver=False)
    assert ops is not None and ops.name == "kvikio-compat" and what == "kvikio (compatibility mode)"
    executor = IOExecutor(2)
    disk = DiskTier(64 << 20, str(tmp_path / "slabs"), executor, 16 << 20, ops=ops)
    try:
        assert disk.backend == "kvikio-compat"
        (piece,) = disk.alloc_pages(3, 1 << 20)
        data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
        disk.write(piece.offset, data)
        disk.sync()
        back = np.zeros_like(data)
        disk.read(piece.offset, back)
        assert np.array_equal(back, data)
    finally:
        disk.close()
        executor.shutdown()
    assert kv.opened and all(f.closed for f in kv.opened)  # every CuFile closed with its slab


def test_a_store_on_the_kvikio_backend_survives_a_restart(tmp_path):
    ops, _ = kvikio_io.probe(str(tmp_path), kvikio=stand_in(), need_driver=False)
    h = Harness(str(tmp_path / "h"), disk_ops=ops)
    key = make_key("default", "a")
    try:
        store = h.open()
        eng = HostEngine(seed=3)
        store.save(key, eng.memory, SPEC, [1, 2, 3], 40)
        store.release(key)
        store = h.reopen(flush=True)
        assert store.stat(key).tier == "disk" and store.tiers["disk"].backend == "kvikio-compat"
        out = HostEngine(seed=4)
        store.restore(key, out.memory, SPEC, [7, 8, 9])
        assert out.pages([7, 8, 9]) == eng.pages([1, 2, 3])
    finally:
        h.close()


def _demote_to_disk(store, key):
    assert store.demote(key).tier == "disk"


def test_device_tier_pages_go_to_and_from_disk_without_a_host_copy(tmp_path):
    kv = stand_in()
    ops, _ = kvikio_io.probe(str(tmp_path), kvikio=kv, need_driver=False)
    h = Harness(str(tmp_path / "h"), disk_ops=ops, device_budget=16 << 20)
    key = make_key("default", "d")
    try:
        store = h.open()
        eng = HostEngine(seed=5, device="cpu")
        store.save(key, eng.memory, SPEC, [4, 5, 6], 48, tier="device")
        kv.buffers.clear()
        _demote_to_disk(store, key)  # device -> disk
        assert kv.buffers == {"Tensor"}  # written from the device tier's memory, no host bounce
        store.prefetch(key, "device")
        assert store.wait_ready(key, "device", timeout=10) == (True, "device")
        assert kv.buffers == {"Tensor"}  # and read straight back into it
        out = HostEngine(seed=6, device="cpu")
        store.restore(key, out.memory, SPEC, [0, 1, 2])
        assert out.pages([0, 1, 2]) == eng.pages([4, 5, 6])

        # A page damaged on disk is caught as it lands in the device tier, and never served.
        _demote_to_disk(store, key)
        disk = store.tiers["disk"]
        slab, off = disk.locate(store.pieces(key, "disk")[0].offset)
        fd = os.open(disk.slab_path(slab), os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, off + 100)[0] ^ 1]), off + 100)
        finally:
            os.close(fd)
        store.prefetch(key, "device")
        with pytest.raises(DataLoss, match="is damaged"):
            store.wait_ready(key, "device", timeout=10)
        with pytest.raises(DataLoss):
            store.restore(key, HostEngine(seed=7, device="cpu").memory, SPEC, [0, 1, 2])
    finally:
        h.close()


def test_requiring_kvikio_where_it_cannot_run_stops_the_daemon(tmp_path):
    if kvikio_io.probe(str(tmp_path))[0] is not None:
        pytest.skip("kvikio works here")
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--disk-io", "kvikio", "--data-dir",
                          str(tmp_path / "data"), "--socket", str(tmp_path / "run" / "s.sock"), "--metrics", "off",
                          "--device", "none"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "disk_io is kvikio, but" in out.stderr
