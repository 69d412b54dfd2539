"""The write path: Save (engine blocks gathered into pages), Put (a byte
stream) and save leases (commit_save, in leases.py) all allocate through
_begin_write, are written by their caller, and are installed through
_commit_write, which checks the append again under the session's lock. A
Put's chunks are written on the event loop with no lock held; Save runs on
an RPC thread. The write itself is a PendingWrite (pending.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import numpy as np

from tierd.core import tokens
from tierd.core.model import Session, Snapshot
from tierd.core.store.checks import (
    check_blocks,
    check_blocks_range,
    check_identity,
    check_priority,
    check_start,
    token_hashes,
)
from tierd.core.store.pending import PendingWrite
from tierd.core.store.sharing import Sharing
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    shown,
)
from tierd.layout import KVSpec
from tierd.tiers import MEMORY, tier_order
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import EngineMemory
from tierd.transfer.runs import Geometry
from tierd.types import SessionInfo, SessionKey


class Writes(Sharing):
    def _landing(self, engine: EngineMemory | None) -> str:
        """Where a save's pages land by default: the engine landing tier (VRAM)
        for engines in device memory, where there is one, else the landing
        tier (the host arena)."""
        return self.roles.saves_land(engine is not None and engine.on_device)

    def _check_append(self, key: SessionKey, session: Session | None, spec: KVSpec, start_token: int,
                      hashes: np.ndarray | None = None) -> None:
        """A store from start_token > 0 extends an existing snapshot of the same
        identity (and, with token hashes, of the same tokens before start_token);
        a new session must fit the tenant's session quota."""
        limit = self.policy.tenant_sessions
        if session is None and limit and self._per_tenant.get(key.tenant, 0) >= limit:
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

    def _install(self, key: SessionKey, lock: threading.Lock, session: Session | None, spec: KVSpec,
                 first_page: int, pieces: list, tier: str, sums: np.ndarray, num_tokens: int,
                 nbytes: int, priority: int | None, hashes: np.ndarray | None = None,
                 lent: dict[str, list[Piece]] | None = None) -> Session:
        """Complete a store: replace pages from first_page on with the new ones
        in `tier` and the pieces `lent` by other sessions, by tier (hashes:
        the token hashes of every page, if known). The index forgets the
        replaced pages first: if it cannot, this raises before anything
        changed, and the caller still owns `pieces` and `lent`."""
        durable = self.placement.durable
        add = [(p, sums[p.first_page - first_page : p.first_page - first_page + p.n_pages],
                hashes[p.first_page : p.first_page + p.n_pages])
               for p in (lent or {}).get(durable, [])] if hashes is not None else []  # (every disk piece is indexed)
        if session is not None:
            # Out of the prefix table while its hashes change (truncate cuts them): it lends nothing meanwhile.
            with self._lock:
                before = self._entry(session.snap)
                self._prefixes.remove(session.key, *before)
            try:
                freed = self.placement.truncate(session, first_page, add)
            except BaseException:
                with self._lock:
                    self._share(session, None)  # unchanged: back in
                raise
        else:
            freed = []
            if add and self.index is not None:
                self.index.add_pieces(key, add, None)
        now = self.clock.now()
        with self._changed:
            if session is None:
                session = Session(key, Snapshot(spec), created=now, last_access=now, op=lock)
                self._sessions[key] = session
                self._per_tenant[key.tenant] = self._per_tenant.get(key.tenant, 0) + 1
            snap = session.snap
            if first_page == 0:
                snap.spec = spec
                session.damaged = False
            kept = snap.token_hashes[:first_page]
            new = hashes[first_page:] if hashes is not None and tokens.known(kept) else tokens.empty(len(sums))
            snap.token_hashes = np.concatenate([kept, new])
            snap.checksums = np.concatenate([snap.checksums[:first_page], sums])
            snap.add_pieces(tier, pieces)
            for t, lent_pieces in (lent or {}).items():
                snap.add_pieces(t, lent_pieces)
            snap.num_tokens, snap.nbytes = num_tokens, nbytes
            snap.version += 1
            session.last_access, session.released_at, session.awaited = now, None, False
            if priority is not None:
                session.priority = priority
            self._share(session, None)
        self.placement.retire(session, freed)
        self._notify()
        return session

    def _begin_write(self, key: SessionKey, spec: KVSpec, tier: str, first_page: int, num_tokens: int,
                     nbytes: int, geom: Geometry, hashes: np.ndarray | None,
                     priority: int | None, share: bool = True) -> PendingWrite:
        """Check that the store may go ahead (quota, an append onto the same
        identity and tokens) and allocate its pages, less those the tenant
        holds already (with share); the session's lock is held only for that."""
        lock, session = self._acquire(key)
        try:
            self._check_append(key, session, spec, first_page * spec.block_tokens if first_page else 0, hashes)
            lent, write_from, lent_sums = self._lent_for(key, spec, hashes if share else None, first_page,
                                                         geom.n_pages)
            try:
                pieces = self.placement.alloc(tier, [(write_from, geom.n_pages - write_from)], geom.stride, key,
                                              IOClass.DEMAND, True) if write_from < geom.n_pages else []
            except BaseException:
                self._let_go(lent)
                raise
        finally:
            lock.release()
        return PendingWrite(key, spec, tier, first_page, num_tokens, nbytes, geom, pieces, hashes, priority,
                            time.perf_counter(), lent=lent, lent_sums=lent_sums, write_from=write_from)

    def _lent_for(self, key: SessionKey, spec: KVSpec, hashes: np.ndarray | None, first_page: int, n_pages: int
                  ) -> tuple[dict[str, list[Piece]], int, np.ndarray]:
        """Pages [first_page, ...) of a store that another session of the
        tenant holds already: their pieces, held for the store, the page the
        store writes from, and their checksums. (Not the storing session's
        own: a store from token 0 replaces its bytes, whatever they held.)"""
        none = ({}, first_page, np.empty(0, dtype=np.uint64))
        if hashes is None:
            return none
        with self._lock:
            donor, upto = self._donor(key.tenant, spec, hashes, first_page, n_pages, key)
            if donor is None:
                return none
            lent, write_from = self._lend(donor, first_page, upto)
            sums = donor.snap.checksums[first_page:write_from].copy()
        if write_from > first_page:
            self.events.shared("save", write_from - first_page, (write_from - first_page) * spec.page_bytes)
        return lent, write_from, sums

    def _check_lent(self, w: PendingWrite) -> None:
        """A store whose lent pages were found damaged since it began is refused (DATA_LOSS): it would hold them."""
        with self._lock:
            bad = [p for tier, pieces in w.lent.items() for p in pieces if self.placement.held.is_damaged(tier, p)]
        if bad:
            raise DataLoss(f"page {bad[0].first_page} that session {shown(w.key.session_id)} took from another "
                           "session failed its checksum meanwhile: store it again", session_id=w.key.session_id,
                           page=bad[0].first_page)

    def _let_go(self, lent: dict[str, list[Piece]]) -> None:
        for tier, pieces in lent.items():
            self.placement.free(tier, pieces)

    def _commit_write(self, w: PendingWrite, sums: np.ndarray, keep: bool = False) -> SessionInfo:
        """Publish written pages (sums: their checksums), checked again under
        the session's lock: it may have changed since the write began. A write
        refused for want of room (the index's disk full, say) keeps its pages
        with keep, to be committed again; else they go back."""
        lock, session = self._acquire(w.key)
        try:
            try:
                self._check_append(w.key, session, w.spec, w.first_page * w.spec.block_tokens if w.first_page else 0,
                                   w.hashes)
                self._check_lent(w)
                session = self._install(w.key, lock, session, w.spec, w.first_page, w.pieces, w.tier,
                                        np.concatenate([w.lent_sums, sums]), w.num_tokens, w.nbytes, w.priority,
                                        w.hashes, w.lent)
            except (ResourceExhausted, Unavailable):
                if not keep:
                    self.abort_write(w)
                raise
            except BaseException:
                self.abort_write(w)
                raise
            w.pieces, w.lent = [], {}  # the session's now
            self.events.saved(w.tier, w.nbytes - w.write_from * w.spec.page_bytes, time.perf_counter() - w.started)
            return self._info(session)
        finally:
            lock.release()

    def abort_write(self, w: PendingWrite) -> None:
        """Give back the pages of a write that will not be committed."""
        pieces, w.pieces = w.pieces, []
        lent, w.lent = w.lent, {}
        self.placement.free(w.tier, pieces)
        self._let_go(lent)
        self._end_stream(w)

    def _start_stream(self, key: SessionKey, nbytes: int) -> None:
        """Count a Put's room against its tenant's Puts in progress
        (tenant_put_bytes: half the host budget by default): a stream that
        trickles must not hold the host tier against the others (one Put of
        the whole budget sending 4 KiB every 5 s did; its pages cannot be
        demoted until it commits)."""
        limit = self.policy.tenant_put_bytes
        with self._lock:
            held = self._streaming.get(key.tenant, 0)
            if limit and held + nbytes > limit:
                raise ResourceExhausted(f"tenant {shown(key.tenant)}'s Puts in progress may hold {limit} bytes of "
                                        f"the host tier; they hold {held} and this one needs {nbytes}: let some "
                                        "finish first", tenant=key.tenant, limit=limit, held=held, need=nbytes)
            self._streaming[key.tenant] = held + nbytes

    def _stream_ended(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._streaming[tenant] - nbytes
            if left:
                self._streaming[tenant] = left
            else:
                del self._streaming[tenant]

    def _end_stream(self, w: PendingWrite) -> None:
        streaming, w.streaming = w.streaming, 0
        if streaming:
            self._stream_ended(w.key.tenant, streaming)

    def save(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
             num_tokens: int, start_token: int = 0, tier: str | None = None,
             priority: int | None = None, token_ids: Iterable[int] | None = None, salt: str = "") -> SessionInfo:
        """Gather engine blocks holding tokens [start_token, num_tokens) into the
        session's snapshot, replacing what it held from start_token on. The new
        pages land in `tier` (default: device for GPU engines, else host);
        `priority` sets the session's eviction weight; `token_ids` (the ids of
        tokens [0, num_tokens)) lets lookup() match later prompts against the
        pages (under the cache `salt`), refuses an append onto pages that hold
        other tokens, and takes pages the tenant holds already from them
        instead of copying them again (sharing.py)."""
        check_priority(priority)
        if tier is not None and (tier not in self.tiers or self.tiers[tier].medium != MEMORY):
            targets = ", ".join(repr(t) for t in tier_order(self.tiers) if self.tiers[t].medium == MEMORY)
            raise InvalidArgument(f"a save lands in a memory tier of this machine ({targets}), not {shown(tier)}",
                                  field="tier")
        first_page = check_blocks_range(spec, start_token, num_tokens)
        ids = check_blocks(block_ids, engine.layout.num_blocks)
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        n_pages = spec.pages_for_tokens(num_tokens)
        if ids.size != n_pages - first_page:
            raise InvalidArgument(
                f"tokens [{start_token}, {num_tokens}) fill {n_pages - first_page} blocks of {spec.block_tokens}, "
                f"but {ids.size} block ids were given", field="block_ids", want=n_pages - first_page, got=int(ids.size))
        geom = Geometry(spec.page_bytes, n_pages, spec.page_bytes)
        w = self._begin_write(key, spec, tier or self._landing(engine), first_page, num_tokens,
                              n_pages * spec.page_bytes, geom, tok, priority)
        try:
            sums = self.copier.gather(engine, ids[w.write_from - first_page :], w.spans, geom, w.write_from)
        except BaseException:
            self.abort_write(w)
            raise
        return self._commit_write(w, sums)

    def begin_put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
                  priority: int | None = None, start_token: int = 0,
                  token_ids: Iterable[int] | None = None, salt: str = "") -> PendingWrite:
        """Room for a snapshot sent as bytes: the pages from start_token on (KV
        specs; 0 replaces the whole snapshot), with their token ids (under the
        cache salt) if given. Write the stream into the result (write()), then
        commit_put, or abort_write. No lock is held meanwhile: the stream may
        take its time. Pages the tenant holds already are taken from there:
        their bytes in the stream are read past, not stored."""
        check_priority(priority)
        first_page = check_start(spec, start_token)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be a non-negative integer, got {shown(num_tokens)}",
                                  field="num_tokens")
        if spec.is_opaque:
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
                raise InvalidArgument(f"size must be a positive number of bytes, got {shown(nbytes)}", field="size")
            n_pages = -(-nbytes // spec.page_bytes)
            last = nbytes - (n_pages - 1) * spec.page_bytes
        else:
            if num_tokens <= start_token:
                raise InvalidArgument(f"num_tokens must be above start_token ({start_token})", field="num_tokens")
            n_pages = spec.pages_for_tokens(num_tokens)
            want = (n_pages - first_page) * spec.page_bytes
            if nbytes != want:
                raise InvalidArgument(
                    f"tokens [{start_token}, {num_tokens}) in blocks of {spec.block_tokens} take {want} bytes "
                    f"for this spec, not {nbytes}", field="size", want=want, got=nbytes)
            last = spec.page_bytes
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        tier_budget = self.tiers[self.roles.landing].budget
        if nbytes > tier_budget:
            raise ResourceExhausted(f"{nbytes} bytes do not fit the host tier's budget of {tier_budget} bytes",
                                    need=nbytes, budget=tier_budget)
        geom = Geometry(spec.page_bytes, n_pages, last)
        streaming = (n_pages - first_page) * geom.stride
        self._start_stream(key, streaming)
        try:
            w = self._begin_write(key, spec, self.roles.landing, first_page, num_tokens,
                                  first_page * spec.page_bytes + nbytes, geom, tok, priority)
        except BaseException:
            self._stream_ended(key.tenant, streaming)
            raise
        w.streaming = streaming
        w.writer = self.copier.page_writer(w.spans, geom, skip=(w.first_page, w.write_from))
        return w

    def commit_put(self, w: PendingWrite) -> SessionInfo:
        """Publish a Put whose stream has ended: nothing is visible unless
        exactly the announced bytes arrived."""
        assert w.writer is not None
        try:
            if w.writer.received != w.new_bytes:
                raise InvalidArgument(f"the stream carried {w.writer.received} bytes, the header announced "
                                      f"{w.new_bytes}", field="size", want=w.new_bytes, got=w.writer.received)
            sums = self.copier.checksums(w.spans, w.geom)
        except BaseException:
            self.abort_write(w)
            raise
        self.copier.record("client->host", w.new_bytes, time.perf_counter() - w.started)
        try:
            return self._commit_write(w, sums)
        finally:
            self._end_stream(w)

    def put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
            chunks: Iterable[bytes | memoryview | np.ndarray], priority: int | None = None,
            start_token: int = 0, token_ids: Iterable[int] | None = None, salt: str = "") -> SessionInfo:
        """begin_put, every chunk written, commit_put: the whole Put in one call."""
        w = self.begin_put(key, spec, num_tokens, nbytes, priority, start_token, token_ids, salt)
        try:
            for chunk in chunks:
                w.write(chunk)
        except BaseException:
            self.abort_write(w)
            raise
        return self.commit_put(w)
