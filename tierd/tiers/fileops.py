"""The disk tier's system calls and aligned buffers, used by the disk tier on
the I/O threads and by the copy engine for its staging buffers: FileOps is
the one place the disk tier's reads, writes and syncs go (a fault-injection
harness replaces it; the kvikio backend routes reads and writes through
kvikio), aligned_buffer gives memory that O_DIRECT takes, and
probe_direct_io tells whether a directory's file system takes O_DIRECT."""

from __future__ import annotations

import mmap
import os

import numpy as np

ALIGN = 4096


class FileOps:
    """The disk tier's system calls, in one place: a fault-injection harness
    replaces them to make any call fail, and the kvikio backend routes reads
    and writes through kvikio (tiers/kvikio_io.py)."""

    name: str | None = None  # the backend, if not plain POSIX
    aligns_itself = False  # reads and writes take any buffer (the tier's own descriptors carry no data)
    device_io = False  # reads and writes also take GPU memory (straight to and from VRAM)

    def open(self, path: str, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def pread(self, fd: int, view: np.ndarray, offset: int) -> int:
        return os.preadv(fd, [view], offset)

    def pwrite(self, fd: int, view: np.ndarray, offset: int) -> int:
        return os.pwritev(fd, [view], offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), usable for O_DIRECT."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)[:nbytes]


def probe_direct_io(directory: str) -> bool:
    """True if O_DIRECT writes and reads work in this directory."""
    path = os.path.join(directory, ".direct-io-probe")
    buf = aligned_buffer(ALIGN)
    buf[:] = 0x5A
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buf], 0)
        back = aligned_buffer(ALIGN)
        os.preadv(fd, [back], 0)
        return bool(np.array_equal(back, buf))
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
