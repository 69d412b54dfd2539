import os

import numpy as np
import pytest

from tierd.tiers.disk import DiskTier
from tierd.tiers.fileops import aligned_buffer, probe_direct_io
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
    assert again.open_existing(again.max_slabs()) == {}  # nothing lost
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
    assert again.open_existing(again.max_slabs()) == {1: None, 2: MiB}
    assert again.allocator.num_slabs == 4  # the intact slab after them is kept
    for index in range(4):  # made whole again, sparse
        assert os.path.getsize(again.slab_path(index)) == 8 * MiB
    again.close()


def test_a_stray_slab_file_far_past_the_budget_is_left_alone(tmp_path, executor):
    """An empty slab-099999.bin made the tier create and open 100,000 slabs at
    start: the daemon ran out of descriptors and never started again."""
    disk = DiskTier(32 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    disk.alloc_pages(1, 8 * MiB)
    disk.close()
    stray = tmp_path / "slab-099999.bin"
    stray.touch()
    again = DiskTier(32 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    assert again.open_existing(again.max_slabs()) == {}
    assert again.allocator.num_slabs == 1 and len(os.listdir(tmp_path)) == 2 and stray.stat().st_size == 0
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


def test_a_slab_file_deleted_under_the_tier_fails_the_syncs_of_writes_there(tmp_path, executor):
    """Written, then its file deleted before the sync: the sync fails (the
    write is not durable), later allocations there fail, and other slabs'
    writes sync as before."""
    disk = DiskTier(32 * MiB, str(tmp_path), executor, slab_bytes=8 * MiB)
    first = disk.alloc_pages(1, 8 * MiB)[0]  # fills slab 0
    epoch = disk.epoch()
    disk.write(first.offset, aligned_buffer(MiB))
    os.unlink(disk.slab_path(0))
    with pytest.raises(OSError, match="deleted while in use"):
        disk.sync(epoch)
    assert disk.unusable == 0  # slab 0 is all first's
    disk.free(first)  # ... and stays out of use: retired
    assert disk.unusable == 8 * MiB and disk.used == 8 * MiB
    other = disk.alloc_pages(2, 4 * MiB)
    assert other is not None and {disk.locate(p.offset)[0] for p in other} == {1}
    epoch = disk.epoch()
    disk.write(other[0].offset, aligned_buffer(MiB))
    disk.sync(epoch)  # writes elsewhere sync as before
    disk.close()
