"""The finder: what the remote tier's head of a session makes of this
node's copy, read once per API call (one_read), and what is done with the
copy then: kept, forgotten (dropped on another node), remote-durable no
more and published again, or given way to the remote version (the caller
fetches it). The module docstring of remote.py says why. Runs on the RPC
thread of the call that asks, a mover (a Prefetch's fetch), the publisher
and the sweep."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager


from tierd.core.model import UNKNOWN, Session
from tierd.core.roles import TierRoles
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.link import RemoteLink
from tierd.core.store.remote import PublishQueue, Remote
from tierd.core.store.table import SessionTable
from tierd.errors import DataLoss, Unavailable, shown
from tierd.remote.coded import holds
from tierd.remote.manifest import Manifest
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.store")


class Finder:
    def __init__(self, table: SessionTable, lifecycle: Lifecycle, link: RemoteLink, remote: Remote,
                 queue: PublishQueue, roles: TierRoles) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.link = link
        self.remote = remote
        self.queue = queue
        self.roles = roles
        self._heads = threading.local()  # what one_read found, per thread

    def stale(self, key: SessionKey, whole: bool = False) -> Manifest | None:
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
        with self.table.lock:
            session = self.table.find(key)
            if session is not None and not session.damaged and not session.from_remote:
                return None  # this node's own history: the session, whatever the remote tier holds
            version = -1 if session is None or session.damaged else session.remote_version
            write = "" if session is None else session.remote_write
        if version > 0 and not whole and self._unchanged(key, version, write):
            return None
        try:
            m, at = self.head(key)
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
                self.gone(session, version, write)  # no node resumes it from there: published again
            return None
        if session is not None and version == UNKNOWN and session.own_expect == at:
            self._own(session, fresh=True)  # a history of this node's own, none of whose publishes landed
            return None
        if session is not None and self.settle(session, version, m, at) == "kept":
            return None
        if session is not None and version == UNKNOWN and m is not None and self._recognised(session, m):
            return None  # recovered, and what the remote tier holds: published as it is
        if m is not None and (m.version != version or (write and m.write != write)):
            return m  # another version, or another node's publish under this one's number (this node's was lost)
        if session is not None and version > 0 and (not at or m is not None and whole and self._lost(key, m)):
            self.gone(session, version, write)
        if session is not None and version == UNKNOWN and not at:
            self._own(session)  # recovered, and the remote tier holds nothing of it: this node's own history
        return None

    def _unchanged(self, key: SessionKey, version: int, write: str) -> bool:
        """Whether the remote tier's backend knows, without asking the store,
        that the session's key still holds this copy's version (Redis's change
        notices): then the copy is the session, as a read would have found."""
        if self.link.down.is_set():
            return False
        known = self.remote.store.current(key)
        if known is None or known[0] != version or not known[1] or (write and known[1] != write):
            return False
        spared = getattr(self._heads, "spared", None)
        if spared is None or key not in spared:  # counted as the read it spares: once per call
            self.link.events.remote_op("manifest", "known")
            if spared is not None:
                spared.add(key)
        return True

    def _recognised(self, session: Session, m: Manifest) -> bool:
        """Whether a copy recovered from disk is manifest m's version (the same
        identity and page checksums): recorded as published, not fetched."""
        with self.table.lock:
            snap = session.snap
            if session.remote_version != UNKNOWN or not holds(m, snap.spec.fingerprint, snap.checksums):
                return False
            session.remote_is(m)
            session.remote_at = snap.version
            return True

    def _own(self, session: Session, fresh: bool = False) -> None:
        """A recovered copy the remote tier holds nothing of (fresh: nothing
        of since this node tried to publish it): this node's own, served and
        published (fresh: as a new history, over whatever the key holds)."""
        with self.table.lock:
            if session.remote_version != UNKNOWN:
                return
            session.remote_version = 0
            if fresh:
                session.remote_fresh = session.snap.version
        if self.remote.write == "through":
            self.queue.add(session.key)

    @contextmanager
    def one_read(self) -> Iterator[None]:
        """Within this, on this thread (one API call), each session's remote
        manifest is read once at most: the call's steps (a prompt's limit,
        then the lookup, say) share what the first read found."""
        self._heads.found, self._heads.spared = {}, set()
        try:
            yield
        finally:
            self._heads.found = self._heads.spared = None

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        """The session's remote manifest and the version at its key (see
        RemoteBackend.head), read once per one_read."""
        found = getattr(self._heads, "found", None)
        if found is not None and key in found:
            return found[key]
        head = self.link.call("manifest", self.remote.store.head, key)
        if found is not None:
            found[key] = head
        return head

    def _lost(self, key: SessionKey, m: Manifest) -> bool:
        """Whether a chunk of manifest m's version is gone from the remote tier (False where it does not answer)."""
        try:
            return self.link.call("manifest", self.remote.store.missing, [(key, m.version, m.write, m.stored)])[0]
        except Unavailable:
            return False

    def _went_back(self, session: Session, version: int, m: Manifest | None) -> None:
        """The remote tier holds again what this node's publish of `version`
        replaced (a master lost before its replica had that publish): this
        node's copy is the session. It is served as it is, is no longer
        remote-durable, and is published again onto what the tier holds."""
        with self.table.lock:
            if session.remote_version != version or not session.remote_durable:
                return
            session.remote_version, session.remote_at = version - 1, -1
            session.remote_write = m.write if m is not None else ""
        log.warning("%s/%s: the remote tier lost this node's last publish (a fail-over?); it is published again",
                    *session.key)
        self.queue.add(session.key)

    def gone(self, session: Session, version: int, write: str) -> None:
        """The remote tier no longer holds this node's copy of remote version
        `version` (write id `write`): expired, evicted, or a first publish
        lost in a fail-over. The copy is no longer remote-durable, and is
        published again; as a copy that was published before, not as a new
        history: it gives way to whatever another node published since."""
        with self.table.lock:
            if not session.remote_durable or session.dropped or \
                    (session.remote_version, session.remote_write) != (version, write):
                return
            session.remote_at = session.remote_fresh = -1
        log.info("%s/%s: the remote tier no longer holds this node's copy (evicted or expired); it is published again",
                 *session.key)
        self.queue.add(session.key)

    def settle(self, session: Session, version: int, m: Manifest | None, at: int) -> str:
        """What the remote tier's head (manifest m, or a tombstone, at version
        `at`) makes of this node's copy of remote version `version`: "kept"
        where it holds again what this node's publish of it replaced (the copy
        is published again), "forgotten" where it dropped the session since,
        else "" (the caller compares the versions)."""
        if 0 < at == version - 1:
            self._went_back(session, version, m)
            return "kept"
        if m is None and at and at != version and self.dropped_elsewhere(session, version):
            return "forgotten"
        return ""

    def dropped_elsewhere(self, session: Session, version: int) -> bool:
        """Forget this node's copy of a session another node dropped (of remote
        version `version`, the one that was found dropped), with the stores
        made here onto that version since (they continued the conversation
        that was dropped), unless it was stored from token 0 here (a new
        history) or fetched again meanwhile."""
        lock, now = self.table.acquire(session.key)
        try:
            if now is session and (session.damaged or session.remote_version == version and session.from_remote):
                log.info("%s/%s was dropped on another node: this node's copy is forgotten", *session.key)
                self.lifecycle.forget(session, "drop")
                return True
            return False
        finally:
            lock.release()
