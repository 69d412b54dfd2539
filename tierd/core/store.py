"""The store: per-session KV snapshots across tiers, and everything done to them.

Runs in the daemon (the API calls it from worker threads) and in tests
directly. Its operations: save (gather engine blocks into a snapshot, may
append), restore (scatter it back), put/get (snapshots as bytes), release,
pin/unpin, drop, prefetch/wait_ready, stat/list/stats, set_budget, advise,
and tick (apply policy). Locks: one lock per session serialises data work on
it; the store lock guards metadata and is never held across a copy.
"""

from __future__ import annotations

import heapq
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from tierd.clock import Clock, SystemClock
from tierd.core import recovery, tokens
from tierd.core.events import NullEvents, StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.model import Session, Snapshot
from tierd.core.mover import Job, Mover
from tierd.core.placement import Placement
from tierd.core.rows import Problem
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    IdentityMismatch,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TierdError,
    Unavailable,
    shown,
)
from tierd.layout import KVSpec
from tierd.policy import (
    Advice,
    Move,
    PolicyConfig,
    SessionView,
    advise,
    budget_moves,
    idle_due,
    idle_moves,
    plan_eviction,
    pressure_moves,
)
from tierd.policy.rules import DROP
from tierd.tiers import TIER_ORDER, shm, tier_rank
from tierd.tiers.allocator import Piece
from tierd.transfer.copier import CopyEngine, EngineMemory, PageWriter
from tierd.transfer.ioqueue import Priority
from tierd.transfer.runs import Geometry, Span
from tierd.types import (
    ID,
    BudgetResult,
    Lease,
    LookupResult,
    RestoreResult,
    SessionInfo,
    SessionKey,
    Slot,
    TierStats,
)

log = logging.getLogger("tierd.core.store")
# Used by advise() until a route has been measured (bytes/s).
DEFAULT_BANDWIDTH = {"device": 200e9, "host": 10e9, "disk": 1e9}
MAX_PRIORITY = 1000
DEFAULT_LEASE_SECONDS = 60.0
MAX_LEASE_SECONDS = 3600.0
CHECKS_PER_LOCK = 256  # sessions the tick looks at per hold of the store lock (~5 ms)
SPARE_SECONDS = 30.0  # a segment kept for a tenant's next lease goes after this long unused
REPLANS = 8  # eviction plans tried when their sessions got busy before they could be moved


def check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not ID.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"{name} must be 1-256 characters of letters, digits and ._:@+=~- , not starting with '.' "
            f"or '-' and without '..', got {shown(value)}",
            field=name,
            value=value,
        )
    return value


def make_key(tenant: str, session_id: str) -> SessionKey:
    return SessionKey(check_id("tenant", tenant), check_id("session_id", session_id))


def _check_priority(priority: int | None) -> None:
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidArgument(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                              f"got {shown(priority)}", field="priority", value=priority)


@dataclass(eq=False)
class PendingWrite:
    """Pages on their way into a session: allocated in `tier`, written by the
    caller, invisible until committed (or freed when aborted). Save, Put and
    save leases all store through one."""

    key: SessionKey
    spec: KVSpec
    tier: str
    first_page: int
    num_tokens: int
    nbytes: int  # the snapshot's bytes once committed
    geom: Geometry
    pieces: list[Piece]
    hashes: np.ndarray | None
    priority: int | None
    started: float
    writer: PageWriter | None = None  # Put: where the stream's bytes go, in page order

    @property
    def spans(self) -> list[Span]:
        return [Span(p.first_page, p.n_pages, self.tier, p.offset) for p in self.pieces]

    @property
    def new_bytes(self) -> int:
        return self.nbytes - self.first_page * self.spec.page_bytes

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        """Put: the stream's next bytes (InvalidArgument past what was announced)."""
        assert self.writer is not None
        self.writer.write(data)


@dataclass(eq=False)
class _Lease:
    what = "lease"
    lease_id: str
    key: SessionKey
    expires: float
    segment: shm.Segment  # the lease's pages, and nothing else: the engine maps it by name
    nbytes: int


@dataclass(eq=False)
class _SaveLease(_Lease):
    what = "save"
    write: PendingWrite


@dataclass(eq=False)
class _RestoreLease(_Lease):
    what = "restore"
    source: str
    started: float


class Store:
    def __init__(self, tiers: dict, copier: CopyEngine, index: DiskIndex | None = None, *,
                 clock: Clock | None = None, policy: PolicyConfig | None = None,
                 events: StoreEvents | None = None, movers: int = 2, shm_prefix: str | None = None) -> None:
        if "host" not in tiers:
            raise ValueError("the host tier is required")
        if (index is None) != ("disk" not in tiers):
            raise ValueError("a disk tier and its index come together")
        self.tiers = tiers
        self.copier = copier
        self.index = index
        self.clock = clock or SystemClock()
        self.policy = policy or PolicyConfig()
        self.events = events or NullEvents()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._sessions: dict[SessionKey, Session] = {}
        self._key_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.placement = Placement(tiers, copier, index, self.events, self._changed)
        self.placement.make_room = self._make_room
        self.placement.quota = self.policy.quota
        self._per_tenant: dict[str, int] = {}  # sessions held by each tenant
        self._leases: dict[str, _Lease] = {}
        self._lease_use: dict[str, tuple[int, int]] = {}  # tenant -> (open leases, their bytes)
        self._spares: dict[str, list[tuple[shm.Segment, float]]] = {}  # tenant -> segments of ended leases, since
        self._segments = (shm_prefix or shm.new_prefix()) + ".lease"  # names of lease segments
        self._listeners: list[Callable[[], None]] = []
        # (time, key): when the tick next looks at each released session, so that a
        # tick costs what is due, not what is stored (see _schedule).
        self._checks: list[tuple[float, SessionKey]] = []
        self.recovery_problems = self._recover() if index is not None else []
        self.mover = Mover(self._run_job, movers)
        self._closed = False

    # -- recovery ------------------------------------------------------------

    def _recover(self) -> list[Problem]:
        assert self.index is not None
        kept, problems = recovery.recover(self.index, self.tiers["disk"], self.events)
        now = self.clock.now()
        for rec in kept:
            snap = Snapshot(rec.row.spec, rec.row.num_tokens, rec.row.nbytes, rec.checksums, {"disk": rec.pieces},
                            token_hashes=rec.token_hashes)
            session = Session(rec.key, snap, rec.row.created, rec.row.last_access, released_at=now,
                              priority=rec.row.priority, row=rec.row, row_version=snap.version)
            self._sessions[rec.key] = session
            self._key_locks[rec.key] = session.op
            self._per_tenant[rec.key.tenant] = self._per_tenant.get(rec.key.tenant, 0) + 1
            self._schedule(session)
        return problems

    # -- helpers -------------------------------------------------------------

    def _acquire(self, key: SessionKey) -> tuple[threading.Lock, Session | None]:
        """Take the key's lock; returns it and the session it guards (None if
        there is none). One lock per key: a live session's op lock, else the
        lock a creator of the key already holds, else a new one."""
        while True:
            with self._lock:
                session = self._sessions.get(key)
                lock = session.op if session is not None else self._key_locks.get(key)
                if lock is None:
                    lock = self._key_locks[key] = threading.Lock()
            lock.acquire()
            with self._lock:
                now = self._sessions.get(key)
            if now is None or now.op is lock:
                return lock, now
            lock.release()  # the session changed hands while we waited: look again

    @contextmanager
    def _held(self, key: SessionKey) -> Iterator[Session]:
        """The existing session, its lock held for the duration; NotFound otherwise."""
        lock, session = self._acquire(key)
        try:
            if session is None:
                raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
            yield session
        finally:
            lock.release()

    def _get(self, key: SessionKey) -> Session:
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
        return session

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
        for listener in self._listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call listener (from any thread; it must not block) whenever a
        session's content or placement may have changed."""
        self._listeners.append(listener)

    def _landing(self, engine: EngineMemory | None) -> str:
        if engine is not None and engine.medium == "device" and "device" in self.tiers:
            return "device"
        return "host"

    @staticmethod
    def _check_identity(session: Session, spec: KVSpec) -> None:
        have = session.snap.spec
        if have.fingerprint != spec.fingerprint:
            fields = sorted(k for k, v in have.to_dict().items() if spec.to_dict().get(k) != v)
            raise IdentityMismatch(
                f"session {shown(session.key.session_id)} was saved by {shown(have.model_id)} with another identity "
                f"(differs in {', '.join(fields)})",
                want=have.fingerprint, got=spec.fingerprint, fields=fields)

    @staticmethod
    def _check_start(spec: KVSpec, start_token: int) -> int:
        """The first page a store from start_token replaces."""
        bt = spec.block_tokens
        if isinstance(start_token, bool) or not isinstance(start_token, int) or start_token < 0 or start_token % bt:
            raise InvalidArgument(f"start_token must be a non-negative multiple of block_tokens ({bt}), "
                                  f"got {shown(start_token)}", field="start_token", value=start_token)
        if start_token and spec.is_opaque:
            raise InvalidArgument("opaque snapshots are replaced whole: start_token must be 0", field="start_token")
        return start_token // bt

    @classmethod
    def _check_blocks_range(cls, spec: KVSpec, start_token: int, num_tokens: int) -> int:
        """Tokens [start_token, num_tokens) of a KV spec, in whole pages from
        start_token: returns the first page."""
        if spec.is_opaque:
            raise InvalidArgument("an opaque spec has no blocks: use put", field="spec")
        first_page = cls._check_start(spec, start_token)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= start_token:
            raise InvalidArgument(f"num_tokens must be an integer above start_token ({start_token}), "
                                  f"got {shown(num_tokens)}", field="num_tokens", value=num_tokens)
        return first_page

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
        self._check_identity(session, spec)
        if session.damaged:
            raise FailedPrecondition(f"session {shown(key.session_id)} is damaged: store it again from token 0")
        if start_token > session.snap.num_tokens:
            raise FailedPrecondition(f"start_token {start_token} is past the {session.snap.num_tokens} tokens stored",
                                     field="start_token", have=session.snap.num_tokens)
        kept = session.snap.token_hashes[: start_token // spec.block_tokens]
        if hashes is not None and tokens.known(kept) and not np.array_equal(kept, hashes[: len(kept)]):
            raise FailedPrecondition(f"session {shown(key.session_id)} holds other tokens before start_token "
                                     f"{start_token}: store it from token 0", field="token_ids")

    @staticmethod
    def _check_blocks(block_ids: Iterable[int], num_blocks: int) -> np.ndarray:
        try:
            ids = np.asarray(list(block_ids) if not isinstance(block_ids, np.ndarray) else block_ids)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"block ids must be integers: {exc}", field="block_ids") from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgument("block ids must be a flat list of integers", field="block_ids")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise InvalidArgument(f"block id {bad} is outside the engine's {num_blocks} blocks",
                                  field="block_ids", value=bad)
        if np.unique(ids).size != ids.size:
            raise InvalidArgument("block ids repeat: each block can hold one page", field="block_ids")
        return ids

    @staticmethod
    def _token_hashes(spec: KVSpec, token_ids: Iterable[int] | None, num_tokens: int) -> np.ndarray | None:
        """The page hashes of a store's token ids (tokens [0, num_tokens)), if given."""
        if token_ids is None:
            return None
        if spec.is_opaque:
            raise InvalidArgument("opaque snapshots have no tokens: give no token ids", field="token_ids")
        return tokens.chain(tokens.check_ids(token_ids, num_tokens), spec.block_tokens)

    @staticmethod
    def _check_readable(key: SessionKey, session: Session | None, verb: str) -> None:
        if session is None:
            raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
        if session.damaged:
            raise DataLoss(f"session {shown(key.session_id)} is damaged and cannot be {verb}",
                           session_id=key.session_id)

    def _info(self, s: Session) -> SessionInfo:
        snap = s.snap
        return SessionInfo(
            tenant=s.key.tenant, session_id=s.key.session_id, tier=snap.slowest_tier(),
            tier_bytes=snap.tier_bytes(), state=s.state.value,
            num_tokens=snap.num_tokens, size_bytes=snap.nbytes, num_pages=snap.n_pages, durable=s.durable,
            last_access=s.last_access, created=s.created, priority=s.priority, pins=s.pins,
            model_id=snap.spec.model_id, fingerprint=snap.spec.fingerprint, spec=snap.spec)

    def _publish(self, key: SessionKey, lock: threading.Lock, session: Session | None, spec: KVSpec,
                 first_page: int, pieces: list, tier: str, sums: np.ndarray, num_tokens: int,
                 nbytes: int, priority: int | None, hashes: np.ndarray | None = None) -> Session:
        """Complete a store: replace pages from first_page on with the new ones
        (hashes: the token hashes of every page, if known). The index forgets
        the replaced pages first: if it cannot, this raises before anything
        changed, and the caller still owns `pieces`."""
        freed = self.placement.truncate(session, first_page) if session is not None else []
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
            snap.num_tokens, snap.nbytes = num_tokens, nbytes
            snap.version += 1
            session.last_access, session.released_at, session.awaited = now, None, False
            if priority is not None:
                session.priority = priority
        self.placement.retire(session, freed)
        self._notify()
        return session

    # -- the write path: save, put and save leases ---------------------------------

    def _begin_write(self, key: SessionKey, spec: KVSpec, tier: str, first_page: int, num_tokens: int,
                     nbytes: int, geom: Geometry, hashes: np.ndarray | None,
                     priority: int | None) -> PendingWrite:
        """Check that the store may go ahead (quota, an append onto the same
        identity and tokens) and allocate its pages; the session's lock is held
        only for that."""
        lock, session = self._acquire(key)
        try:
            self._check_append(key, session, spec, first_page * spec.block_tokens if first_page else 0, hashes)
            pieces = self.placement.alloc(tier, [(first_page, geom.n_pages - first_page)], geom.stride, key,
                                          Priority.DEMAND)
        finally:
            lock.release()
        return PendingWrite(key, spec, tier, first_page, num_tokens, nbytes, geom, pieces, hashes, priority,
                            time.perf_counter())

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
                session = self._publish(w.key, lock, session, w.spec, w.first_page, w.pieces, w.tier, sums,
                                        w.num_tokens, w.nbytes, w.priority, w.hashes)
            except (ResourceExhausted, Unavailable):
                if not keep:
                    self.abort_write(w)
                raise
            except BaseException:
                self.abort_write(w)
                raise
            w.pieces = []  # the session's now
            self.events.saved(w.tier, w.new_bytes, time.perf_counter() - w.started)
            return self._info(session)
        finally:
            lock.release()

    def abort_write(self, w: PendingWrite) -> None:
        """Give back the pages of a write that will not be committed."""
        pieces, w.pieces = w.pieces, []
        self.placement.free(w.tier, pieces)

    # -- engine memory: save / restore -----------------------------------------

    def save(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
             num_tokens: int, start_token: int = 0, tier: str | None = None,
             priority: int | None = None, token_ids: Iterable[int] | None = None) -> SessionInfo:
        """Gather engine blocks holding tokens [start_token, num_tokens) into the
        session's snapshot, replacing what it held from start_token on. The new
        pages land in `tier` (default: device for GPU engines, else host);
        `priority` sets the session's eviction weight; `token_ids` (the ids of
        tokens [0, num_tokens)) lets lookup() match later prompts against the
        pages, and refuses an append onto pages that hold other tokens."""
        _check_priority(priority)
        if tier is not None and (tier not in self.tiers or tier == "disk"):
            raise InvalidArgument(f"save lands in 'host' or 'device' where present, not {shown(tier)}", field="tier")
        first_page = self._check_blocks_range(spec, start_token, num_tokens)
        ids = self._check_blocks(block_ids, engine.layout.num_blocks)
        tok = self._token_hashes(spec, token_ids, num_tokens)
        n_pages = spec.pages_for_tokens(num_tokens)
        if ids.size != n_pages - first_page:
            raise InvalidArgument(
                f"tokens [{start_token}, {num_tokens}) fill {n_pages - first_page} blocks of {spec.block_tokens}, "
                f"but {ids.size} block ids were given", field="block_ids", want=n_pages - first_page, got=int(ids.size))
        geom = Geometry(spec.page_bytes, n_pages, spec.page_bytes)
        w = self._begin_write(key, spec, tier or self._landing(engine), first_page, num_tokens,
                              n_pages * spec.page_bytes, geom, tok, priority)
        try:
            sums = self.copier.gather(engine, ids, w.spans, geom, first_page)
        except BaseException:
            self.abort_write(w)
            raise
        return self._commit_write(w, sums)

    def restore(self, key: SessionKey, engine: EngineMemory, spec: KVSpec,
                block_ids: Iterable[int]) -> RestoreResult:
        """Scatter the snapshot's first len(block_ids) pages into those blocks.
        Waits for a move of the session in flight rather than starting another."""
        ids = self._check_blocks(block_ids, engine.layout.num_blocks)
        with self._held(key) as session:
            self._check_readable(key, session, "restored")
            self._check_identity(session, spec)
            snap = session.snap
            if not 0 < ids.size <= snap.n_pages:
                raise InvalidArgument(f"the snapshot has {snap.n_pages} pages; give 1 to {snap.n_pages} block ids, "
                                      f"not {ids.size}", field="block_ids", have=snap.n_pages, got=int(ids.size))
            spans = snap.best_spans()
            source = max((s.tier for s in spans if s.first_page < ids.size), key=tier_rank)
            t0 = time.perf_counter()
            self._read_out(session, lambda: self.copier.scatter(spans, engine, ids, snap.geometry, snap.checksums))
            seconds = time.perf_counter() - t0
            with self._lock:
                session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
            self.events.restored(source, ids.size * snap.spec.page_bytes, seconds)
            return RestoreResult(min(snap.num_tokens, ids.size * snap.spec.block_tokens), int(ids.size), source, seconds)

    def _read_out(self, session: Session, copy: Callable[[], None]) -> None:
        """Run a copy of the session's pages out of the daemon (every page
        checked against its checksum): a mismatch damages the session, a
        failed disk read is UNAVAILABLE."""
        try:
            copy()
        except DataLoss as exc:
            self.placement.mark_damaged(session, exc)
            raise DataLoss(f"session {shown(session.key.session_id)}: {exc}", session_id=session.key.session_id,
                           **exc.details) from None
        except OSError as exc:
            raise self.placement.io_failed("read", exc, session.key) from None

    # -- bytes: put / get --------------------------------------------------------

    def begin_put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
                  priority: int | None = None, start_token: int = 0,
                  token_ids: Iterable[int] | None = None) -> PendingWrite:
        """Room for a snapshot sent as bytes: the pages from start_token on (KV
        specs; 0 replaces the whole snapshot), with their token ids if given.
        Write the stream into the result (write()), then commit_put, or
        abort_write. No lock is held meanwhile: the stream may take its time."""
        _check_priority(priority)
        first_page = self._check_start(spec, start_token)
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
        tok = self._token_hashes(spec, token_ids, num_tokens)
        tier_budget = self.tiers["host"].budget
        if nbytes > tier_budget:
            raise ResourceExhausted(f"{nbytes} bytes do not fit the host tier's budget of {tier_budget} bytes",
                                    need=nbytes, budget=tier_budget)
        geom = Geometry(spec.page_bytes, n_pages, last)
        w = self._begin_write(key, spec, "host", first_page, num_tokens, first_page * spec.page_bytes + nbytes, geom,
                              tok, priority)
        w.writer = self.copier.page_writer(w.spans, geom)
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
        return self._commit_write(w, sums)

    def put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
            chunks: Iterable[bytes | memoryview | np.ndarray], priority: int | None = None,
            start_token: int = 0, token_ids: Iterable[int] | None = None) -> SessionInfo:
        """begin_put, every chunk written, commit_put: the whole Put in one call."""
        w = self.begin_put(key, spec, num_tokens, nbytes, priority, start_token, token_ids)
        try:
            for chunk in chunks:
                w.write(chunk)
        except BaseException:
            self.abort_write(w)
            raise
        return self.commit_put(w)

    def get(self, key: SessionKey, chunk_bytes: int = 1 << 20) -> tuple[SessionInfo, SnapshotReader]:
        """The snapshot's info and a reader of its bytes, checked against their
        checksums whatever the tier. No lock is held while it reads: pages it
        reads that the session gives up meanwhile (a move, a drop, a new save)
        are freed only once the reader is closed, so the stream stays the
        snapshot as it was when the call came."""
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= 64 << 20:
            raise InvalidArgument(f"chunk size must be 1 byte to 64 MiB, got {shown(chunk_bytes)}", field="chunk_bytes")
        session = self._get(key)
        with self._lock:
            self._check_readable(key, session, "read")
            snap = session.snap
            info = self._info(session)
            spans, geom, sums = snap.best_spans(), snap.geometry, snap.checksums
            session.readers += 1
        return info, SnapshotReader(self._stream(session, spans, geom, sums, chunk_bytes),
                                    lambda: self.placement.end_read(session))

    def _stream(self, session: Session, spans: list[Span], geom: Geometry, sums: np.ndarray,
                chunk_bytes: int) -> Iterator[tuple[bytes | memoryview, int]]:
        t0 = time.perf_counter()
        try:
            yield from self.copier.read_stream(spans, geom, sums, chunk_bytes)
        except DataLoss as exc:
            self.placement.mark_damaged(session, exc)
            raise DataLoss(f"session {shown(session.key.session_id)}: {exc}", **exc.details) from None
        except OSError as exc:
            raise self.placement.io_failed("read", exc, session.key) from None
        with self._lock:
            session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
        self.events.restored(max((s.tier for s in spans), key=tier_rank) if spans else "host", geom.nbytes,
                             time.perf_counter() - t0)


    # -- token lookup -----------------------------------------------------------------

    def lookup(self, key: SessionKey, token_ids: Iterable[int], spec: KVSpec | None = None) -> LookupResult:
        """How many leading tokens of a request (its token ids) the snapshot
        supplies: whole pages whose chained token hashes match. With spec, a
        snapshot of another identity is refused."""
        request = tokens.check_ids(token_ids)
        session = self._get(key)
        with self._lock:
            snap = session.snap
            if spec is not None:
                self._check_identity(session, spec)
            hashes, stored, damaged = snap.token_hashes, snap.num_tokens, session.damaged
            bt = snap.spec.block_tokens
        pages = 0 if damaged or snap.spec.is_opaque else tokens.matched_pages(hashes, stored, bt, request)
        with self._lock:
            spans = [sp for sp in snap.best_spans() if sp.first_page < pages] if pages else []
        return LookupResult(min(pages * bt, stored), pages, stored,
                            max((sp.tier for sp in spans), key=tier_rank) if spans else None)

    # -- leases: the engine copies pages in and out of memory of the lease's own ----------

    @staticmethod
    def _check_ttl(ttl: float) -> float:
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_LEASE_SECONDS:
            raise InvalidArgument(f"a lease lasts more than 0 and at most {MAX_LEASE_SECONDS:g} seconds, "
                                  f"got {shown(ttl)}", field="ttl_seconds", value=ttl)
        return float(ttl)

    def _open_lease(self, tenant: str, nbytes: int) -> shm.Segment:
        """Count a new lease against its tenant's limits and create its segment."""
        count_limit, bytes_limit = self.policy.tenant_leases, self.policy.tenant_lease_bytes
        with self._lock:
            count, held = self._lease_use.get(tenant, (0, 0))
            if count_limit and count >= count_limit:
                raise ResourceExhausted(f"tenant {tenant!r} may hold {count_limit} leases open; end some first",
                                        tenant=tenant, quota=count_limit)
            if bytes_limit and held + nbytes > bytes_limit:
                raise ResourceExhausted(f"tenant {tenant!r} may hold {bytes_limit} bytes in open leases; it holds "
                                        f"{held} and this needs {nbytes} more", tenant=tenant, quota=bytes_limit)
            self._lease_use[tenant] = (count + 1, held + nbytes)
        with self._lock:
            spares = self._spares.get(tenant, [])
            fit = next((i for i, (seg, _) in enumerate(spares) if nbytes <= seg.size <= 2 * nbytes), None)
            spare = spares.pop(fit)[0] if fit is not None else None
        if spare is not None:
            st = os.fstat(spare.fd)
            if st.st_size == spare.size and st.st_nlink:
                return spare
            spare.close()  # its engine cut it short or removed it: a new one
        try:
            return shm.Segment(self._segments, nbytes)
        except OSError as exc:
            self._close_lease(tenant, None, nbytes)
            raise ResourceExhausted(f"no shared memory for a lease of {nbytes} bytes: {exc.strerror or exc}",
                                    need=nbytes) from None

    def _close_lease(self, tenant: str, segment: shm.Segment | None, nbytes: int) -> None:
        """A lease's end: its segment is kept for the tenant's next lease (its
        pages resident: a fresh segment cost ~0.6 ms per MiB in page faults),
        up to the tenant's lease bytes, or goes."""
        keep = self.policy.tenant_lease_bytes or self.tiers["host"].budget // 4
        with self._lock:
            spares = self._spares.setdefault(tenant, [])
            if segment is not None and not self._closed and sum(seg.size for seg, _ in spares) + segment.size <= keep:
                spares.append((segment, self.clock.now()))
                segment = None
        if segment is not None:
            segment.close()
        with self._lock:
            count, held = self._lease_use[tenant]
            if count > 1:
                self._lease_use[tenant] = (count - 1, held - nbytes)
            else:
                del self._lease_use[tenant]

    def _take_lease(self, tenant: str, lease_id: str, kind: type) -> _Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.key.tenant != tenant or not isinstance(lease, kind):
                raise NotFound(f"no open {kind.what} lease {shown(lease_id)}: it ended, expired or never was",
                               lease_id=lease_id)
            del self._leases[lease_id]
        if lease.expires <= self.clock.now():  # past its time: it ends as it would have on the next tick
            log.warning("a %s lease on %s/%s expired", lease.what, *lease.key)
            self.events.lease_expired(lease.what)
            self._end_lease(lease)
            raise NotFound(f"no open {kind.what} lease {shown(lease_id)}: it ended, expired or never was",
                           lease_id=lease_id)
        return lease

    def _end_lease(self, lease: _Lease) -> None:
        if isinstance(lease, _SaveLease):
            self.abort_write(lease.write)  # nothing, once committed
        self._close_lease(lease.key.tenant, lease.segment, lease.nbytes)

    def begin_save(self, key: SessionKey, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Iterable[int] | None = None, priority: int | None = None,
                   ttl: float = DEFAULT_LEASE_SECONDS) -> Lease:
        """A segment of shared memory for pages [start_token // block_tokens,
        pages for num_tokens): the engine writes each page's bytes there, then
        calls commit_save (or abort_save). The pages' room in the host tier is
        taken now; nothing is visible before the commit."""
        _check_priority(priority)
        ttl = self._check_ttl(ttl)
        first_page = self._check_blocks_range(spec, start_token, num_tokens)
        tok = self._token_hashes(spec, token_ids, num_tokens)
        n_pages = spec.pages_for_tokens(num_tokens)
        count = n_pages - first_page
        nbytes = count * spec.page_bytes
        segment = self._open_lease(key.tenant, nbytes)
        try:
            w = self._begin_write(key, spec, "host", first_page, num_tokens, n_pages * spec.page_bytes,
                                  Geometry(spec.page_bytes, n_pages, spec.page_bytes), tok, priority)
        except BaseException:
            self._close_lease(key.tenant, segment, nbytes)
            raise
        lease = _SaveLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, nbytes, w)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return Lease(lease.lease_id, [Slot(segment.name, 0, first_page, count)], spec.page_bytes, spec.page_bytes,
                     first_page, count, num_tokens, ttl)

    def commit_save(self, tenant: str, lease_id: str) -> SessionInfo:
        """Copy the leased pages into the host tier, taking their checksums, and publish them."""
        lease = self._take_lease(tenant, lease_id, _SaveLease)
        w = lease.write
        try:
            try:
                sums = self.copier.from_segment(lease.segment, w.spans, w.geom, w.first_page)
            except OSError as exc:
                raise InvalidArgument(f"the lease's pages could not be read: {exc.strerror or exc}",
                                      lease_id=lease_id) from None
            try:
                return self._commit_write(w, sums, keep=True)
            except (ResourceExhausted, Unavailable):
                # Refused for want of room (the index could not forget the pages this replaces, on a
                # full disk, say): nothing changed, and the lease stays open to commit again or abort.
                with self._lock:
                    self._leases[lease.lease_id] = lease
                lease = None
                raise
        finally:
            if lease is not None:
                self._end_lease(lease)

    def abort_save(self, tenant: str, lease_id: str) -> None:
        self._end_lease(self._take_lease(tenant, lease_id, _SaveLease))

    def begin_restore(self, key: SessionKey, spec: KVSpec | None = None, num_pages: int = 0,
                      ttl: float = DEFAULT_LEASE_SECONDS, token_ids: Iterable[int] | None = None) -> Lease:
        """Copy the snapshot's first num_pages pages (0: all), checked against
        their checksums, into a segment of shared memory of the lease's own
        (waiting for a move of the session in flight first), and hand it out;
        end_restore gives it back. With token_ids (the request's prompt), pages
        that hold other tokens are refused: the snapshot changed since the lookup."""
        ttl = self._check_ttl(ttl)
        request = tokens.check_ids(token_ids) if token_ids is not None else None
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgument(f"num_pages must be a non-negative integer, got {shown(num_pages)}",
                                  field="num_pages")
        with self._held(key) as session:
            self._check_readable(key, session, "restored")
            if spec is not None:
                self._check_identity(session, spec)
            snap = session.snap
            n = num_pages or snap.n_pages
            if not 0 < n <= snap.n_pages:
                raise InvalidArgument(f"the snapshot has {snap.n_pages} pages; ask for 1 to {snap.n_pages}, "
                                      f"not {num_pages}", field="num_pages", have=snap.n_pages)
            bt = snap.spec.block_tokens
            if request is not None and tokens.matched_pages(snap.token_hashes[:n], snap.num_tokens, bt, request) < n:
                raise FailedPrecondition(f"the first {n} pages of session {shown(key.session_id)} hold other tokens "
                                         "than the request's: look it up again", field="token_ids")
            started = time.perf_counter()
            spans = [sp for sp in snap.best_spans() if sp.first_page < n]
            source = max((sp.tier for sp in spans), key=tier_rank)
            nbytes = n * snap.spec.page_bytes
            segment = self._open_lease(key.tenant, nbytes)
            try:
                self._read_out(session, lambda: self.copier.to_segment(spans, snap.geometry, snap.checksums, n,
                                                                       segment))
            except BaseException:
                self._close_lease(key.tenant, segment, nbytes)
                raise
            with self._lock:
                session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
            lease = _RestoreLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, nbytes, source,
                                  started)
            with self._lock:
                self._leases[lease.lease_id] = lease
            return Lease(lease.lease_id, [Slot(segment.name, 0, 0, n)], snap.spec.page_bytes, snap.spec.page_bytes,
                         0, n, min(snap.num_tokens, n * bt), ttl)

    def end_restore(self, tenant: str, lease_id: str) -> None:
        """The engine has read its pages: the segment goes. A lease that
        expired first is NOT_FOUND."""
        lease = self._take_lease(tenant, lease_id, _RestoreLease)
        self._end_lease(lease)
        self.events.restored(lease.source, lease.nbytes, time.perf_counter() - lease.started)

    def expire_leases(self, everything: bool = False) -> int:
        """End leases past their time (or all): their segments go, and the
        host-tier room of uncommitted saves returns; segments kept for a
        next lease go after SPARE_SECONDS unused. Returns how many ended."""
        now = self.clock.now()
        with self._lock:
            gone = [lease for lease in self._leases.values() if everything or lease.expires <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
            unused = []
            for tenant, spares in list(self._spares.items()):
                unused += [seg for seg, since in spares if everything or now - since > SPARE_SECONDS]
                self._spares[tenant] = [(seg, since) for seg, since in spares
                                        if not everything and now - since <= SPARE_SECONDS]
                if not self._spares[tenant]:
                    del self._spares[tenant]
        for segment in unused:
            segment.close()
        for lease in gone:
            if not everything:
                log.warning("a %s lease on %s/%s expired", lease.what, *lease.key)
                self.events.lease_expired(lease.what)
            self._end_lease(lease)
        return len(gone)


    # -- lifecycle -----------------------------------------------------------------

    def release(self, key: SessionKey) -> SessionInfo:
        """The engine is done with the session for now: its idle clock starts."""
        session = self._get(key)
        with self._lock:
            session.released_at = session.last_access = self.clock.now()
            self._schedule(session)
            return self._info(session)

    def pin(self, key: SessionKey) -> SessionInfo:
        session = self._get(key)
        with self._lock:
            session.pins += 1
            return self._info(session)

    def unpin(self, key: SessionKey) -> SessionInfo:
        session = self._get(key)
        with self._lock:
            if session.pins == 0:
                raise FailedPrecondition(f"session {shown(key.session_id)} is not pinned", session_id=key.session_id)
            session.pins -= 1
            self._schedule(session)
            return self._info(session)

    def drop(self, key: SessionKey) -> None:
        """Forget the session everywhere; a queued move for it is cancelled."""
        self.mover.cancel(key)
        with self._held(key) as session:
            self._forget(session)

    def _forget(self, session: Session, reason: str = "drop") -> None:
        """Remove a session whose op lock the caller holds. Its index entry
        goes first: if the index cannot be written, this raises and the
        session is served as before."""
        with self._lock:
            if self._sessions.get(session.key) is not session:
                return
        self.placement.unindex(session)
        with self._lock:
            del self._sessions[session.key]
            self._per_tenant[session.key.tenant] -= 1
            session.dropped = True
        held = session.snap.tiers_held()
        self.placement.forget(session)
        for t in held:
            self.events.evicted(t, reason)
        self._notify()

    def prefetch(self, key: SessionKey, tier: str = "host", priority: int = 0,
                 deadline: float | None = None) -> str:
        """Start promoting the session toward `tier`; returns "ready" if it is
        there already, else "queued". Never waits for the move."""
        if tier not in ("device", "host"):
            raise InvalidArgument(f"prefetch goes to 'host' or 'device', not {shown(tier)}", field="tier", value=tier)
        if tier not in self.tiers:
            raise FailedPrecondition(f"there is no {tier} tier on this machine", field="tier", value=tier)
        session = self._get(key)
        if session.damaged:
            raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
        if tier_rank(session.snap.slowest_tier() or "device") <= tier_rank(tier):
            self._expect(session)
            self.events.prefetch_outcome("ready")
            return "ready"
        self.mover.submit(Job(key, tier, "prefetch", Priority.PREFETCH, priority, deadline), _merge_prefetch)
        return "queued"

    def _expect(self, session: Session) -> float:
        """The engine is about to come back for this session: a fresh idle clock,
        and evicted after every session not awaited. Returns the time."""
        now = self.clock.now()
        with self._lock:
            session.last_access, session.awaited = now, True
            if session.released_at is not None:
                session.released_at = now
                self._schedule(session)  # promoted: an earlier threshold may apply
        return now

    def ready(self, key: SessionKey, tier: str = "host") -> tuple[bool, str | None]:
        """Whether the whole session is in `tier` or faster, and the tier it is in; never waits."""
        if tier not in TIER_ORDER:
            raise InvalidArgument(f"unknown tier {shown(tier)}", field="tier", value=tier)
        with self._lock:
            session = self._get(key)
            if session.damaged:
                raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
            where = session.snap.slowest_tier()
        return where is not None and tier_rank(where) <= tier_rank(tier), where

    def wait_ready(self, key: SessionKey, tier: str = "host", timeout: float = 30.0) -> tuple[bool, str | None]:
        """Wait until the whole session is in `tier` or faster; returns
        (ready, the tier it is in). (The API waits on its event loop instead, through ready() and subscribe().)"""
        end = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while True:
                ready, where = self.ready(key, tier)
                left = end - time.monotonic()
                if ready or left <= 0:
                    return ready, where
                self._changed.wait(left)

    def _run_job(self, job: Job) -> None:
        with self._lock:
            session = self._sessions.get(job.key)
        if session is None:
            if job.reason == "prefetch":
                self.events.prefetch_outcome("missed")
            return
        if job.reason == "prefetch":
            if job.deadline is not None and self.clock.now() > job.deadline:
                self.events.prefetch_outcome("missed")
                return
            session.op.acquire()
        elif not session.op.acquire(blocking=False):
            return  # busy: policy asks again next tick
        try:
            if session.dropped:
                return
            with self._lock:
                session.moving = True
            if job.reason == "prefetch":
                self.placement.promote(session, job.target, Priority.PREFETCH)
                now = self._expect(session)
                self.events.prefetch_outcome("late" if job.deadline is not None and now > job.deadline else "in_time")
            elif job.target == DROP:
                self._forget(session, job.reason)
            elif job.keep:
                self.placement.write_disk(session, job.klass, job.reason)
            else:
                self._demote(session, job.target, job.klass, job.reason)
        except TierdError as exc:
            if job.reason == "prefetch":
                self.events.prefetch_outcome("missed")
            log.warning("%s of %s/%s to %s failed: %s", job.reason, job.key.tenant, job.key.session_id,
                        job.target, exc)
        finally:
            with self._lock:
                session.moving = False
            session.op.release()
            self._notify()

    def _demote(self, session: Session, target: str, klass: Priority, reason: str) -> None:
        """Demote toward target, or further down where target cannot take it;
        where no lower tier can, the session is dropped (it is a cache)."""
        lower = [] if target == DROP else [t for t in TIER_ORDER if t in self.tiers and tier_rank(t) >= tier_rank(target)]
        for tier in lower:
            try:
                self.placement.demote(session, tier, klass, reason)
                return
            except ResourceExhausted as exc:
                log.info("cannot demote %s/%s to %s: %s", *session.key, tier, exc)
        if lower:
            log.info("dropping %s/%s: no lower tier has room", *session.key)
        self._forget(session, reason)

    # -- policy ------------------------------------------------------------------------

    def _views(self, exclude: SessionKey | None = None, keep: Callable[[Session], bool] | None = None,
               queued_busy: bool = True) -> list[SessionView]:
        """What policy may know of the sessions (those `keep` accepts). A
        session is busy while a move of it runs, or (queued_busy) is queued:
        the tick queues no second move, but room is made now, before queued
        write-backs run; the queued move then finds its work done."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.key != exclude and (keep is None or keep(s))]
        busy = self.mover.busy_keys(queued=queued_busy)
        return [self._view(s, busy) for s in sessions]

    @staticmethod
    def _view(s: Session, busy: set[SessionKey] | frozenset = frozenset()) -> SessionView:
        return SessionView(s.key, s.snap.tier_bytes(), s.last_access, s.released_at, s.priority, s.pins > 0,
                           s.op.locked() or s.key in busy or s.readers > 0, s.durable, s.awaited)

    def _schedule(self, session: Session, at: float | None = None) -> None:
        """Have the tick look at a session at `at`, or else when policy says its
        next idle move is due; a check already scheduled earlier stands (it
        reschedules). Called with the store lock held, wherever a session
        becomes released, unpinned or promoted: nothing else brings a move
        due sooner (demotions and write-backs only put it off)."""
        if session.dropped:
            return
        if at is None:
            at = idle_due(self._view(session), self.policy, self.tiers)
        if at is None or (session.idle_check is not None and session.idle_check <= at):
            return
        session.idle_check = at
        heapq.heappush(self._checks, (at, session.key))

    def _due(self, now: float) -> list[Session]:
        """The sessions whose scheduled check has come (each is unscheduled)."""
        due = []
        with self._lock:
            while self._checks and self._checks[0][0] <= now:
                at, key = heapq.heappop(self._checks)
                session = self._sessions.get(key)
                if session is not None and session.idle_check == at:  # else rescheduled, or dropped
                    session.idle_check = None
                    due.append(session)
        return due

    def _execute(self, moves: list[Move], klass: Priority) -> int:
        """Carry out eviction moves now, skipping sessions busy by then."""
        done = 0
        for mv in moves:
            with self._lock:
                session = self._sessions.get(mv.key)
            if session is None or not session.op.acquire(blocking=False):
                continue
            try:
                if not session.dropped:
                    self._demote(session, mv.target, klass, mv.reason)
                    done += 1
            except TierdError as exc:
                log.warning("evicting %s/%s failed: %s", mv.key.tenant, mv.key.session_id, exc)
            finally:
                session.op.release()
        return done

    def _make_room(self, tier: str, need: int, protect: SessionKey, klass: Priority, tenant: str | None) -> bool:
        """Demote sessions out of `tier` (only `tenant`'s, if given) until `need`
        bytes are free. False when no set of movable sessions holds that much."""
        for _ in range(REPLANS):
            views = [v for v in self._views(exclude=protect, queued_busy=False)
                     if tenant is None or v.key.tenant == tenant]
            plan = plan_eviction(views, tier, need, self.tiers, self.policy)
            if plan is None:
                return False
            if self._execute(plan, klass):
                return True
            # Each planned session got busy in between (a queued move of it started): plan again.
        return False

    def tick(self) -> list[Move]:
        """Apply policy once: queue due demotions, write-backs and drops; let
        the tiers do their housekeeping."""
        self.expire_leases()
        for tier in self.tiers.values():
            tier.maintain()
        now = self.clock.now()
        # Only sessions whose check has come are looked at: with many sessions
        # stored, looking at each every tick held the store lock (and the GIL)
        # for tens of ms, and every call waited behind it.
        due = self._due(now)
        busy = self.mover.busy_keys()
        moves: list[Move] = []
        for i in range(0, len(due), CHECKS_PER_LOCK):  # the lock is let go between batches
            batch = due[i : i + CHECKS_PER_LOCK]
            with self._lock:
                views = [self._view(s, busy) for s in batch]
            batch_moves = idle_moves(views, now, self.policy, self.tiers)
            moved = {mv.key for mv in batch_moves}
            with self._lock:
                for s, v in zip(batch, views):
                    # A session given a move, or busy, is looked at again next tick: the
                    # move may be skipped (busy by then) or fail, or leave another due.
                    self._schedule(s, now if v.key in moved or v.busy else None)
            moves += batch_moves
        for name, tier in self.tiers.items():
            if tier.used > self.policy.high_watermark * tier.budget:
                views = self._views(keep=lambda s, name=name: bool(s.snap.placement.get(name)))
                moves += pressure_moves(views, name, tier.used, tier.budget, self.policy, self.tiers)
        seen: set[SessionKey] = set()
        for mv in moves:
            if mv.key in seen:
                continue
            seen.add(mv.key)
            klass = Priority.WRITEBACK if mv.keep else Priority.DEMOTION
            self.mover.submit(Job(mv.key, mv.target, mv.reason, klass, keep=mv.keep), lambda old, new: False)
        return moves

    def demote(self, key: SessionKey, tier: str = "disk", reason: str = "request") -> SessionInfo:
        """Move the session down to `tier` now (its faster copies go), under its
        lock, as an idle demotion would; what the tests and benches use to
        put a session in a tier."""
        if tier not in self.tiers:
            raise InvalidArgument(f"no {shown(tier)} tier here; tiers are {sorted(self.tiers)}", field="tier")
        with self._held(key) as session:
            self.placement.demote(session, tier, Priority.DEMOTION, reason)
            with self._lock:
                return self._info(session)

    def write_back(self, key: SessionKey) -> SessionInfo:
        """Give every page of the session a disk copy now, keeping the faster ones."""
        with self._held(key) as session:
            self.placement.write_disk(session, Priority.WRITEBACK)
            with self._lock:
                return self._info(session)

    def pieces(self, key: SessionKey, tier: str) -> list[Piece]:
        """Where the session's pages lie in a tier (a copy): for tests and inspection."""
        with self._lock:
            return list(self._get(key).snap.pieces(tier))

    def drain(self, timeout: float | None = 60.0) -> bool:
        """Wait until no move is queued or running."""
        return self.mover.drain(timeout)

    # -- inspection and control ------------------------------------------------------------

    def stat(self, key: SessionKey) -> SessionInfo:
        session = self._get(key)
        with self._lock:
            return self._info(session)

    def list(self, tenant: str | None = None, after: str = "", limit: int = 100) -> tuple[list[SessionInfo], str]:
        """Sessions ordered by (tenant, id), after the page token; returns the
        page and the token of the next page ("" when done)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit must be 1 to 10000, got {shown(limit)}", field="limit")
        with self._lock:
            keys = sorted(k for k in self._sessions if tenant is None or k.tenant == tenant)
            if after:
                keys = [k for k in keys if "\x00".join(k) > after]
            page = [self._info(self._sessions[k]) for k in keys[:limit]]
            token = "\x00".join(keys[limit - 1]) if len(keys) > limit else ""
        return page, token

    def stats(self, tenant: str | None = None) -> list[TierStats]:
        """Each tier's budget, bytes used, capacity and sessions holding pages
        there: the whole daemon's, or only what `tenant` holds (its capacity,
        the bytes the tier has mapped for every tenant, is 0)."""
        with self._lock:
            sessions = list(self._sessions.values())
        # Counted without the store lock (a scrape took it for ~20 ms at 20,000
        # sessions): tiers_held() reads each placement by name, never iterating a
        # dict that a move may change meanwhile.
        counts = {t: 0 for t in self.tiers}
        for s in sessions:
            if tenant is None or s.key.tenant == tenant:
                for t in s.snap.tiers_held():
                    counts[t] += 1
        return [TierStats(name, t.budget, t.used if tenant is None else t.used_by(tenant),
                          t.capacity if tenant is None else 0, counts[name], t.backend)
                for name, t in sorted(self.tiers.items(), key=lambda kv: tier_rank(kv[0]))]

    def count(self, tenant: str | None = None) -> int:
        """Sessions held: by every tenant, or by one."""
        with self._lock:
            return len(self._sessions) if tenant is None else self._per_tenant.get(tenant, 0)

    def set_budget(self, tier: str, nbytes: int) -> BudgetResult:
        """Change a tier's budget at run time; shrinking demotes the overflow now."""
        if tier not in self.tiers:
            raise InvalidArgument(f"no {shown(tier)} tier here; tiers are {sorted(self.tiers)}", field="tier",
                                  value=tier)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"budget must be a non-negative number of bytes, got {shown(nbytes)}", field="budget")
        t = self.tiers[tier]
        t0, used0, old = time.perf_counter(), t.used, t.budget
        plan = budget_moves(self._views(queued_busy=False), tier, t.used, nbytes, self.policy, self.tiers)
        if plan is None:
            raise FailedPrecondition(
                f"pinned or busy sessions hold more of the {tier} tier than {nbytes} bytes; unpin some first",
                tier=tier, used=t.used, budget=nbytes)
        t.budget = nbytes  # no new allocation past the new budget from here on
        moved = self._execute(plan, Priority.DEMAND)
        t.set_budget(nbytes)
        return BudgetResult(tier, old, nbytes, max(0, used0 - t.used), moved, time.perf_counter() - t0)

    def advise(self, key: SessionKey, prefill_tokens_per_s: float) -> Advice:
        if not isinstance(prefill_tokens_per_s, (int, float)) or not prefill_tokens_per_s > 0:
            raise InvalidArgument("prefill_tokens_per_s must be positive", field="prefill_tokens_per_s")
        session = self._get(key)
        with self._lock:
            snap = session.snap
            source = snap.slowest_tier() or "host"
            nbytes, tokens = snap.nbytes, snap.num_tokens
        bandwidth = self.copier.bandwidth.get(f"{source}->engine", DEFAULT_BANDWIDTH[source])
        return advise(nbytes, source, bandwidth, tokens, float(prefill_tokens_per_s))

    def scan(self) -> list[str]:
        """An integrity scan of the disk tier: every committed page reads back
        with its checksum, pieces lie inside the slabs and never overlap, the
        index holds exactly the pieces in memory, and the accounting holds
        (check_accounting). Returns the problems."""
        problems: list[str] = []
        if self.index is None:
            return problems
        disk = self.tiers["disk"]
        extents = []
        for key in self.keys():
            with self._held(key) as session:
                snap = session.snap
                pieces = snap.pieces("disk")
                extents += [(p.offset, p.alloc_bytes, key) for p in pieces]
                spans = [s for s in snap.spans("disk")]
                try:
                    for _ in self.copier.windows(spans, snap.geometry, snap.checksums, Priority.WRITEBACK):
                        pass
                except (DataLoss, OSError) as exc:
                    problems.append(f"{key.tenant}/{key.session_id}: {exc}")
        extents.sort()
        for (a, n, k1), (b, _, k2) in zip(extents, extents[1:]):
            if a + disk.allocator.round(n) > b:
                problems.append(f"{k1.session_id} and {k2.session_id} overlap at byte {b}")
        if extents and extents[-1][0] + extents[-1][1] > disk.capacity:
            problems.append("a piece lies past the end of the slab files")
        indexed = self.index.count()[1]
        if indexed != len(extents):
            problems.append(f"the index holds {indexed} pieces, the sessions {len(extents)}")
        return problems + self.check_accounting()

    def check_accounting(self) -> list[str]:
        """The accounting invariant: in every tier, the bytes its allocator
        holds, in all and per tenant, are the bytes held by the sessions'
        pieces and the open save leases, rounded as the allocator rounds.
        Returns the differences; exact only while no call or move is in flight."""
        held: dict[str, dict[str, int]] = {name: {} for name in self.tiers}
        with self._lock:
            holders = [(s.key.tenant, s.snap.placement) for s in self._sessions.values()]
            holders += [(lease.key.tenant, {"host": lease.write.pieces}) for lease in self._leases.values()
                        if isinstance(lease, _SaveLease)]
            holders += [(s.key.tenant, {tier: [p]}) for s in self._sessions.values() for tier, p in s.deferred]
            for tenant, placement in holders:
                for tier, pieces in placement.items():
                    rounded = sum(self.tiers[tier].allocator.round(p.alloc_bytes) for p in pieces)
                    held[tier][tenant] = held[tier].get(tenant, 0) + rounded
        problems = []
        for name, tier in self.tiers.items():
            if tier.used != sum(held[name].values()):
                problems.append(f"the {name} tier's allocator holds {tier.used} bytes, its sessions and leases "
                                f"{sum(held[name].values())}")
            problems += [f"the {name} tier accounts {tier.used_by(tenant)} bytes to tenant {tenant!r}, its sessions "
                         f"and leases hold {nbytes}" for tenant, nbytes in sorted(held[name].items())
                         if tier.used_by(tenant) != nbytes]
        return problems

    def keys(self) -> list[SessionKey]:
        with self._lock:
            return list(self._sessions)

    def close(self, flush: bool = True) -> None:
        """Stop moving; with flush, write every session not yet durable to disk."""
        if self._closed:
            return
        self._closed = True
        self.mover.close()
        self.expire_leases(everything=True)
        if flush and self.index is not None:
            for session in list(self._sessions.values()):
                with session.op:
                    if session.dropped or session.durable or session.damaged:
                        continue
                    try:
                        self.placement.write_disk(session, Priority.WRITEBACK, "shutdown")
                    except (TierdError, OSError) as exc:
                        log.warning("shutdown: %s/%s not flushed: %s", *session.key, exc)
        for tier in self.tiers.values():
            tier.close()
        if self.index is not None:
            self.index.close()


class SnapshotReader(Iterator[bytes | memoryview]):
    """Chunks of a snapshot (bytes, or memoryviews valid until the next
    chunk). Until it is exhausted or closed, the pages it reads stay
    allocated; close() may come from any thread, also while another thread
    is taking a chunk (it then waits for that chunk). `digest` is the XXH3 of
    the chunk last returned where the store knew it (a whole page's stored
    checksum), else 0."""

    def __init__(self, chunks: Iterator[tuple[bytes | memoryview, int]], done: Callable[[], None]) -> None:
        self._chunks = chunks
        self._done = done
        self._open = True
        self._lock = threading.Lock()
        self.digest = 0

    def __next__(self) -> bytes | memoryview:
        with self._lock:
            if not self._open:
                raise StopIteration
            try:
                data, self.digest = next(self._chunks)
                return data
            except BaseException:
                self._close()
                raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._chunks.close()  # type: ignore[attr-defined]
            finally:
                self._done()


def _merge_prefetch(old: Job, new: Job) -> bool:
    """Fold a new prefetch into a queued job: the faster target, the higher
    priority, the earlier deadline; a prefetch replaces a queued demotion."""
    changed = False
    if old.reason != "prefetch":
        old.target, old.reason, old.klass, old.keep = new.target, "prefetch", new.klass, False
        old.priority, old.deadline = new.priority, new.deadline
        return True
    if tier_rank(new.target) < tier_rank(old.target):
        old.target, changed = new.target, True
    if new.priority > old.priority:
        old.priority, changed = new.priority, True
    if new.deadline is not None and (old.deadline is None or new.deadline < old.deadline):
        old.deadline, changed = new.deadline, True
    return changed
