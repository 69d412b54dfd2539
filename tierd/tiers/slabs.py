"""Budget and slab bookkeeping shared by the host, disk and device tiers.

A tier's address space is a row of equal slabs (one shared-memory file, one
slab file or one VRAM allocation each), opened lazily as the allocator needs
room, up to the budget. Subclasses open and close slabs; this class decides
nothing beyond "does it fit the budget".
"""

from __future__ import annotations

import errno
import logging
import threading

from tierd.tiers import kind_of
from tierd.tiers.allocator import ExtentAllocator, Piece

log = logging.getLogger("tierd.tiers")


class SlabTier:
    name = "tier"  # a registered kind's (tiers.register)
    backend = "slabs"
    out_of_space = False  # the system refused room the budget allows (the disk tier sets it)
    unusable = 0  # bytes of used that no session holds: slabs retired after a fault (the disk tier's)

    def __init__(self, budget: int, slab_bytes: int, granule: int = 4096) -> None:
        if budget < 0:
            raise ValueError(f"{self.name} budget must not be negative")
        self.budget = budget
        self.allocator = ExtentAllocator(slab_bytes, granule)
        self._lock = threading.Lock()
        self._owners: dict[int, tuple[str, int]] = {}  # piece offset -> (owner, bytes)
        self._by_owner: dict[str, int] = {}

    # Subclasses -------------------------------------------------------------

    def _open_slab(self, index: int) -> None:
        raise NotImplementedError

    def _close_slab(self, index: int) -> None:
        raise NotImplementedError

    def _on_alloc(self, piece: Piece) -> bool:
        """Back the piece with real memory or space: False where there is no
        room (making room may help); raises OSError where the system failed
        otherwise (it would not)."""
        return True

    def _on_free(self, piece: Piece) -> None:
        """Return the piece's memory to the system where that is cheap."""

    def _retired(self, slab: int) -> bool:
        """Whether nothing may be allocated in this slab any more (its file is gone, say)."""
        return False

    def _give_back(self, piece: Piece) -> None:
        """The piece's room to the allocator, or, in a retired slab, kept from use."""
        if self._retired(piece.offset // self.slab_bytes):
            self.unusable += self.allocator.round(piece.alloc_bytes)
        else:
            self.allocator.free(piece.offset, piece.alloc_bytes)

    # Tier -------------------------------------------------------------------

    @property
    def medium(self) -> str:
        return kind_of(self.name).medium

    @property
    def used(self) -> int:
        return self.allocator.used

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def slab_bytes(self) -> int:
        return self.allocator.slab_bytes

    def max_slabs(self) -> int:
        return -(-self.budget // self.slab_bytes)

    def alloc_pages(self, n_pages: int, page_bytes: int, owner: str = "") -> list[Piece] | None:
        """Room for n_pages pages within the budget, accounted to owner; None if
        there is none. Raises OSError where backing it failed otherwise; either
        way a failure leaves the tier as it was."""
        if n_pages <= 0:
            return []
        with self._lock:
            if self.used + self.allocator.round(n_pages * page_bytes) > self.budget:
                return None
            slabs = self.allocator.num_slabs  # slabs opened for this call close again if it fails
            while True:
                pieces = self.allocator.alloc_pages(n_pages, page_bytes)
                if pieces is not None or self.allocator.num_slabs >= self.max_slabs():
                    break
                index = self.allocator.add_slab()
                try:
                    self._open_slab(index)
                except OSError as exc:
                    self.allocator.remove_last_slab()
                    log.warning("%s tier: cannot open slab %d: %s", self.name, index, exc)
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        self._close_free_slabs(slabs)
                        raise  # out of descriptors, not of room: evicting sessions would not help
                    break
            backed: list[Piece] = []
            failure: OSError | None = None
            for p in pieces or []:
                try:
                    if not self._on_alloc(p):
                        break
                except OSError as exc:
                    failure = exc
                    break
                backed.append(p)
            if pieces is None or len(backed) < len(pieces):
                for q in backed:
                    self._on_free(q)
                for q in pieces or []:
                    self._give_back(q)
                self._close_free_slabs(slabs)
                if failure is not None:
                    raise failure
                return None
            for p in pieces:
                self._own(p.offset, p.alloc_bytes, owner)
            return pieces

    def free(self, piece: Piece) -> None:
        with self._lock:
            self._on_free(piece)
            self._give_back(piece)
            owner, size = self._owners.pop(piece.offset)
            self._by_owner[owner] -= size

    def reserve(self, pieces: list[tuple[Piece, str]]) -> None:
        """Mark pieces found on recovery as allocated to their owners."""
        with self._lock:
            self.allocator.reserve_all([(p.offset, p.alloc_bytes) for p, _ in pieces])
            for p, owner in pieces:
                self._own(p.offset, self.allocator.round(p.alloc_bytes), owner)

    def used_by(self, owner: str) -> int:
        with self._lock:
            return self._by_owner.get(owner, 0)

    def _own(self, offset: int, size: int, owner: str) -> None:
        self._owners[offset] = (owner, size)
        self._by_owner[owner] = self._by_owner.get(owner, 0) + size

    def maintain(self) -> int:
        """Periodic housekeeping (returning memory, say); returns bytes released."""
        return 0

    def set_budget(self, nbytes: int) -> None:
        """Change the budget. The caller moves data out first when shrinking;
        slabs left empty past the new budget are closed."""
        with self._lock:
            self.budget = nbytes
            self._close_free_slabs(self.max_slabs())

    def _close_free_slabs(self, keep: int) -> None:
        """Close the last slabs, past the first `keep`, while they hold nothing."""
        while self.allocator.num_slabs > keep and self.allocator.slab_is_free(self.allocator.num_slabs - 1):
            index = self.allocator.num_slabs - 1
            self.allocator.remove_last_slab()
            self._close_slab(index)

    def close(self) -> None:
        with self._lock:
            for index in range(self.allocator.num_slabs):
                self._close_slab(index)

    def locate(self, offset: int, nbytes: int = 0) -> tuple[int, int]:
        """(slab index, offset inside the slab) of bytes [offset, offset + nbytes),
        which must lie in one slab."""
        slab, off = divmod(offset, self.slab_bytes)
        if off + nbytes > self.slab_bytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) cross a slab boundary")
        return slab, off
