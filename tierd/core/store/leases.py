"""Leases: the engine copies pages in and out of shared memory of the
lease's own (a segment created for it, or kept from the same tenant's
previous lease), never the daemon's tiers. A save lease holds its pages'
room in the host tier until committed or aborted; a restore lease holds a
checked copy. Leases expire when taken past their time and on the tick; a
tenant's open leases and their bytes are capped. Calls come from RPC
threads; expiry also from the policy thread."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tierd.core import tokens
from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.core.roles import TierRoles
from tierd.core.store.checks import (
    DEFAULT_LEASE_SECONDS,
    check_blocks_range,
    check_identity,
    check_lossy,
    check_opaque_size,
    check_priority,
    check_readable,
    check_start,
    check_token_count,
    check_ttl,
    token_hashes,
)
from tierd.core.store.reads import Reader
from tierd.core.store.segments import LeaseSegments
from tierd.core.store.table import SessionTable
from tierd.core.store.writes import Writer
from tierd.core.store.pending import PendingWrite
from tierd.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    shown,
)
from tierd.layout import KVSpec
from tierd.tiers import shm, tier_rank
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import Geometry
from tierd.types import Lease, SessionInfo, SessionKey, Slot

log = logging.getLogger("tierd.core.store")


@dataclass(eq=False)
class _Lease:
    what = "lease"
    lease_id: str
    key: SessionKey
    expires: float
    segment: shm.Segment  # the lease's pages, and nothing else: the engine maps it by name
    nbytes: int


@dataclass(eq=False)
class _SaveLease(_Lease):
    what = "save"
    write: PendingWrite


@dataclass(eq=False)
class _RestoreLease(_Lease):
    what = "restore"
    source: str
    started: float
    served: int  # bytes of the snapshot it holds (nbytes: its segment's, whole pages)


class Leases:
    def __init__(self, table: SessionTable, writer: Writer, reader: Reader, segments: LeaseSegments,
                 copier: CopyEngine, roles: TierRoles, clock: Clock, events: StoreEvents) -> None:
        self.table = table
        self.writer = writer
        self.reader = reader
        self.segments = segments
        self.copier = copier
        self.roles = roles
        self.clock = clock
        self.events = events
        self._lock = threading.Lock()  # the open leases
        self._leases: dict[str, _Lease] = {}

    def _take_lease(self, tenant: str, lease_id: str, kind: type) -> _Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.key.tenant != tenant or not isinstance(lease, kind):
                raise NotFound(f"no open {kind.what} lease {shown(lease_id)}: it ended, expired or never was",
                               lease_id=lease_id)
            del self._leases[lease_id]
        if lease.expires <= self.clock.now():  # past its time: it ends as it would have on the next tick
            log.warning("a %s lease on %s/%s expired", lease.what, *lease.key)
            self.events.lease_expired(lease.what)
            self._end_lease(lease)
            raise NotFound(f"no open {kind.what} lease {shown(lease_id)}: it ended, expired or never was",
                           lease_id=lease_id)
        return lease

    def _end_lease(self, lease: _Lease) -> None:
        if isinstance(lease, _SaveLease):
            self.writer.abort_write(lease.write)  # nothing, once committed
        self.segments.close_one(lease.key.tenant, lease.segment, lease.nbytes)

    def begin_save(self, key: SessionKey, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Iterable[int] | None = None, priority: int | None = None,
                   ttl: float = DEFAULT_LEASE_SECONDS, salt: str = "", lossy: float | None = None,
                   nbytes: int = 0) -> Lease:
        """A segment of shared memory for pages [start_token // block_tokens,
        pages for num_tokens): the engine writes each page's bytes there, then
        calls commit_save (or abort_save). The pages' room in the host tier is
        taken now; nothing is visible before the commit. Leading pages the
        tenant holds already (same tokens under the same cache salt) are
        taken from there: the lease starts past them (its first_page). For an
        opaque spec, nbytes is the snapshot's size (replaced whole; num_tokens
        the tokens it stands for). `lossy`: as in save."""
        check_priority(priority)
        check_lossy(lossy, spec)
        ttl = check_ttl(ttl)
        if spec.is_opaque:
            first_page = check_start(spec, start_token)
            check_token_count(num_tokens)
            n_pages, last = check_opaque_size(spec, nbytes)
        else:
            if nbytes:
                raise InvalidArgument("size is an opaque snapshot's: a KV lease's follows from its tokens",
                                      field="size")
            first_page = check_blocks_range(spec, start_token, num_tokens)
            n_pages, last = spec.pages_for_tokens(num_tokens), spec.page_bytes
            nbytes = n_pages * spec.page_bytes
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        w = self.writer.begin_write(key, spec, self.roles.landing, first_page, num_tokens, nbytes,
                                    Geometry(spec.page_bytes, n_pages, last), tok, priority, lossy=lossy)
        count = n_pages - w.write_from
        room = max(count * spec.page_bytes, 1)  # (every page held already: a segment the engine never reads)
        try:
            segment = self.segments.open(key.tenant, room)
        except BaseException:
            self.writer.abort_write(w)
            raise
        try:
            segment.clear_from(room)  # past the pages to write, nothing of a kept segment's earlier lease
        except BaseException:
            self.segments.close_one(key.tenant, segment, room)
            self.writer.abort_write(w)
            raise
        lease = _SaveLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, room, w)
        with self._lock:
            self._leases[lease.lease_id] = lease
        slots = [Slot(segment.name, 0, w.write_from, count)] if count else []
        return Lease(lease.lease_id, slots, spec.page_bytes, spec.page_bytes, w.write_from, count, num_tokens, ttl,
                     nbytes - w.write_from * spec.page_bytes)

    def commit_save(self, tenant: str, lease_id: str) -> SessionInfo:
        """Copy the leased pages into the host tier, taking their checksums, and commit them."""
        lease = self._take_lease(tenant, lease_id, _SaveLease)
        w = lease.write
        try:
            try:
                sums = self.copier.from_segment(lease.segment, w.spans, w.geom, w.write_from)
            except OSError as exc:
                raise InvalidArgument(f"the lease's pages could not be read: {exc.strerror or exc}",
                                      lease_id=lease_id) from None
            try:
                return self.writer.commit_write(w, sums, keep=True)
            except (ResourceExhausted, Unavailable):
                # Refused for want of room (the index could not forget the pages this replaces, on a
                # full disk, say): nothing changed, and the lease stays open to commit again or abort.
                with self._lock:
                    self._leases[lease.lease_id] = lease
                lease = None
                raise
        finally:
            if lease is not None:
                self._end_lease(lease)

    def abort_save(self, tenant: str, lease_id: str) -> None:
        self._end_lease(self._take_lease(tenant, lease_id, _SaveLease))

    def begin_restore(self, key: SessionKey, spec: KVSpec | None = None, num_pages: int = 0,
                      ttl: float = DEFAULT_LEASE_SECONDS, token_ids: Iterable[int] | None = None,
                      salt: str = "") -> Lease:
        """Copy the snapshot's first num_pages pages (0: all), checked against
        their checksums, into a segment of shared memory of the lease's own
        (waiting for a move of the session in flight first), and hand it out;
        end_restore gives it back. With token_ids (the request's prompt, under
        its cache salt), pages that hold other tokens are refused: the
        snapshot changed since the lookup (they are never replaced). With
        spec and token_ids, a session that does not exist, or whose pages are
        a prefix of the request's and fewer than other sessions of the tenant
        hold, starts from theirs (lookup() said so)."""
        ttl = check_ttl(ttl)
        request = tokens.check_ids(token_ids) if token_ids is not None else None
        salt = tokens.check_salt(salt)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgument(f"num_pages must be a non-negative integer, got {shown(num_pages)}",
                                  field="num_pages")
        lock, session = self.table.acquire(key)
        try:
            if request is not None and spec is not None and not spec.is_opaque:
                session = self.reader.start_shared(key, lock, session, spec, request, salt, num_pages) or session
            return self._lease_out(key, session, spec, num_pages, ttl, request, salt)
        finally:
            lock.release()

    def _lease_out(self, key: SessionKey, session: Session | None, spec: KVSpec | None, num_pages: int, ttl: float,
                   request: np.ndarray | None, salt: str) -> Lease:
        """begin_restore, the key's lock held."""
        check_readable(key, session, "restored")
        assert session is not None
        if spec is not None:
            check_identity(session, spec)
        snap = session.snap
        n = num_pages or snap.n_pages
        if not 0 < n <= snap.n_pages:
            raise InvalidArgument(f"the snapshot has {snap.n_pages} pages; ask for 1 to {snap.n_pages}, "
                                  f"not {num_pages}", field="num_pages", have=snap.n_pages)
        bt = snap.spec.block_tokens
        if request is not None and \
                tokens.matched_pages(snap.token_hashes[:n], snap.num_tokens, bt, request, salt) < n:
            raise FailedPrecondition(f"the first {n} pages of session {shown(key.session_id)} hold other tokens "
                                     "than the request's: look it up again", field="token_ids")
        started = time.perf_counter()
        spans = [sp for sp in snap.best_spans() if sp.first_page < n]
        source = max((sp.tier for sp in spans), key=tier_rank)
        nbytes = n * snap.spec.page_bytes
        segment = self.segments.open(key.tenant, nbytes)
        held = min(snap.nbytes, nbytes)
        try:
            self.reader.read_out(session, lambda: self.copier.to_segment(spans, snap.geometry, snap.checksums, n,
                                                                   segment))
            segment.clear_from(held)  # past the snapshot's end, nothing (a kept segment held an earlier lease's)
        except BaseException:
            self.segments.close_one(key.tenant, segment, nbytes)
            raise
        with self.table.lock:
            session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
        lease = _RestoreLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, nbytes, source,
                              started, held)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return Lease(lease.lease_id, [Slot(segment.name, 0, 0, n)], snap.spec.page_bytes, snap.spec.page_bytes,
                     0, n, min(snap.num_tokens, n * bt), ttl, held, snap.served_error(n))

    def end_restore(self, tenant: str, lease_id: str) -> None:
        """The engine has read its pages: the segment goes. A lease that
        expired first is NOT_FOUND."""
        lease = self._take_lease(tenant, lease_id, _RestoreLease)
        self._end_lease(lease)
        self.events.restored(lease.source, lease.served, time.perf_counter() - lease.started)

    def expire_leases(self, everything: bool = False) -> int:
        """End leases past their time (or all): their segments go, and the
        host-tier room of uncommitted saves returns; segments kept for a
        next lease go after a while unused (segments.py). Returns how many ended."""
        now = self.clock.now()
        with self._lock:
            gone = [lease for lease in self._leases.values() if everything or lease.expires <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
        self.segments.expire(now, everything)
        for lease in gone:
            if not everything:
                log.warning("a %s lease on %s/%s expired", lease.what, *lease.key)
                self.events.lease_expired(lease.what)
            self._end_lease(lease)
        return len(gone)

    def open_writes(self) -> list[PendingWrite]:
        """The writes of the save leases open now."""
        with self._lock:
            return [lease.write for lease in self._leases.values() if isinstance(lease, _SaveLease)]

    def close(self) -> None:
        """End every lease, and keep no segment for a next one."""
        self.segments.close()
        self.expire_leases(everything=True)
