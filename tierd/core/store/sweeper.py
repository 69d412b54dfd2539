"""The sweep: each `Remote.sweep` seconds, every remote-durable copy this
node holds is looked at in the remote tier, those no call named since too
(the module docstring of remote.py says what it does with what it finds).
It reaches the sessions and the remote link through the store it serves.
Runs on its own thread (or the caller's, for sweep())."""

from __future__ import annotations

import logging
import threading
from typing import Any

from tierd.errors import Unavailable

log = logging.getLogger("tierd.core.store")

SWEEP_BATCH = 1000  # copies a sweep asks the remote tier about in one round trip


class Sweeper:
    def __init__(self, store: Any, remote: Any) -> None:
        self.store = store  # the remote layer of the store: sessions, locks, the remote link
        self.remote = remote
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierd-remote-sweep", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.remote.sweep):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper outlives any one pass
                log.exception("looking for sessions dropped on other nodes failed")

    def sweep(self) -> int:
        """Look at every remote-durable copy held here, those no call named
        since too: forget those of sessions another node dropped (their
        tombstones are of another version), so their bytes go back and List
        stops showing them well before a tombstone expires; and those whose
        version the remote tier lost (evicted, expired) are remote-durable no
        more, and published again. How many were forgotten."""
        if self.store.link.down.is_set():
            return 0
        with self.store._lock:
            held = [(s, s.remote_version, s.remote_write, s.snap.nbytes)
                    for s in self.store._sessions.values() if s.remote_durable and not s.dropped]
        gone = 0
        for i in range(0, len(held), SWEEP_BATCH):
            batch = held[i : i + SWEEP_BATCH]
            try:
                dropped = self.store.link.call("sweep", self.remote.store.tombstones, [s.key for s, *_ in batch])
                lost = self.store.link.call("sweep", self.remote.store.missing, [(s.key, *rest) for s, *rest in batch])
            except Unavailable:
                return gone
            for (session, version, write, _), at, loss in zip(batch, dropped, lost):
                if self.store._settle(session, version, None, at) == "forgotten":
                    gone += 1
                elif loss:
                    self.store._gone(session, version, write)
        return gone
