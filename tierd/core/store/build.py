"""The one place where the store's components are built and wired, in the
order they depend on each other, each handed its collaborators; nothing is
assigned onto a component after it is built. Two calls go back up the
order, and are late-bound here (a call through a name of this function,
not an attribute set afterwards): placement makes room through upkeep,
which moves sessions through placement; the mover runs jobs, which queue
more through the mover. The sessions of the disk index are recovered into
the table before any of the store's threads starts. Runs once, on
the thread that builds the daemon (machine.py)."""

from __future__ import annotations

import threading

import numpy as np

from tierd.clock import Clock, SystemClock
from tierd.core import recovery
from tierd.core.events import NullEvents, StoreEvents
from tierd.core.faults import Faults
from tierd.core.holders import Holders
from tierd.core.index import DiskIndex
from tierd.core.model import UNKNOWN, Session, Snapshot
from tierd.core.move_queue import MoveQueue
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.rows import Problem
from tierd.core.store.coding import PageCoder
from tierd.core.store.describe import Describe, IdleChecks
from tierd.core.store.fetcher import Fetcher
from tierd.core.store.finder import Finder
from tierd.core.store.inspection import Inspection
from tierd.core.store.jobs import Jobs
from tierd.core.store.leases import Leases
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.link import RemoteLink
from tierd.core.store.publisher import Publisher
from tierd.core.store.reads import Reader
from tierd.core.store.recode import Recoder
from tierd.core.store.recoding import Recoding
from tierd.core.store.remote import Committed, PublishQueue, Remote, RemoteBusy
from tierd.core.store.remote_calls import RemoteCalls
from tierd.core.store.segments import LeaseSegments
from tierd.core.store.sharing import Sharing
from tierd.core.store.parts import Parts, RemoteParts
from tierd.core.store.store import Store
from tierd.core.store.stores import Saves
from tierd.core.store.sweeper import Sweeper
from tierd.core.store.table import SessionTable
from tierd.core.store.upkeep import Upkeep
from tierd.core.store.writes import Writer
from tierd.policy import PolicyConfig
from tierd.tiers import Tier, durable_tier
from tierd.transfer.copier import CopyEngine


def build(tiers: dict, copier: CopyEngine, index: DiskIndex | None = None, *, clock: Clock | None = None,
          policy: PolicyConfig | None = None, events: StoreEvents | None = None, movers: int = 2,
          shm_prefix: str | None = None, remote: Remote | None = None, recoding: Recoding | None = None) -> Store:
    """The store over these tiers (a durable one comes with its index), its
    sessions recovered from the index, and its threads started."""
    if (index is None) != (durable_tier(tiers) is None):
        raise ValueError("a durable (disk) tier and its index come together")
    roles = TierRoles.of(tiers)  # ValueError without a landing tier
    clock, policy, events = clock or SystemClock(), policy or PolicyConfig(), events or NullEvents()
    lock = threading.RLock()  # the store lock (see the package docstring for the order)
    sharing = Sharing(lock, tiers)
    holders = sharing.holders
    table = SessionTable(lock, observers=[sharing])
    describe = Describe(tiers, roles, policy, holders, sharing, recoding)
    idle = IdleChecks(table, describe, policy, tiers)
    faults = Faults(events, lock, roles.durable, sharing.damage_holders)
    placement = Placement(tiers, copier, index, events, lock, holders, faults, sharing.lending,
                          lambda *room: upkeep.make_room(*room), policy.quota)
    # Recovered before any thread starts (the mover's, the publisher's, the sweep's): a start that fails here
    # leaves nothing running.
    problems = recover(table, holders, idle, index, tiers[roles.durable], roles.durable, events, clock,
                       remote is not None) if index is not None and roles.durable is not None else []
    moves = MoveQueue(lambda job: jobs.run(job), movers)
    link = queue = busy = None
    committed = []
    if remote is not None:
        queue = PublishQueue(remote, events)
        link = RemoteLink(remote.store, events, queue.wake)
        busy = RemoteBusy(table.changed)
        committed.append(Committed(lock, queue, remote))
        if remote.write == "through":  # recovered histories of this node's own, published as its stores are
            for session in table.sessions(lambda s: s.own_row and s.own_expect is None):
                queue.add(session.key)
    writer = Writer(table, sharing, placement, describe, index, roles, policy, clock, events, committed)
    saves = Saves(writer, copier, tiers, roles)
    reader = Reader(table, sharing, writer, placement, describe, copier, roles, clock, events)
    segments = LeaseSegments(tiers, roles, policy, clock, shm_prefix)
    leases = Leases(table, writer, reader, segments, copier, roles, clock, events)
    lifecycle = Lifecycle(table, placement, describe, idle, moves, tiers, roles, clock, events)
    recoder = Recoder(recoding, table, placement, copier, tiers, events) if recoding is not None else None
    upkeep = Upkeep(table, describe, idle, lifecycle, leases, moves, copier, tiers, roles, policy, clock, recoder)
    inspection = Inspection(table, describe, placement, leases, moves, index, copier, tiers, roles)
    parts = None
    fetcher = None
    if remote is not None:
        assert link is not None and queue is not None and busy is not None
        coder = PageCoder(remote.codec, roles.versions, events, remote.lossy_tenants, remote.lossy_max_error)
        finder = Finder(table, lifecycle, link, remote, queue, roles)
        fetcher = Fetcher(table, finder, writer, reader, lifecycle, idle, moves, busy, link, remote, copier, coder,
                          roles, clock, events)
        publisher = Publisher(queue, table, finder, busy, placement, link, remote, copier, coder, roles, clock,
                              events)
        sweeper = Sweeper(table, finder, link, remote)
        calls = RemoteCalls(table, lifecycle, fetcher, publisher, queue, busy, link, remote, roles)
        parts = RemoteParts(remote, link, queue, finder, fetcher, publisher, sweeper, calls)
    jobs = Jobs(table, lifecycle, placement, fetcher, clock, events, recoder)
    return Store(Parts(tiers, roles, table, sharing, describe, placement, writer, saves, reader, leases, lifecycle,
                       upkeep, inspection, moves, parts), index, copier, clock, policy, events, problems)


def recover(table: SessionTable, holders: Holders, idle: IdleChecks, index: DiskIndex, disk: Tier, durable: str,
            events: StoreEvents, clock: Clock, with_remote: bool) -> list[Problem]:
    """The sessions the index holds, into the table; with a remote tier
    (with_remote), each is asked about there before it is served (another node
    may have dropped it, or stored a newer turn, while this one was down)."""
    kept, problems, records = recovery.recover(index, disk, events)
    own = index.own() if with_remote else {}  # histories of this node's own, and over what a publish was tried
    now = clock.now()
    held: set[int] = set()
    for rec in kept:
        holders.hold(durable, [p for p in rec.pieces if p.offset in held])  # shared prefix pages
        held.update(p.offset for p in rec.pieces)
        snap = Snapshot(rec.row.spec, rec.row.num_tokens, rec.row.nbytes, rec.checksums, {durable: rec.pieces},
                        token_hashes=rec.token_hashes)
        snap.set_errors(0, np.frombuffer(rec.row.errors, dtype="<f4").copy() if rec.row.errors else None)
        session = Session(rec.key, snap, rec.row.created, rec.row.last_access, released_at=now,
                          priority=rec.row.priority, lossy=rec.row.lossy, row=rec.row, row_version=snap.version,
                          record=records.get(rec.key), own_row=rec.key in own, own_expect=own.get(rec.key))
        if with_remote and (rec.key not in own or session.own_expect is not None):
            session.remote_version = UNKNOWN  # asked about there first (finder.stale)
        elif rec.key in own:
            session.remote_fresh = snap.version  # served, and published as a new history
        table.add(session)
        idle.schedule(session)
    return problems
