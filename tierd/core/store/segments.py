"""The shared-memory segments of leases: one of its own per lease, created
for it or kept from the same tenant's previous lease (its pages resident),
and each tenant's open leases and their bytes, counted against its limits.
Any thread that opens or ends a lease; the tick expires unused ones."""

from __future__ import annotations

import os
import threading

from tierd.clock import Clock
from tierd.core.roles import TierRoles
from tierd.errors import ResourceExhausted
from tierd.policy import PolicyConfig
from tierd.tiers import shm

SPARE_SECONDS = 30.0  # a segment kept for a tenant's next lease goes after this long unused


class LeaseSegments:
    def __init__(self, tiers: dict, roles: TierRoles, policy: PolicyConfig, clock: Clock,
                 shm_prefix: str | None) -> None:
        self.tiers = tiers
        self.roles = roles
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._lease_use: dict[str, tuple[int, int]] = {}  # tenant -> (open leases, their bytes)
        self._spares: dict[str, list[tuple[shm.Segment, float]]] = {}  # tenant -> segments of ended leases, since
        self._segments = (shm_prefix or shm.new_prefix()) + ".lease"  # names of lease segments

    def open(self, tenant: str, nbytes: int) -> shm.Segment:
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
            self.close_one(tenant, None, nbytes)
            raise ResourceExhausted(f"no shared memory for a lease of {nbytes} bytes: {exc.strerror or exc}",
                                    need=nbytes) from None

    def close_one(self, tenant: str, segment: shm.Segment | None, nbytes: int) -> None:
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

    def expire(self, now: float, everything: bool = False) -> None:
        """Segments kept for a next lease go after SPARE_SECONDS unused (or all)."""
        unused = []
        with self._lock:
            for tenant, spares in list(self._spares.items()):
                unused += [seg for seg, since in spares if everything or now - since > SPARE_SECONDS]
                self._spares[tenant] = [(seg, since) for seg, since in spares
                                        if not everything and now - since <= SPARE_SECONDS]
                if not self._spares[tenant]:
                    del self._spares[tenant]
        for segment in unused:
            segment.close()

    def close(self) -> None:
        """No segment is kept from here on."""
        self._closed = True
