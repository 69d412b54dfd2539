"""The remote tier in the store: sessions shared with every node through a
remote store (a backend of tierd/remote, known by its protocol alone),
whole versions at a time.

Reading. Before a call reads a session (Stat, Lookup, Restore, Get,
BeginRestore, an append: a store from start_token > 0, Prefetch), the store
asks the remote tier for the session's manifest: where this node holds no
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

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierd.core import tokens
from tierd.core.model import UNKNOWN, Session, Snapshot
from tierd.core.move_queue import Job
from tierd.core.store.checks import check_blocks, check_identity, check_priority
from tierd.core.store.inspection import Inspection
from tierd.core.store.lifecycle import merge_prefetch
from tierd.core.store.link import RemoteLink
from tierd.core.store.publisher import Publisher
from tierd.core.store.remote_info import info_of, spec_of
from tierd.core.store.sweeper import Sweeper
from tierd.errors import DataLoss, FailedPrecondition, NotFound, TierdError, Unavailable, shown
from tierd.layout import KVSpec
from tierd.remote.backend import RemoteBackend
from tierd.remote.manifest import Manifest
from tierd.tiers import tier_rank
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import EngineMemory
from tierd.transfer.pages import between
from tierd.transfer.runs import Geometry
from tierd.types import LookupResult, RestoreResult, SessionInfo, SessionKey

log = logging.getLogger("tierd.core.store")

FAILED_KEPT = 1024  # keys whose last fetch failed, remembered for WaitReady


@dataclass(frozen=True)
class Remote:
    """The remote tier as the store uses it."""

    store: RemoteBackend
    write: str = "through"  # through (every store), back (sessions idle on disk) or off (read only)
    idle: float = 60.0  # write "back": seconds idle on disk before a session is published
    queue: int = 256  # sessions waiting to be published, at most
    tenant_quota: int = 0  # bytes each tenant's sessions may take in the remote tier (0: no limit)
    sweep: float = 60.0  # seconds between looks for drops on other nodes of the sessions this node holds


@dataclass
class _Into:
    """Engine blocks a fetch scatters pages [0, len(ids)) into as they arrive:
    a Restore of a session whose current version only the remote tier holds.
    session is set once the version fetched is the session's (the blocks
    then hold it); else the Restore reads the session as it is."""

    engine: EngineMemory
    ids: np.ndarray
    session: Session | None = None


class RemoteLayer(Inspection):
    remote: Remote | None = None

    @property
    def reaches_remote(self) -> bool:
        """Whether calls that read sessions may wait on the remote tier: the
        API runs them on its RPC threads then, never on the event loop."""
        return self.remote is not None

    def _start_remote(self, remote: Remote | None) -> None:
        self.remote = remote
        self.link = RemoteLink(remote.store, self.events, self._remote_up) if remote is not None else None
        self._heads = threading.local()  # what one_read found, per thread
        self._fetches: set[SessionKey] = set()  # queued or running fetches (Prefetch), under the store lock
        # Why the last fetch of a key failed (DataLoss, NotFound), for WaitReady; the latest FAILED_KEPT.
        self._failed: OrderedDict[SessionKey, TierdError] = OrderedDict()
        self._fetching: dict[SessionKey, threading.Event] = {}  # one fetch per key at once
        # Keys being dropped, and published (by the publisher or publish()), under the store lock: a drop
        # waits for the fetch and publish of its key in flight, and none starts until it is done.
        self._dropping: set[SessionKey] = set()
        self._pubs: set[SessionKey] = set()
        self.publisher = Publisher(self, remote) if remote is not None else None
        self.sweeper = Sweeper(self, remote) if remote is not None else None

    def _stop_publisher(self, flush: bool) -> None:
        """Stop the publisher (with flush, after what is queued is published) and the sweep."""
        if self.publisher is not None:
            self.publisher.close(flush)
        if self.sweeper is not None:
            self.sweeper.close()

    def _close_remote(self) -> None:
        """Close the connections to the remote tier (once nothing runs that uses them)."""
        if self.link is not None:
            self.link.close()

    def _remote_up(self) -> None:
        """The remote tier answers again: what waits to be published goes."""
        if self.publisher is not None:
            self.publisher.wake()

    # -- fetching -----------------------------------------------------------------------------

    def _stale(self, key: SessionKey, whole: bool = False) -> Manifest | None:
        """The remote manifest where it is the session and this node's copy is
        not: this node holds none, or one of another version with nothing
        stored here since. None where the local copy (or nothing) is the
        session, or the remote tier does not answer. A damaged local copy
        gives way to whatever the remote tier holds; a remote manifest that
        does not parse is DataLoss only where this node holds no copy. A copy
        of a version the remote tier has since dropped (its tombstone is of
        another version) is forgotten here: the session was dropped on
        another node. A remote-durable copy whose version the remote tier no
        longer holds (nothing at its key; with whole, a chunk gone too) is
        remote-durable no more, and published again. A copy built on a version
        the remote tier holds (fetched or published, stores made here since
        or not; or recovered from disk) is served only once the remote tier
        said it was not dropped: while it does not answer, Unavailable. A copy
        recovered from disk gives way to the version the remote tier holds,
        and is forgotten where it holds a tombstone."""
        if self.remote is None:
            return None
        with self._lock:
            session = self._sessions.get(key)
            if session is not None and not session.damaged and not session.from_remote:
                return None  # this node's own history: the session, whatever the remote tier holds
            version = -1 if session is None or session.damaged else session.remote_version
            write = "" if session is None else session.remote_write
        try:
            m, at = self._head(key)
        except Unavailable:
            if session is None or session.damaged:
                return None
            raise Unavailable(f"the remote tier does not answer, and this node's copy of session "
                              f"{shown(key.session_id)} builds on a version other nodes hold: it is served once the "
                              "tier answers (another node may have dropped it meanwhile)", session_id=key.session_id,
                              tier=self.roles.versions) from None
        except DataLoss:
            if session is None:
                raise
            log.warning("%s/%s: the remote tier's manifest does not parse; this node's copy is served", *key)
            if version > 0:
                self._gone(session, version, write)  # no node resumes it from there: published again
            return None
        if session is not None and self._settle(session, version, m, at) == "kept":
            return None
        if session is not None and version == UNKNOWN and m is not None and self._recognised(session, m):
            return None  # recovered, and what the remote tier holds: published as it is
        if m is not None and (m.version != version or (write and m.write != write)):
            return m  # another version, or another node's publish under this one's number (this node's was lost)
        if session is not None and version > 0 and (not at or m is not None and whole and self._lost(key, m)):
            self._gone(session, version, write)
        if session is not None and version == UNKNOWN and not at:
            self._own(session)  # recovered, and the remote tier holds nothing of it: this node's own history
        return None

    def _recognised(self, session: Session, m: Manifest) -> bool:
        """Whether a copy recovered from disk is manifest m's version (the same
        identity and page checksums): recorded as published, not fetched."""
        with self._lock:
            snap = session.snap
            if session.remote_version != UNKNOWN or snap.spec.fingerprint != m.fingerprint or \
                    not np.array_equal(snap.checksums, m.checksums):
                return False
            session.remote_version, session.remote_write, session.remote_at = m.version, m.write, snap.version
            return True

    def _own(self, session: Session) -> None:
        """A recovered copy the remote tier holds nothing of: this node's own, served and published."""
        with self._lock:
            if session.remote_version != UNKNOWN:
                return
            session.remote_version = 0
        if self.remote is not None and self.remote.write == "through":
            self.publisher.queue(session.key)

    @contextmanager
    def one_read(self) -> Iterator[None]:
        """Within this, on this thread (one API call), each session's remote
        manifest is read once at most: the call's steps (a prompt's limit,
        then the lookup, say) share what the first read found."""
        self._heads.found = {}
        try:
            yield
        finally:
            self._heads.found = None

    def _head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        """The session's remote manifest and the version at its key (see
        RemoteBackend.head), read once per one_read."""
        assert self.remote is not None
        found = getattr(self._heads, "found", None)
        if found is not None and key in found:
            return found[key]
        head = self.link.call("manifest", self.remote.store.head, key)
        if found is not None:
            found[key] = head
        return head

    def _lost(self, key: SessionKey, m: Manifest) -> bool:
        """Whether a chunk of manifest m's version is gone from the remote tier (False where it does not answer)."""
        assert self.remote is not None
        try:
            return self.link.call("manifest", self.remote.store.missing, [(key, m.version, m.write, m.nbytes)])[0]
        except Unavailable:
            return False

    def _went_back(self, session: Session, version: int, m: Manifest | None) -> None:
        """The remote tier holds again what this node's publish of `version`
        replaced (a master lost before its replica had that publish): this
        node's copy is the session. It is served as it is, is no longer
        remote-durable, and is published again onto what the tier holds."""
        with self._lock:
            if session.remote_version != version or not session.remote_durable:
                return
            session.remote_version, session.remote_at = version - 1, -1
            session.remote_write = m.write if m is not None else ""
        log.warning("%s/%s: the remote tier lost this node's last publish (a fail-over?); it is published again",
                    *session.key)
        self.publisher.queue(session.key)

    def _gone(self, session: Session, version: int, write: str) -> None:
        """The remote tier no longer holds this node's copy of remote version
        `version` (write id `write`): expired, evicted, or a first publish
        lost in a fail-over. The copy is no longer remote-durable, and is
        published again; as a copy that was published before, not as a new
        history: it gives way to whatever another node published since."""
        with self._lock:
            if not session.remote_durable or session.dropped or \
                    (session.remote_version, session.remote_write) != (version, write):
                return
            session.remote_at = session.remote_fresh = -1
        log.info("%s/%s: the remote tier no longer holds this node's copy (evicted or expired); it is published again",
                 *session.key)
        self.publisher.queue(session.key)

    def _settle(self, session: Session, version: int, m: Manifest | None, at: int) -> str:
        """What the remote tier's head (manifest m, or a tombstone, at version
        `at`) makes of this node's copy of remote version `version`: "kept"
        where it holds again what this node's publish of it replaced (the copy
        is published again), "forgotten" where it dropped the session since,
        else "" (the caller compares the versions)."""
        if 0 < at == version - 1:
            self._went_back(session, version, m)
            return "kept"
        if m is None and at and at != version and self._dropped_elsewhere(session, version):
            return "forgotten"
        return ""

    def _dropped_elsewhere(self, session: Session, version: int) -> bool:
        """Forget this node's copy of a session another node dropped (of remote
        version `version`, the one that was found dropped), with the stores
        made here onto that version since (they continued the conversation
        that was dropped), unless it was stored from token 0 here (a new
        history) or fetched again meanwhile."""
        lock, now = self._acquire(session.key)
        try:
            if now is session and (session.damaged or session.remote_version == version and session.from_remote):
                log.info("%s/%s was dropped on another node: this node's copy is forgotten", *session.key)
                self._forget(session, "drop")
                return True
            return False
        finally:
            lock.release()

    def _bring(self, key: SessionKey, appending: bool = False) -> None:
        """Make this node's copy the session's current version, fetching it
        into the host tier where the remote tier holds a newer one. For an
        append, a tier that does not answer leaves this node's copy to store
        onto: the store is published once it answers (or gives way to a drop
        or another node's history found then)."""
        try:
            m = self._stale(key)
        except Unavailable:
            if appending:
                return
            raise
        if m is not None:
            self._fetch(key, m)

    def _fetch(self, key: SessionKey, m: Manifest | None = None, into: _Into | None = None) -> bool:
        """Bring the session's remote version (m, else the current one) into the
        host tier, every page checked, in place of an older local copy (and
        into engine blocks on the way, see _Into); False if the remote tier
        holds none. One fetch per key at once: a second caller waits for the
        first."""
        with self._changed:
            self._changed.wait_for(lambda: key not in self._dropping)  # after a drop of the key, never across it
            running = self._fetching.get(key)
            if running is None:
                done = self._fetching[key] = threading.Event()
        if running is not None:
            running.wait(60.0)
            return self._has(key)
        try:
            m = m or self._stale(key)
            if m is None:
                return self._has(key)
            self._adopt(key, m, into)
            return True
        finally:
            with self._changed:
                del self._fetching[key]
                self._changed.notify_all()
            done.set()


    def _adopt(self, key: SessionKey, m: Manifest, into: _Into | None = None) -> None:
        assert self.remote is not None
        spec = spec_of(key, m, self.roles.versions)
        n = m.n_pages
        geom = Geometry(m.page_bytes, n, m.nbytes - (n - 1) * m.page_bytes)
        hashes = m.token_hashes if len(m.token_hashes) else None
        t0 = time.perf_counter()
        # Every page of the manifest is read into pages of its own (the fetch writes them all as they come).
        w = self._begin_write(key, spec, self.roles.landing, 0, m.num_tokens, m.nbytes, geom, hashes, None, share=False)
        try:
            writer = self.copier.page_writer(w.spans, geom)
            want = into.ids.size if into is not None else 0
            step, scattered = max(1, self.copier.window_bytes // geom.stride), 0
            for received in self.remote.store.read_into(key, m, writer.claim):  # read into its pages
                done = min(n if received == m.nbytes else received // geom.page_bytes, want)
                if done - scattered >= step or scattered < done == want:  # while the next chunks are fetched
                    assert into is not None
                    self._scatter_fetched(key, w.spans, geom, m.checksums, into, scattered, done)
                    scattered = done
            # Pages scattered were checked against the manifest's checksums on their way out.
            sums = np.concatenate([m.checksums[:scattered],
                                   self.copier.checksums(between(w.spans, scattered, n, geom.stride), geom)])
            bad = np.flatnonzero(sums != m.checksums)
            if bad.size:
                raise DataLoss(f"page {int(bad[0])} of session {shown(key.session_id)} failed its checksum in the "
                               "remote tier", page=int(bad[0]), tier=self.roles.versions)
        except Unavailable:
            self.abort_write(w)
            self.link.went_down("fetch")
            raise
        except DataLoss:
            self.abort_write(w)
            self.events.checksum_failed(self.roles.versions)
            raise
        except BaseException:
            self.abort_write(w)
            raise
        lock, session = self._acquire(key)
        try:
            fetched = (session.remote_version, session.remote_write) == (m.version, m.write) if session else False
            if session is not None and not session.damaged and session.remote_version != UNKNOWN and \
                    (not session.remote_durable or fetched):
                self.abort_write(w)  # stored here meanwhile (this node's copy is the session), or fetched
                return
            session = self._install(key, lock, session, spec, 0, w.pieces, self.roles.landing, sums, m.num_tokens,
                                    m.nbytes, None, hashes)
            w.pieces = []
            if into is not None:
                into.session = session
            with self._lock:
                session.remote_version, session.remote_at = m.version, session.snap.version
                session.remote_write = m.write
                session.released_at = self.clock.now()
                self._schedule(session)
        finally:
            lock.release()
        seconds = time.perf_counter() - t0
        self.copier.record(f"{self.roles.versions}->{self.roles.landing}", m.nbytes, seconds)
        self.events.moved(self.roles.versions, self.roles.landing, "fetch", m.nbytes, seconds)

    def _scatter_fetched(self, key: SessionKey, spans: list, geom: Geometry, sums: np.ndarray, into: _Into,
                         start: int, stop: int) -> None:
        """Pages [start, stop) of a fetch, written to its host pages, into the
        engine's blocks, each checked against the manifest's checksum: a
        mismatch is the remote copy's (DataLoss)."""
        try:
            self.copier.scatter(between(spans, start, stop, geom.stride), into.engine, into.ids[:stop], geom, sums)
        except DataLoss as exc:
            page = exc.details.get("page", start)
            raise DataLoss(f"page {page} of session {shown(key.session_id)} failed its checksum in the remote tier",
                           page=page, tier=self.roles.versions) from None

    # -- the calls that reach the remote tier ---------------------------------------------------

    def _manifest_info(self, key: SessionKey, m: Manifest) -> SessionInfo:
        return info_of(key, m, self.roles.versions)

    def stat(self, key: SessionKey) -> SessionInfo:
        try:
            m = self._stale(key, whole=True)  # remote_durable: whether the remote tier holds every chunk of this copy
        except Unavailable:  # what this node holds, not remote-durable while no node can fetch it
            return dataclasses.replace(super().stat(key), remote_durable=False)
        return self._manifest_info(key, m) if m is not None else super().stat(key)

    def prompt_limit(self, key: SessionKey) -> int:
        m = self._stale(key)  # the remote tier's copy too
        return max(super().prompt_limit(key), m.num_tokens if m is not None else 0)

    def own_tokens(self, key: SessionKey) -> int:
        m = self._stale(key)
        return m.num_tokens if m is not None else super().own_tokens(key)


    def lookup(self, key: SessionKey, token_ids: Iterable[int], spec: KVSpec | None = None,
               salt: str = "") -> LookupResult:
        m = self._stale(key)
        if m is None:
            return super().lookup(key, token_ids, spec, salt)
        info = self._manifest_info(key, m)
        if spec is not None:
            check_identity(Session(key, Snapshot(info.spec), 0.0, 0.0), spec)
        bt = info.spec.block_tokens
        hashes = m.token_hashes if len(m.token_hashes) else tokens.empty(m.n_pages)
        request = tokens.check_ids(token_ids)
        pages = 0 if info.spec.is_opaque else tokens.matched_pages(hashes, m.num_tokens, bt, request,
                                                                   tokens.check_salt(salt))
        return LookupResult(min(pages * bt, m.num_tokens), pages, m.num_tokens, self.roles.versions if pages else None)

    def list(self, tenant: str | None = None, after: str = "", limit: int = 100) -> tuple[list[SessionInfo], str]:
        """The store's list, and for one tenant the sessions only the remote tier
        holds, merged in order of id (every tenant's: this node's only)."""
        page, token = super().list(tenant, after, limit)
        if self.link is not None and self.link.down.is_set():  # no node can fetch them meanwhile
            page = [dataclasses.replace(info, remote_durable=False) for info in page]
        if self.remote is None or tenant is None:
            return page, token
        start = after.split("\x00", 1)[1] if after else ""
        try:
            listed = self.link.call("list", self.remote.store.listed, tenant, start, limit + 1)
            ids = [i for i in listed if not self._has(SessionKey(tenant, i))]
            found = self.link.call("list", self.remote.store.heads, [SessionKey(tenant, i) for i in ids])
        except Unavailable:
            return page, token
        gone = [i for i, m in zip(ids, found) if m is None]
        if gone:
            try:
                self.link.call("list", self.remote.store.unlist, tenant, gone)  # expired or evicted
            except Unavailable:
                pass
        infos = []
        for i, m in zip(ids, found):
            try:
                infos.append(None if m is None else self._manifest_info(SessionKey(tenant, i), Manifest.listed(m)))
            except DataLoss:
                pass  # a copy that does not agree with itself: not listed (Stat on it says why)
        merged = sorted(page + [info for info in infos if info is not None], key=lambda info: info.session_id)
        # Each source is complete up to the last id it returned, where it had more.
        ends = ([page[-1].session_id] if token and page else []) + ([listed[-1]] if len(listed) > limit else [])
        if ends:
            merged = [info for info in merged if info.session_id <= min(ends)]
        if len(merged) > limit:
            return merged[:limit], f"{tenant}\x00{merged[limit - 1].session_id}"
        if ends:
            return merged, f"{tenant}\x00{merged[-1].session_id if merged else min(ends)}"
        return merged, ""

    def restore(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
                *args: Any, **kw: Any) -> RestoreResult:
        m = self._stale(key)
        if m is not None:
            ids = check_blocks(block_ids, engine.layout.num_blocks)
            # Where the call would succeed on the version fetched, its pages go into the blocks as
            # they arrive (the scatter overlaps the fetch); else the restore below says why not.
            fetched = spec_of(key, m, self.roles.versions)
            into = _Into(engine, ids) if fetched.fingerprint == spec.fingerprint and 0 < ids.size <= m.n_pages \
                else None
            t0 = time.perf_counter()
            self._fetch(key, m, into)
            if into is not None and into.session is not None:
                return self._restored(into.session, fetched, m.num_tokens, int(ids.size), self.roles.versions,
                                      time.perf_counter() - t0)
        return super().restore(key, engine, spec, block_ids, *args, **kw)

    def get(self, key: SessionKey, chunk_bytes: int = 1 << 20):  # type: ignore[override]
        self._bring(key)
        return super().get(key, chunk_bytes)

    def begin_restore(self, key: SessionKey, *args: Any, **kw: Any):  # type: ignore[override]
        self._bring(key)
        return super().begin_restore(key, *args, **kw)

    def save(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
             num_tokens: int, start_token: int = 0, *args: Any, **kw: Any) -> SessionInfo:
        if start_token:
            self._bring(key, appending=True)  # an append onto a session another node stored
        return super().save(key, engine, spec, block_ids, num_tokens, start_token, *args, **kw)

    def begin_put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int, priority: int | None = None,
                  start_token: int = 0, token_ids: Iterable[int] | None = None,
                  salt: str = ""):  # type: ignore[override]
        if start_token:
            self._bring(key, appending=True)
        return super().begin_put(key, spec, num_tokens, nbytes, priority, start_token, token_ids, salt)

    def begin_save(self, key: SessionKey, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   *args: Any, **kw: Any):  # type: ignore[override]
        if start_token:
            self._bring(key, appending=True)
        return super().begin_save(key, spec, num_tokens, start_token, *args, **kw)

    def prefetch(self, key: SessionKey, tier: str | None = None, priority: int = 0,
                 deadline: float | None = None) -> str:
        tier = tier or self.roles.landing
        check_priority(priority)
        self.check_prefetch_target(tier)
        m = self._stale(key)
        if m is None:
            return super().prefetch(key, tier, priority, deadline)
        with self._lock:
            self._fetches.add(key)
            self._failed.pop(key, None)
        self.moves.submit(Job(key, tier, "fetch", IOClass.PREFETCH, priority, deadline), merge_prefetch)
        return "queued"

    def ready(self, key: SessionKey, tier: str | None = None) -> tuple[bool, str | None]:
        with self._lock:
            if key in self._fetches:
                return False, self.roles.versions
            failed = self._failed.get(key) if key not in self._sessions else None
        if failed is not None:
            raise failed  # the prefetch's fetch failed: why, rather than "not found"
        return super().ready(key, tier)

    def _run_job(self, job: Job) -> None:
        if job.reason != "fetch":
            super()._run_job(job)
            return
        try:
            if job.deadline is not None and self.clock.now() > job.deadline:
                self.events.prefetch_outcome("missed")
                return
            try:
                found = self._fetch(job.key)
            except TierdError as exc:
                log.warning("fetch of %s/%s from the remote tier failed: %s", *job.key, exc)
                found = False
                if isinstance(exc, (DataLoss, NotFound)):
                    with self._lock:
                        self._failed[job.key] = exc
                        while len(self._failed) > FAILED_KEPT:
                            self._failed.popitem(last=False)
            if not found:
                self.events.prefetch_outcome("missed")
                return
            if tier_rank(job.target) < tier_rank(self.roles.landing):
                super()._run_job(Job(job.key, job.target, "prefetch", job.io_class, job.priority, job.deadline))
                return
            with self._lock:
                session = self._sessions.get(job.key)
            if session is not None:
                now = self._expect(session)
                self.events.prefetch_outcome("late" if job.deadline is not None and now > job.deadline else "in_time")
        finally:
            with self._lock:
                self._fetches.discard(job.key)
            self._notify()

    def drop(self, key: SessionKey) -> None:
        """Forget the session in the remote tier (unless it is read-only), then
        here. A drop the remote tier does not take fails (Unavailable) and
        changes nothing: the engine tries again. Taken here alone, it would be
        undone once the tier answers (this node and the others would find the
        remote copy again). A fetch or publish of the session on this node
        ends before the drop starts, and none starts until it is done: no copy
        of the dropped version is taken in or published after its tombstone."""
        there, why = False, None
        if self.remote is None or self.remote.write == "off":
            held = self._drop_here(key)
        else:
            with self._changed:
                self._changed.wait_for(lambda: key not in self._dropping and key not in self._pubs
                                       and key not in self._fetching)
                self._dropping.add(key)
            try:
                try:
                    there = self.link.call("drop", self.remote.store.drop, key)
                except DataLoss as exc:  # the store holds something else there: no copy any node serves
                    why = exc
                except Unavailable as exc:
                    raise Unavailable(f"session {shown(key.session_id)} is not dropped: {exc}; nothing was changed, "
                                      "try again", session_id=key.session_id) from None
                held = self._drop_here(key)
            finally:
                with self._changed:
                    self._dropping.discard(key)
                    self._changed.notify_all()
        if not held and not there:
            raise why or NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)

    def _drop_here(self, key: SessionKey) -> bool:
        """Forget this node's copy, if it holds one; whether it did."""
        held = True
        try:
            super().drop(key)
        except NotFound:
            held = False
        with self._lock:
            self._fetches.discard(key)  # a queued fetch was cancelled with the drop
        return held

    # -- publishing ---------------------------------------------------------------------------

    def _commit_write(self, w: Any, sums: np.ndarray, keep: bool = False) -> SessionInfo:
        info = super()._commit_write(w, sums, keep)
        if self.remote is not None:
            with self._lock:
                session = self._sessions.get(w.key)
                if session is not None and w.first_page == 0:
                    session.remote_fresh = session.snap.version
            if session is not None and self.remote.write == "through":
                self.publisher.queue(w.key)
        return info

    def publish(self, key: SessionKey) -> bool:
        """Publish the session to the remote tier now, on this thread, as the
        publisher would; whether the remote tier then holds its content."""
        if self.remote is None:
            raise FailedPrecondition("there is no remote tier: start with --remote")
        assert self.publisher is not None
        session = self._get(key)
        self.publisher.publish_one(key)
        with self._lock:
            return session.remote_durable and not session.dropped

    def publish_queue(self) -> tuple[int, int]:
        """Sessions waiting for the publisher, and being published (0 or 1)."""
        return self.publisher.queued() if self.publisher is not None else (0, 0)

__all__ = ["Remote", "RemoteLayer"]
