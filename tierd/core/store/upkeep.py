"""Policy applied: the tick (on the policy thread) looks only at sessions
whose idle check is due and queues their moves; room is made on demand for a
store or a move that needs it (on its thread); budgets change at run time;
advice on restore against recompute. The decisions are tierd.policy's,
pure functions of SessionViews; this layer gathers the views and carries
the moves out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierd.core.model import Session
from tierd.core.pages import pages_within
from tierd.core.store.checks import check_bound
from tierd.clock import Clock
from tierd.core.move_queue import Job, MoveQueue
from tierd.core.roles import TierRoles
from tierd.core.store.describe import Describe, IdleChecks
from tierd.core.store.leases import Leases
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.recode import Recoder
from tierd.core.store.table import SessionTable
from tierd.errors import FailedPrecondition, InvalidArgument, TierdError, shown
from tierd.policy import (
    RECODE,
    Advice,
    Move,
    PolicyConfig,
    SessionView,
    advise,
    budget_moves,
    idle_moves,
    plan_eviction,
    pressure_moves,
    under_pressure,
)
from tierd.tiers import kind_of
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine
from tierd.types import BudgetResult, SessionKey

log = logging.getLogger("tierd.core.store")
CHECKS_PER_LOCK = 256  # sessions the tick looks at per hold of the store lock (~5 ms)
REPLANS = 8  # eviction plans tried when their sessions got busy before they could be moved


class Upkeep:
    def __init__(self, table: SessionTable, describe: Describe, idle: IdleChecks, lifecycle: Lifecycle,
                 leases: Leases, moves: MoveQueue, copier: CopyEngine, tiers: dict, roles: TierRoles,
                 policy: PolicyConfig, clock: Clock, recoder: Recoder | None = None) -> None:
        self.table = table
        self.describe = describe
        self.idle = idle
        self.lifecycle = lifecycle
        self.leases = leases
        self.moves = moves
        self.copier = copier
        self.tiers = tiers
        self.roles = roles
        self.policy = policy
        self.clock = clock
        self.recoder = recoder  # re-codes sessions in place to make room in its tier, if one does

    def _shrink(self, tier: str) -> float:
        """The part of a session's bytes in `tier` a re-code frees (0: the tier re-codes nothing)."""
        return self.recoder.recoding.shrink if self.recoder is not None and self.recoder.recoding.tier == tier else 0.0

    def _views(self, exclude: SessionKey | None = None, keep: Callable[[Session], bool] | None = None,
               queued_busy: bool = True) -> list[SessionView]:
        """What policy may know of the sessions (those `keep` accepts). A
        session is busy while a move of it runs, or (queued_busy) is queued:
        the tick queues no second move, but room is made now, before queued
        write-backs run; the queued move then finds its work done."""
        sessions = self.table.sessions(lambda s: s.key != exclude and (keep is None or keep(s)))
        busy = self.moves.busy_keys(queued=queued_busy)
        views: list[SessionView] = []
        for i in range(0, len(sessions), CHECKS_PER_LOCK):  # the lock is let go between batches
            with self.table.lock:
                views += [self.describe.view(s, busy) for s in sessions[i : i + CHECKS_PER_LOCK]]
        return views

    def _execute(self, moves: list[Move], io_class: IOClass) -> tuple[int, int]:
        """Carry out eviction moves now, skipping sessions busy by then;
        returns how many were done and how many failed."""
        done = failed = 0
        for mv in moves:
            session = self.table.find(mv.key)
            if session is None or not session.op.acquire(blocking=False):
                continue
            try:
                if not session.dropped:
                    if mv.reason == RECODE and self.recoder is not None:
                        self.recoder.recode(session, io_class)
                    else:
                        self.lifecycle.demote_session(session, mv.target, io_class, mv.reason, evict=mv.evict,
                                                      drop=mv.evict)
                    self.lifecycle.move_done(session)
                    done += 1
            except TierdError as exc:
                failed += 1
                _, first = self.lifecycle.move_failed(session)
                log.log(logging.WARNING if first else logging.DEBUG, "evicting %s/%s failed: %s", *mv.key, exc)
            finally:
                session.op.release()
        return done, failed

    def make_room(self, tier: str, need: int, protect: SessionKey, io_class: IOClass, tenant: str | None,
                   evict: bool) -> bool:
        """Demote sessions out of `tier` (only `tenant`'s, if given) until `need`
        bytes are free: with evict, least valuable first, dropped where no lower
        tier can take them; without, only into room the lower tiers have free
        (none out of the lowest tier). False when no set of movable sessions
        holds that much."""
        t, made = self.tiers[tier], False
        for _ in range(REPLANS):
            views = [v for v in self._views(exclude=protect, queued_busy=False)
                     if tenant is None or v.key.tenant == tenant]
            plan = plan_eviction(views, tier, need, self.tiers, self.policy, drop=evict, shrink=self._shrink(tier))
            if plan is None:
                return made
            used = t.used
            done, failed = self._execute(plan, io_class)
            made = made or done > 0
            if done and any(mv.reason == RECODE for mv in plan) and used - t.used < need:
                # Re-codes free what their pages code to, which the plan could only guess: plan the rest
                # (the re-coded sessions may leave the tier now).
                need -= max(used - t.used, 0)
                continue
            if done:
                return True
            if failed:
                return made  # a plan again would fail as this one did (the disk index full, say)
            # Each planned session got busy in between (a queued move of it started): plan again.
        return made

    def tick(self) -> list[Move]:
        """Apply policy once: queue due demotions, write-backs and drops; let
        the tiers do their housekeeping."""
        self.leases.expire_leases()
        for tier in self.tiers.values():
            tier.maintain()
        now = self.clock.now()
        # Only sessions whose check has come are looked at: with many sessions
        # stored, looking at each every tick held the store lock (and the GIL)
        # for tens of ms, and every call waited behind it.
        due = self.idle.due(now)
        busy = self.moves.busy_keys()
        moves: list[Move] = []
        for i in range(0, len(due), CHECKS_PER_LOCK):  # the lock is let go between batches
            batch = due[i : i + CHECKS_PER_LOCK]
            with self.table.lock:
                views = [self.describe.view(s, busy) for s in batch]
            batch_moves = idle_moves(views, now, self.policy, self.tiers)
            moved = {mv.key for mv in batch_moves}
            with self.table.lock:
                for s, v in zip(batch, views):
                    # A session given a move, or busy, is looked at again next tick: the
                    # move may be skipped (busy by then) or fail, or leave another due.
                    self.idle.schedule(s, now if v.key in moved or v.busy else None)
            moves += batch_moves
        for name, tier in self.tiers.items():
            # (only where policy has something to say: building every view of a tier of 100,000 sessions
            # held each call up ~0.5 s, every tick, while the disk tier sat between its watermark and budget)
            if under_pressure(name, tier.used, tier.budget, self.policy, self.tiers):
                views = self._views(keep=lambda s, name=name: bool(s.snap.placement.get(name)))
                moves += pressure_moves(views, name, tier.used, tier.budget, self.policy, self.tiers, now,
                                        self._shrink(name))
        seen: set[SessionKey] = set()
        for mv in sorted(moves, key=lambda mv: mv.reason != RECODE):  # (a re-code writes back first: it goes)
            if mv.key in seen:
                continue
            seen.add(mv.key)
            io_class = IOClass.WRITEBACK if mv.keep else IOClass.DEMOTION
            self.moves.submit(Job(mv.key, mv.target, mv.reason, io_class, keep=mv.keep, evict=mv.evict),
                              lambda old, new: False)
        return moves

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
        moved, _ = self._execute(plan, IOClass.DEMAND)
        t.set_budget(nbytes)
        return BudgetResult(tier, old, nbytes, max(0, used0 - t.used), moved, time.perf_counter() - t0)

    def advise(self, key: SessionKey, prefill_tokens_per_s: float, max_error: float | None = None) -> Advice:
        """Whether restoring the session beats recomputing its tokens (with
        max_error: the leading pages within that relative error; none: recompute)."""
        if not isinstance(prefill_tokens_per_s, (int, float)) or not prefill_tokens_per_s > 0:
            raise InvalidArgument("prefill_tokens_per_s must be positive", field="prefill_tokens_per_s")
        check_bound(max_error)
        session = self.table.get(key)
        with self.table.lock:
            snap = session.snap
            pages = pages_within(snap.served_errors(), snap.n_pages, max_error)
            source = snap.source_of(pages) or self.roles.landing
            nbytes = snap.nbytes if pages == snap.n_pages else pages * snap.spec.page_bytes
            tokens = min(snap.num_tokens, pages * snap.spec.block_tokens) if pages < snap.n_pages else snap.num_tokens
        # Until a copy out of the tier has been measured, its kind's nominal figure.
        bandwidth = self.copier.bandwidth.get(f"{source}->engine", kind_of(source).bandwidth)
        return advise(nbytes, source, bandwidth, tokens, float(prefill_tokens_per_s))
