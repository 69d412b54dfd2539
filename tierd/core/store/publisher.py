"""The publisher: the queue of sessions to publish to the remote tier
(PublishQueue: any thread adds to it), and the thread that publishes them
(Publisher; publish_one also on the caller's thread). The module docstring
of remote.py says when a session is queued and what a publish replaces.
"""

from __future__ import annotations

import logging
import threading
import time


from tierd.core import tokens
from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.core.placement import Placement
from tierd.core.rows import own_stmt
from tierd.core.roles import TierRoles
from tierd.core.store.coding import PageCoder
from tierd.core.store.link import RemoteLink
from tierd.core.store.finder import Finder
from tierd.core.store.remote import PublishQueue, Remote, RemoteBusy
from tierd.core.store.table import SessionTable
from tierd.errors import DataLoss, FailedPrecondition, TierdError, Unavailable, shown
from tierd.remote.backend import Unreplicated
from tierd.remote.coded import holds
from tierd.remote.manifest import Manifest
from tierd.tiers import tier_rank
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.store")


class Publisher:
    def __init__(self, queue: PublishQueue, table: SessionTable, finder: Finder, busy: RemoteBusy,
                 placement: Placement, link: RemoteLink, remote: Remote, copier: CopyEngine, coder: PageCoder,
                 roles: TierRoles, clock: Clock, events: StoreEvents) -> None:
        self.queue = queue
        self.coder = coder
        self.table = table
        self.finder = finder
        self.busy = busy
        self.placement = placement
        self.link = link
        self.remote = remote
        self.copier = copier
        self.roles = roles
        self.clock = clock
        self.events = events
        self._stop = False
        self._thread: threading.Thread | None = None
        if queue.open:
            self._thread = threading.Thread(target=self._run, name="tierd-publisher", daemon=True)
            self._thread.start()

    def close(self, flush: bool, timeout: float = 10.0) -> None:
        """Stop; with flush, after what is queued is published (within timeout,
        unless the remote tier is down)."""
        end = time.monotonic() + timeout
        q = self.queue
        with q.cv:
            while flush and (q.keys or q.busy) and time.monotonic() < end and not self.link.down.is_set():
                q.cv.wait(max(0.0, end - time.monotonic()))
        with q.cv:
            self._stop = True
            q.cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        scan_every = max(0.5, min(self.remote.idle / 4, 10.0))
        next_scan = time.monotonic() + scan_every
        while True:
            q = self.queue
            with q.cv:
                # While the tier is down, what is queued waits (the probe wakes this once it answers).
                while (not q.keys or self.link.down.is_set()) and not self._stop:
                    left = next_scan - time.monotonic()
                    if self.remote.write == "back" and left <= 0 and not self.link.down.is_set():
                        break
                    q.cv.wait(left if self.remote.write == "back" and not self.link.down.is_set() else None)
                if self._stop:
                    return
                key = q.keys.popitem(last=False)[0] if q.keys else None
                q.busy = int(key is not None)
            if key is None:
                self._queue_idle()
                next_scan = time.monotonic() + scan_every
                continue
            try:
                self.publish_one(key)
            except Exception:  # noqa: BLE001 - the publisher outlives any one session
                log.exception("publishing %s/%s to the remote tier failed", *key)
            finally:
                with q.cv:
                    q.busy = 0
                    q.cv.notify_all()

    def _queue_idle(self) -> None:
        """Write back: queue the sessions idle on disk long enough and not yet remote-durable."""
        now = self.clock.now()
        due = [s.key for s in self.table.sessions(
            lambda s: s.durable and not s.remote_durable and not s.damaged and s.released_at is not None
            and now - s.released_at >= self.remote.idle)]
        for key in due:
            if not self.queue.add(key):
                return

    def publish_one(self, key: SessionKey) -> None:
        backend = self.remote.store
        if self.link.down.is_set():
            self.queue.add(key)  # published once the tier answers
            return
        with self.table.changed:
            self.busy.start_publish(key)
            session = self.table.find(key)
            if session is None or session.dropped or session.damaged or session.remote_durable:
                self.busy.end_publish(key)
                return
            snap = session.snap
            version, spec, sums, hashes, errors = snap.version, snap.spec, snap.checksums, snap.token_hashes, snap.errors
            num_tokens, spans, geom = snap.num_tokens, snap.best_spans(served=False), snap.geometry
            base, fresh = session.remote_version, session.remote_fresh > session.remote_at
            base_write = session.remote_write
            unacked = session.remote_unacked == version  # this content, published: waits for a replica
            session.readers += 1
        try:
            unusable = False
            try:
                m, expect = self.link.call("manifest", backend.head, key)
            except DataLoss:  # unusable (garbled, another session's): replaced, whatever its version
                m, expect, unusable = None, self.link.call("manifest", backend.version_of, key), True
            if unacked and m is not None and (m.version, m.write) == (base, base_write):
                # This node's publish of this content, not yet on a replica: asked again, not published again.
                if self.link.call("replication", backend.replicated, [key])[0]:
                    self._published(session, version, m)
                return
            if m is None and expect and expect != base and not fresh and not unusable:  # a tombstone
                self.events.remote_op("publish", "conflict")
                log.info("%s/%s not published: another node dropped it (only a store from token 0 starts it "
                         "again)", *key)
                self.finder.dropped_elsewhere(session, base)
                return
            if m is not None and (m.version != base or (base_write and m.write != base_write)) and not fresh:
                if holds(m, spec.fingerprint, sums):  # the same content is there already
                    if self.link.call("replication", backend.replicated, [key])[0]:
                        self._published(session, version, m)
                    else:
                        self._unreplicated(session, version, m)
                    return
                self.events.remote_op("publish", "conflict")
                log.info("%s/%s not published: another node stored a newer version (%d) of it", *key, m.version)
                return
            if self.remote.tenant_quota and not self._within_quota(key, geom.nbytes):
                return
            if not self._trying(session, expect):
                return
            t0 = time.perf_counter()
            # A move to another tier, checked as moves are: every reader checks every page against the
            # manifest, so a page damaged here is never served from there either.
            data = self.copier.views(spans, geom, sums, IOClass.WRITEBACK, self.remote.store.publish_window,
                                      handout=False)
            with self.table.lock:
                bound = self.coder.consent.bound(session)
            coding = self.coder.coding_for(bound, geom.n_pages, errors)
            if coding is not None:  # coded as they are read
                data = self.coder.encode(data, spec, geom, sums, coding, errors, bound)
            new = self.link.call("publish", backend.publish, key, expect, spec.to_dict(),
                             spec.fingerprint, num_tokens, spec.page_bytes, sums,
                             hashes if tokens.known(hashes) else tokens.empty(0), data, coding=coding)
            seconds = time.perf_counter() - t0
            self.copier.record(f"{self.roles.landing}->{self.roles.versions}", geom.nbytes, seconds)
            self.coder.measured(coding.codec if coding is not None else "none", "publish", geom.nbytes, seconds)
            self.events.moved(max((s.tier for s in spans), key=tier_rank), self.roles.versions, "publish",
                                    geom.nbytes, seconds)
            self.events.remote_op("publish", "ok")
            self._published(session, version, new)
        except Unreplicated as exc:  # the store took it: the session's version, not remote-durable yet
            self.events.remote_op("publish", "unreplicated")
            self._unreplicated(session, version, exc.manifest)
            log.info("%s/%s published, not remote-durable yet: %s", *key, exc)
        except FailedPrecondition as exc:
            self.events.remote_op("publish", "conflict")
            log.info("%s/%s not published: %s", *key, exc)
        except DataLoss as exc:
            self.placement.faults.damaged(session, exc)
        except Unavailable as exc:
            if self.link.down.is_set():  # not Refused (the store answered): published once the tier answers
                self.queue.add(key)
            log.info("%s/%s not published: %s", *key, exc)
        finally:
            self.placement.end_read(session)
            self.busy.end_publish(key)

    def _trying(self, session: Session, expect: int) -> bool:
        """Before the publish call: the version its key holds now recorded as
        the one the publish is tried over, in the index too where it names the
        row a history of this node's own (after any durable write deciding
        that ends). Recovered, the copy is this node's own only where the key
        still holds that version: nothing this node published landed. False
        where the index cannot record it: not published now, queued again."""
        deadline = time.monotonic() + 30.0
        while True:
            with self.table.lock:
                writing = session.own_writes
                if not writing:
                    session.own_expect, own = expect, session.own_row
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)  # a write of its pages to disk commits: milliseconds
        index = self.placement.index
        try:
            if writing:
                raise Unavailable("a durable write of it did not end in 30 s")
            if own and index is not None:
                index.apply([own_stmt(session.key, True, expect)])
        except TierdError as exc:
            log.warning("%s/%s not published now: %s", *session.key, exc)
            self.queue.add(session.key)
            return False
        return True

    def _within_quota(self, key: SessionKey, nbytes: int) -> bool:
        """Whether a version of nbytes fits the tenant's remote quota (in place of
        the session's last). Checked before each publish: nodes publishing at
        the same moment may each take one session past it."""
        total, own = self.link.call("quota", self.remote.store.usage, key.tenant, key.session_id)
        if total - own + nbytes > self.remote.tenant_quota:  # the total may count sessions expired or evicted since
            total, own = self.link.call("quota", self.remote.store.usage, key.tenant, key.session_id, True)
        held = total - own
        if held + nbytes <= self.remote.tenant_quota:
            return True
        self.events.remote_op("publish", "quota")
        log.info("%s/%s not published: tenant %s holds %d bytes of its %d in the remote tier", *key, shown(key.tenant),
                 held, self.remote.tenant_quota)
        return False

    def _unreplicated(self, session: Session, version: int, m: Manifest) -> None:
        """Record that the remote tier took snapshot `version` as manifest m,
        not yet as durably as it promises: it is remote-durable once the tier
        says it is (the sweeper asks each second, sweeper.py)."""
        with self.table.lock:
            session.remote_is(m)
            session.remote_unacked = version

    def _published(self, session: Session, version: int, m: Manifest) -> None:
        """Record that the remote tier holds snapshot `version` as manifest m."""
        with self.table.lock:
            session.remote_is(m)
            session.remote_acked(version)
