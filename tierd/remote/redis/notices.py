"""Change notices: which version each session's manifest key holds, known
here without asking the store, so that a read of a copy nothing changed
costs no round trip.

Every manifest switch (CAS) and drop (DROP) publishes a notice from inside
its script, on the primary that holds the key, before its write: `NAME
VERSION WRITE` on the channel PREFIX:n (WRITE `-` for a tombstone); where
the store's ACL refuses it, the write goes on without (scripts.py). This
node subscribes on every primary, each over a connection of its own watched
by a thread that also sends a PING every HEARTBEAT seconds: a PONG says
that every notice the primary sent before it has arrived. (Redis Cluster
also passes a publish on to its other nodes over the cluster bus; only the
primary's own delivery is watched.) What a read (head), a publish or a drop here found at a key is
remembered, unless a notice of another version at that key arrived while
it ran; a notice of another version forgets it.

What is remembered is trusted (current()) only while notices are live:
every primary subscribed, each PONG back within LEASE seconds of its PING,
and the primaries read again within LEASE seconds and the same; and for
`recheck` seconds after it was read at most (a node of a fleet that sends no
notices, an older tierd, is caught up with that late). A connection lost,
a heartbeat unanswered, a primary more or fewer (a fail-over, a node
added): everything remembered is forgotten, and reads ask the store until
the subscriptions are back. So a version published on another node is
taken for current here at most LEASE seconds after it was published
(typically a round trip), and one this node missed a notice of never is.

Runs: one thread per primary (tierd-remote-notice) on its subscription, one
(tierd-remote-notices) that reads the primaries and restarts the
subscriptions; current() and watching() on the caller's thread. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tierd.errors import Unavailable
from tierd.remote.redis.link import Link

log = logging.getLogger("tierd.remote.redis")

LEASE = 1.0  # seconds a primary's last answered heartbeat vouches for its notices
HEARTBEAT = LEASE / 4  # seconds between heartbeats on each subscription, and between reads of the primaries
KNOWN = 1 << 14  # keys whose version is remembered, the latest read kept (about 350 bytes each)


@dataclass(eq=False)
class Seen:
    """A read, publish or drop at one key in progress: what it found (found,
    set by the caller once it succeeded), and the notices heard meanwhile."""

    epoch: int
    began: float  # (what it found is as old as this)
    found: tuple[int, str] | None = None
    heard: list[tuple[int, str]] = field(default_factory=list)


class _Round:
    """One set of subscriptions, one per primary: the times the PING whose
    PONG came back last was sent, by primary."""

    def __init__(self, primaries: list[tuple[str, int]]) -> None:
        self.primaries = primaries
        self.confirmed: dict[tuple[str, int], float] = {}
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []


class Notices:
    def __init__(self, link: Link, recheck: float) -> None:
        self.link = link
        self.recheck = recheck
        self.channel = f"{link.prefix}:n"
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[int, str, float]] = OrderedDict()  # key: (version, write, read at)
        self._reading: dict[str, list[Seen]] = {}
        self._epoch = 0  # one more at every lapse: a read begun before it remembers nothing
        self._round: _Round | None = None
        self._topology_at = float("-inf")  # when the primaries were last read (and found the same)
        self._live_said: bool | None = None  # what the log said last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what callers ask -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierd-remote-notices", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            r = self._round
        if r is not None:
            r.stopped.set()
            for t in r.threads:  # each ends within a wait for a message
                t.join(timeout=5)

    def current(self, name: str) -> tuple[int, str] | None:
        """(version, write id: '' for a tombstone or nothing) at key `name`, as
        the notices keep it; None where that is not known now."""
        now = time.monotonic()
        with self._lock:
            entry = self._known.get(name)
            if entry is None or not self._live(now):
                return None
            if now - entry[2] > self.recheck:
                del self._known[name]
                return None
            return entry[0], entry[1]

    def live(self) -> bool:
        with self._lock:
            return self._live(time.monotonic())

    @contextmanager
    def watching(self, name: str) -> Iterator[Seen | None]:
        """Around a read, publish or drop at key `name`: what the caller sets
        as found is remembered as the key's version, unless a notice of another
        one came meanwhile or notices lapsed. None (nothing is remembered)
        while notices are not live."""
        with self._lock:
            now = time.monotonic()
            seen = Seen(self._epoch, now) if self._live(now) else None
            if seen is not None:
                self._reading.setdefault(name, []).append(seen)
        try:
            yield seen
        finally:
            if seen is not None:
                self._done(name, seen)

    def forget(self, name: str) -> None:
        with self._lock:
            self._known.pop(name, None)

    # -- notices ----------------------------------------------------------------------------------

    def _done(self, name: str, seen: Seen) -> None:
        now = time.monotonic()
        with self._lock:
            pending = self._reading[name]
            pending.remove(seen)
            if not pending:
                del self._reading[name]
            if seen.found is None or seen.epoch != self._epoch or not self._live(now) or \
                    any(h != seen.found for h in seen.heard):
                return
            self._known[name] = (*seen.found, seen.began)
            self._known.move_to_end(name)
            while len(self._known) > KNOWN:
                self._known.popitem(last=False)

    def heard(self, data: bytes) -> None:
        """A notice: the key it names holds another version now."""
        try:
            name, version, write = data.decode().rsplit(" ", 2)
            found = (int(version), "" if write == "-" else write)
        except (UnicodeDecodeError, ValueError):
            self._lapse(f"a notice that does not parse ({data[:80]!r})")
            return
        with self._lock:
            known = self._known.get(name)
            if known is not None and known[:2] != found:
                del self._known[name]
            for seen in self._reading.get(name, ()):
                seen.heard.append(found)

    def _live(self, now: float) -> bool:
        r = self._round
        return r is not None and not r.stopped.is_set() and now - self._topology_at <= LEASE and \
            len(r.confirmed) == len(r.primaries) and all(now - t <= LEASE for t in r.confirmed.values())

    def _lapse(self, why: str, r: _Round | None = None) -> None:
        """Forget everything known; the subscriptions are made again (of round
        r, where it is still the current one)."""
        with self._lock:
            if r is not None and r is not self._round:
                return
            self._epoch += 1
            self._known.clear()
            if self._round is not None:
                self._round.stopped.set()
            said, self._live_said = self._live_said, False
        if said:
            log.warning("remote tier: change notices lapsed (%s): reads ask the store until they are back", why)
        elif said is None:
            log.info("remote tier: no change notices yet (%s): reads ask the store until they come", why)

    # -- the threads ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._stop.wait(HEARTBEAT)

    def _look(self) -> None:
        """Read the primaries: the same, the round goes on; else (or where it
        stopped) notices lapse and a round subscribes on the primaries now."""
        try:
            primaries = self._primaries()
        except Exception as exc:  # noqa: BLE001 - whatever the store did, notices lapse and come back
            self._lapse(f"the primaries could not be read: {exc}")
            return
        now = time.monotonic()
        with self._lock:
            r = self._round
            same = r is not None and not r.stopped.is_set() and sorted(r.primaries) == primaries
            if same:
                self._topology_at = now
        if not same:
            if r is not None:
                self._lapse("the primaries changed" if not r.stopped.is_set() else "a subscription failed")
            self._subscribe(primaries, now)
        elif self._live_said is not True and self.live():
            self._live_said = True
            log.info("remote tier: change notices live on %d primaries: a read of a copy nothing changed asks the "
                     "store nothing", len(primaries))

    def _primaries(self) -> list[tuple[str, int]]:
        from redis.cluster import RedisCluster

        client = self.link.client
        if not isinstance(client, RedisCluster):
            kw = client.get_connection_kwargs()
            return [(kw["host"], int(kw["port"]))]
        # Every primary that holds slots, failing or not: notices are live only while each answers (a slot
        # whose primary is down is read from the store, as before a fail-over gives it another).
        nodes = self.link.call("a topology read", client.cluster_nodes)
        return sorted(_address(addr) for addr, node in nodes.items()
                      if "master" in node.get("flags", "").split(",") and node.get("slots"))

    def _subscribe(self, primaries: list[tuple[str, int]], now: float) -> None:
        r = _Round(primaries)
        with self._lock:
            self._round = r
            self._topology_at = now
        for host, port in primaries:
            r.threads.append(threading.Thread(target=self._watch, args=(r, host, port), name="tierd-remote-notice",
                                              daemon=True))
            r.threads[-1].start()

    def _watch(self, r: _Round, host: str, port: int) -> None:
        """Subscribe on one primary, heartbeat it, and pass on its notices,
        until round r stops; a fault lapses the notices."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        pubsub: Any = None
        try:
            kw = {k: v for k, v in self.link.client.get_connection_kwargs().items()
                  if k in ("password", "username", "socket_timeout", "socket_connect_timeout") or k.startswith("ssl")}
            # No retry: redis-py would connect again and subscribe again on its own, and the notices sent
            # meanwhile would be missed unseen; a connection lost lapses the notices instead.
            pubsub = redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0), **kw).pubsub()
            pubsub.subscribe(self.channel)
            pings: deque[float] = deque()
            next_ping = 0.0
            while not r.stopped.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    pubsub.ping()
                    pings.append(now)
                    next_ping = now + HEARTBEAT
                if pings and now - pings[0] > LEASE:
                    raise Unavailable(f"a heartbeat unanswered for {LEASE:g} s")
                msg = pubsub.get_message(timeout=HEARTBEAT / 2)
                if msg is None:
                    continue
                if msg["type"] == "pong" and pings:
                    sent = pings.popleft()
                    with self._lock:
                        r.confirmed[(host, port)] = sent
                elif msg["type"] == "message":
                    self.heard(msg["data"])
        except Exception as exc:  # noqa: BLE001 - a subscription that fails lapses the notices
            if not r.stopped.is_set():
                self._lapse(f"the subscription on {host}:{port}: {type(exc).__name__}: {exc}", r)
        finally:
            if pubsub is not None:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001 - closing what failed
                    pass


def _address(addr: str) -> tuple[str, int]:
    host, _, port = addr.partition("@")[0].rpartition(":")
    return host, int(port)
