"""The store: per-session KV snapshots across tiers, and everything done to them.

The store is built in layers, one module each, every layer a class that
extends the one below it and calls nothing above it:

    checks      argument checks that need no state (ids, blocks, tokens, ttl)
    table       the session table, its locks, what changes wake, SessionInfo
    writes      the one write path: save, put and leased saves all store through it
                (the write itself: a PendingWrite, pending.py)
    reads       restore, get and lookup: pages out, every one checked
    leases      save and restore leases: the engine's pages in segments of their own
    lifecycle   release, pin, drop, prefetch, wait_ready, the mover's jobs
    upkeep      the policy tick, making room, budgets, advice
    inspection  list, stats, the integrity scan and the accounting check
    remote      the remote tier: sessions other nodes stored, found, fetched and published
                (components it holds: the publish queue and its thread, publisher.py; the calls
                on the remote backend and whether it is down, link.py; the sweep, sweeper.py;
                a manifest described, remote_info.py)
    store       Store: assembled, recovered from the index at start, closed

Where the code runs. In the daemon, the API calls the store from its RPC
worker threads (Save, Restore, Get's reads, leases, control calls) and from
the event loop (a Put's chunks go through PendingWrite.write on the loop;
WaitReady polls ready() there, woken by subscribe()); the policy tick runs
on a thread of its own; queued moves (prefetch, demotion, write-back, a
fetch from the remote tier) run on the mover's threads; publishes to the
remote tier run on the publisher thread (publisher.py); the engine's process only reads and writes the lease
segments and its own memory, never the store. Tests and benches call it
directly from any thread.

Lock order. A session's op lock (taken through _acquire/_held, or by a mover
with acquire(blocking=False)) comes before the store lock (`_lock`, an RLock
whose condition `_changed` wakes waiters); the store lock guards the table,
the counters and every session's metadata and is never held across a copy or
an index write; tier allocators and the index lock their own state below it.
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
from tierd.core.store.leases import SPARE_SECONDS
from tierd.core.store.reads import SnapshotReader
from tierd.core.store.store import Store
from tierd.core.store.pending import PendingWrite

__all__ = ["DEFAULT_LEASE_SECONDS", "MAX_LEASE_SECONDS", "MAX_PRIORITY", "SPARE_SECONDS", "PendingWrite",
           "SnapshotReader", "Store", "check_id", "make_key"]
