"""Placement: moving a session's pages between tiers, two-phase.

Runs inside the store, called with the session's op lock held. Every move is
prepare (allocate in the destination, room made by the store's make_room),
copy, complete: the new pieces join the snapshot only after the copy succeeded
(and, for the durable tier, after fdatasync and the index commit, which names a
history of this node's own); on failure they are freed, the old copies stay authoritative.

An allocation may be held by several snapshots of one tenant (shared
prefix pages: core/store/sharing.py), each holding a piece cut to the
pages it shares, starting where the allocation starts. `hold` counts a
holder more; `free` gives the room back only when its last holder lets go.
Before a copy into a tier, the store may hand the session pages another
snapshot already holds there (`borrow`), so they are not stored twice. Copies
of pages other snapshots hold too (`shared`) go into a tier one at a time
(the tier's copy lock, taken after the session's op lock and before the
store lock): two sessions written back at once would each have stored them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np

from tierd import codecs
from tierd.core.events import StoreEvents
from tierd.core.faults import Faults
from tierd.core.holders import Holders
from tierd.core.ports import Lending, MakeRoom
from tierd.core.index import DiskIndex, Row
from tierd.core.index_edits import IndexEdits
from tierd.core.rows import with_pages
from tierd.core.model import Session
from tierd.errors import DataLoss, ResourceExhausted, Unavailable, shown
from tierd.tiers import durable_tier, tier_order, tier_rank
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.transfer import coded
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import Span
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.placement")
class Placement:
    def __init__(self, tiers: dict, copier: CopyEngine, index: DiskIndex | None, events: StoreEvents,
                 lock: threading.RLock, holders: Holders, faults: Faults, lending: Lending = Lending(),
                 make_room: MakeRoom | None = None, quota: Callable[[str], int | None] = lambda tier: None) -> None:
        self.tiers = tiers
        self.durable = durable_tier(tiers)  # the tier the index records (disk), if there is one
        self.copier = copier
        self.index = index
        self.events = events
        self.lock = lock
        self.lending = lending
        self.make_room: MakeRoom = make_room or (lambda tier, need, protect, io_class, tenant, evict: False)
        self.quota = quota
        self._copy_locks = {t: threading.RLock() for t in tiers}  # re-entrant: making room copies too
        self.held = holders  # allocations several pieces hold (prefix sharing)
        self.faults = faults
        self.edits = IndexEdits(index, self.durable, lock, holders, self.retire)  # cuts, replacements, forgetting

    def alloc(self, tier: str, ranges: list[tuple[int, int]], stride: int, protect: SessionKey,
              io_class: IOClass, evict: bool) -> list[Piece]:
        """Pieces in `tier` for page ranges [(first, count)], making room if
        needed (as make_room, with evict). All or nothing; raises ResourceExhausted."""
        t = self.tiers[tier]
        total = sum(t.allocator.round(n * stride) for _, n in ranges)
        tenant = protect.tenant
        quota = self.quota(tier)
        if quota is not None and t.used_by(tenant) + total > quota:
            # Over the tenant's quota: only the tenant's own sessions make room.
            over = t.used_by(tenant) + total - quota
            if total > quota or not self.make_room(tier, over, protect, io_class, tenant, evict) or \
                    t.used_by(tenant) + total > quota:
                raise ResourceExhausted(
                    f"tenant {shown(tenant)} may hold {quota} bytes of the {tier} tier; it holds {t.used_by(tenant)} "
                    f"and this needs {total} more", tier=tier, quota=quota, used=t.used_by(tenant), need=total)
        for attempt in range(3):
            got: list[Piece] = []
            for first, n in ranges:
                try:
                    pieces = t.alloc_pages(n, stride, owner=tenant)
                except OSError as exc:
                    self.free(tier, got)
                    raise self.faults.io_failed("allocation", exc, protect, tier) from exc
                if pieces is None:
                    break
                got += [Piece(p.offset, p.alloc_bytes, p.first_page + first, p.n_pages) for p in pieces]
            else:
                return got
            for p in got:
                t.free(p)
            if t.out_of_space:
                # The file system is full, not the budget: evicting sessions would not help.
                raise Unavailable(f"the file system under the {tier} tier is full; demotion pauses until space "
                                  "frees", tier=tier)
            # First ask for what the budget lacks; if fragmentation still bites, for all of it.
            need = max(total - (t.budget - t.used), stride) if attempt == 0 else total
            if total > t.budget or not self.make_room(tier, need, protect, io_class, None, evict):
                break
        raise ResourceExhausted(  # bytes used are every tenant's: in the details, not the caller's message
            f"the {tier} tier has no room for {total} bytes (budget {t.budget})",
            tier=tier, need=total, budget=t.budget, used=t.used)

    def free(self, tier: str, pieces: list[Piece]) -> None:
        """Let go of each piece: its room returns when no other piece holds its allocation."""
        for p in pieces:
            if self.held.let_go(tier, p):
                self.tiers[tier].free(p)

    def retire(self, session: Session, pieces: list[tuple[str, Piece]]) -> None:
        """Free pieces the session no longer holds, or, while a Get stream
        still reads them, once it is done (end_read)."""
        with self.lock:
            if session.readers:
                session.deferred += pieces
                return
        for tier, p in pieces:
            self.free(tier, [p])

    def end_read(self, session: Session) -> None:
        """A Get stream is done with the session's pages: free what waited for it."""
        with self.lock:
            session.readers -= 1
            if session.readers:
                return
            pieces, session.deferred = session.deferred, []
        for tier, p in pieces:
            self.free(tier, [p])

    def promote(self, session: Session, target: str, io_class: IOClass) -> int:
        """Copy into `target` every page whose fastest copy is slower; returns bytes moved."""
        snap = session.snap
        missing = snap.missing([t for t in self.tiers if tier_rank(t) <= tier_rank(target)])
        if not missing:
            return 0
        return self.copy_in(session, target, missing, io_class, "prefetch", True)

    def demote(self, session: Session, target: str, io_class: IOClass, reason: str, evict: bool) -> None:
        """Leave no page faster than `target`: copy the faster pages that
        `target` lacks into it (to disk: every page; evict: as alloc), then free the faster pieces."""
        snap = session.snap
        faster = [t for t in tier_order(self.tiers) if tier_rank(t) < tier_rank(target) and snap.pieces(t)]
        if not faster:
            return
        if target == self.durable:
            self.write_durable(session, io_class, reason, evict)
        else:
            missing = snap.missing([target], among=faster)
            if missing:
                self.copy_in(session, target, missing, io_class, reason, evict)
        with self.lock:
            dropped = {t: snap.remove_tier(t) for t in faster}
        self.retire(session, [(t, p) for t, pieces in dropped.items() for p in pieces])
        for t in dropped:
            self.events.evicted(t, reason)

    def copy_in(self, session: Session, target: str, missing: list[tuple[int, int]], io_class: IOClass,
                 reason: str, evict: bool) -> int:
        with self._one_copy(session, target, missing):
            return self._copy_in(session, target, missing, io_class, reason, evict)

    @contextmanager
    def _one_copy(self, session: Session, tier: str, ranges: list[tuple[int, int]]) -> Iterator[None]:
        """Held while pages of these ranges are copied into the tier, if other
        sessions hold them too: the next copy of them borrows this one's."""
        with self._copy_locks[tier] if self.lending.held_by_others(session, ranges) else nullcontext():
            yield

    def _copy_in(self, session: Session, target: str, missing: list[tuple[int, int]], io_class: IOClass,
                 reason: str, evict: bool) -> int:
        snap = session.snap
        geom = snap.geometry
        borrowed, missing = self.lending.borrow(session, target, missing)
        try:
            pieces = self.alloc(target, missing, geom.stride, session.key, io_class, evict) if missing else []
        except BaseException:
            self.free(target, borrowed)
            raise
        dst = [Span(p.first_page, p.n_pages, target, p.offset) for p in pieces]
        src = [s for s in snap.best_spans(served=False) if s.tier != target]
        t0 = time.perf_counter()
        with self._copying(session, target, pieces + borrowed, "read"):
            moved = self.copier.move(src, dst, geom, snap.checksums, io_class) if dst else 0
        with self.lock:
            snap.add_pieces(target, pieces + borrowed)
        if not dst:
            return 0
        source = max((s.tier for s in src), key=tier_rank)
        self.events.moved(source, target, reason, moved, time.perf_counter() - t0)
        return moved

    @contextmanager
    def _copying(self, session: Session, tier: str, pieces: list[Piece], op: str) -> Iterator[None]:
        """A copy of the session's pages into these pieces: where it fails, they
        go back; a page that fails its check damages the session, failed I/O is UNAVAILABLE."""
        try:
            yield
        except BaseException as exc:
            self.free(tier, pieces)
            if isinstance(exc, DataLoss):
                self.faults.damaged(session, exc)
            elif isinstance(exc, OSError):
                raise self.faults.io_failed(op, exc, session.key) from exc
            raise

    def write_durable(self, session: Session, io_class: IOClass, reason: str, evict: bool) -> None:
        """Give every page a copy in the durable tier (evict: as alloc) and record the session as durable."""
        if self.index is None or self.durable is None:
            raise ResourceExhausted("there is no disk tier")
        if not session.durable:
            missing = session.snap.missing([self.durable])
            with self._one_copy(session, self.durable, missing):
                if session.kept and self._kept_gives_room(session, missing):
                    self.edits.give_up_kept(session)  # what the new content lacks is its room: it goes first
                self._write_durable(session, missing, io_class, reason, evict)

    def _kept_gives_room(self, session: Session, missing: list[tuple[int, int]]) -> bool:
        """Whether the durable tier lacks free room for the pages the new content
        needs there, and letting go of the state kept for a store (Session.kept)
        gives it: then it goes first, before any other session is moved out. Not
        where that would not free enough (content that never fits; pieces a Get
        stream still reads, freed only once it is done): it would be lost for nothing."""
        t, stride, tier = self.tiers[self.durable], session.snap.geometry.stride, self.durable
        need = sum(t.allocator.round(n * stride) for _, n in missing)
        with self.lock:
            frees = 0 if session.readers else sum(t.allocator.round(p.alloc_bytes) for p in session.kept
                                                  if self.held.holders(tier, p) == 1)
        quota = self.quota(tier)
        room = t.budget - t.used if quota is None else min(t.budget - t.used, quota - t.used_by(session.key.tenant))
        return room < need <= room + frees

    def _write_durable(self, session: Session, missing: list[tuple[int, int]], io_class: IOClass,
                       reason: str, evict: bool) -> None:
        durable = self.durable
        assert self.index is not None and durable is not None
        snap = session.snap
        borrowed, missing = self.lending.borrow(session, durable, missing)
        pieces: list[Piece] = []
        if missing:
            geom, src = snap.geometry, [s for s in snap.best_spans(served=False) if s.tier != durable]
            coding = self.copier.codings.get(durable)
            codec = coding.choose() if coding is not None else "none"
            t0, epoch = time.perf_counter(), self.tiers[durable].epoch()
            try:
                with self._copying(session, durable, pieces, "write"):  # (pieces: as they are allocated)
                    coded.write(self.copier, durable, src, missing, geom, snap.checksums, codec,
                                codecs.lossless_shape(snap.spec), lambda ranges, stride: self.alloc(
                                    durable, ranges, stride, session.key, io_class, evict), pieces, io_class)
                    self.tiers[durable].sync(epoch)
            except BaseException:
                self.free(durable, borrowed)
                raise
            moved, seconds = sum(n for _, n in missing) * geom.page_bytes, time.perf_counter() - t0
            if coding is not None:
                coding.measured(codec, "write", moved, seconds)
            self.events.moved(max((s.tier for s in src), key=tier_rank), durable, reason, moved, seconds)
        row = Row(snap.spec, snap.num_tokens, snap.n_pages, snap.nbytes, session.created, session.last_access,
                  session.priority, snap.errors.astype("<f4").tobytes(), session.lossy)
        pieces += borrowed
        entries = with_pages(snap.pieces(durable) + pieces, snap.checksums, snap.token_hashes)
        record = self.index.records.describe(session.key, row, entries)  # (the whole state) before the index
        with self.lock:
            own = session.own_begin()
            replace = bool(session.kept)  # the index holds the state a store replaced: replaced here
        try:
            self.index.add_pieces(session.key, entries if replace else entries[len(entries) - len(pieces):], row,
                                  record, own, replace)
        except BaseException:
            with self.lock:
                session.own_end(None)
            self.free(durable, pieces)
            self.index.records.discard(record)
            raise
        with self.lock:
            session.own_end(own)
            snap.add_pieces(durable, pieces)
            session.row, session.row_version = row, snap.version
            replaced, session.record = (session.record, record) if record is not None or replace else \
                (None, session.record)
        self.index.records.discard(replaced)
        self.edits.let_go_kept(session)
