"""Per-tenant limits on what a tenant's calls may hold at once: open calls,
RPC threads and open Put/Get streams.

Runs on the daemon's event loop. A call past its tenant's open calls is
refused with RESOURCE_EXHAUSTED as it starts, so one tenant never holds every
call gRPC admits (--max-concurrent-rpcs); a call that needs an RPC thread
waits for one of its tenant's slots on the loop, holding nothing, so one
tenant's calls can never take every thread (a slot stays taken until its
thread's job is done, even when the call is cancelled first); a stream past
the tenant's cap is refused. (Bytes in flight, leases and stored bytes have limits of their
own: api/inflight.py, the store's policy.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any

from tierd.errors import ResourceExhausted


class TenantLimits:
    def __init__(self, workers: int, streams: int, calls: int = 0) -> None:
        if workers < 1 or streams < 0 or calls < 0:
            raise ValueError("a tenant needs at least one worker; limits must not be negative")
        self.workers = workers
        self.streams = streams  # 0: no cap
        self.calls = calls  # 0: no cap
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}  # calls holding or waiting for each tenant's semaphore
        self._open: dict[str, int] = {}
        self._calls: dict[str, int] = {}

    async def submit(self, tenant: str, executor: Executor, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on an RPC thread once one of the tenant's slots is free
        (waited for on the loop). The slot is given back when the job is done,
        not when its call ends: a call cancelled while its thread works (a Get
        whose client left, say) must not let the tenant start another."""
        sem = self._slots.get(tenant)
        if sem is None:
            sem = self._slots[tenant] = asyncio.Semaphore(self.workers)
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1
        try:
            await sem.acquire()
        except BaseException:
            self._leave(tenant, sem, held=False)
            raise
        try:
            job = executor.submit(fn, *args)
        except BaseException:
            self._leave(tenant, sem, held=True)
            raise
        loop = asyncio.get_running_loop()

        def done(_: Future) -> None:
            try:
                loop.call_soon_threadsafe(self._leave, tenant, sem, True)
            except RuntimeError:
                pass  # the loop is closed: the daemon is stopping, nothing waits for the slot

        job.add_done_callback(done)
        return job

    def _leave(self, tenant: str, sem: asyncio.Semaphore, held: bool) -> None:
        if held:
            sem.release()
        left = self._waiting[tenant] - 1
        if left:
            self._waiting[tenant] = left
        else:  # nobody holds or waits: forget the tenant
            del self._waiting[tenant]
            del self._slots[tenant]

    @contextmanager
    def stream(self, tenant: str) -> Iterator[None]:
        """An open Put or Get stream of the tenant."""
        with _counted(self._open, tenant, self.streams, "Put and Get streams"):
            yield

    @contextmanager
    def call(self, tenant: str) -> Iterator[None]:
        """An open call of the tenant, of any method."""
        with _counted(self._calls, tenant, self.calls, "calls"):
            yield


@contextmanager
def _counted(counts: dict[str, int], tenant: str, limit: int, what: str) -> Iterator[None]:
    n = counts.get(tenant, 0)
    if limit and n >= limit:
        raise ResourceExhausted(f"tenant {tenant!r} has {n} {what} open, its limit: try again when one ends",
                                tenant=tenant, limit=limit)
    counts[tenant] = n + 1
    try:
        yield
    finally:
        left = counts[tenant] - 1
        if left:
            counts[tenant] = left
        else:
            del counts[tenant]
