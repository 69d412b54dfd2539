"""Faults met while moving or serving a session: failed I/O of a tier,
counted, logged and UNAVAILABLE (nothing was served or changed), and a page
that failed its check, which damages the session and every session holding
the same copy (prefix sharing's `spread`). Any thread; the session's flag
under the store lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.errors import DataLoss, Unavailable, shown
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.placement")


class Faults:
    def __init__(self, events: StoreEvents, lock: threading.RLock, durable: str | None,
                 spread: Callable[[Session, DataLoss], None] = lambda session, exc: None) -> None:
        self.events = events
        self.lock = lock
        self.durable = durable
        self.spread = spread  # the other sessions that hold a damaged page are damaged too

    def io_failed(self, op: str, exc: OSError, key: SessionKey, tier: str | None = None) -> Unavailable:
        """A tier's I/O (None: the durable tier's, the one that does I/O)
        failed while moving or serving a session: counted, logged, and
        retryable (nothing was served or changed; the old copies stay
        authoritative)."""
        tier = tier or self.durable or "tier"
        self.events.disk_error(op)
        log.error("%s %s for %s/%s failed: %s", tier, op, key.tenant, key.session_id, exc)
        return Unavailable(f"a {tier} {op} for session {shown(key.session_id)} failed ({exc.strerror or exc}); "
                           "nothing was changed, try again", op=op, session_id=key.session_id)

    def damaged(self, session: Session, exc: DataLoss) -> None:
        log.error("session %s/%s is damaged: %s", session.key.tenant, session.key.session_id, exc)
        with self.lock:
            session.damaged = True
        self.spread(session, exc)
        self.events.checksum_failed(str(exc.details.get("tier", self.durable)))
