"""The remote tier in the store: sessions every node reaches through a
remote store (a backend of tierd/remote, known by its protocol alone),
whole versions at a time.

Reading. Before a call reads a session (Stat, Lookup, Restore, Get,
BeginRestore, an append: a store from start_token > 0, Prefetch), the store
asks the remote tier for the session's manifest, unless the backend knows
without asking that the key still holds the version this node's copy is
of (RemoteBackend.current: Redis's change notices): where this node holds no
copy, or a copy of an older version with nothing stored here since, the
remote version is the session; where the tier holds a tombstone past the
version this node's copy builds on, the copy is forgotten, with any stores
made onto it here (they continued the conversation that was dropped). Stat
and Lookup answer from the manifest;
the others fetch it into the host tier first, every page checked, and then
serve it as any other; a Restore scatters each window of pages into the
engine's blocks as soon as it is in (checked on its way out, as every page
is), while the next chunks are fetched. A local copy with stores not yet
published is this node's and is served as it is, once the tier said its
base was not dropped. Drop removes the remote
copy first, leaving a tombstone, then this node's; one the remote tier does
not take fails and changes nothing (taken here alone, it would be undone
once the tier answers). A fetch or publish of the session on this node ends
before a drop starts, and none starts until it is done. Another node's copy
of the dropped version is forgotten at its next call, or by the sweep
thread, which looks at every remote-durable copy held here each `sweep`
seconds. A copy is of a version by number and write id: where the store
holds again exactly what this node's last publish replaced (a fail-over
lost it), the copy is kept and published again; where it holds nothing of
it any more (evicted, expired: nothing at its manifest's key, or, at Stat
and at the sweep, a chunk gone), the copy is not remote-durable and is
published again.

Publishing. With write "through", every committed store queues the session
for the publisher thread, which reads its pages (no lock held, as a Get
does) and publishes them as a new version; with "back", the publisher
queues sessions that have been idle on disk for `idle` seconds. While the
remote tier is down, the queue waits (a publish the fault cut short is
queued again) and is published once it answers. The queue holds `queue`
sessions: a store that finds it full still succeeds here and the session is
not remote-durable until it is stored again (or, with back, found idle). A
version replaces the one this content builds on (the one it
was fetched as, or last published as); a session stored from token 0 here
since replaces whatever is there (a new history); anything else is another
node's newer history, which wins: this node's copy is not published.

Faults. A remote call that fails marks the remote tier down; until a probe
thread finds it answering again (each second, link.py), no call waits on it:
sessions this node does not hold are NOT_FOUND at once (the engine
recomputes); copies of this node's own histories (never in the remote tier,
or stored from token 0 here since) are served as they are; a copy built on
a version the remote tier holds is UNAVAILABLE for reads (another node may
have dropped it: a drop is never undone by a node that did not hear of it)
and takes appends, published once the tier answers; Stat answers what this
node holds, not remote-durable; a Drop is UNAVAILABLE (the engine tries
again) and publishes wait in the queue.

The parts: what the remote tier's head makes of this node's copy, read once
per call (finder.py); fetches (fetcher.py); the calls that answer from the
remote tier, and drops (remote_calls.py); the publish queue and its thread
(publisher.py); the sweep (sweeper.py); the calls on the backend and
whether it is down (link.py); a manifest described (remote_info.py). This
module: the remote tier's settings, and the keys being dropped, fetched or
published, which keep a drop apart from the others.

Where the code runs: manifests, fetches and drops on the RPC thread of the
call that needs them, or on a mover for a Prefetch; publishes on the
publisher's thread (publisher.py; or the RPC thread of publish()); the probe on a thread of
its own while the tier is down; the sweep on its own thread; never on the
event loop (the API runs every call that reads sessions on its RPC threads
where there is a remote tier: reaches_remote). A drop, fetch or publish that
waits for another of its key waits on the store lock's condition (the lock
released meanwhile), holding no op lock.
"""


from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.core.store.pending import PendingWrite
from tierd.remote.backend import RemoteBackend
from tierd.types import SessionKey


@dataclass(frozen=True)
class Remote:
    """The remote tier as the store uses it."""

    store: RemoteBackend
    write: str = "through"  # through (every store), back (sessions idle on disk) or off (read only)
    idle: float = 60.0  # write "back": seconds idle on disk before a session is published
    queue: int = 256  # sessions waiting to be published, at most
    tenant_quota: int = 0  # bytes each tenant's sessions may take in the remote tier (0: no limit)
    sweep: float = 60.0  # seconds between looks for drops on other nodes of the sessions this node holds
    codec: str = "none"  # what pages are coded with on their way there (coding.py)
    lossy_tenants: frozenset[str] = frozenset()  # whose KV a lossy codec codes ("*": every tenant's)
    lossy_max_error: float = 0.05  # a page a lossy codec would give more relative error is kept as it is


class RemoteBusy:
    """The keys being dropped, fetched and published on this node, under the
    store lock (its condition `changed` wakes waiters): a drop waits for the
    fetch and publish of its key in flight, and none starts until it is
    done; one fetch and one publish of a key at once."""

    def __init__(self, changed: threading.Condition) -> None:
        self.changed = changed
        self._dropping: set[SessionKey] = set()
        self._publishing: set[SessionKey] = set()
        self._fetching: dict[SessionKey, threading.Event] = {}

    @contextmanager
    def dropping(self, key: SessionKey) -> Iterator[None]:
        """While this runs, no fetch or publish of the key starts; it starts once those in flight end."""
        with self.changed:
            self.changed.wait_for(lambda: key not in self._dropping and key not in self._publishing
                                  and key not in self._fetching)
            self._dropping.add(key)
        try:
            yield
        finally:
            self._end(self._dropping, key)

    def start_publish(self, key: SessionKey) -> None:
        """Wait until no drop or publish of the key runs, and mark it published
        (store lock held by the caller: with changed)."""
        self.changed.wait_for(lambda: key not in self._dropping and key not in self._publishing)
        self._publishing.add(key)

    def end_publish(self, key: SessionKey) -> None:
        self._end(self._publishing, key)

    def start_fetch(self, key: SessionKey) -> tuple[threading.Event, bool]:
        """After a drop of the key, never across it: the event set when the
        key's fetch ends, and whether that fetch is the caller's (else
        another runs, and the caller waits for its event)."""
        with self.changed:
            self.changed.wait_for(lambda: key not in self._dropping)
            running = self._fetching.get(key)
            if running is not None:
                return running, False
            done = self._fetching[key] = threading.Event()
            return done, True

    def end_fetch(self, key: SessionKey, done: threading.Event) -> None:
        with self.changed:
            del self._fetching[key]
            self.changed.notify_all()
        done.set()

    def _end(self, keys: set[SessionKey], key: SessionKey) -> None:
        with self.changed:
            keys.discard(key)
            self.changed.notify_all()


class PublishQueue:
    """The sessions waiting to be published, `remote.queue` at most, in order."""

    def __init__(self, remote: Remote, events: StoreEvents) -> None:
        self.remote = remote
        self.events = events
        self.cv = threading.Condition()
        self.keys: OrderedDict[SessionKey, None] = OrderedDict()
        self.busy = 0  # 1 while the publisher works on a session
        self.open = remote.write != "off"  # with write "off", publish() alone publishes

    def add(self, key: SessionKey) -> bool:
        """Queue the session for the publisher; whether it is."""
        if not self.open:
            return False
        with self.cv:
            if key in self.keys:
                return True
            if len(self.keys) >= self.remote.queue:
                self.events.remote_op("publish", "queue_full")
                return False
            self.keys[key] = None
            self.cv.notify()
            return True

    def wake(self) -> None:
        """The remote tier answers again: what waits in the queue goes."""
        with self.cv:
            self.cv.notify_all()

    def counts(self) -> tuple[int, int]:
        """Sessions waiting for the publisher, and being published (0 or 1)."""
        with self.cv:
            return len(self.keys), self.busy



class Committed:
    """What the publisher hears of each write committed (Writer's listener):
    a store from token 0 starts a history of this node's; with write
    "through", the session is queued to be published."""

    def __init__(self, lock: threading.RLock, queue: PublishQueue, remote: Remote) -> None:
        self.lock = lock  # the store lock
        self.queue = queue
        self.remote = remote

    def __call__(self, w: PendingWrite, session: Session) -> None:
        with self.lock:
            if session.dropped:  # dropped since its commit: nothing to publish
                return
            if w.first_page == 0:
                session.remote_fresh = session.snap.version
                session.own_expect = None  # a new history: no publish of it tried yet
        if self.remote.write == "through":
            self.queue.add(w.key)


__all__ = ["Committed", "PublishQueue", "Remote", "RemoteBusy"]
