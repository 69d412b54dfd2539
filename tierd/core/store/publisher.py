"""The publisher: the queue of sessions to publish to the remote tier, and
the thread that publishes them (the module docstring of remote.py says
when a session is queued and what a publish replaces). It hears of every
store through queue(), and reaches the sessions, their locks and the
remote link through the store it serves. Runs on its own thread, or on
the caller's thread for publish_one().
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from tierd.core import tokens
from tierd.core.model import Session
from tierd.errors import DataLoss, FailedPrecondition, Unavailable, shown
from tierd.remote.manifest import Manifest
from tierd.tiers import tier_rank
from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.store")


class Publisher:
    def __init__(self, store: Any, remote: Any) -> None:
        self.store = store  # the remote layer of the store: sessions, locks, the remote link
        self.remote = remote
        self._cv = threading.Condition()
        self._queue: OrderedDict[SessionKey, None] = OrderedDict()
        self._stop = False
        self._busy = 0  # 1 while the thread works on a session
        self._thread: threading.Thread | None = None
        if remote.write != "off":
            self._thread = threading.Thread(target=self._run, name="tierd-publisher", daemon=True)
            self._thread.start()

    def close(self, flush: bool, timeout: float = 10.0) -> None:
        """Stop; with flush, after what is queued is published (within timeout,
        unless the remote tier is down)."""
        end = time.monotonic() + timeout
        with self._cv:
            while flush and (self._queue or self._busy) and time.monotonic() < end \
                    and not self.store.link.down.is_set():
                self._cv.wait(max(0.0, end - time.monotonic()))
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def wake(self) -> None:
        """The remote tier answers again: what waits in the queue goes."""
        with self._cv:
            self._cv.notify_all()

    def queue(self, key: SessionKey) -> bool:
        """Queue the session for the publisher (none with write "off": publish() alone publishes); whether it is."""
        if self._thread is None:
            return False
        with self._cv:
            if key in self._queue:
                return True
            if len(self._queue) >= self.remote.queue:
                self.store.events.remote_op("publish", "queue_full")
                return False
            self._queue[key] = None
            self._cv.notify()
            return True

    def queued(self) -> tuple[int, int]:
        """Sessions waiting for the publisher, and being published (0 or 1)."""
        with self._cv:
            return len(self._queue), self._busy

    def _run(self) -> None:
        scan_every = max(0.5, min(self.remote.idle / 4, 10.0))
        next_scan = time.monotonic() + scan_every
        while True:
            with self._cv:
                # While the tier is down, what is queued waits (the probe wakes this once it answers).
                while (not self._queue or self.store.link.down.is_set()) and not self._stop:
                    left = next_scan - time.monotonic()
                    if self.remote.write == "back" and left <= 0 and not self.store.link.down.is_set():
                        break
                    self._cv.wait(left if self.remote.write == "back" and not self.store.link.down.is_set() else None)
                if self._stop:
                    return
                key = self._queue.popitem(last=False)[0] if self._queue else None
                self._busy = int(key is not None)
            if key is None:
                self._queue_idle()
                next_scan = time.monotonic() + scan_every
                continue
            try:
                self.publish_one(key)
            except Exception:  # noqa: BLE001 - the publisher outlives any one session
                log.exception("publishing %s/%s to the remote tier failed", *key)
            finally:
                with self._cv:
                    self._busy = 0
                    self._cv.notify_all()

    def _queue_idle(self) -> None:
        """Write back: queue the sessions idle on disk long enough and not yet remote-durable."""
        now = self.store.clock.now()
        with self.store._lock:
            due = [s.key for s in self.store._sessions.values()
                   if s.durable and not s.remote_durable and not s.damaged and s.released_at is not None
                   and now - s.released_at >= self.remote.idle]
        for key in due:
            if not self.queue(key):
                return

    def publish_one(self, key: SessionKey) -> None:
        backend = self.remote.store
        if self.store.link.down.is_set():
            self.queue(key)  # published once the tier answers
            return
        with self.store._changed:
            self.store._changed.wait_for(lambda: key not in self.store._dropping and key not in self.store._pubs)
            session = self.store._sessions.get(key)
            if session is None or session.dropped or session.damaged or session.remote_durable:
                return
            self.store._pubs.add(key)
            snap = session.snap
            version, spec, sums, hashes = snap.version, snap.spec, snap.checksums, snap.token_hashes
            num_tokens, spans, geom = snap.num_tokens, snap.best_spans(), snap.geometry
            base, fresh = session.remote_version, session.remote_fresh > session.remote_at
            base_write = session.remote_write
            session.readers += 1
        try:
            unusable = False
            try:
                m, expect = self.store.link.call("manifest", backend.head, key)
            except DataLoss:  # unusable (garbled, another session's): replaced, whatever its version
                m, expect, unusable = None, self.store.link.call("manifest", backend.version_of, key), True
            if m is None and expect and expect != base and not fresh and not unusable:  # a tombstone
                self.store.events.remote_op("publish", "conflict")
                log.info("%s/%s not published: another node dropped it (only a store from token 0 starts it "
                         "again)", *key)
                self.store._dropped_elsewhere(session, base)
                return
            if m is not None and (m.version != base or (base_write and m.write != base_write)) and not fresh:
                if m.fingerprint == spec.fingerprint and np.array_equal(m.checksums, sums):
                    self._published(session, version, m)  # the same content is there already
                    return
                self.store.events.remote_op("publish", "conflict")
                log.info("%s/%s not published: another node stored a newer version (%d) of it", *key, m.version)
                return
            if self.remote.tenant_quota and not self._within_quota(key, geom.nbytes):
                return
            t0 = time.perf_counter()
            # A move to another tier, checked as moves are: every reader checks every page against the
            # manifest, so a page damaged here is never served from there either.
            data = self.store.copier.views(spans, geom, sums, IOClass.WRITEBACK, self.remote.store.publish_window,
                                      handout=False)
            new = self.store.link.call("publish", backend.publish, key, expect, spec.to_dict(),
                             spec.fingerprint, num_tokens, spec.page_bytes, sums,
                             hashes if tokens.known(hashes) else tokens.empty(0), data)
            seconds = time.perf_counter() - t0
            self.store.copier.record(f"{self.store.roles.landing}->{self.store.roles.versions}", geom.nbytes, seconds)
            self.store.events.moved(max((s.tier for s in spans), key=tier_rank), self.store.roles.versions, "publish",
                                    geom.nbytes, seconds)
            self.store.events.remote_op("publish", "ok")
            self._published(session, version, new)
        except FailedPrecondition as exc:
            self.store.events.remote_op("publish", "conflict")
            log.info("%s/%s not published: %s", *key, exc)
        except DataLoss as exc:
            self.store.placement.mark_damaged(session, exc)
        except Unavailable as exc:
            if self.store.link.down.is_set():  # not Refused (the store answered): published once the tier answers
                self.queue(key)
            log.info("%s/%s not published: %s", *key, exc)
        finally:
            self.store.placement.end_read(session)
            with self.store._changed:
                self.store._pubs.discard(key)
                self.store._changed.notify_all()

    def _within_quota(self, key: SessionKey, nbytes: int) -> bool:
        """Whether a version of nbytes fits the tenant's remote quota (in place of
        the session's last). Checked before each publish: nodes publishing at
        the same moment may each take one session past it."""
        total, own = self.store.link.call("quota", self.remote.store.usage, key.tenant, key.session_id)
        if total - own + nbytes > self.remote.tenant_quota:  # the total may count sessions expired or evicted since
            total, own = self.store.link.call("quota", self.remote.store.usage, key.tenant, key.session_id, True)
        held = total - own
        if held + nbytes <= self.remote.tenant_quota:
            return True
        self.store.events.remote_op("publish", "quota")
        log.info("%s/%s not published: tenant %s holds %d bytes of its %d in the remote tier", *key, shown(key.tenant),
                 held, self.remote.tenant_quota)
        return False

    def _published(self, session: Session, version: int, m: Manifest) -> None:
        """Record that the remote tier holds snapshot `version` as manifest m."""
        with self.store._lock:
            session.remote_version, session.remote_write = m.version, m.write
            if session.snap.version == version:
                session.remote_at = version
