"""The session table: sessions by key, the lock of each key, the per-tenant
counts, the idle-check schedule, and the wake-ups sent when a session
changes. Every layer above builds on it; see the package docstring for the
threads and the lock order."""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from tierd.clock import Clock, SystemClock
from tierd.core.events import NullEvents, StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.model import Session, Snapshot
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.errors import NotFound, shown
from tierd.policy import PolicyConfig, SessionView, idle_due
from tierd.transfer.copier import CopyEngine
from tierd.types import SessionInfo, SessionKey


class SessionTable:
    def __init__(self, tiers: dict, copier: CopyEngine, index: DiskIndex | None, clock: Clock | None,
                 policy: PolicyConfig | None, events: StoreEvents | None) -> None:
        self.tiers = tiers
        self.roles = TierRoles.of(tiers)  # ValueError without a landing tier
        self.copier = copier
        self.index = index
        self.clock = clock or SystemClock()
        self.policy = policy or PolicyConfig()
        self.events = events or NullEvents()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._sessions: dict[SessionKey, Session] = {}
        self._key_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._per_tenant: dict[str, int] = {}  # sessions held by each tenant
        self._streaming: dict[str, int] = {}  # host bytes held by each tenant's Puts in progress
        self._listeners: list[Callable[[], None]] = []
        # (time, key): when the tick next looks at each released session, so that a
        # tick costs what is due, not what is stored (see _schedule).
        self._checks: list[tuple[float, SessionKey]] = []
        # Placement takes what it needs of sharing and upkeep when the store is built (Store.__init__).
        self.placement: Placement
        self._closed = False

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

    def _durable(self, s: Session) -> bool:
        """Durable, and none of its pages in a slab file deleted since it was written."""
        durable = self.placement.durable
        return s.durable and not any(self.tiers[durable].retired(p.offset) for p in s.snap.pieces(durable))

    def _shares(self, snap: Snapshot) -> dict[str, int]:
        """What policy counts of a snapshot's bytes in each tier that holds
        any: an allocation it shares with other snapshots (prefix pages) split
        evenly among its holders, so that evicting them all frees what the
        sums say. (Stat's tier_bytes counts such an allocation in full: the
        bytes the session reads from; Stats says what sharing saves.)"""
        holders = self.placement.held.holders
        return {t: sum(p.alloc_bytes // holders(t, p) for p in pieces) for t, pieces in snap.placement.items()
                if pieces}

    def _shared_bytes(self, s: Session) -> int:
        """The snapshot's bytes in pages of which other sessions hold the same
        copy: in an allocation with other holders, and held by another session
        by their token hash."""
        snap = s.snap
        mask = np.zeros(snap.n_pages, dtype=bool)
        for t, pieces in snap.placement.items():
            for p in pieces:
                if self.placement.held.holders(t, p) > 1:
                    mask[p.first_page : p.first_page + p.n_pages] = True
        mask[self._shared_depth(s) :] = False
        if not mask.any():
            return 0
        geom = snap.geometry
        return int(mask.sum()) * geom.page_bytes - (geom.page_bytes - geom.last_bytes if mask[-1] else 0)

    def _shared_depth(self, s: Session) -> int:
        """How many leading pages of the session others hold too (sharing.py)."""
        return 0

    def _info(self, s: Session) -> SessionInfo:
        snap = s.snap
        return SessionInfo(
            tenant=s.key.tenant, session_id=s.key.session_id, tier=snap.slowest_tier(),
            tier_bytes=snap.tier_bytes(), state=s.state.value,
            num_tokens=snap.num_tokens, size_bytes=snap.nbytes, num_pages=snap.n_pages, durable=self._durable(s),
            last_access=s.last_access, created=s.created, priority=s.priority, pins=s.pins,
            model_id=snap.spec.model_id, fingerprint=snap.spec.fingerprint, spec=snap.spec,
            remote_durable=s.remote_durable, shared_bytes=self._shared_bytes(s))

    def _view(self, s: Session, busy: set[SessionKey] | frozenset = frozenset()) -> SessionView:
        return SessionView(s.key, self._shares(s.snap), s.last_access, s.released_at, s.priority, s.pins > 0,
                           s.op.locked() or s.key in busy or s.readers > 0, s.durable, s.awaited, s.retry_at)

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

    def stat(self, key: SessionKey) -> SessionInfo:
        session = self._get(key)
        with self._lock:
            return self._info(session)

    def policy_view(self, key: SessionKey) -> SessionView:
        """What policy knows of the session now (its idle clock, whether it is awaited, busy, ...)."""
        session = self._get(key)
        with self._lock:
            return self._view(session, self.moves.busy_keys())

    def _has(self, key: SessionKey) -> bool:
        with self._lock:
            return key in self._sessions

    def keys(self) -> list[SessionKey]:
        with self._lock:
            return list(self._sessions)

    def count(self, tenant: str | None = None) -> int:
        """Sessions held: by every tenant, or by one."""
        with self._lock:
            return len(self._sessions) if tenant is None else self._per_tenant.get(tenant, 0)
