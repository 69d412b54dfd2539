"""A session's life after its pages are stored: release (its idle clock
starts), pin and unpin, drop, prefetch and readiness, demotions and
write-backs on request, and the jobs the mover runs (prefetch, demotion,
write-back, drop: jobs.py) on its own threads, each under the session's lock. A
move that fails leaves the session where it was, held off from idle and
pressure moves until policy's retry delay has passed."""

from __future__ import annotations

import logging

from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.move_queue import Job, MoveQueue
from tierd.core.store.describe import Describe, IdleChecks
from tierd.core.store.table import SessionTable
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    shown,
)
from tierd.policy.rules import DROP, retry_delay
from tierd.tiers import MEMORY, is_tier, kind_of, tier_order, tier_rank
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionInfo, SessionKey

log = logging.getLogger("tierd.core.store")


class Lifecycle:
    def __init__(self, table: SessionTable, placement: Placement, describe: Describe, idle: IdleChecks,
                 moves: MoveQueue, tiers: dict, roles: TierRoles, clock: Clock, events: StoreEvents) -> None:
        self.table = table
        self.placement = placement
        self.describe = describe
        self.idle = idle
        self.moves = moves
        self.tiers = tiers
        self.roles = roles
        self.clock = clock
        self.events = events

    def release(self, key: SessionKey) -> SessionInfo:
        """The engine is done with the session for now: its idle clock starts."""
        session = self.table.get(key)
        with self.table.lock:
            session.released_at = session.last_access = self.clock.now()
            self.idle.schedule(session)
            return self.describe.info(session)

    def pin(self, key: SessionKey) -> SessionInfo:
        session = self.table.get(key)
        with self.table.lock:
            session.pins += 1
            return self.describe.info(session)

    def unpin(self, key: SessionKey) -> SessionInfo:
        session = self.table.get(key)
        with self.table.lock:
            if session.pins == 0:
                raise FailedPrecondition(f"session {shown(key.session_id)} is not pinned", session_id=key.session_id)
            session.pins -= 1
            self.idle.schedule(session)
            return self.describe.info(session)

    def drop(self, key: SessionKey) -> None:
        """Forget the session everywhere; a queued move for it is cancelled."""
        self.moves.cancel(key)
        with self.table.held(key) as session:
            self.forget(session)

    def forget(self, session: Session, reason: str = "drop") -> None:
        """Remove a session whose op lock the caller holds. Its index entry
        goes first: if the index cannot be written, this raises and the
        session is served as before."""
        if not self.table.holds(session):
            return
        self.placement.edits.unindex(session)
        self.table.remove(session)
        held = session.snap.tiers_held()
        self.placement.edits.forget(session)
        for t in held:
            self.events.evicted(t, reason)
        self.table.notify()

    def prefetch(self, key: SessionKey, tier: str, priority: int, deadline: float | None) -> str:
        """Start promoting the session toward `tier` (a memory tier; the
        facade checked it and the priority); returns "ready" if it is there
        already, else "queued". Never waits for the move."""
        session = self.table.get(key)
        if session.damaged:
            raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
        where = session.snap.slowest_tier()
        if where is None or tier_rank(where) <= tier_rank(tier):
            self.expect(session)
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

    def expect(self, session: Session) -> float:
        """The engine is about to come back for this session: a fresh idle clock,
        and evicted after every session not awaited. Returns the time."""
        now = self.clock.now()
        with self.table.lock:
            session.last_access, session.awaited = now, True
            if session.released_at is not None:
                session.released_at = now
                self.idle.schedule(session)  # promoted: an earlier threshold may apply
        return now

    def ready(self, key: SessionKey, tier: str | None = None) -> tuple[bool, str | None]:
        """Whether the whole session is in `tier` (None: the landing tier) or
        faster, and the tier it is in; never waits."""
        tier = tier or self.roles.landing
        if not is_tier(tier):
            raise InvalidArgument(f"unknown tier {shown(tier)}", field="tier", value=tier)
        with self.table.lock:
            session = self.table.get(key)
            if session.damaged:
                raise DataLoss(f"session {shown(key.session_id)} is damaged", session_id=key.session_id)
            where = session.snap.slowest_tier()
        return where is not None and tier_rank(where) <= tier_rank(tier), where

    def move_failed(self, session: Session) -> tuple[float, bool]:
        """A move of the session failed and it stays as it was: no idle or
        pressure move takes it before policy's retry delay (eviction for room
        may). Returns the delay, and whether this is the first failure in a
        row: logged as a warning, the next ones at debug level."""
        with self.table.lock:
            session.failures += 1
            delay = retry_delay(session.failures)
            session.retry_at = self.clock.now() + delay
            return delay, session.failures == 1

    def move_done(self, session: Session) -> None:
        with self.table.lock:
            session.retry_at, session.failures = None, 0

    def demote_session(self, session: Session, target: str, io_class: IOClass, reason: str, evict: bool,
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
        self.forget(session, reason)

    def demote(self, key: SessionKey, tier: str | None = None, reason: str = "request") -> SessionInfo:
        """Move the session down to `tier` (None: the durable tier) now (its
        faster copies go), under its lock, making room there by eviction as a
        store does; what the tests and benches use to put a session in a tier."""
        tier = tier or self.roles.durable
        if tier is None or tier not in self.tiers:
            raise InvalidArgument(f"no {shown(tier)} tier here; tiers are {sorted(self.tiers)}", field="tier")
        with self.table.held(key) as session:
            self.placement.demote(session, tier, IOClass.DEMOTION, reason, True)
            with self.table.lock:
                return self.describe.info(session)

    def write_back(self, key: SessionKey) -> SessionInfo:
        """Give every page of the session a copy in the durable tier (disk) now,
        keeping the faster ones, making room there by eviction as a store does."""
        with self.table.held(key) as session:
            self.placement.write_durable(session, IOClass.WRITEBACK, "writeback", True)
            with self.table.lock:
                return self.describe.info(session)

    def pieces(self, key: SessionKey, tier: str) -> list[Piece]:
        """Where the session's pages lie in a tier (a copy): for tests and inspection."""
        with self.table.lock:
            return list(self.table.get(key).snap.pieces(tier))

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
