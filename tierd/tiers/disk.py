"""Disk tier: pages in extents inside slab files under the data dir.

POSIX backend: O_DIRECT pread/pwrite of aligned buffers, cut into chunks that
run on a prioritised thread pool; where the file system refuses O_DIRECT
(tmpfs, some overlays) buffered I/O with fdatasync. The kvikio backend
(GPUDirect Storage, or kvikio's compatibility mode) replaces the reads and
writes when libcuda and kvikio are present and pass a self-test.
Slab files are named by number only; what they hold lives in the index. They
are sparse: room on the file system is taken where pages are allocated
(fallocate of each piece), so opening them at start needs no free space, and
a file system that is full fails the allocation, not the daemon.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any

import numpy as np

from tierd.tiers import DISK
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass, IOExecutor, wait_all
from tierd.tiers.slabs import SlabTier

log = logging.getLogger("tierd.tiers.disk")
ALIGN = 4096
IO_CHUNK = 4 << 20
SLAB_FILE = re.compile(r"slab-(\d{6})\.bin")
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


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


class DiskTier(SlabTier):
    name = DISK

    def __init__(self, budget: int, directory: str, executor: IOExecutor, slab_bytes: int = 1 << 30,
                 direct: bool | None = None, ops: FileOps | None = None) -> None:
        super().__init__(budget, slab_bytes, granule=ALIGN)
        self.ops = ops or FileOps()
        self._failed_syncs = 0
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.direct = False if self.ops.aligns_itself else probe_direct_io(directory) if direct is None else direct
        self.backend = self.ops.name or ("posix-odirect" if self.direct else "posix-buffered")
        self.out_of_space = False  # the file system refused room: demotion pauses until it frees
        self._executor = executor
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()

    def slab_path(self, index: int) -> str:
        return os.path.join(self.directory, f"slab-{index:06d}.bin")

    def open_existing(self) -> dict[int, int | None]:
        """Map the slab files a previous run left into the address space
        (before recovery): slabs 0 to the highest-numbered file. A file that
        is missing or short is made whole again, sparse; returns how many bytes
        each of those held (None: no file), so that recovery drops the
        sessions whose pages were there, and only those."""
        sizes = {int(m.group(1)): entry.stat(follow_symlinks=False).st_size for entry in os.scandir(self.directory)
                 if (m := SLAB_FILE.fullmatch(entry.name))}
        lost: dict[int, int | None] = {}
        with self._lock:
            for index in range(max(sizes, default=-1) + 1):
                self.allocator.add_slab()
                if sizes.get(index, 0) < self.slab_bytes:
                    lost[index] = sizes.get(index)
                try:
                    self._open_slab(index)
                except OSError as exc:
                    # Its sessions stay indexed (a read answers UNAVAILABLE); an
                    # allocation in it tries the file again (_on_alloc).
                    log.error("disk tier: cannot open %s: %s", self.slab_path(index), exc)
        return lost

    def _open_slab(self, index: int) -> None:
        """Open slab file `index`, creating it if there is none. A new file is
        removed again if it cannot be sized, so a failure leaves nothing behind."""
        path = self.slab_path(index)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.direct else 0)
        created = not os.path.lexists(path)
        fd = self.ops.open(path, flags | (os.O_CREAT | os.O_EXCL if created else 0), 0o600)
        try:
            if os.fstat(fd).st_size < self.slab_bytes:
                self.ops.truncate(fd, self.slab_bytes)  # sparse: no room is taken yet
        except OSError as exc:
            self.ops.close(fd)
            if created:
                os.unlink(path)
            if exc.errno in NO_ROOM:
                self._set_full(f"no room for slab file {index}")
            raise
        self._fds[index] = fd

    def _on_alloc(self, piece: Piece) -> bool:
        """Take the file system's room for a new piece, so that writing its
        pages cannot find the disk full; False where there is none. Room
        already taken (a freed piece's) costs nothing more."""
        slab, off = self.locate(piece.offset)
        try:
            if slab not in self._fds:
                self._open_slab(slab)  # its file could not be opened at start
            self.ops.fallocate(self._fds[slab], off, piece.alloc_bytes)
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise  # an I/O error: evicting sessions to make room would not help
            self._set_full(f"no room for {piece.alloc_bytes} bytes in slab file {slab}")
            return False
        return True

    def _set_full(self, why: str) -> None:
        if not self.out_of_space:
            log.warning("disk tier: the file system under %s is full (%s): demotion to disk pauses until "
                        "space frees", self.directory, why)
        self.out_of_space = True

    def maintain(self) -> int:
        """Resume once the file system has a slab's worth of room again."""
        if self.out_of_space and shutil.disk_usage(self.directory).free >= self.slab_bytes:
            self.out_of_space = False
            log.info("disk tier: space freed under %s; demotion resumes", self.directory)
        return 0

    def _close_slab(self, index: int) -> None:
        fd = self._fds.pop(index, None)
        if fd is not None:
            self.ops.close(fd)
        if index >= self.allocator.num_slabs:
            # Removed from the address space: the file goes too.
            try:
                os.unlink(self.slab_path(index))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                self.ops.close(fd)
            self._fds.clear()

    # -- I/O ---------------------------------------------------------------

    def _spans(self, offset: int, nbytes: int) -> list[tuple[int, int, int, int]]:
        """(fd, file offset, buffer offset, length) chunks of at most IO_CHUNK."""
        slab, off = self.locate(offset, nbytes)
        fd = self._fds.get(slab)
        if fd is None:
            raise OSError(errno.ENOENT, f"slab file {slab} could not be opened")
        return [(fd, off + pos, pos, min(IO_CHUNK, nbytes - pos)) for pos in range(0, nbytes, IO_CHUNK)]

    @property
    def device_io(self) -> bool:
        """Whether reads and writes take GPU memory (tensors) as well as host arrays."""
        return self.ops.device_io

    def takes(self, buf: Any) -> bool:
        """Whether read and write take buf as it is: host arrays (4096-aligned
        under O_DIRECT), and GPU memory where device_io."""
        if not isinstance(buf, np.ndarray):
            return self.ops.device_io
        return not self.direct or not (buf.ctypes.data % ALIGN or buf.nbytes % ALIGN)

    def _check_buffer(self, buf: Any, offset: int) -> None:
        if not isinstance(buf, np.ndarray):
            if not self.ops.device_io:
                raise ValueError(f"the {self.backend} disk backend reads and writes host memory only")
            return
        if self.direct and (buf.ctypes.data % ALIGN or buf.nbytes % ALIGN or offset % ALIGN):
            raise ValueError("O_DIRECT I/O needs a 4096-aligned buffer, length and offset")

    def read(self, offset: int, buf: Any, io_class: int = IOClass.DEMAND) -> None:
        """Fill buf (uint8, contiguous; GPU memory too where device_io) from the tier's bytes at offset."""
        wait_all(self.read_async(offset, buf, io_class))

    def read_async(self, offset: int, buf: Any, io_class: int = IOClass.DEMAND) -> list[Future]:
        """Queue the reads that fill buf; wait_all(result) waits for them."""
        self._check_buffer(buf, offset)
        return [self._executor.submit(io_class, self._pread_exact, fd, buf[pos : pos + n], foff)
                for fd, foff, pos, n in self._spans(offset, buf.nbytes)]

    def write(self, offset: int, buf: Any, io_class: int = IOClass.DEMOTION) -> None:
        """Write buf at offset; durable only after sync()."""
        self._check_buffer(buf, offset)
        slab, _ = self.locate(offset)
        with self._lock:
            self._dirty.add(slab)
        try:
            wait_all([self._executor.submit(io_class, self._pwrite_exact, fd, buf[pos : pos + n], foff)
                      for fd, foff, pos, n in self._spans(offset, buf.nbytes)])
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._set_full("a write found no room")
            raise

    def epoch(self) -> int:
        """Count of failed syncs so far; pass it to sync() after writing."""
        return self._failed_syncs

    def sync(self, since: int | None = None) -> None:
        """fdatasync every slab written since the last sync. With `since` (an
        epoch() taken before writing), fail if any sync failed meanwhile: after a
        failed fdatasync the kernel may have dropped dirty pages and a later one
        can succeed anyway, so writes that overlapped a failure are not trusted."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for slab in sorted(dirty):
            fd = self._fds.get(slab)
            if fd is not None:
                try:
                    self.ops.fdatasync(fd)
                except OSError:
                    with self._lock:
                        self._failed_syncs += 1
                        self._dirty |= dirty
                    raise
        if since is not None and self._failed_syncs != since:
            raise OSError(errno.EIO, "a sync failed while these writes were in flight; they may be lost")

    def _pread_exact(self, fd: int, view: np.ndarray, offset: int) -> None:
        done = 0
        while done < view.nbytes:
            n = self.ops.pread(fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at {offset + done}: slab file truncated")
            done += n

    def _pwrite_exact(self, fd: int, view: np.ndarray, offset: int) -> None:
        done = 0
        while done < view.nbytes:
            done += self.ops.pwrite(fd, view[done:], offset + done)

