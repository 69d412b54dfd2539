"""Sessions and snapshots: metadata only, no bytes and no I/O.

A snapshot is an ordered list of pages. Each tier holds some of them in
pieces (contiguous extents); a page may be in several tiers, and since pages
never change once stored, every copy of a page is as good as any other: the
fastest is the one served, the lower ones are clean and cost nothing to drop.
The one exception: a copy a memory tier re-coded lossily to make room, which
its codes say decodes to other bytes (and with what error); it is served,
but never read by a move, and its session keeps an exact copy on disk.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from tierd.core import tokens
from tierd.core.pages import ranges
from tierd.core.remote_copy import RemoteCopy
from tierd.layout import KVSpec
from tierd.tiers import MEMORY, kind_of, tier_order, tier_rank
from tierd.tiers.allocator import Piece
from tierd.transfer.runs import Geometry, Span
from tierd.types import SessionKey


NO_ERRORS = np.zeros(0, dtype=np.float32)
UNKNOWN = -1  # Session.remote_version of a copy recovered from disk: what the remote tier holds is asked

class State(str, Enum):
    ACTIVE = "active"
    IDLE = "idle"
    MOVING = "moving"
    DAMAGED = "damaged"


@dataclass(eq=False)
class Snapshot:
    spec: KVSpec
    num_tokens: int = 0
    nbytes: int = 0
    checksums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    placement: dict[str, list[Piece]] = field(default_factory=dict)
    version: int = 0  # bumped whenever the content changes
    token_hashes: np.ndarray = field(default_factory=tokens.empty)  # a chained hash per page (tokens.py)
    # Per page, the relative L2 error it carries against the page first stored (fetched from a copy
    # coded lossily); empty: every page exact.
    errors: np.ndarray = field(default_factory=lambda: NO_ERRORS)

    @property
    def rel_error(self) -> float:
        """The worst relative error of a page a restore serves (0: every page exact)."""
        return self.served_error(self.n_pages)

    def served_error(self, n_pages: int) -> float:
        """The worst relative error of the first n_pages a restore serves (0: exact)."""
        served = self.served_errors()[:n_pages]
        return float(served.max()) if served.size else 0.0

    def served_errors(self) -> np.ndarray:
        """Per page, the relative error of the copy a restore serves: what the
        content carries (errors), plus what a copy coded lossily adds, where
        that copy is the one served (empty: every page exact)."""
        if not any(p.codes is not None and p.codes.lossy for pieces in self.placement.values() for p in pieces):
            return self.errors
        lossy = [s for s in self.best_spans() if s.codes is not None and s.codes.lossy]
        out = np.zeros(self.n_pages, dtype=np.float64)  # (errors add up: in float64, never rounded down)
        out[: self.errors.size] = self.errors
        for s in lossy:
            out[s.first_page : s.first_page + s.n_pages] += s.codes.rel_error
        return out

    def set_errors(self, first_page: int, errors: np.ndarray | None) -> None:
        """Pages from first_page on are new, with these errors (None: exact)."""
        kept = self.errors[:first_page]
        if errors is not None and errors.any():
            self.errors = np.concatenate([np.pad(kept, (0, first_page - kept.size)), errors]).astype(np.float32)
        elif kept.size and kept.any():
            self.errors = np.pad(kept, (0, self.n_pages - kept.size))
        else:
            self.errors = NO_ERRORS

    @property
    def n_pages(self) -> int:
        return len(self.checksums)

    @property
    def geometry(self) -> Geometry:
        n = self.n_pages
        last = self.nbytes - (n - 1) * self.spec.page_bytes if n else 0
        return Geometry(self.spec.page_bytes, n, last)

    def pieces(self, tier: str) -> list[Piece]:
        return self.placement.get(tier, [])

    def spans(self, tier: str) -> list[Span]:
        return [Span(p.first_page, p.n_pages, tier, p.offset, p.codes) for p in self.pieces(tier)]

    def bytes_in(self, tier: str) -> int:
        return sum(p.alloc_bytes for p in self.pieces(tier))

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held in each tier that holds any."""
        return {t: sum(p.alloc_bytes for p in pieces) for t, pieces in self.placement.items() if pieces}

    def tiers_held(self) -> list[str]:
        held = [t for t, pieces in self.placement.items() if pieces]
        return held if len(held) < 2 else list(tier_order(held))

    def add_pieces(self, tier: str, pieces: list[Piece]) -> None:
        merged = self.placement.get(tier, []) + pieces
        self.placement[tier] = sorted(merged, key=lambda p: p.first_page)

    def covered(self, tiers: tuple[str, ...] | list[str]) -> np.ndarray:
        """A bool per page: does some tier in `tiers` hold it?"""
        mask = np.zeros(self.n_pages, dtype=bool)
        for t in tiers:
            for p in self.pieces(t):
                mask[p.first_page : p.first_page + p.n_pages] = True
        return mask

    def missing(self, tiers: tuple[str, ...] | list[str],
                among: tuple[str, ...] | list[str] | None = None) -> list[tuple[int, int]]:
        """(first page, count) ranges held by none of `tiers` (and, with
        `among`, held by one of those)."""
        mask = ~self.covered(tiers)
        if among is not None:
            mask &= self.covered(among)
        return ranges(mask)

    def best_spans(self, usable: tuple[str, ...] | list[str] | None = None, served: bool = True) -> list[Span]:
        """For each page, the fastest copy among usable tiers (default: all), as
        spans in page order. served False: only copies a move may read, not
        those a memory tier re-coded to make room (serving copies: every page
        of them has a copy on disk)."""
        spans: list[Span] = []
        stride = self.geometry.stride
        todo = np.ones(self.n_pages, dtype=bool)
        for tier in tier_order(self.placement if usable is None else usable):
            for p in self.pieces(tier) if served or kind_of(tier).medium != MEMORY else \
                    [p for p in self.pieces(tier) if p.codes is None]:
                part = todo[p.first_page : p.first_page + p.n_pages]
                for first, count in ranges(part):
                    codes = p.codes.part(first, count) if p.codes is not None else None
                    spans.append(Span(p.first_page + first, count, tier, p.offset + p.bytes_before(first, stride),
                                      codes))
                part[:] = False
        if todo.any():
            raise ValueError("some pages are in no tier")
        return sorted(spans, key=lambda s: s.first_page)

    def slowest_tier(self) -> str | None:
        """The tier a full restore has to read its worst page from: the first
        tier that, with the faster ones, holds every page."""
        if self.n_pages == 0:
            return None
        ranges: list[tuple[int, int]] = []
        for tier in self.tiers_held():
            ranges += [(p.first_page, p.first_page + p.n_pages) for p in self.pieces(tier)]
            covered = 0
            for lo, hi in sorted(ranges):
                if lo > covered:
                    break
                covered = max(covered, hi)
            if covered >= self.n_pages:
                return tier
        raise ValueError("some pages are in no tier")

    def source_of(self, n_pages: int) -> str | None:
        """The slowest tier a read of the first n_pages pages takes a page from (None: no pages)."""
        spans = [s for s in self.best_spans() if s.first_page < n_pages] if n_pages else []
        return max((s.tier for s in spans), key=tier_rank) if spans else None

    def truncate(self, n_pages: int) -> list[tuple[str, Piece]]:
        """Forget pages from n_pages on; returns the pieces to free.
        Pieces cut in two keep their allocation until they are freed whole."""
        freed: list[tuple[str, Piece]] = []
        for tier, pieces in self.placement.items():
            kept = []
            for p in pieces:
                if p.first_page >= n_pages:
                    freed.append((tier, p))
                elif p.first_page + p.n_pages > n_pages:
                    kept.append(p.head(n_pages - p.first_page))
                else:
                    kept.append(p)
            self.placement[tier] = kept
        self.checksums = self.checksums[:n_pages].copy()
        self.token_hashes = self.token_hashes[:n_pages].copy()
        self.errors = self.errors[:n_pages].copy() if self.errors[:n_pages].any() else NO_ERRORS
        self.nbytes = min(self.nbytes, n_pages * self.spec.page_bytes)
        self.num_tokens = 0 if n_pages == 0 else min(self.num_tokens, n_pages * self.spec.block_tokens)
        return freed

    def remove_tier(self, tier: str) -> list[Piece]:
        return self.placement.pop(tier, [])


@dataclass(eq=False)
class Session(RemoteCopy):
    key: SessionKey
    snap: Snapshot
    created: float
    last_access: float
    released_at: float | None = None  # None while the engine uses it
    priority: int = 0
    # A save's consent to lossy codes: the relative error each page may carry (0: lossless only);
    # None: the tenant's setting (--lossy-tenants).
    lossy: float | None = None
    pins: int = 0
    damaged: bool = False
    moving: bool = False
    dropped: bool = False
    awaited: bool = False  # prefetched, not yet restored or read
    row: Any = None  # the complete state recorded in the disk index (index.Row), if any
    row_version: int = -1  # the snapshot version that row describes
    record: Any = None  # the record that describes that row beside the slab files (records.Record), if any
    idle_check: float | None = None  # when the policy tick looks at it next (None: not scheduled)
    retry_at: float | None = None  # a move of it failed: no idle or pressure move before this time
    failures: int = 0  # moves of it that failed in a row
    op: threading.Lock = field(default_factory=threading.Lock)
    readers: int = 0  # Get streams reading pages without the op lock
    deferred: list[tuple[str, Piece]] = field(default_factory=list)  # pieces to free once the readers are done
    # After a store from token 0 over a durable state, the durable tier's pieces of that state: the index
    # holds it until the new content is durable ([]: none), and they are freed then, or with the session.
    kept: list[Piece] = field(default_factory=list)

    @property
    def durable(self) -> bool:
        """Every page of the current content is on disk and indexed."""
        return self.row is not None and self.row_version == self.snap.version

    @property
    def state(self) -> State:
        if self.damaged:
            return State.DAMAGED
        if self.moving:
            return State.MOVING
        return State.ACTIVE if self.released_at is None else State.IDLE
