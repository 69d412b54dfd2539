"""Per-tenant limits on what a tenant's calls may hold at once: RPC threads
and open Put/Get streams.

Runs on the daemon's event loop. A call that needs an RPC thread waits for
one of its tenant's slots on the loop, holding nothing, so one tenant's
calls can never take every thread; a stream past the tenant's cap is
refused with RESOURCE_EXHAUSTED. (Bytes in flight, leases and stored bytes
have limits of their own: api/inflight.py, the store's policy.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from tierd.errors import ResourceExhausted


class TenantLimits:
    def __init__(self, workers: int, streams: int) -> None:
        if workers < 1 or streams < 0:
            raise ValueError("a tenant needs at least one worker; streams must not be negative")
        self.workers = workers
        self.streams = streams  # 0: no cap
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}  # calls holding or waiting for each tenant's semaphore
        self._open: dict[str, int] = {}

    @asynccontextmanager
    async def worker(self, tenant: str) -> AsyncIterator[None]:
        """One of the tenant's RPC-thread slots, waited for on the loop."""
        sem = self._slots.get(tenant)
        if sem is None:
            sem = self._slots[tenant] = asyncio.Semaphore(self.workers)
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1
        try:
            async with sem:
                yield
        finally:
            left = self._waiting[tenant] - 1
            if left:
                self._waiting[tenant] = left
            else:  # nobody holds or waits: forget the tenant
                del self._waiting[tenant]
                del self._slots[tenant]

    @contextmanager
    def stream(self, tenant: str) -> Iterator[None]:
        """An open Put or Get stream of the tenant."""
        n = self._open.get(tenant, 0)
        if self.streams and n >= self.streams:
            raise ResourceExhausted(f"tenant {tenant!r} has {n} Put and Get streams open, its limit: try again "
                                    "when one ends", tenant=tenant, limit=self.streams)
        self._open[tenant] = n + 1
        try:
            yield
        finally:
            left = self._open[tenant] - 1
            if left:
                self._open[tenant] = left
            else:
                del self._open[tenant]

    def open_streams(self, tenant: str) -> int:
        return self._open.get(tenant, 0)
