"""Engine-side shared memory: a paged KV cache the daemon can read and write.

An engine that keeps its KV cache in these regions lets tierd save and
restore blocks with no bytes in messages: register the cache once, then call
save and restore with block ids. Each region is a memfd sealed against
shrinking and growing, the only shared memory the daemon takes: memory that
could be cut short under it would fault the daemon in the middle of a copy.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from typing import TYPE_CHECKING

import numpy as np

from tierd.errors import FailedPrecondition
from tierd.layout import EngineLayout, KVSpec

if TYPE_CHECKING:
    from tierd.types import Lease

SHM_DIR = "/dev/shm"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of `size` bytes that can never shrink or grow; returns its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedKVCache:
    """KV blocks in sealed memfds: one per layer and K/V ("layer_major", as
    vLLM and SGLang keep them) or one holding whole pages ("cross_layer").
    `fds` are the regions' descriptors (handed to the daemon at registration;
    pass them to other processes of the engine the same way)."""

    def __init__(self, spec: KVSpec, num_blocks: int, kind: str = "layer_major") -> None:
        if kind not in ("layer_major", "cross_layer"):
            raise ValueError(f"kind must be layer_major or cross_layer, not {kind!r}")
        self.spec = spec
        self.layout = (EngineLayout.layer_major if kind == "layer_major" else EngineLayout.cross_layer)(spec, num_blocks)
        n_regions = 2 * spec.num_layers if kind == "layer_major" else 1
        size = num_blocks * self.layout.segments[0].stride
        self.sizes = [size] * n_regions
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self.regions: list[np.ndarray] = []
        try:
            for i in range(n_regions):
                self.fds.append(sealed_memfd(f"tierd-kv.{i}", size))
                m = mmap.mmap(self.fds[-1], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps.append(m)
                self.regions.append(np.frombuffer(m, dtype=np.uint8))
        except BaseException:
            self.close()
            raise

    def block(self, region: int, block: int) -> np.ndarray:
        """One block's bytes in one region (a view)."""
        seg = self.layout.segments[region]
        return self.regions[seg.region][seg.offset + block * seg.stride : seg.offset + block * seg.stride + seg.nbytes]

    def close(self) -> None:
        """Unmap and close (the memory goes once no process maps or holds it)."""
        self.regions.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Arena:
    """Leased pages as an engine on the same machine sees them: each lease is
    a shared-memory segment, mapped read-write here, with numpy views of its
    pages. The daemon hands a tenant's ended segments to its next leases, so
    mappings are kept for them; one whose segment the daemon has removed is
    let go when the next lease is mapped (it would hold the memory for good),
    and at most MAPPED stay mapped, the oldest let go first. release(lease)
    lets a lease's mapping go at once."""

    MAPPED = 64

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self._maps: dict[str, tuple[int, mmap.mmap, np.ndarray]] = {}  # name -> (open fd, mapping, view)

    def _slab(self, name: str) -> np.ndarray:
        if "/" in name or name.startswith("."):
            raise ValueError(f"not a segment name: {name!r}")
        for old in [n for n, (fd, _, _) in self._maps.items() if os.fstat(fd).st_nlink == 0]:
            self._unmap(old)  # removed by the daemon
        # Not through a link, and only a file of this user that no one else may open: after the
        # daemon removed a segment, another local user could plant something under its name.
        try:
            fd = os.open(os.path.join(self.shm_dir, name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise FailedPrecondition(f"shared memory {name!r} is a symbolic link, not a lease segment of the "
                                     "daemon: not mapped", segment=name) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise FailedPrecondition(f"shared memory {name!r} is not a lease segment of the daemon (owner uid "
                                         f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): not mapped",
                                         segment=name)
            have = self._maps.get(name)
            if have is not None and os.fstat(have[0]).st_ino == st.st_ino:
                os.close(fd)
                return have[2]
            m = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if name in self._maps:
            self._unmap(name)  # replaced by a restarted daemon
        while len(self._maps) >= self.MAPPED:
            self._unmap(next(iter(self._maps)))
        self._maps[name] = (fd, m, np.frombuffer(m, dtype=np.uint8))
        return self._maps[name][2]

    def _unmap(self, name: str) -> None:
        fd, m, _ = self._maps.pop(name)
        os.close(fd)
        try:
            m.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it

    def release(self, lease: Lease) -> None:
        """Let the lease's segments go now (views still alive keep them until they go)."""
        for slot in lease.slots:
            if slot.shm_name in self._maps:
                self._unmap(slot.shm_name)

    def runs(self, lease: Lease) -> list[tuple[int, np.ndarray]]:
        """(first page, uint8 array [pages, page_bytes]) for each run of leased
        pages: views into the arena, written by a save lease's holder before
        commit, read by a restore lease's holder before it ends."""
        out = []
        stride, nbytes = lease.page_stride, lease.page_bytes
        for slot in lease.slots:
            slab = self._slab(slot.shm_name)
            rows = slab[slot.offset : slot.offset + slot.n_pages * stride].reshape(slot.n_pages, stride)
            out.append((slot.first_page, rows[:, :nbytes]))
        return out

    def pages(self, lease: Lease) -> list[np.ndarray]:
        """One uint8 view per leased page, in page order."""
        return [row for _, rows in self.runs(lease) for row in rows]

    def close(self) -> None:
        for name in list(self._maps):
            self._unmap(name)
