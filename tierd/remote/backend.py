"""What the core needs of a remote store, whatever holds the bytes: the
`RemoteBackend` protocol. Backends live in packages of their own beside this
module, registered by URL scheme (registry.py); they import nothing of the
daemon, and the core knows only this protocol.

One history per session. A version is published whole or not at all: its
bytes first, then the manifest switched by compare-and-set on the version it
replaces, so racing writers never splice and a reader never sees a mix. A
drop leaves a tombstone one version past the one it ends; the next history
numbers on from it. A version whose bytes are not all there is NotFound
(recompute, never a part); bytes that do not match their manifest are
DataLoss. The caller checks every page it reads against the manifest's
checksums: a backend need not.

Runs on the thread that calls it (RPC threads, movers, the publisher); every
method is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from tierd.errors import Unavailable
from tierd.types import SessionKey

RECOUNT = 256  # a tenant's sessions a recount checks against what the store holds (usage(recount=True)), of each
# record a backend keeps of them (the Redis backend's list and map of bytes)


class Refused(Unavailable):
    """The remote store answered, with an error (out of memory, say), or the
    backend refused the call (a session past what a manifest may be): the
    call failed, the store is not down."""


class Unreplicated(Refused):
    """A version the store took (it is the session's now, manifest), which is
    not yet held as durably as the backend promises (Redis: no replica
    acknowledged it in time); replicated() says once it is."""

    def __init__(self, message: str, manifest: Any) -> None:
        super().__init__(message)
        self.manifest = manifest


class RemoteBackend(Protocol):
    """Sessions' versions in a store every node reaches."""

    chunk_bytes: int  # read_into claims memory this many bytes at a time (the last claim may be shorter)
    publish_window: int  # bytes of pieces publish may hold at once (views of a piece valid only while held)

    def head(self, key: SessionKey) -> tuple[Any, int]:
        """(current Manifest or None, version number at the session's key;
        0: none). None with a number: a tombstone (dropped). DataLoss for a
        manifest that does not parse or is another session's."""

    def current(self, key: SessionKey) -> tuple[int, str] | None:
        """(version number, write id: '' for a tombstone or none) at the
        session's key, known without asking the store (a backend that hears
        of every change keeps it: the Redis backend's notices); None where
        that is not known now. Answers at once, from memory."""

    def hears_changes(self) -> bool:
        """Whether current() may answer now (the backend hears of every change)."""

    def version_of(self, key: SessionKey) -> int:
        """The version number the manifest's switch compares, whatever the
        rest of the manifest holds (0: none): what a store replacing an
        unusable manifest expects."""

    def heads(self, keys: list[SessionKey]) -> list[Any]:
        """The first line of each session's current manifest (a manifest.Head;
        None: none, dropped, one that does not parse, or another session's):
        what a listing says of it, read without the rest."""

    def tombstones(self, keys: list[SessionKey]) -> list[int]:
        """For each session, the version of its tombstone (0: not dropped)."""

    def publish(self, key: SessionKey, expect: int, spec: dict[str, Any], fingerprint: str, num_tokens: int,
                page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray,
                data: Iterable[tuple[bytes | memoryview, bool]], coding: Any = None) -> Any:
        """A new version replacing `expect` (0: none); data is the logical
        bytes in pieces, each with whether it stays valid until this returns;
        or, with coding (a manifest.Coding, filled once data is read), the
        pages' coded bytes, which the manifest then describes
        (manifest.made).
        FailedPrecondition (with the version found) where another writer got
        there first: nothing is left behind. Unreplicated (with the manifest)
        where the store took the version but does not hold it as durably as
        the backend promises yet. Refused, before anything is
        written, for a session past what a manifest may be
        (manifest.check_bounds)."""

    def replicated(self, keys: list[SessionKey]) -> list[bool]:
        """For each session, whether everything the store took for it until
        now is held as durably as the backend promises (Redis: acknowledged by
        the replicas --remote-replicas asks for, fewer where its primary has
        fewer connected); False where that is not so yet."""

    def read_into(self, key: SessionKey, manifest: Any, claim: Callable[[int], list[Any]]) -> Iterator[int]:
        """Read the version into the memory claim(n) gives for each next n
        bytes; yields how many bytes are in place as more arrive. NotFound
        where any of it is gone; nothing is written once this returns."""

    def drop(self, key: SessionKey) -> bool:
        """Tombstone the current version and reclaim its bytes; whether there
        was one."""

    def missing(self, versions: list[tuple[SessionKey, int, str, int]]) -> list[bool]:
        """For each version a node holds a copy of (session, version number,
        write id, bytes it takes in the store: Manifest.stored), whether the store lost it, so that no node resumes
        it: nothing at the session's key, or nothing that resumes it there
        (bytes that are no manifest, a manifest of another length than its
        first line says, another session's), or that version with any of its
        bytes gone or of another length. Another version or a tombstone there
        is no loss; neither is a store that did not answer plainly. Read off
        the manifest's first line and the bytes' lengths: a byte changed in
        place is found by reading the pages against their checksums, not
        here."""

    def usage(self, tenant: str, session_id: str, recount: bool = False) -> tuple[int, int]:
        """Bytes of the tenant's sessions the store holds, and of this one;
        with recount, after some of the tenant's listed sessions were checked
        against what the store holds (those gone unlisted)."""

    def listed(self, tenant: str, after: str = "", count: int = 100) -> list[str]:
        """The tenant's session ids, in order, after `after`."""

    def unlist(self, tenant: str, session_ids: list[str]) -> None:
        """Forget these ids in the tenant's list (their versions are gone)."""

    def ping(self) -> None:
        """Unavailable unless the store answers."""

    def describe(self) -> str:
        """What the store is and where, for the log (no password)."""

    def close(self) -> None:
        ...
