"""Admission by bytes: how much data each tenant has in calls right now.

Runs in the servicer. A data call (Save, Restore, Put, Get) holds its size for
its duration; one that would take its tenant past the cap is refused with
RESOURCE_EXHAUSTED, so one tenant cannot tie up the daemon's copy bandwidth
and staging memory. A call alone is always admitted, whatever its size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tierd.errors import ResourceExhausted, shown


class InflightBytes:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, tenant: str, nbytes: int) -> Iterator[None]:
        with self._lock:
            now = self._held.get(tenant, 0)
            if self.cap and now and now + nbytes > self.cap:
                raise ResourceExhausted(
                    f"tenant {shown(tenant)} has {now} bytes in flight; {nbytes} more would pass the cap of "
                    f"{self.cap}: try again when calls finish", tenant=tenant, cap=self.cap, inflight=now)
            self._held[tenant] = now + nbytes
        try:
            yield
        finally:
            with self._lock:
                left = self._held.get(tenant, 0) - nbytes  # (a call of 0 bytes may end after the entry went)
                if left:
                    self._held[tenant] = left
                else:
                    self._held.pop(tenant, None)

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held.get(tenant, 0)
