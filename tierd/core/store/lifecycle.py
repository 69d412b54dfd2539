"""A session's life after its pages are stored: release (its idle clock
starts), pin and unpin, drop, prefetch and readiness, demotions and
write-backs on request, and the jobs the mover runs (prefetch, demotion,
write-back, drop) on its own threads, each under the session's lock. A
move that fails leaves the session where it was, held off from idle and
pressure moves until policy's retry delay has passed."""

from __future__ import annotations

import logging
import time

from tierd.core.model import Session
from tierd.core.move_queue import Job
from tierd.core.store.checks import check_priority
from tierd.core.store.leases import Leases
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    TierdError,
    shown,
)
from tierd.policy.rules import DROP, retry_delay
from tierd.tiers import MEMORY, is_tier, kind_of, tier_order, tier_rank
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionInfo, SessionKey

log = logging.getLogger("tierd.core.store")


class Lifecycle(Leases):
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
        self.moves.cancel(key)
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
            self._unshare(session)
        held = session.snap.tiers_held()
        self.placement.forget(session)
        for t in held:
            self.events.evicted(t, reason)
        self._notify()

    def prefetch(self, key: SessionKey, tier: str | None = None, priority: int = 0,
                 deadline: float | None = None) -> str:
        """Start promoting the session toward `tier` (a memory tier; None: the
        landing tier); returns "ready" if it is there already, else "queued".
        Never waits for the move."""
        tier = tier or self.roles.landing
        check_priority(priority)
        self.check_prefetch_target(tier)
        session = self._get(key)
        if session.damaged:
            raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
        where = session.snap.slowest_tier()
        if where is None or tier_rank(where) <= tier_rank(tier):
            self._expect(session)
            self.events.prefetch_outcome("ready")
            return "ready"
        self.moves.submit(Job(key, tier, "prefetch", IOClass.PREFETCH, priority, deadline), merge_prefetch)
        return "queued"

    def check_prefetch_target(self, tier: str) -> None:
        """A prefetch goes to a memory tier this machine has."""
        if not is_tier(tier) or kind_of(tier).medium != MEMORY:
            targets = ", ".join(repr(t) for t in tier_order() if kind_of(t).medium == MEMORY)
            raise InvalidArgument(f"prefetch goes to a memory tier ({targets}), not {shown(tier)}", field="tier",
                                  value=tier)
        if tier not in self.tiers:
            raise FailedPrecondition(f"there is no {tier} tier on this machine", field="tier", value=tier)

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

    def ready(self, key: SessionKey, tier: str | None = None) -> tuple[bool, str | None]:
        """Whether the whole session is in `tier` (None: the landing tier) or
        faster, and the tier it is in; never waits."""
        tier = tier or self.roles.landing
        if not is_tier(tier):
            raise InvalidArgument(f"unknown tier {shown(tier)}", field="tier", value=tier)
        with self._lock:
            session = self._get(key)
            if session.damaged:
                raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
            where = session.snap.slowest_tier()
        return where is not None and tier_rank(where) <= tier_rank(tier), where

    def wait_ready(self, key: SessionKey, tier: str | None = None, timeout: float = 30.0) -> tuple[bool, str | None]:
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
                self.placement.promote(session, job.target, IOClass.PREFETCH)
                now = self._expect(session)
                self.events.prefetch_outcome("late" if job.deadline is not None and now > job.deadline else "in_time")
            elif job.target == DROP:
                self._forget(session, job.reason)
            elif job.keep:
                self.placement.write_durable(session, job.io_class, job.reason, job.evict)
            else:
                self._demote(session, job.target, job.io_class, job.reason, evict=job.evict)
        except TierdError as exc:
            if job.reason == "prefetch":
                self.events.prefetch_outcome("missed")
                log.warning("prefetch of %s/%s to %s failed: %s", *job.key, job.target, exc)
            else:
                delay, first = self._move_failed(session)
                log.log(logging.WARNING if first else logging.DEBUG, "%s of %s/%s to %s failed: %s; tried again "
                        "in %g s", job.reason, *job.key, job.target, exc, delay)
        else:
            if job.reason != "prefetch":
                self._move_done(session)
        finally:
            with self._lock:
                session.moving = False
            session.op.release()
            self._notify()

    def _move_failed(self, session: Session) -> tuple[float, bool]:
        """A move of the session failed and it stays as it was: no idle or
        pressure move takes it before policy's retry delay (eviction for room
        may). Returns the delay, and whether this is the first failure in a
        row: logged as a warning, the next ones at debug level."""
        with self._lock:
            session.failures += 1
            delay = retry_delay(session.failures)
            session.retry_at = self.clock.now() + delay
            return delay, session.failures == 1

    def _move_done(self, session: Session) -> None:
        with self._lock:
            session.retry_at, session.failures = None, 0

    def _demote(self, session: Session, target: str, io_class: IOClass, reason: str, evict: bool,
                drop: bool = False) -> None:
        """Demote toward target, or further down where target cannot take it:
        with evict (pressure, room for a store), a lower tier makes room by
        evicting its least valuable sessions; without (an idle demotion), the
        session takes only room a lower tier has free. Where no lower tier can
        take it, drop (its room is needed now) drops the session (it is a
        cache); otherwise this raises, and the session stays where it is."""
        lower = [] if target == DROP else [t for t in tier_order(self.tiers) if tier_rank(t) >= tier_rank(target)]
        for tier in lower:
            try:
                self.placement.demote(session, tier, io_class, reason, evict)
                return
            except ResourceExhausted as exc:
                if not drop and tier == lower[-1]:
                    raise
                log.info("cannot demote %s/%s to %s: %s", *session.key, tier, exc)
        if lower:
            log.info("dropping %s/%s: no lower tier has room", *session.key)
        self._forget(session, reason)

    def demote(self, key: SessionKey, tier: str | None = None, reason: str = "request") -> SessionInfo:
        """Move the session down to `tier` (None: the durable tier) now (its
        faster copies go), under its lock, making room there by eviction as a
        store does; what the tests and benches use to put a session in a tier."""
        tier = tier or self.roles.durable
        if tier is None or tier not in self.tiers:
            raise InvalidArgument(f"no {shown(tier)} tier here; tiers are {sorted(self.tiers)}", field="tier")
        with self._held(key) as session:
            self.placement.demote(session, tier, IOClass.DEMOTION, reason, True)
            with self._lock:
                return self._info(session)

    def write_back(self, key: SessionKey) -> SessionInfo:
        """Give every page of the session a copy in the durable tier (disk) now,
        keeping the faster ones, making room there by eviction as a store does."""
        with self._held(key) as session:
            self.placement.write_durable(session, IOClass.WRITEBACK, "writeback", True)
            with self._lock:
                return self._info(session)

    def pieces(self, key: SessionKey, tier: str) -> list[Piece]:
        """Where the session's pages lie in a tier (a copy): for tests and inspection."""
        with self._lock:
            return list(self._get(key).snap.pieces(tier))

    def drain(self, timeout: float | None = 60.0) -> bool:
        """Wait until no move is queued or running."""
        return self.moves.drain(timeout)


PREFETCHES = ("prefetch", "fetch")  # fetch: a prefetch that first brings the remote tier's version (remote.py)


def merge_prefetch(old: Job, new: Job) -> bool:
    """Fold a new prefetch (or fetch) into a queued job: the faster target, the
    higher priority, the earlier deadline, a fetch over a prefetch; a
    prefetch replaces a queued demotion."""
    if old.reason not in PREFETCHES:
        old.target, old.reason, old.io_class, old.keep = new.target, new.reason, new.io_class, False
        old.priority, old.deadline = new.priority, new.deadline
        return True
    changed = False
    if new.reason == "fetch" and old.reason != "fetch":
        old.reason, changed = "fetch", True
    if tier_rank(new.target) < tier_rank(old.target):
        old.target, changed = new.target, True
    if new.priority > old.priority:
        old.priority, changed = new.priority, True
    if new.deadline is not None and (old.deadline is None or new.deadline < old.deadline):
        old.deadline, changed = new.deadline, True
    return changed
