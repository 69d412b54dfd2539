"""The sweep: each `Remote.sweep` seconds, every remote-durable copy this
node holds is looked at in the remote tier, those no call named since too
(the module docstring of remote.py says what it does with what it finds);
and each ACK_SECONDS, the copies this node published that the tier took
but held less durably than it promises (no replica had acknowledged them)
are asked about again. Runs on its own thread (or the caller's, for sweep()
and acknowledged())."""

from __future__ import annotations

import logging
import threading
import time

from tierd.core.store.finder import Finder
from tierd.core.store.link import RemoteLink
from tierd.core.store.remote import Remote
from tierd.core.store.table import SessionTable
from tierd.errors import Unavailable

log = logging.getLogger("tierd.core.store")

SWEEP_BATCH = 1000  # copies a sweep asks the remote tier about in one round trip
ACK_SECONDS = 1.0  # between asks whether copies the remote tier took are replicated now


class Sweeper:
    def __init__(self, table: SessionTable, finder: Finder, link: RemoteLink, remote: Remote) -> None:
        self.table = table
        self.finder = finder
        self.link = link
        self.remote = remote
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierd-remote-sweep", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        swept = time.monotonic()
        while not self._stop.wait(min(ACK_SECONDS, self.remote.sweep)):
            try:
                self.acknowledged()
                if time.monotonic() - swept >= self.remote.sweep:
                    swept = time.monotonic()
                    self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper outlives any one pass
                log.exception("looking for sessions dropped on other nodes failed")

    def acknowledged(self) -> int:
        """Ask the remote tier whether the copies it took from this node but
        did not yet hold as durably as it promises (no replica acknowledged
        them) are so now: those are remote-durable from then on. How many."""
        with self.table.lock:
            waiting = [(s, s.remote_unacked) for s in self.table.sessions(
                lambda s: s.remote_unacked >= 0 and not s.dropped)]
        if not waiting or self.link.down.is_set():
            return 0
        try:
            ok = self.link.call("replication", self.remote.store.replicated, [s.key for s, _ in waiting])
        except Unavailable:
            return 0
        done = 0
        with self.table.lock:
            for (session, version), yes in zip(waiting, ok):
                if yes and session.remote_unacked == version and session.remote_acked(version):
                    done += 1
        return done

    def sweep(self) -> int:
        """Look at every remote-durable copy held here, those no call named
        since too: forget those of sessions another node dropped (their
        tombstones are of another version), so their bytes go back and List
        stops showing them well before a tombstone expires; and those whose
        version the remote tier lost (evicted, expired) are remote-durable no
        more, and published again. How many were forgotten."""
        if self.link.down.is_set():
            return 0
        with self.table.lock:
            held = [(s, s.remote_version, s.remote_write, s.remote_stored)
                    for s in self.table.sessions(lambda s: s.remote_durable and not s.dropped)]
        gone = 0
        for i in range(0, len(held), SWEEP_BATCH):
            batch = held[i : i + SWEEP_BATCH]
            try:
                dropped = self.link.call("sweep", self.remote.store.tombstones, [s.key for s, *_ in batch])
                lost = self.link.call("sweep", self.remote.store.missing, [(s.key, *rest) for s, *rest in batch])
            except Unavailable:
                return gone
            for (session, version, write, _), at, loss in zip(batch, dropped, lost):
                if self.finder.settle(session, version, None, at) == "forgotten":
                    gone += 1
                elif loss:
                    self.finder.gone(session, version, write)
        return gone
