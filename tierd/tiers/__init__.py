"""Tiers: where bytes live (device VRAM, host shared memory, disk slabs).

Mechanism only: a tier allocates, frees and exposes its bytes; it never
decides what to move or why. Names are ordered fastest first.
"""

from __future__ import annotations

from typing import Protocol

from tierd.tiers.allocator import Piece

TIER_ORDER = ("device", "host", "disk")


def tier_rank(name: str) -> int:
    return TIER_ORDER.index(name)


class Tier(Protocol):
    name: str
    budget: int
    backend: str  # the mechanism behind it, for logs and metrics
    out_of_space: bool  # the system refused room the budget allows

    @property
    def used(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def alloc_pages(self, n_pages: int, page_bytes: int, owner: str = "") -> list[Piece] | None: ...

    def used_by(self, owner: str) -> int: ...

    def free(self, piece: Piece) -> None: ...

    def set_budget(self, nbytes: int) -> None: ...

    def maintain(self) -> int: ...

    def close(self) -> None: ...


__all__ = ["TIER_ORDER", "Piece", "Tier", "tier_rank"]
