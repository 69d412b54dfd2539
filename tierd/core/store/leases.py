"""Leases: the engine copies pages in and out of shared memory of the
lease's own (a segment created for it, or kept from the same tenant's
previous lease), never the daemon's tiers. A save lease holds its pages'
room in the host tier until committed or aborted; a restore lease holds a
checked copy. Leases expire when taken past their time and on the tick; a
tenant's open leases and their bytes are capped. Calls come from RPC
threads; expiry also from the policy thread."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tierd.core import tokens
from tierd.core.model import Session
from tierd.core.store.checks import (
    DEFAULT_LEASE_SECONDS,
    check_blocks_range,
    check_identity,
    check_priority,
    check_readable,
    check_ttl,
    token_hashes,
)
from tierd.core.store.reads import Reads
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
from tierd.transfer.runs import Geometry
from tierd.types import Lease, SessionInfo, SessionKey, Slot

log = logging.getLogger("tierd.core.store")
SPARE_SECONDS = 30.0  # a segment kept for a tenant's next lease goes after this long unused


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


class Leases(Reads):
    def __init__(self, tiers: dict, copier, index, clock, policy, events, shm_prefix: str | None) -> None:
        super().__init__(tiers, copier, index, clock, policy, events)
        self._leases: dict[str, _Lease] = {}
        self._lease_use: dict[str, tuple[int, int]] = {}  # tenant -> (open leases, their bytes)
        self._spares: dict[str, list[tuple[shm.Segment, float]]] = {}  # tenant -> segments of ended leases, since
        self._segments = (shm_prefix or shm.new_prefix()) + ".lease"  # names of lease segments

    def _open_lease(self, tenant: str, nbytes: int) -> shm.Segment:
        """Count a new lease against its tenant's limits and create its segment."""
        count_limit, bytes_limit = self.policy.tenant_leases, self.policy.tenant_lease_bytes
        with self._lock:
            count, held = self._lease_use.get(tenant, (0, 0))
            if count_limit and count >= count_limit:
                raise ResourceExhausted(f"tenant {tenant!r} may hold {count_limit} leases open; end some first",
                                        tenant=tenant, quota=count_limit)
            if bytes_limit and held + nbytes > bytes_limit:
                raise ResourceExhausted(f"tenant {tenant!r} may hold {bytes_limit} bytes in open leases; it holds "
                                        f"{held} and this needs {nbytes} more", tenant=tenant, quota=bytes_limit)
            self._lease_use[tenant] = (count + 1, held + nbytes)
        with self._lock:
            spares = self._spares.get(tenant, [])
            fit = next((i for i, (seg, _) in enumerate(spares) if nbytes <= seg.size <= 2 * nbytes), None)
            spare = spares.pop(fit)[0] if fit is not None else None
        if spare is not None:
            st = os.fstat(spare.fd)
            if st.st_size == spare.size and st.st_nlink:
                return spare
            spare.close()  # its engine cut it short or removed it: a new one
        try:
            return shm.Segment(self._segments, nbytes)
        except OSError as exc:
            self._close_lease(tenant, None, nbytes)
            raise ResourceExhausted(f"no shared memory for a lease of {nbytes} bytes: {exc.strerror or exc}",
                                    need=nbytes) from None

    def _close_lease(self, tenant: str, segment: shm.Segment | None, nbytes: int) -> None:
        """A lease's end: its segment is kept for the tenant's next lease (its
        pages resident: a fresh segment cost ~0.6 ms per MiB in page faults),
        up to the tenant's lease bytes, or goes."""
        keep = self.policy.tenant_lease_bytes or self.tiers[self.roles.landing].budget // 4
        with self._lock:
            spares = self._spares.setdefault(tenant, [])
            if segment is not None and not self._closed and sum(seg.size for seg, _ in spares) + segment.size <= keep:
                spares.append((segment, self.clock.now()))
                segment = None
        if segment is not None:
            segment.close()
        with self._lock:
            count, held = self._lease_use[tenant]
            if count > 1:
                self._lease_use[tenant] = (count - 1, held - nbytes)
            else:
                del self._lease_use[tenant]

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
            self.abort_write(lease.write)  # nothing, once committed
        self._close_lease(lease.key.tenant, lease.segment, lease.nbytes)

    def begin_save(self, key: SessionKey, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Iterable[int] | None = None, priority: int | None = None,
                   ttl: float = DEFAULT_LEASE_SECONDS, salt: str = "") -> Lease:
        """A segment of shared memory for pages [start_token // block_tokens,
        pages for num_tokens): the engine writes each page's bytes there, then
        calls commit_save (or abort_save). The pages' room in the host tier is
        taken now; nothing is visible before the commit. Leading pages the
        tenant holds already (same tokens under the same cache salt) are
        taken from there: the lease starts past them (its first_page)."""
        check_priority(priority)
        ttl = check_ttl(ttl)
        first_page = check_blocks_range(spec, start_token, num_tokens)
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        n_pages = spec.pages_for_tokens(num_tokens)
        w = self._begin_write(key, spec, self.roles.landing, first_page, num_tokens, n_pages * spec.page_bytes,
                              Geometry(spec.page_bytes, n_pages, spec.page_bytes), tok, priority)
        count = n_pages - w.write_from
        nbytes = max(count * spec.page_bytes, 1)  # (every page held already: a segment the engine never reads)
        try:
            segment = self._open_lease(key.tenant, nbytes)
        except BaseException:
            self.abort_write(w)
            raise
        lease = _SaveLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, nbytes, w)
        with self._lock:
            self._leases[lease.lease_id] = lease
        slots = [Slot(segment.name, 0, w.write_from, count)] if count else []
        return Lease(lease.lease_id, slots, spec.page_bytes, spec.page_bytes, w.write_from, count, num_tokens, ttl)

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
                return self._commit_write(w, sums, keep=True)
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
        lock, session = self._acquire(key)
        try:
            if request is not None and spec is not None and not spec.is_opaque:
                session = self._start_shared(key, lock, session, spec, request, salt, num_pages) or session
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
        segment = self._open_lease(key.tenant, nbytes)
        try:
            self._read_out(session, lambda: self.copier.to_segment(spans, snap.geometry, snap.checksums, n,
                                                                   segment))
        except BaseException:
            self._close_lease(key.tenant, segment, nbytes)
            raise
        with self._lock:
            session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
        lease = _RestoreLease(secrets.token_hex(16), key, self.clock.now() + ttl, segment, nbytes, source,
                              started)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return Lease(lease.lease_id, [Slot(segment.name, 0, 0, n)], snap.spec.page_bytes, snap.spec.page_bytes,
                     0, n, min(snap.num_tokens, n * bt), ttl)

    def end_restore(self, tenant: str, lease_id: str) -> None:
        """The engine has read its pages: the segment goes. A lease that
        expired first is NOT_FOUND."""
        lease = self._take_lease(tenant, lease_id, _RestoreLease)
        self._end_lease(lease)
        self.events.restored(lease.source, lease.nbytes, time.perf_counter() - lease.started)

    def expire_leases(self, everything: bool = False) -> int:
        """End leases past their time (or all): their segments go, and the
        host-tier room of uncommitted saves returns; segments kept for a
        next lease go after SPARE_SECONDS unused. Returns how many ended."""
        now = self.clock.now()
        with self._lock:
            gone = [lease for lease in self._leases.values() if everything or lease.expires <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
            unused = []
            for tenant, spares in list(self._spares.items()):
                unused += [seg for seg, since in spares if everything or now - since > SPARE_SECONDS]
                self._spares[tenant] = [(seg, since) for seg, since in spares
                                        if not everything and now - since <= SPARE_SECONDS]
                if not self._spares[tenant]:
                    del self._spares[tenant]
        for segment in unused:
            segment.close()
        for lease in gone:
            if not everything:
                log.warning("a %s lease on %s/%s expired", lease.what, *lease.key)
                self.events.lease_expired(lease.what)
            self._end_lease(lease)
        return len(gone)
