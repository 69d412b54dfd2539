"""Holders: how many pieces hold each allocation that several snapshots or
writes share (prefix sharing lends pages by holding the allocation they lie
in), the bytes those would take again, and which shared allocations hold a
page that failed its check. Under the store lock (handed in), as placement's
other state."""

from __future__ import annotations

import threading

from tierd.tiers.allocator import Piece


class Holders:
    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._count: dict[tuple[str, int], int] = {}  # (tier, offset) -> holders, of allocations with several
        self.shared_bytes: dict[str, int] = {}  # tier -> bytes its allocations would take again, one per holder more
        self._damaged: set[tuple[str, int]] = set()  # (tier, offset) of shared allocations whose bytes failed a check

    def hold(self, tier: str, pieces: list[Piece]) -> None:
        """One holder more for each piece's allocation (a piece cut from
        one that a snapshot or a write holds)."""
        with self.lock:
            for p in pieces:
                key = (tier, p.offset)
                self._count[key] = self._count.get(key, 1) + 1
                self.shared_bytes[tier] = self.shared_bytes.get(tier, 0) + p.alloc_bytes

    def holders(self, tier: str, piece: Piece) -> int:
        """How many pieces hold the allocation this piece is in (called with the store lock held)."""
        return self._count.get((tier, piece.offset), 1)

    def damage(self, tier: str, piece: Piece) -> None:
        """The allocation holds a page that failed its checksum: it is lent no more (store lock held)."""
        self._damaged.add((tier, piece.offset))

    def is_damaged(self, tier: str, piece: Piece) -> bool:
        return (tier, piece.offset) in self._damaged

    def shared_allocations(self) -> list[tuple[str, int]]:
        """(tier, offset) of every allocation counted as held more than once (store lock held)."""
        return list(self._count)

    def let_go(self, tier: str, piece: Piece) -> bool:
        """One holder fewer for the piece's allocation; whether it was the last
        (its room is the caller's to free)."""
        with self.lock:
            key = (tier, piece.offset)
            n = self._count.get(key, 1)
            if n > 2:
                self._count[key] = n - 1
            elif n == 2:
                del self._count[key]
            if n > 1:
                self.shared_bytes[tier] -= piece.alloc_bytes
            else:
                self._damaged.discard(key)
            return n == 1
