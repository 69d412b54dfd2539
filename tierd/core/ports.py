"""The seams between the store's parts that are not imports: what one part
needs of another, handed in when the store is built. Plain data: any
thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierd.core.model import Session
from tierd.tiers import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionKey

# Room in a tier for `need` bytes (tier, need, the session to protect, I/O class, tenant or None, whether
# sessions may be evicted for it): whether it was made.
MakeRoom = Callable[[str, int, SessionKey, IOClass, "str | None", bool], bool]
Borrow = Callable[[Session, str, list[tuple[int, int]]], tuple[list[Piece], list[tuple[int, int]]]]


@dataclass(frozen=True)
class Lending:
    """What placement needs of prefix sharing (none where sessions share nothing)."""

    # Pieces of pages in these ranges that other snapshots hold in a tier, held (hold) for the session,
    # and the ranges still missing.
    borrow: Borrow = lambda session, tier, ranges: ([], ranges)
    # Whether pages in these ranges of the session are held by other sessions too.
    held_by_others: Callable[[Session, list[tuple[int, int]]], bool] = lambda session, ranges: False
