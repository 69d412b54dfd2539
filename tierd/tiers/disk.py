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
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any

import numpy as np

from tierd.tiers import DISK
from tierd.tiers.allocator import Piece
from tierd.tiers.fileops import ALIGN, FileOps, probe_direct_io
from tierd.tiers.ioqueue import IOClass, IOExecutor, wait_all
from tierd.tiers.slabs import SlabTier

log = logging.getLogger("tierd.tiers.disk")
IO_CHUNK = 4 << 20
SLAB_FILE = re.compile(r"slab-(\d{6})\.bin")
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class DiskTier(SlabTier):
    name = DISK

    def __init__(self, budget: int, directory: str, executor: IOExecutor, slab_bytes: int = 1 << 30,
                 direct: bool | None = None, ops: FileOps | None = None) -> None:
        super().__init__(budget, slab_bytes, granule=ALIGN)
        self.ops = ops or FileOps()
        self._failed_syncs = 0
        self._unlinked: set[int] = set()  # slabs whose files were deleted while in use
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

    def open_existing(self, max_slabs: int) -> dict[int, int | None]:
        """Map the slab files a previous run left into the address space
        (before recovery): slabs 0 to the highest-numbered file below
        max_slabs (files past it are left alone, logged). A file that is
        missing or short is made whole again, sparse; returns how many bytes
        each of those held (None: no file), so that recovery drops the
        sessions whose pages were there, and only those."""
        sizes = {int(m.group(1)): entry.stat(follow_symlinks=False).st_size for entry in os.scandir(self.directory)
                 if (m := SLAB_FILE.fullmatch(entry.name))}
        stray = sorted(i for i in sizes if i >= max_slabs)
        if stray:
            log.warning("disk tier: ignoring %d slab files past the %d this tier may use and the index records "
                        "(%s...): no session lies there", len(stray), max_slabs, self.slab_path(stray[0]))
            sizes = {i: n for i, n in sizes.items() if i < max_slabs}
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
            if not self._linked(slab, self._fds[slab]):  # (the tier's lock is held: retired here)
                raise OSError(errno.ENOENT, f"slab file {self.slab_path(slab)} was deleted while in use")
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

    def _look_for_room(self) -> None:
        """Resume once the file system has a slab's worth of room again."""
        if self.out_of_space and shutil.disk_usage(self.directory).free >= self.slab_bytes:
            self.out_of_space = False
            log.info("disk tier: space freed under %s; demotion resumes", self.directory)

    def alloc_pages(self, n_pages: int, page_bytes: int, owner: str = "") -> list[Piece] | None:
        # out_of_space then says what this allocation found, not what one before the space returned did
        # (it decides whether making room by eviction may help: placement.alloc).
        self._look_for_room()
        return super().alloc_pages(n_pages, page_bytes, owner)

    def maintain(self) -> int:
        """Notice slab files deleted under the daemon (see _linked), and space
        freed on the file system."""
        with self._lock:
            for slab, fd in self._fds.items():
                self._linked(slab, fd)
        self._look_for_room()
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
        with self._lock:
            deleted = [slab for slab in sorted(dirty) if slab in self._fds and not self._linked(slab, self._fds[slab])]
            if deleted:
                self._failed_syncs += 1  # whoever wrote since their epoch may have written there
        if deleted:
            raise OSError(errno.ENOENT, f"slab file {self.slab_path(deleted[0])} was deleted while in use")
        if since is not None and self._failed_syncs != since:
            raise OSError(errno.EIO, "a sync failed while these writes were in flight; they may be lost")

    def _linked(self, slab: int, fd: int) -> bool:
        """Whether the slab's file is still there (called with the tier's lock
        held). One deleted under the daemon loses what it holds at the next
        start: nothing written there is reported durable, and the slab is
        retired: nothing is allocated in it any more, its room counted as
        unusable, while the sessions whose pages are there still read them."""
        if slab in self._unlinked:
            return False
        if os.fstat(fd).st_nlink:
            return True
        self._unlinked.add(slab)
        self.unusable += self.allocator.take_free(slab)
        log.error("disk tier: %s was deleted while in use: the sessions in it are lost at the next start, and it "
                  "takes no new pages (restart the daemon to make it anew)", self.slab_path(slab))
        return False

    def _retired(self, slab: int) -> bool:
        return slab in self._unlinked

    def retired(self, offset: int) -> bool:
        """Whether the byte at offset lies in a slab retired after its file was deleted."""
        return offset // self.slab_bytes in self._unlinked

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

