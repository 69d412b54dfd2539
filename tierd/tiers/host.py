"""Host tier: an arena of shared-memory slabs that other processes can map.

Each slab is a file under /dev/shm mapped into the daemon, created
exclusively under a random name (tiers/shm.py), mode 0600; engines never map
it (leases hand out segments of their own). Allocations are
backed with posix_fallocate (a full /dev/shm then fails the allocation instead
of killing the daemon with SIGBUS); freed ranges stay resident while the arena
is busy and are punched out once it is quiet, so an idle arena costs only what
it holds. With a GPU, each slab is registered with CUDA
(cudaHostRegister through cupy) so device copies run by DMA.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

import numpy as np

from tierd.tiers import HOST, shm
from tierd.tiers.allocator import Piece
from tierd.tiers.slabs import SlabTier

log = logging.getLogger("tierd.tiers.host")
SHM_DIR = shm.SHM_DIR


class HostTier(SlabTier):
    name = HOST

    def __init__(self, budget: int, prefix: str, slab_bytes: int = 1 << 30, shm_dir: str = SHM_DIR,
                 pin: bool = False) -> None:
        super().__init__(budget, slab_bytes)
        self.prefix = prefix
        self.shm_dir = shm_dir
        self.pin = pin
        self._maps: dict[int, mmap.mmap] = {}
        self._fds: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._registered: dict[int, object] = {}
        self._backed: dict[int, np.ndarray] = {}  # per slab, per granule: memory is reserved in /dev/shm
        self._unreleased = False
        self._last_alloc = 0.0

    @property
    def pinned(self) -> bool:
        """Every slab is registered with CUDA for DMA."""
        return bool(self._registered) and len(self._registered) == len(self._maps)

    @property
    def backend(self) -> str:
        return "shm-pinned" if self.pinned else "shm-pageable"

    def slab_name(self, index: int) -> str:
        return self._names[index]

    def slab_path(self, index: int) -> str:
        return os.path.join(self.shm_dir, self.slab_name(index))

    def _open_slab(self, index: int) -> None:
        name, fd = shm.create(self.prefix, self.slab_bytes, self.shm_dir)
        try:
            mm = mmap.mmap(fd, self.slab_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            shm.remove(name, fd, self.shm_dir)
            raise
        self._fds[index], self._maps[index], self._names[index] = fd, mm, name
        self._arrays[index] = np.frombuffer(mm, dtype=np.uint8)
        self._backed[index] = np.zeros(self.slab_bytes // self.allocator.granule, dtype=bool)
        if self.pin:
            self._register(index)

    def _register(self, index: int) -> None:
        from tierd.tiers import cuda_host

        handle = cuda_host.register(self._arrays[index])
        if handle is None:
            log.warning("host arena: cudaHostRegister failed for slab %d; copies to the GPU use pageable memory",
                        index)
            return
        self._registered[index] = handle

    def _close_slab(self, index: int) -> None:
        handle = self._registered.pop(index, None)
        if handle is not None:
            from tierd.tiers import cuda_host

            cuda_host.unregister(handle)
        self._arrays.pop(index, None)
        self._backed.pop(index, None)
        mm = self._maps.pop(index, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes with it.
                pass
        fd = self._fds.pop(index, None)
        if fd is not None:
            shm.remove(self._names.pop(index), fd, self.shm_dir)

    def _on_alloc(self, piece: Piece) -> bool:
        self._last_alloc = time.monotonic()
        slab, off = self.locate(piece.offset)
        g0, g1 = off // self.allocator.granule, (off + piece.alloc_bytes) // self.allocator.granule
        backed = self._backed[slab]
        if backed[g0:g1].all():
            return True  # still resident from an earlier use
        try:
            os.posix_fallocate(self._fds[slab], off, piece.alloc_bytes)
        except OSError as exc:
            log.warning("host arena: cannot back %d bytes in %s: %s", piece.alloc_bytes, self.shm_dir, exc)
            return False
        backed[g0:g1] = True
        return True

    def _on_free(self, piece: Piece) -> None:
        # Freed pages stay resident for reuse: a busy arena recycles them with
        # no page faults or kernel zeroing. maintain() returns them once quiet.
        self._unreleased = True

    def maintain(self, quiet_seconds: float = 1.0) -> int:
        """Give free memory back to the system (punch holes in the slabs) once no
        allocation happened for quiet_seconds; returns bytes released."""
        with self._lock:
            if not self._unreleased or time.monotonic() - self._last_alloc < quiet_seconds:
                return 0
            released = 0
            granule = self.allocator.granule
            for start, size in self.allocator.free_extents():
                slab, off = self.locate(start)
                if slab in self._maps and self._backed[slab][off // granule : (off + size) // granule].any():
                    self._maps[slab].madvise(mmap.MADV_REMOVE, off, size)
                    self._backed[slab][off // granule : (off + size) // granule] = False
                    released += size
            self._unreleased = False
            return released

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The arena's bytes [offset, offset + nbytes) as a writable uint8 array (no copy)."""
        slab, off = self.locate(offset, nbytes)
        return self._arrays[slab][off : off + nbytes]
