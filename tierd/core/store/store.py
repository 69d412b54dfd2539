"""Store: the facade the API, the tests and the benches call. Each call that
reads a session resolves its key once (where there is a remote tier, the
finder reads its manifest at most once), then delegates to the component
that does the work; calls with nothing to resolve go straight to theirs.
The components are built and wired by build.py; this class only holds
them. Any thread (see the package docstring)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.rows import Problem
from tierd.core.store.checks import DEFAULT_LEASE_SECONDS, check_bound, check_lossy, check_priority
from tierd.core.store.parts import Parts
from tierd.core.store.pending import PendingWrite
from tierd.core.store.snapshot_reader import SnapshotReader
from tierd.errors import FailedPrecondition, TierdError, Unavailable
from tierd.layout import KVSpec
from tierd.policy import PolicyConfig
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine, EngineMemory
from tierd.types import Lease, LookupResult, RestoreResult, SessionInfo, SessionKey

log = logging.getLogger("tierd.core.store")


class Store:
    def __init__(self, parts: Parts, index: DiskIndex | None, copier: CopyEngine, clock: Clock, policy: PolicyConfig,
                 events: StoreEvents, recovery_problems: list[Problem]) -> None:
        self.tiers, self.roles, self.placement, self.moves = parts.tiers, parts.roles, parts.placement, parts.moves
        self.table, self.saves, self.reader, self.leases = parts.table, parts.saves, parts.reader, parts.leases
        self.lifecycle, self.upkeep, self.inspection = parts.lifecycle, parts.upkeep, parts.inspection
        self.index, self.copier, self.clock, self.policy, self.events = index, copier, clock, policy, events
        self.recovery_problems = recovery_problems
        r = parts.remote
        self.remote = r.remote if r is not None else None
        self.link = r.link if r is not None else None
        self.finder = r.finder if r is not None else None
        self.publisher = r.publisher if r is not None else None
        self.sweeper = r.sweeper if r is not None else None
        self._remote = r
        self._closed = False
        # Calls with nothing to resolve: the component's own.
        self.keys, self.count, self.subscribe = parts.table.keys, parts.table.count, parts.table.subscribe
        self.commit_put, self.abort_write = parts.saves.commit_put, parts.writer.abort_write
        self.commit_save, self.abort_save = parts.leases.commit_save, parts.leases.abort_save
        self.end_restore, self.expire_leases = parts.leases.end_restore, parts.leases.expire_leases
        self.release, self.pin, self.unpin = parts.lifecycle.release, parts.lifecycle.pin, parts.lifecycle.unpin
        self.check_prefetch_target = parts.lifecycle.check_prefetch_target
        self.demote, self.write_back = parts.lifecycle.demote, parts.lifecycle.write_back
        self.pieces, self.drain = parts.lifecycle.pieces, parts.lifecycle.drain
        self.tick, self.set_budget, self.advise = parts.upkeep.tick, parts.upkeep.set_budget, parts.upkeep.advise
        self.policy_view, self.stats = parts.inspection.policy_view, parts.inspection.stats
        self.scan, self.check_accounting = parts.inspection.scan, parts.inspection.check_accounting

    # -- resolving a key once -------------------------------------------------------------

    @property
    def reaches_remote(self) -> bool:
        """Whether calls that read sessions may wait on the remote tier: the
        API runs them on its RPC threads then, never on the event loop."""
        return self._remote is not None

    def one_read(self) -> AbstractContextManager:
        """Within this, on this thread (one API call), each session's remote
        manifest is read once at most."""
        return self._remote.finder.one_read() if self._remote is not None else nullcontext()

    def _stale(self, key: SessionKey, whole: bool = False):
        """The remote manifest where it, not this node's copy, is the session (finder.py)."""
        return self._remote.finder.stale(key, whole) if self._remote is not None else None

    def _bring(self, key: SessionKey, appending: bool = False) -> None:
        if self._remote is not None:
            self._remote.fetcher.bring(key, appending)

    # -- storing ----------------------------------------------------------------------------

    def save(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
             num_tokens: int, start_token: int = 0, tier: str | None = None, priority: int | None = None,
             token_ids: Iterable[int] | None = None, salt: str = "", lossy: float | None = None) -> SessionInfo:
        check_lossy(lossy, spec)  # (before the remote tier is asked)
        if start_token:
            self._bring(key, appending=True)  # an append onto a session another node stored
        return self.saves.save(key, engine, spec, block_ids, num_tokens, start_token, tier, priority, token_ids, salt,
                               lossy)

    def begin_put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int, priority: int | None = None,
                  start_token: int = 0, token_ids: Iterable[int] | None = None, salt: str = "",
                  lossy: float | None = None) -> PendingWrite:
        check_lossy(lossy, spec)
        if start_token:
            self._bring(key, appending=True)
        return self.saves.begin_put(key, spec, num_tokens, nbytes, priority, start_token, token_ids, salt, lossy)

    def put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
            chunks: Iterable[bytes | memoryview | np.ndarray], priority: int | None = None, start_token: int = 0,
            token_ids: Iterable[int] | None = None, salt: str = "", lossy: float | None = None) -> SessionInfo:
        check_lossy(lossy, spec)
        if start_token:
            self._bring(key, appending=True)
        return self.saves.put(key, spec, num_tokens, nbytes, chunks, priority, start_token, token_ids, salt, lossy)

    def begin_save(self, key: SessionKey, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Iterable[int] | None = None, priority: int | None = None,
                   ttl: float = DEFAULT_LEASE_SECONDS, salt: str = "", lossy: float | None = None,
                   nbytes: int = 0) -> Lease:
        check_lossy(lossy, spec)
        if start_token:
            self._bring(key, appending=True)
        return self.leases.begin_save(key, spec, num_tokens, start_token, token_ids, priority, ttl, salt, lossy,
                                      nbytes)

    # -- reading ----------------------------------------------------------------------------

    def restore(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
                token_ids: Iterable[int] | None = None, salt: str = "", whole: bool = False) -> RestoreResult:
        m = self._stale(key)
        if m is not None:
            assert self._remote is not None
            done = self._remote.fetcher.restore(key, m, engine, spec, block_ids, whole)
            if done is not None:
                return done
        return self.reader.restore(key, engine, spec, block_ids, token_ids, salt, whole)

    def get(self, key: SessionKey, chunk_bytes: int = 1 << 20) -> tuple[SessionInfo, SnapshotReader]:
        self._bring(key)
        return self.reader.get(key, chunk_bytes)

    def begin_restore(self, key: SessionKey, spec: KVSpec | None = None, num_pages: int = 0,
                      ttl: float = DEFAULT_LEASE_SECONDS, token_ids: Iterable[int] | None = None,
                      salt: str = "") -> Lease:
        self._bring(key)
        return self.leases.begin_restore(key, spec, num_pages, ttl, token_ids, salt)

    def lookup(self, key: SessionKey, token_ids: Iterable[int], spec: KVSpec | None = None,
               salt: str = "", max_error: float | None = None) -> LookupResult:
        check_bound(max_error)  # before the remote tier is asked
        m = self._stale(key)
        if m is not None:
            assert self._remote is not None
            return self._remote.calls.lookup(key, m, token_ids, spec, salt, max_error)
        return self.reader.lookup(key, token_ids, spec, salt, max_error)

    def own_tokens(self, key: SessionKey) -> int:
        """The tokens the session's current version holds (NotFound without one)."""
        m = self._stale(key)
        return m.num_tokens if m is not None else self.reader.own_tokens(key)

    def prompt_limit(self, key: SessionKey) -> int:
        m = self._stale(key)  # the remote tier's copy too
        return max(self.reader.prompt_limit(key), m.num_tokens if m is not None else 0)

    def stat(self, key: SessionKey) -> SessionInfo:
        try:
            m = self._stale(key, whole=True)  # remote_durable: whether the remote tier holds every chunk of this copy
        except Unavailable:  # what this node holds, not remote-durable while no node can fetch it
            return dataclasses.replace(self.inspection.stat(key), remote_durable=False)
        if m is not None:
            assert self._remote is not None
            return self._remote.calls.stat(key, m)
        return self.inspection.stat(key)

    def list(self, tenant: str | None = None, after: str = "", limit: int = 100) -> tuple[list[SessionInfo], str]:
        """Sessions ordered by (tenant, id), after the page token; returns the
        page and the token of the next page ("" when done). For one tenant,
        those only the remote tier holds too."""
        page, token = self.inspection.list(tenant, after, limit)
        if self._remote is None:
            return page, token
        return self._remote.calls.list(page, token, tenant, after, limit)

    # -- a session's life -------------------------------------------------------------------

    def drop(self, key: SessionKey) -> None:
        """Forget the session everywhere (the remote tier first, remote_calls.py)."""
        if self._remote is not None:
            self._remote.calls.drop(key)
        else:
            self.lifecycle.drop(key)

    def prefetch(self, key: SessionKey, tier: str | None = None, priority: int = 0,
                 deadline: float | None = None) -> str:
        """Start promoting the session toward `tier` (a memory tier; None: the
        landing tier), fetching it first where the remote tier holds its
        current version; "ready" if it is there already, else "queued"."""
        tier = tier or self.roles.landing
        check_priority(priority)
        self.lifecycle.check_prefetch_target(tier)
        m = self._stale(key)
        if m is not None:
            assert self._remote is not None
            return self._remote.fetcher.prefetch(key, tier, priority, deadline)
        return self.lifecycle.prefetch(key, tier, priority, deadline)

    def ready(self, key: SessionKey, tier: str | None = None) -> tuple[bool, str | None]:
        """Whether the whole session is in `tier` (None: the landing tier) or
        faster, and the tier it is in; never waits."""
        if self._remote is not None and self._remote.fetcher.pending(key):
            return False, self.roles.versions
        return self.lifecycle.ready(key, tier)

    def wait_ready(self, key: SessionKey, tier: str | None = None, timeout: float = 30.0) -> tuple[bool, str | None]:
        """Wait until the whole session is in `tier` or faster; returns
        (ready, the tier it is in). (The API waits on its event loop instead,
        through ready() and subscribe().)"""
        end = time.monotonic() + max(0.0, timeout)
        with self.table.changed:
            while True:
                ready, where = self.ready(key, tier)
                left = end - time.monotonic()
                if ready or left <= 0:
                    return ready, where
                self.table.changed.wait(left)

    # -- the remote tier --------------------------------------------------------------------

    def publish(self, key: SessionKey) -> bool:
        """Publish the session to the remote tier now, on this thread, as the
        publisher would; whether the remote tier then holds its content."""
        if self._remote is None:
            raise FailedPrecondition("there is no remote tier: start with --remote")
        return self._remote.calls.publish(key)

    def publish_queue(self) -> tuple[int, int]:
        """Sessions waiting for the publisher, and being published (0 or 1)."""
        return self._remote.queue.counts() if self._remote is not None else (0, 0)

    # -- closing ----------------------------------------------------------------------------

    def close(self, flush: bool = True) -> None:
        """Stop moving; with flush, write every session not yet durable to disk."""
        if self._closed:
            return
        self._closed = True
        if self._remote is not None:
            self._remote.publisher.close(flush)
            self._remote.sweeper.close()
        self.moves.close()
        self.leases.close()
        if flush and self.index is not None:
            for session in self.table.sessions():
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
        if self._remote is not None:
            self._remote.link.close()
