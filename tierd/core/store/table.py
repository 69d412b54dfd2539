"""The session table: the one owner of the sessions by key. It holds the
lock of each key, the per-tenant counts, and tells what follows the
sessions (the prefix index: TableObserver) when a session's content enters
or is about to change or go, and the listeners (WaitReady) when anything
may have changed. Every other part of the store reaches sessions through
its methods; see the package docstring for the threads and the lock order."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from tierd.core.model import Session
from tierd.errors import NotFound, shown
from tierd.types import SessionKey


class TableObserver(Protocol):
    """Hears, under the store lock, of each session's content entering the
    table (a new session, or one whose content changed) and leaving it (a
    change about to begin, or the session going)."""

    def entered(self, session: Session) -> None: ...

    def leaving(self, session: Session) -> None: ...


class SessionTable:
    def __init__(self, lock: threading.RLock, observers: Sequence[TableObserver] = ()) -> None:
        self.lock = lock  # the store lock
        self.changed = threading.Condition(lock)  # notified whenever a session may have changed
        self._sessions: dict[SessionKey, Session] = {}
        self._key_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._per_tenant: dict[str, int] = {}  # sessions held by each tenant
        self._observers = tuple(observers)
        self._listeners: list[Callable[[], None]] = []

    # -- keys and their locks ----------------------------------------------------------

    def acquire(self, key: SessionKey) -> tuple[threading.Lock, Session | None]:
        """Take the key's lock; returns it and the session it guards (None if
        there is none). One lock per key: a live session's op lock, else the
        lock a creator of the key already holds, else a new one."""
        while True:
            with self.lock:
                session = self._sessions.get(key)
                lock = session.op if session is not None else self._key_locks.get(key)
                if lock is None:
                    lock = self._key_locks[key] = threading.Lock()
            lock.acquire()
            with self.lock:
                now = self._sessions.get(key)
            if now is None or now.op is lock:
                return lock, now
            lock.release()  # the session changed hands while we waited: look again

    @contextmanager
    def held(self, key: SessionKey) -> Iterator[Session]:
        """The existing session, its lock held for the duration; NotFound otherwise."""
        lock, session = self.acquire(key)
        try:
            if session is None:
                raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
            yield session
        finally:
            lock.release()

    # -- looking ----------------------------------------------------------------------

    def get(self, key: SessionKey) -> Session:
        """The session; NotFound without one."""
        session = self.find(key)
        if session is None:
            raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
        return session

    def find(self, key: SessionKey) -> Session | None:
        with self.lock:
            return self._sessions.get(key)

    def has(self, key: SessionKey) -> bool:
        with self.lock:
            return key in self._sessions

    def holds(self, session: Session) -> bool:
        """Whether this session (not another of its key) is the table's."""
        with self.lock:
            return self._sessions.get(session.key) is session

    def keys(self, tenant: str | None = None) -> list[SessionKey]:
        with self.lock:
            return [k for k in self._sessions if tenant is None or k.tenant == tenant]

    def sessions(self, keep: Callable[[Session], bool] | None = None) -> list[Session]:
        """The sessions (those `keep` accepts: called under the store lock)."""
        with self.lock:
            return [s for s in self._sessions.values() if keep is None or keep(s)]

    def count(self, tenant: str | None = None) -> int:
        """Sessions held: by every tenant, or by one."""
        with self.lock:
            return len(self._sessions) if tenant is None else self._per_tenant.get(tenant, 0)

    # -- changing ---------------------------------------------------------------------

    def add(self, session: Session) -> None:
        """A new session, its content complete, whose key's lock the caller holds."""
        with self.lock:
            self._sessions[session.key] = session
            self._key_locks[session.key] = session.op
            self._per_tenant[session.key.tenant] = self._per_tenant.get(session.key.tenant, 0) + 1
            self.entered(session)

    def remove(self, session: Session) -> bool:
        """The session goes (its key's lock held by the caller): it is marked
        dropped. False where the table holds another, or none."""
        with self.lock:
            if self._sessions.get(session.key) is not session:
                return False
            del self._sessions[session.key]
            self._per_tenant[session.key.tenant] -= 1
            if not self._per_tenant[session.key.tenant]:
                del self._per_tenant[session.key.tenant]
            self.leaving(session)
            session.dropped = True
            return True

    def leaving(self, session: Session) -> None:
        """The session's content is about to change (its key's lock held)."""
        with self.lock:
            for observer in self._observers:
                observer.leaving(session)

    def entered(self, session: Session) -> None:
        """The session's content changed, or is back unchanged after leaving()."""
        with self.lock:
            if not session.dropped:
                for observer in self._observers:
                    observer.entered(session)

    # -- wake-ups ---------------------------------------------------------------------

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()
        for listener in self._listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call listener (from any thread; it must not block) whenever a
        session's content or placement may have changed."""
        self._listeners.append(listener)
