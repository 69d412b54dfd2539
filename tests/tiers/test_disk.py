import os

import numpy as np
import pytest

from tierd.tiers.disk import DiskTier, aligned_buffer, probe_direct_io
from tierd.tiers.ioqueue import IOExecutor

MiB = 1 << 20


@pytest.fixture
def executor():
    ex = IOExecutor(2)
    yield ex
    ex.shutdown()


def test_roundtrip_through_slab_files(tmp_path, executor):
    disk = DiskTier(32 * MiB, str(tmp_path / "slabs"), executor, slab_bytes=8 * MiB)
    (piece,) = disk.alloc_pages(3, MiB)
    data = aligned_buffer(3 * MiB)
    data[:] = np.random.default_rng(1).integers(0, 256, 3 * MiB, dtype=np.uint8)
    disk.write(piece.offset, data)
    disk.sync()
    back = aligned_buffer(3 * MiB)
    disk.read(piece.offset, back)
    assert np.array_equal(back, data)
    # a whole slab long, but sparse: room is taken where pages were allocated
    assert os.path.getsize(disk.slab_path(0)) == 8 * MiB
    assert 3 * MiB <= os.stat(disk.slab_path(0)).st_blocks * 512 < 8 * MiB
    disk.close()


def test_probe_reports_direct_io_where_it_works(tmp_path):
    assert probe_direct_io(str(tmp_path)) in (True, False)
    assert not probe_direct_io("/proc")  # cannot create files there


def test_unaligned_buffers_are_refused_on_direct_io(tmp_path, executor):
    disk = DiskTier(8 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB, direct=True)
    (piece,) = disk.alloc_pages(1, 8192)
    buf = aligned_buffer(8192 + 1)[1:]
    with pytest.raises(ValueError, match="aligned"):
        disk.write(piece.offset, buf)
    disk.close()


def test_tensors_are_refused_where_the_backend_takes_host_memory_only(tmp_path, executor):
    import torch

    disk = DiskTier(8 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    (piece,) = disk.alloc_pages(1, 8192)
    assert not disk.device_io
    with pytest.raises(ValueError, match="reads and writes host memory only"):
        disk.read(piece.offset, torch.zeros(8192, dtype=torch.uint8))
    disk.close()


def test_existing_slabs_are_reopened(tmp_path, executor):
    disk = DiskTier(32 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    disk.alloc_pages(2, 8 * MiB // 2)
    disk.alloc_pages(1, 8 * MiB)
    disk.close()
    again = DiskTier(32 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    assert again.open_existing() == {}  # nothing lost
    assert again.allocator.num_slabs == 2
    again.close()


def test_slabs_are_found_by_name_and_lost_ones_are_reported(tmp_path, executor):
    disk = DiskTier(64 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    for _ in range(4):
        disk.alloc_pages(1, 8 * MiB)
    disk.close()
    os.unlink(disk.slab_path(1))
    os.truncate(disk.slab_path(2), MiB)
    again = DiskTier(64 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    assert again.open_existing() == {1: None, 2: MiB}
    assert again.allocator.num_slabs == 4  # the intact slab after them is kept
    for index in range(4):  # made whole again, sparse
        assert os.path.getsize(again.slab_path(index)) == 8 * MiB
    again.close()


def test_buffered_fallback_roundtrip(tmp_path, executor):
    disk = DiskTier(8 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB, direct=False)
    assert disk.backend == "posix-buffered"
    (piece,) = disk.alloc_pages(1, 4096)
    data = aligned_buffer(4096)
    data[:] = 9
    disk.write(piece.offset, data)
    disk.sync()
    back = aligned_buffer(4096)
    disk.read(piece.offset, back)
    assert (back == 9).all()
    disk.close()
