"""Fetches: a session's version that only the remote tier holds, brought
into the landing tier, every page checked against the manifest's
checksums, in place of an older local copy; for a Restore, scattered into
the engine's blocks as it arrives; for a Prefetch, on a mover (jobs.py),
its outcome kept for WaitReady. One fetch per key at once, never across a
drop of it (remote.py: RemoteBusy). Runs on the RPC thread of the call
that reads the session, or a mover."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.model import UNKNOWN, Session
from tierd.core.move_queue import Job, MoveQueue
from tierd.core.roles import TierRoles
from tierd.core.store.checks import check_blocks
from tierd.core.store.coding import PageCoder
from tierd.core.store.describe import IdleChecks
from tierd.core.store.finder import Finder
from tierd.core.store.lifecycle import Lifecycle, merge_prefetch
from tierd.core.store.link import RemoteLink
from tierd.core.store.reads import Reader
from tierd.core.store.remote import Remote, RemoteBusy
from tierd.core.store.remote_info import spec_of
from tierd.core.store.table import SessionTable
from tierd.core.store.writes import Writer
from tierd.errors import DataLoss, NotFound, TierdError, Unavailable, shown
from tierd.layout import KVSpec
from tierd.remote.manifest import Manifest
from tierd.tiers import tier_rank
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import CopyEngine, EngineMemory
from tierd.transfer.runs import between
from tierd.transfer.runs import Geometry
from tierd.types import RestoreResult, SessionKey

log = logging.getLogger("tierd.core.store")

FAILED_KEPT = 1024  # keys whose last fetch failed, remembered for WaitReady


@dataclass
class _Into:
    """Engine blocks a fetch scatters pages [0, len(ids)) into as they arrive:
    a Restore of a session whose current version only the remote tier holds.
    session is set once the version fetched is the session's (the blocks
    then hold it); else the Restore reads the session as it is."""

    engine: EngineMemory
    ids: np.ndarray
    session: Session | None = None


class Fetcher:
    def __init__(self, table: SessionTable, finder: Finder, writer: Writer, reader: Reader, lifecycle: Lifecycle,
                 idle: IdleChecks, moves: MoveQueue, busy: RemoteBusy, link: RemoteLink, remote: Remote,
                 copier: CopyEngine, coder: PageCoder, roles: TierRoles, clock: Clock, events: StoreEvents) -> None:
        self.table = table
        self.coder = coder
        self.finder = finder
        self.writer = writer
        self.reader = reader
        self.lifecycle = lifecycle
        self.idle = idle
        self.moves = moves
        self.busy = busy
        self.link = link
        self.remote = remote
        self.copier = copier
        self.roles = roles
        self.clock = clock
        self.events = events
        self._fetches: set[SessionKey] = set()  # queued or running fetches (Prefetch), under the store lock
        # Why the last fetch of a key failed (DataLoss, NotFound), for WaitReady; the latest FAILED_KEPT.
        self._failed: OrderedDict[SessionKey, TierdError] = OrderedDict()

    def bring(self, key: SessionKey, appending: bool = False) -> None:
        """Make this node's copy the session's current version, fetching it
        into the host tier where the remote tier holds a newer one. For an
        append, a tier that does not answer leaves this node's copy to store
        onto: the store is published once it answers (or gives way to a drop
        or another node's history found then)."""
        try:
            m = self.finder.stale(key)
        except Unavailable:
            if appending:
                return
            raise
        if m is not None:
            self.fetch(key, m)

    def fetch(self, key: SessionKey, m: Manifest | None = None, into: _Into | None = None) -> bool:
        """Bring the session's remote version (m, else the current one) into the
        host tier, every page checked, in place of an older local copy (and
        into engine blocks on the way, see _Into); False if the remote tier
        holds none. One fetch per key at once: a second caller waits for the
        first."""
        done, mine = self.busy.start_fetch(key)  # after a drop of the key, never across it
        if not mine:  # another fetch of the key runs: its outcome
            done.wait(60.0)
            return self.table.has(key)
        try:
            m = m or self.finder.stale(key)
            if m is None:
                return self.table.has(key)
            self._adopt(key, m, into)
            return True
        finally:
            self.busy.end_fetch(key, done)

    def _adopt(self, key: SessionKey, m: Manifest, into: _Into | None = None) -> None:
        spec = spec_of(key, m, self.roles.versions)
        n = m.n_pages
        geom = Geometry(m.page_bytes, n, m.nbytes - (n - 1) * m.page_bytes)
        hashes = m.token_hashes if len(m.token_hashes) else None
        decoder = self.coder.decoder(m, spec)  # (coded pages: read into a buffer of its own, decoded into theirs)
        t0 = time.perf_counter()
        # Every page of the manifest is read into pages of its own (the fetch writes them all as they come).
        w = self.writer.begin_write(key, spec, self.roles.landing, 0, m.num_tokens, m.nbytes, geom, hashes, None,
                                    share=False)
        try:
            writer = self.copier.page_writer(w.spans, geom)
            want = into.ids.size if into is not None else 0
            step, scattered = max(1, self.copier.window_bytes // geom.stride), 0
            for received in self.remote.store.read_into(key, m, decoder.claim if decoder else writer.claim):
                arrived = decoder.decode_upto(received, writer) if decoder else \
                    n if received == m.nbytes else received // geom.page_bytes
                done = min(arrived, want)
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
            self.writer.abort_write(w)
            self.link.went_down("fetch")
            raise
        except DataLoss:
            self.writer.abort_write(w)
            self.events.checksum_failed(self.roles.versions)
            raise
        except BaseException:
            self.writer.abort_write(w)
            raise
        lock, session = self.table.acquire(key)
        try:
            fetched = (session.remote_version, session.remote_write) == (m.version, m.write) if session else False
            if session is not None and not session.damaged and session.remote_version != UNKNOWN and \
                    (not session.remote_durable or fetched):
                self.writer.abort_write(w)  # stored here meanwhile (this node's copy is the session), or fetched
                return
            session = self.writer.install(key, lock, session, spec, 0, w.pieces, self.roles.landing, sums,
                                          m.num_tokens, m.nbytes, None, hashes, errors=m.errors, fetched=True)
            w.pieces = []
            if into is not None:
                into.session = session
            with self.table.lock:
                session.remote_is(m)
                session.remote_at = session.snap.version
                session.released_at = self.clock.now()
                self.idle.schedule(session)
        finally:
            lock.release()
        seconds = time.perf_counter() - t0
        self.copier.record(f"{self.roles.versions}->{self.roles.landing}", m.nbytes, seconds)
        self.coder.measured(m.codec, "fetch", m.nbytes, seconds)
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

    def restore(self, key: SessionKey, m: Manifest, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
                whole: bool = False) -> RestoreResult | None:
        """A Restore of a session whose current version is manifest m's, held
        by the remote tier alone: fetched, and where the call would succeed on
        the version fetched, its pages go into the blocks as they arrive (the
        scatter overlaps the fetch); the result, or None where the restore
        then reads the session as it is (and says why not)."""
        ids = check_blocks(block_ids, engine.layout.num_blocks)
        if whole and ids.size >= m.n_pages:
            ids = ids[: m.n_pages]
        fetched = spec_of(key, m, self.roles.versions)
        into = _Into(engine, ids) if fetched.fingerprint == spec.fingerprint and 0 < ids.size <= m.n_pages else None
        t0 = time.perf_counter()
        self.fetch(key, m, into)
        if into is not None and into.session is not None:
            return self.reader.restored(into.session, fetched, m.num_tokens, m.nbytes, int(ids.size),
                                        self.roles.versions, time.perf_counter() - t0)
        return None

    def prefetch(self, key: SessionKey, tier: str, priority: int, deadline: float | None) -> str:
        """Queue the fetch of the session's remote version, and a promotion to `tier` after it."""
        with self.table.lock:
            self._fetches.add(key)
            self._failed.pop(key, None)
        self.moves.submit(Job(key, tier, "fetch", IOClass.PREFETCH, priority, deadline), merge_prefetch)
        return "queued"

    def dropped(self, key: SessionKey) -> None:
        """The key was dropped: a queued fetch of it was cancelled with it."""
        with self.table.lock:
            self._fetches.discard(key)

    def pending(self, key: SessionKey) -> bool:
        """Whether a fetch of the key is queued or running; raises why the last
        one failed where it failed and the session is not held (WaitReady
        says why, rather than "not found")."""
        with self.table.lock:
            if key in self._fetches:
                return True
            failed = self._failed.get(key) if not self.table.has(key) else None
        if failed is not None:
            raise failed
        return False

    def run_job(self, job: Job, promote: Callable[[Job], None]) -> None:
        """A mover runs a fetch (a Prefetch of a version the remote tier holds),
        then, where the prefetch asked for a tier faster than the landing
        tier, the promotion there (promote: the mover's prefetch job); the
        fetch is pending (ready() says so) until both are done."""
        try:
            if job.deadline is not None and self.clock.now() > job.deadline:
                self.events.prefetch_outcome("missed")
                return
            try:
                found = self.fetch(job.key)
            except TierdError as exc:
                log.warning("fetch of %s/%s from the remote tier failed: %s", *job.key, exc)
                found = False
                if isinstance(exc, (DataLoss, NotFound)):
                    with self.table.lock:
                        self._failed[job.key] = exc
                        while len(self._failed) > FAILED_KEPT:
                            self._failed.popitem(last=False)
            if not found:
                self.events.prefetch_outcome("missed")
                return
            if tier_rank(job.target) < tier_rank(self.roles.landing):
                promote(Job(job.key, job.target, "prefetch", job.io_class, job.priority, job.deadline))
                return
            session = self.table.find(job.key)
            if session is not None:
                now = self.lifecycle.expect(session)
                self.events.prefetch_outcome("late" if job.deadline is not None and now > job.deadline else "in_time")
        finally:
            with self.table.lock:
                self._fetches.discard(job.key)
            self.table.notify()
