"""Store: the layers assembled (see the package docstring), the sessions of
the disk index recovered at start, and the shutdown that flushes what is
not yet durable."""

from __future__ import annotations

import logging

from tierd.clock import Clock
from tierd.core import recovery
from tierd.core.events import StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.model import UNKNOWN, Session, Snapshot
from tierd.core.move_queue import MoveQueue
from tierd.core.placement import Lending, Placement
from tierd.core.rows import Problem
from tierd.core.store.remote import Remote, RemoteLayer
from tierd.errors import TierdError
from tierd.policy import PolicyConfig
from tierd.tiers import durable_tier
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine

log = logging.getLogger("tierd.core.store")


class Store(RemoteLayer):
    def __init__(self, tiers: dict, copier: CopyEngine, index: DiskIndex | None = None, *,
                 clock: Clock | None = None, policy: PolicyConfig | None = None,
                 events: StoreEvents | None = None, movers: int = 2, shm_prefix: str | None = None,
                 remote: Remote | None = None) -> None:
        if (index is None) != (durable_tier(tiers) is None):
            raise ValueError("a durable (disk) tier and its index come together")
        super().__init__(tiers, copier, index, clock, policy, events, shm_prefix)
        self.placement = Placement(tiers, copier, index, self.events, self._changed,
                                   Lending(self._borrow, self._shared_ranges, self._damage_holders),
                                   self._make_room, self.policy.quota)
        self.recovery_problems = self._recover(remote is not None) if index is not None else []
        self.moves = MoveQueue(self._run_job, movers)
        self._start_remote(remote)

    def _recover(self, shared: bool) -> list[Problem]:
        """The sessions the index holds; with a remote tier (shared), each is
        checked against it before it is served (another node may have
        dropped it, or stored a newer turn, while this one was down)."""
        assert self.index is not None
        durable = self.placement.durable
        kept, problems = recovery.recover(self.index, self.tiers[durable], self.events)
        now = self.clock.now()
        held: set[int] = set()
        for rec in kept:
            self.placement.held.hold(durable, [p for p in rec.pieces if p.offset in held])  # shared prefix pages
            held.update(p.offset for p in rec.pieces)
            snap = Snapshot(rec.row.spec, rec.row.num_tokens, rec.row.nbytes, rec.checksums, {durable: rec.pieces},
                            token_hashes=rec.token_hashes)
            session = Session(rec.key, snap, rec.row.created, rec.row.last_access, released_at=now,
                              priority=rec.row.priority, row=rec.row, row_version=snap.version,
                              remote_version=UNKNOWN if shared else 0)
            self._sessions[rec.key] = session
            self._key_locks[rec.key] = session.op
            self._per_tenant[rec.key.tenant] = self._per_tenant.get(rec.key.tenant, 0) + 1
            self._share(session, None)
            self._schedule(session)
        return problems

    def close(self, flush: bool = True) -> None:
        """Stop moving; with flush, write every session not yet durable to disk."""
        if self._closed:
            return
        self._closed = True
        self._stop_publisher(flush)
        self.moves.close()
        self.expire_leases(everything=True)
        if flush and self.index is not None:
            for session in list(self._sessions.values()):
                with session.op:
                    if session.dropped or session.durable or session.damaged:
                        continue
                    try:
                        # The memory tiers are emptied for good: their sessions leave them as evictions do.
                        self.placement.write_durable(session, IOClass.WRITEBACK, "shutdown", True)
                    except (TierdError, OSError) as exc:
                        log.warning("shutdown: %s/%s not flushed: %s", *session.key, exc)
        for tier in self.tiers.values():
            tier.close()
        if self.index is not None:
            self.index.close()
        self._close_remote()
