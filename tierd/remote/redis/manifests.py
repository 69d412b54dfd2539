"""Reading manifests off the Redis store: a read returns the whole of one up
to HEAD_BYTES, else its head, whose first line says how long the whole is
(a value of another length is DataLoss before more of it is read); a large
manifest is read whole once per version (kept, by key and first line, up to
MANIFESTS_KEPT bytes), one at a time. Tombstones and versions are read off
the head of a manifest's key alone; losses off its first line and the
lengths of the version's chunks (a script, LOOK). Runs on the thread that
calls it; thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from tierd.errors import DataLoss
from tierd.remote.backend import Refused
from tierd.remote.manifest import HEAD_BYTES, Head, Manifest, dropped_at, held_at, listed_head, owned, version_at
from tierd.remote.redis import scripts
from tierd.remote.redis.link import CHUNK_BYTES, Link, chunks_of
from tierd.types import SessionKey

MANIFESTS_KEPT = 64 << 20  # bytes of large manifests kept so that they are not read again (4 of the largest)
LOOK_BATCH = 8192  # keys missing() asks about in one round trip (a version's keys go together)


class Manifests:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._read = link.client.register_script(scripts.READ)
        # Large manifests read whole (see _manifest_at), by key: (first line, length, manifest), oldest first.
        self._kept: OrderedDict[str, tuple[bytes, int, Manifest]] = OrderedDict()
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        self._large = threading.Lock()  # one large manifest read at a time

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        """The session's current manifest (None: none, or a tombstone: the
        session was dropped) and the version number at its key (0: none);
        DataLoss for a manifest that does not parse or is another session's."""
        name = self.link.key(key, "m")
        m, at = self._manifest_at(name, *self.link.call("a manifest read", self._read, keys=[name], args=[0]))
        return (owned(key, m) if m is not None else None), at

    def heads(self, keys: list[SessionKey]) -> list[Head | None]:
        """The first line of each session's manifest (HEAD_BYTES at most read of each)."""
        if not keys:
            return []
        pipe = self.link.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self.link.key(key, "m"), 0, HEAD_BYTES - 1)
        return [listed_head(key, raw) for key, raw in
                zip(keys, self.link.call("a manifest read", pipe.execute, raise_on_error=False))]

    def _manifest_at(self, name: str, length: int, raw: bytes | None) -> tuple[Manifest | None, int]:
        """What a read of key `name` found (`length` bytes, of which raw is the
        whole or the head): its manifest (None: none, or a tombstone) and the
        version number there. A large one is read whole once per version,
        one at a time; DataLoss where its head says another length."""
        for _ in range(2):
            if raw is None:
                return None, 0
            if dropped_at(raw):
                return None, dropped_at(raw)
            if len(raw) == length:
                m = Manifest.decode(raw)
                return m, m.version
            head = Head.parse(raw)
            if head.length != length:
                raise DataLoss(f"a remote manifest of {length} bytes where its head says {head.length}",
                               tier="remote")
            with self._large:
                with self._kept_lock:
                    kept = self._kept.get(name)
                    if kept is not None and kept[:2] == (head.line, length):
                        self._kept.move_to_end(name)
                        return kept[2], kept[2].version
                # Not as a _call: a large manifest may take longer than the timeout (each read is bounded by it).
                length, raw = self.link.run("a manifest read", self._read, keys=[name], args=[length])
                if raw is not None and len(raw) == length > HEAD_BYTES:
                    m = Manifest.decode(raw)
                    self._keep(name, raw.partition(b"\n")[0], length, m)
                    return m, m.version
        raise Refused("the remote tier's manifest of this session changed twice as it was read")

    def _keep(self, name: str, line: bytes, length: int, m: Manifest) -> None:
        with self._kept_lock:
            old = self._kept.pop(name, None)
            self._kept_bytes += length - (old[1] if old is not None else 0)
            self._kept[name] = (line, length, m)
            while self._kept_bytes > MANIFESTS_KEPT:
                self._kept_bytes -= self._kept.popitem(last=False)[1][1]

    def version_of(self, key: SessionKey) -> int:
        """The version number the manifest switch sees in the manifest's key,
        whatever the rest holds (0: none, or none it can read)."""
        try:
            raw = self.link.call("a manifest read", self.link.client.getrange, self.link.key(key, "m"), 0, 31)
        except DataLoss:
            return 0  # a key of another type: the switch replaces it as none
        return version_at(raw)

    def tombstones(self, keys: list[SessionKey]) -> list[int]:
        """For each session, the version of its tombstone (0: not dropped),
        from the head of its manifest's key alone."""
        pipe = self.link.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self.link.key(key, "m"), 0, 31)
        heads = self.link.call("a tombstone read", pipe.execute, raise_on_error=False)
        return [dropped_at(h) for h in heads]

    def missing(self, versions: list[tuple[SessionKey, int, str, int]]) -> list[bool]:
        """For each version of a session (its number, write id and bytes),
        whether the store lost it: its manifest's key holds nothing that
        resumes the session (nothing, bytes that are no manifest, another
        session's), or that version with a chunk gone or of another length
        (evicted, expired, lost in a fail-over, cut short). Another version or
        a tombstone there is no loss (another node's store, or a drop), nor is
        anything the store did not answer plainly. One LOOK a session: its
        manifest's first line back, and a count of its chunks."""
        out: list[bool] = []
        pipe, asked, keys = self.link.client.pipeline(transaction=False), [], 0
        for key, version, write, nbytes in versions:
            chunks = chunks_of(nbytes)
            names = [self.link.key(key, "m")] + [self.link.key(key, f"w{write}", str(i)) for i in range(chunks)]
            pipe.execute_command("EVAL", scripts.LOOK, len(names), *names, CHUNK_BYTES,
                                 nbytes - (chunks - 1) * CHUNK_BYTES)
            asked.append((key, version, write, chunks))
            keys += len(names)
            if keys >= LOOK_BATCH:
                out += self._missing(pipe, asked)
                pipe, asked, keys = self.link.client.pipeline(transaction=False), [], 0
        return out + self._missing(pipe, asked)

    def _missing(self, pipe: Any, asked: list[tuple[SessionKey, int, str, int]]) -> list[bool]:
        if not asked:
            return []
        replies = self.link.call("a manifest read", pipe.execute, raise_on_error=False)
        out = []
        for (key, version, write, chunks), reply in zip(asked, replies):
            if isinstance(reply, Exception):
                out.append(False)  # not a plain answer
                continue
            line, length, whole = reply
            at = held_at(key, line, length)
            out.append(at is None or at == (version, write) and whole < chunks)
        return out
