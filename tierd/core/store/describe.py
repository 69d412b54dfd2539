"""What is said of a session: its SessionInfo (Stat, List), the view policy
decides on, what policy counts of its bytes in each tier; and the idle
checks, when the tick next looks at each released session. Called under
the store lock, on whichever thread describes or schedules."""

from __future__ import annotations

import heapq

import numpy as np

from tierd.core.holders import Holders
from tierd.core.model import Session, Snapshot
from tierd.core.roles import TierRoles
from tierd.core.store.recoding import Recoding
from tierd.core.store.remote_info import coded_copy
from tierd.core.store.sharing import Sharing
from tierd.core.store.table import SessionTable
from tierd.policy import PolicyConfig, SessionView, idle_due
from tierd.types import SessionInfo, SessionKey


class Describe:
    def __init__(self, tiers: dict, roles: TierRoles, policy: PolicyConfig, holders: Holders,
                 sharing: Sharing, recoding: Recoding | None = None) -> None:
        self.tiers = tiers
        self.roles = roles
        self.policy = policy
        self.holders = holders
        self.sharing = sharing
        self.recoding = recoding  # a tier that re-codes sessions in place to make room, if any

    def durable(self, s: Session) -> bool:
        """Durable, and none of its pages in a slab file deleted since it was written."""
        durable = self.roles.durable
        return s.durable and durable is not None and \
            not any(self.tiers[durable].retired(p.offset) for p in s.snap.pieces(durable))

    def tier_bytes(self, s: Session) -> dict[str, int]:
        """Bytes the session holds in each tier that holds any: its content's,
        and in the durable tier, the durable state kept for a store (Session.kept)
        where the content holds none of the same allocations."""
        held = s.snap.tier_bytes()
        if s.kept and self.roles.durable is not None:
            joint = self.joint(s)
            held[self.roles.durable] = held.get(self.roles.durable, 0) + sum(p.alloc_bytes for p in s.kept
                                                                             if p.offset not in joint)
        return held

    def joint(self, s: Session) -> set[int]:
        """Offsets of the durable tier's allocations that both the session's
        content and the state kept for a store hold: one holder, as sharing counts."""
        return {p.offset for p in s.snap.pieces(self.roles.durable)} & {p.offset for p in s.kept} if s.kept else set()

    def shares(self, s: Session) -> dict[str, int]:
        """What policy counts of a snapshot's bytes in each tier that holds
        any: an allocation it shares with other snapshots (prefix pages) split
        evenly among its holders, so that evicting them all frees what the
        sums say. (Stat's tier_bytes counts such an allocation in full: the
        bytes the session reads from; Stats says what sharing saves.)"""
        holders, joint, durable = self.holders.holders, self.joint(s), self.roles.durable
        return {t: sum(p.alloc_bytes // (holders(t, p) - (t == durable and p.offset in joint)) for p in pieces)
                for t, pieces in s.snap.placement.items() if pieces}

    def shared_bytes(self, s: Session) -> int:
        """The snapshot's bytes in pages of which other sessions hold the same
        copy: in an allocation with other holders, and held by another session
        by their token hash."""
        snap = s.snap
        mask = np.zeros(snap.n_pages, dtype=bool)
        joint = self.joint(s)  # (allocations the state kept for a store holds too: not others)
        for t, pieces in snap.placement.items():
            for p in pieces:
                if self.holders.holders(t, p) - (t == self.roles.durable and p.offset in joint) > 1:
                    mask[p.first_page : p.first_page + p.n_pages] = True
        if not mask.any():
            return 0
        mask[self.sharing.shared_depth(s) :] = False
        if not mask.any():
            return 0
        geom = snap.geometry
        return int(mask.sum()) * geom.page_bytes - (geom.page_bytes - geom.last_bytes if mask[-1] else 0)

    def info(self, s: Session) -> SessionInfo:
        snap = s.snap
        coded = coded_copy(self.roles.versions, s.remote_codec, s.remote_stored, s.remote_error) \
            if s.remote_durable and self.roles.versions else {}
        for tier, (codec, stored, error) in local_codes(snap).items():
            coded.setdefault("codecs", {})[tier] = codec
            coded.setdefault("coded_bytes", {})[tier] = stored
            if error:
                coded.setdefault("tier_errors", {})[tier] = error
        return SessionInfo(
            tenant=s.key.tenant, session_id=s.key.session_id, tier=snap.slowest_tier(),
            tier_bytes=self.tier_bytes(s), state=s.state.value,
            num_tokens=snap.num_tokens, size_bytes=snap.nbytes, num_pages=snap.n_pages, durable=self.durable(s),
            last_access=s.last_access, created=s.created, priority=s.priority, pins=s.pins,
            model_id=snap.spec.model_id, fingerprint=snap.spec.fingerprint, spec=snap.spec,
            remote_durable=s.remote_durable, shared_bytes=self.shared_bytes(s), rel_error=snap.rel_error, **coded)

    def view(self, s: Session, busy: set[SessionKey] | frozenset = frozenset()) -> SessionView:
        recodable = (self.recoding.tier,) if self.recoding is not None and self.recoding.may(s) else ()
        return SessionView(s.key, self.shares(s), s.last_access, s.released_at, s.priority, s.pins > 0,
                           s.op.locked() or s.key in busy or s.readers > 0, s.durable, s.awaited, s.retry_at,
                           recodable)


def local_codes(snap: Snapshot) -> dict[str, tuple[str, int, float]]:
    """tier -> (its codec, or codecs joined by "+" where some of its pieces
    are coded and some not: "lossless+none"; the bytes its pages take
    there; the worst relative error of a page of its copy, 0 where exact)
    of each tier holding coded pages."""
    out = {}
    for tier, pieces in snap.placement.items():
        names = {p.codes.codec if p.codes is not None else "none" for p in pieces}
        if names - {"none"}:
            stored = sum(p.codes.stored if p.codes is not None else p.n_pages * snap.spec.page_bytes for p in pieces)
            carried = np.zeros(snap.n_pages, dtype=np.float64)
            carried[: snap.errors.size] = snap.errors
            worst = max((float((p.codes.rel_error + carried[p.first_page : p.first_page + p.n_pages]).max())
                         for p in pieces if p.codes is not None and p.codes.lossy and p.n_pages), default=0.0)
            out[tier] = ("+".join(sorted(names)), stored, worst)
    return out


class IdleChecks:
    """(time, key): when the tick next looks at each released session, so
    that a tick costs what is due, not what is stored."""

    def __init__(self, table: SessionTable, describe: Describe, policy: PolicyConfig, tiers: dict) -> None:
        self.table = table
        self.describe = describe
        self.policy = policy
        self.tiers = tiers
        self._checks: list[tuple[float, SessionKey]] = []

    def schedule(self, session: Session, at: float | None = None) -> None:
        """Have the tick look at a session at `at`, or else when policy says its
        next idle move is due; a check already scheduled earlier stands (it
        reschedules). Called wherever a session becomes released, unpinned or
        promoted: nothing else brings a move due sooner (demotions and
        write-backs only put it off)."""
        with self.table.lock:
            if session.dropped:
                return
            if at is None:
                at = idle_due(self.describe.view(session), self.policy, self.tiers)
            if at is None or (session.idle_check is not None and session.idle_check <= at):
                return
            session.idle_check = at
            heapq.heappush(self._checks, (at, session.key))

    def due(self, now: float) -> list[Session]:
        """The sessions whose scheduled check has come (each is unscheduled)."""
        due = []
        with self.table.lock:
            while self._checks and self._checks[0][0] <= now:
                at, key = heapq.heappop(self._checks)
                session = self.table.find(key)
                if session is not None and session.idle_check == at:  # else rescheduled, or dropped
                    session.idle_check = None
                    due.append(session)
        return due
