"""The store: per-session KV snapshots across tiers, and everything done to them.

The store is a facade (store.py) over components, each a class of one
module that receives its collaborators when it is built (build.py, in
this order):

    checks      argument checks that need no state (ids, blocks, tokens, ttl)
    table       the session table: the one owner of the sessions, their locks, tenant counts, wake-ups
    sharing     prefix sharing: the prefix index (a table observer) and lending pages to stores
    describe    a session's SessionInfo and policy view; the idle checks the tick looks at
    writes      the one write path: begin, commit (listeners hear of it), abort; a write: pending.py
    stores      Save and Put, through the write path
    reads       Restore, Get (its reader: snapshot_reader.py) and Lookup: pages out, every one checked
    leases      save and restore leases, in segments of their own (segments.py)
    lifecycle   release, pin, drop, prefetch, readiness, demotions and write-backs on request
    jobs        the mover's jobs: prefetch, demotion, write-back, drop, fetch
    upkeep      the policy tick, making room, budgets, advice
    inspection  Stat, List, Stats, the integrity scan and the accounting check
    remote      the remote tier's settings, the keys being dropped, fetched or published, the
                publish queue; its components: finder.py (a call's one manifest read, and what
                it makes of this node's copy), fetcher.py, remote_calls.py (answers from the
                remote tier, Drop), publisher.py, sweeper.py, link.py (the backend's calls and
                whether it is down), remote_info.py (a manifest described)
    store       Store: each call resolves its key once, then delegates
    build       the wiring, and the sessions of the disk index recovered at start

Where the code runs. In the daemon, the API calls the store from its RPC
worker threads (Save, Restore, Get's reads, leases, control calls) and from
the event loop (a Put's chunks go through PendingWrite.write on the loop;
WaitReady polls ready() there, woken by subscribe()); the policy tick runs
on a thread of its own; queued moves (prefetch, demotion, write-back, a
fetch from the remote tier) run on the mover's threads; publishes to the
remote tier run on the publisher thread (publisher.py); the engine's
process only reads and writes the lease segments and its own memory,
never the store. Tests and benches call it
directly from any thread.

Lock order. A session's op lock (taken through SessionTable.acquire/held,
or by a mover with acquire(blocking=False)) comes before the store lock
(`SessionTable.lock`, an RLock whose condition `changed` wakes waiters);
the store lock guards the table, the counters and every session's metadata
and is never held across a copy or an index write; the leases' and the
publish queue's locks are taken alone; tier allocators and the index lock
their own state below it.
A Get holds no lock while it streams: its pages stay allocated until its
reader closes (Placement.end_read).
"""

from tierd.core.store.checks import (
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MAX_PRIORITY,
    check_id,
    make_key,
)
from tierd.core.store.build import build
from tierd.core.store.pending import PendingWrite
from tierd.core.store.segments import SPARE_SECONDS
from tierd.core.store.snapshot_reader import SnapshotReader
from tierd.core.store.store import Store

__all__ = ["DEFAULT_LEASE_SECONDS", "MAX_LEASE_SECONDS", "MAX_PRIORITY", "SPARE_SECONDS", "PendingWrite",
           "SnapshotReader", "Store", "build", "check_id", "make_key"]
