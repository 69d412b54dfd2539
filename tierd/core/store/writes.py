"""The write path: Save (engine blocks gathered into pages), Put (a byte
stream), save leases (commit_save, in leases.py) and fetches from the
remote tier all allocate through begin_write, are written by their caller,
and are installed through commit_write (a fetch: install), which checks the
append again under the session's lock; what a commit listener must hear
(the remote publisher) it hears after each commit. A Put's chunks are
written on the event loop with no lock held; the rest on the caller's
thread (an RPC thread, a mover). The write itself is a PendingWrite
(pending.py); the calls that make one, stores.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierd.clock import Clock
from tierd.core import tokens
from tierd.core.events import StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.model import Session, Snapshot
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.store.checks import check_identity
from tierd.core.store.describe import Describe
from tierd.core.store.pending import PendingWrite
from tierd.core.store.sharing import Sharing
from tierd.core.store.table import SessionTable
from tierd.errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted, Unavailable, shown
from tierd.layout import KVSpec
from tierd.policy import PolicyConfig
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.runs import Geometry
from tierd.types import SessionInfo, SessionKey


class Writer:
    def __init__(self, table: SessionTable, sharing: Sharing, placement: Placement, describe: Describe,
                 index: DiskIndex | None, roles: TierRoles, policy: PolicyConfig, clock: Clock, events: StoreEvents,
                 committed: Sequence[Callable[[PendingWrite, Session], None]] = ()) -> None:
        self.table = table
        self.sharing = sharing
        self.placement = placement
        self.describe = describe
        self.index = index
        self.roles = roles
        self.policy = policy
        self.clock = clock
        self.events = events
        self.committed = tuple(committed)  # told of each write committed, after its session's lock is let go
        self._streaming: dict[str, int] = {}  # host bytes held by each tenant's Puts in progress

    def check_append(self, key: SessionKey, session: Session | None, spec: KVSpec, start_token: int,
                      hashes: np.ndarray | None = None) -> None:
        """A store from start_token > 0 extends an existing snapshot of the same
        identity (and, with token hashes, of the same tokens before start_token);
        a new session must fit the tenant's session quota."""
        limit = self.policy.tenant_sessions
        if session is None and limit and self.table.count(key.tenant) >= limit:
            raise ResourceExhausted(f"tenant {shown(key.tenant)} may hold {limit} sessions; drop some first",
                                    tenant=key.tenant, quota=limit)
        if not start_token:
            return
        if session is None:
            raise NotFound(f"session {shown(key.session_id)} not found: nothing to append to",
                           session_id=key.session_id)
        check_identity(session, spec)
        if session.damaged:
            raise FailedPrecondition(f"session {shown(key.session_id)} is damaged: store it again from token 0")
        if start_token > session.snap.num_tokens:
            raise FailedPrecondition(f"start_token {start_token} is past the {session.snap.num_tokens} tokens stored",
                                     field="start_token", have=session.snap.num_tokens)
        kept = session.snap.token_hashes[: start_token // spec.block_tokens]
        if hashes is not None and tokens.known(kept) and not np.array_equal(kept, hashes[: len(kept)]):
            raise FailedPrecondition(f"session {shown(key.session_id)} holds other tokens before start_token "
                                     f"{start_token}: store it from token 0", field="token_ids")

    def install(self, key: SessionKey, lock: threading.Lock, session: Session | None, spec: KVSpec,
                first_page: int, pieces: list, tier: str, sums: np.ndarray, num_tokens: int,
                nbytes: int, priority: int | None, hashes: np.ndarray | None = None,
                lent: dict[str, list[Piece]] | None = None, errors: np.ndarray | None = None,
                lossy: float | None = None, fetched: bool = False) -> Session:
        """Complete a store: replace pages from first_page on with the new ones
        in `tier` and the pieces `lent` by other sessions, by tier (hashes:
        the token hashes of every page, if known; errors: what the new pages
        carry, if fetched from a copy coded lossily; lossy: the save's consent
        to lossy codes, None to leave the session's as it is). The index forgets the
        replaced pages first (but for a fetch from the remote tier, which
        replaces the session: not a durable state it holds, until the new
        content is durable; core/index_edits.py): if it
        cannot, this raises before anything changed, and the caller still owns `pieces` and `lent`."""
        durable = self.roles.durable
        add = [(p, sums[p.first_page - first_page : p.first_page - first_page + p.n_pages],
                hashes[p.first_page : p.first_page + p.n_pages])
               for p in (lent or {}).get(durable, [])] if hashes is not None else []  # (every disk piece is indexed)
        if session is not None:
            # Out of the prefix index while its hashes change (truncate cuts them): it lends nothing meanwhile.
            self.table.leaving(session)
            try:
                freed = self.placement.edits.truncate(session, first_page, add, keep=not fetched)
            except BaseException:
                self.table.entered(session)  # unchanged: back in
                raise
        else:
            freed = []
            if add and self.index is not None:
                self.index.add_pieces(key, add, None)
        now = self.clock.now()
        with self.table.changed:
            new = session is None
            if session is None:
                session = Session(key, Snapshot(spec), created=now, last_access=now, op=lock)
            snap = session.snap
            if first_page == 0:
                snap.spec = spec
                session.damaged = False
            kept = snap.token_hashes[:first_page]
            new_hashes = hashes[first_page:] if hashes is not None and tokens.known(kept) else tokens.empty(len(sums))
            snap.token_hashes = np.concatenate([kept, new_hashes])
            snap.checksums = np.concatenate([snap.checksums[:first_page], sums])
            snap.set_errors(first_page, errors)
            snap.add_pieces(tier, pieces)
            for t, lent_pieces in (lent or {}).items():
                snap.add_pieces(t, lent_pieces)
            snap.num_tokens, snap.nbytes = num_tokens, nbytes
            snap.version += 1
            session.last_access, session.released_at, session.awaited = now, None, False
            if priority is not None:
                session.priority = priority
            if lossy is not None:
                session.lossy = lossy
            if new:
                self.table.add(session)
            else:
                self.table.entered(session)
        self.placement.retire(session, freed)
        self.table.notify()
        return session

    def begin_write(self, key: SessionKey, spec: KVSpec, tier: str, first_page: int, num_tokens: int,
                     nbytes: int, geom: Geometry, hashes: np.ndarray | None,
                     priority: int | None, share: bool = True, lossy: float | None = None) -> PendingWrite:
        """Check that the store may go ahead (quota, an append onto the same
        identity and tokens) and allocate its pages, less those the tenant
        holds already (with share); the session's lock is held only for that."""
        lock, session = self.table.acquire(key)
        try:
            self.check_append(key, session, spec, first_page * spec.block_tokens if first_page else 0, hashes)
            lent, write_from, lent_sums = self._lent_for(key, spec, hashes if share else None, first_page,
                                                         geom.n_pages)
            try:
                pieces = self.placement.alloc(tier, [(write_from, geom.n_pages - write_from)], geom.stride, key,
                                              IOClass.DEMAND, True) if write_from < geom.n_pages else []
            except BaseException:
                self.let_go(lent)
                raise
        finally:
            lock.release()
        return PendingWrite(key, spec, tier, first_page, num_tokens, nbytes, geom, pieces, hashes, priority,
                            time.perf_counter(), lent=lent, lent_sums=lent_sums, write_from=write_from, lossy=lossy)

    def _lent_for(self, key: SessionKey, spec: KVSpec, hashes: np.ndarray | None, first_page: int, n_pages: int
                  ) -> tuple[dict[str, list[Piece]], int, np.ndarray]:
        """Pages [first_page, ...) of a store that another session of the
        tenant holds already: their pieces, held for the store, the page the
        store writes from, and their checksums. (Not the storing session's
        own: a store from token 0 replaces its bytes, whatever they held.)"""
        none = ({}, first_page, np.empty(0, dtype=np.uint64))
        if hashes is None:
            return none
        with self.table.lock:
            donor, upto = self.sharing.donor(key.tenant, spec, hashes, first_page, n_pages, key)
            if donor is None:
                return none
            lent, write_from = self.sharing.lend(donor, first_page, upto)
            sums = donor.snap.checksums[first_page:write_from].copy()
        if write_from > first_page:
            self.events.shared("save", write_from - first_page, (write_from - first_page) * spec.page_bytes)
        return lent, write_from, sums

    def _check_lent(self, w: PendingWrite) -> None:
        """A store whose lent pages were found damaged since it began is refused (DATA_LOSS): it would hold them."""
        with self.table.lock:
            bad = [p for tier, pieces in w.lent.items() for p in pieces if self.placement.held.is_damaged(tier, p)]
        if bad:
            raise DataLoss(f"page {bad[0].first_page} that session {shown(w.key.session_id)} took from another "
                           "session failed its checksum meanwhile: store it again", session_id=w.key.session_id,
                           page=bad[0].first_page)

    def let_go(self, lent: dict[str, list[Piece]]) -> None:
        for tier, pieces in lent.items():
            self.placement.free(tier, pieces)

    def commit_write(self, w: PendingWrite, sums: np.ndarray, keep: bool = False) -> SessionInfo:
        """Commit written pages (sums: their checksums), checked again under
        the session's lock: it may have changed since the write began. A write
        refused for want of room (the index's disk full, say) keeps its pages
        with keep, to be committed again; else they go back."""
        lock, session = self.table.acquire(w.key)
        try:
            try:
                self.check_append(w.key, session, w.spec, w.first_page * w.spec.block_tokens if w.first_page else 0,
                                   w.hashes)
                self._check_lent(w)
                session = self.install(w.key, lock, session, w.spec, w.first_page, w.pieces, w.tier,
                                        np.concatenate([w.lent_sums, sums]), w.num_tokens, w.nbytes, w.priority,
                                        w.hashes, w.lent, lossy=w.lossy)
            except (ResourceExhausted, Unavailable):
                if not keep:
                    self.abort_write(w)
                raise
            except BaseException:
                self.abort_write(w)
                raise
            w.pieces, w.lent = [], {}  # the session's now
            self.events.saved(w.tier, w.nbytes - w.write_from * w.spec.page_bytes, time.perf_counter() - w.started)
            with self.table.lock:
                info = self.describe.info(session)
        finally:
            lock.release()
        for listener in self.committed:
            listener(w, session)
        return info

    def abort_write(self, w: PendingWrite) -> None:
        """Give back the pages of a write that will not be committed."""
        pieces, w.pieces = w.pieces, []
        lent, w.lent = w.lent, {}
        self.placement.free(w.tier, pieces)
        self.let_go(lent)
        self.end_stream(w)

    def start_stream(self, key: SessionKey, nbytes: int) -> None:
        """Count a Put's room against its tenant's Puts in progress
        (tenant_put_bytes: half the host budget by default): a stream that
        trickles must not hold the host tier against the others (one Put of
        the whole budget sending 4 KiB every 5 s did; its pages cannot be
        demoted until it commits)."""
        limit = self.policy.tenant_put_bytes
        with self.table.lock:
            held = self._streaming.get(key.tenant, 0)
            if limit and held + nbytes > limit:
                raise ResourceExhausted(f"tenant {shown(key.tenant)}'s Puts in progress may hold {limit} bytes of "
                                        f"the host tier; they hold {held} and this one needs {nbytes}: let some "
                                        "finish first", tenant=key.tenant, limit=limit, held=held, need=nbytes)
            self._streaming[key.tenant] = held + nbytes

    def stream_ended(self, tenant: str, nbytes: int) -> None:
        with self.table.lock:
            left = self._streaming[tenant] - nbytes
            if left:
                self._streaming[tenant] = left
            else:
                del self._streaming[tenant]

    def end_stream(self, w: PendingWrite) -> None:
        streaming, w.streaming = w.streaming, 0
        if streaming:
            self.stream_ended(w.key.tenant, streaming)
