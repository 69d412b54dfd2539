"""FileBackend: versions of sessions in a shared directory (the package's
docstring says how). Runs on the thread that calls it (RPC threads, movers,
the publisher); thread-safe."""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tierd.errors import DataLoss, FailedPrecondition, NotFound, Unavailable
from tierd.remote.backend import RECOUNT
from tierd.remote.files import fsio
from tierd.remote.files.listing import TenantLists
from tierd.remote.coded import Coding
from tierd.remote.manifest import (HEAD_BYTES, MAX_MANIFEST_BYTES, MAX_VERSION, Head, Manifest, check_bounds,
                                   dropped_at, held_at, listed_head, made, next_version, owned, owner_of, tag_of,
                                   version_at)
from tierd.types import SessionKey

LINE_BYTES = 4096  # of a manifest missing() reads first: its first line, unless its spec's text is long
MARKER = "marker"  # a file the directory holds from its first use on
ORPHAN_SECONDS = 3600.0  # a version's bytes no manifest names, this old, are a dead publish's
# Record locks are the process's, whichever file descriptor took them: threads (and backends) of one
# process take one of these first.
_LOCKS = [threading.Lock() for _ in range(64)]


class FileBackend:
    chunk_bytes = 4 << 20
    publish_window = 16 << 20

    def __init__(self, root: str, prefix: str = "tierd", ttl: float | None = None) -> None:
        self.root = os.path.join(root, prefix)
        self.ttl = ttl or 0.0
        fsio.call("opening the directory", os.makedirs, os.path.join(self.root, "s"), exist_ok=True)
        fsio.call("opening the directory", os.makedirs, os.path.join(self.root, "t"), exist_ok=True)
        # Where the directory is not mounted (or was swapped), this is missing: every call is Unavailable
        # then, not an empty store that takes drops and publishes into the mount point.
        self.marker = os.path.join(self.root, MARKER)
        if not os.path.exists(self.marker):
            fsio.call("opening the directory", fsio.replace, self.root, MARKER, b"a remote tier of tierd\n")
        self.lists = TenantLists(os.path.join(self.root, "t"))
        self.listed, self.unlist = self.lists.listed, self.lists.unlist

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"directory {self.root}"

    def dir_of(self, key: SessionKey) -> str:
        tag = tag_of(key)
        return os.path.join(self.root, "s", tag[:2], tag)

    @contextmanager
    def _locked(self, where: str) -> Iterator[None]:
        import fcntl

        with _LOCKS[hash(where) % len(_LOCKS)]:
            fd = fsio.call("a lock", os.open, os.path.join(where, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
            try:
                fsio.call("a lock", fcntl.lockf, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # the record lock goes with it

    def _mounted(self) -> None:
        """Unavailable unless the directory is the one opened (its marker is there)."""
        if not os.path.exists(self.marker):
            raise Unavailable(f"the remote directory {self.root} lost its {MARKER} file: not mounted, or replaced")

    def _file(self, path: str, what: str) -> tuple[int, os.stat_result] | None:
        """A session's file, open (the caller closes it), and its status; None
        where there is none (and the directory is mounted). Anything else
        than a plain file there (a directory, a pipe: one would block the
        read) is that session's DataLoss."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self._mounted()
            return None
        except OSError as exc:
            fsio.call(what, _raise, exc)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DataLoss(f"the remote tier holds something else than a file at a session's place ({what})",
                               tier="remote")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _open(self, where: str) -> tuple[int, int] | None:
        """The manifest's file, open (the caller closes it), and its size;
        None for none, or one older than the TTL."""
        opened = self._file(os.path.join(where, "m"), "a manifest read")
        if opened is None:
            return None
        fd, st = opened
        if self.ttl and time.time() - st.st_mtime > self.ttl:
            os.close(fd)
            return None
        return fd, st.st_size

    def _current(self, where: str, head_only: bool = False) -> bytes | None:
        """What the manifest's file holds (None: none, or older than the TTL),
        or with head_only its first 64 bytes (a tombstone, or a version's
        number and write id); DataLoss
        for one larger than a manifest can be, found by its size before
        anything is read."""
        opened = self._open(where)
        if opened is None:
            return None
        fd, size = opened
        try:
            if not head_only and size > MAX_MANIFEST_BYTES:
                raise DataLoss(f"a remote manifest does not parse ({size} bytes)", tier="remote")
            return fsio.call("a manifest read", os.pread, fd, 64 if head_only else size, 0)
        finally:
            os.close(fd)

    def _line(self, where: str) -> tuple[bytes | None, int]:
        """The manifest's first line (to its newline, HEAD_BYTES at most; None
        for none, or older than the TTL) and the file's size: LINE_BYTES
        read, more only where the line is longer."""
        opened = self._open(where)
        if opened is None:
            return None, 0
        fd, size = opened
        try:
            raw = fsio.call("a manifest read", os.pread, fd, LINE_BYTES, 0)
            if b"\n" not in raw and size > LINE_BYTES:
                raw = fsio.call("a manifest read", os.pread, fd, HEAD_BYTES, 0)
            line, newline, _ = raw.partition(b"\n")
            return line + newline, size
        finally:
            os.close(fd)

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        raw = self._current(self.dir_of(key))
        if raw is None:
            return None, 0
        if dropped_at(raw):
            return None, dropped_at(raw)
        m = owned(key, Manifest.decode(raw))
        return m, m.version

    def current(self, key: SessionKey) -> tuple[int, str] | None:
        return None  # a shared directory tells no one of a change: every read asks

    def hears_changes(self) -> bool:
        return False

    def replicated(self, keys: list[SessionKey]) -> list[bool]:
        return [True] * len(keys)  # a publish syncs its files and directories before it returns

    def version_of(self, key: SessionKey) -> int:
        return version_at(self._current(self.dir_of(key), head_only=True))

    def heads(self, keys: list[SessionKey]) -> list[Head | None]:
        return [listed_head(key, self._line(self.dir_of(key))[0]) for key in keys]

    def missing(self, versions: list[tuple[SessionKey, int, str, int]]) -> list[bool]:
        return [self._lost(key, *rest) for key, *rest in versions]

    def _lost(self, key: SessionKey, version: int, write: str, nbytes: int) -> bool:
        where = self.dir_of(key)
        try:
            at = held_at(key, *self._line(where))
            return at is None or at == (version, write) and os.stat(os.path.join(where, f"w{write}")).st_size != nbytes
        except (FileNotFoundError, DataLoss):
            return True  # the version's bytes are gone, or something else is at the manifest's place
        except (OSError, Unavailable):
            return False  # not a plain answer

    def usage(self, tenant: str, session_id: str, recount: bool = False) -> tuple[int, int]:
        if recount:  # sessions expired or dropped no longer count
            heads = {i: self._current(self.dir_of(SessionKey(tenant, i)), head_only=True)
                     for i in self.lists.sample(tenant, RECOUNT)}
            self.unlist(tenant, [i for i, h in heads.items() if h is None or dropped_at(h)])
        return self.lists.usage(tenant, session_id)

    def tombstones(self, keys: list[SessionKey]) -> list[int]:
        return [dropped_at(self._current(self.dir_of(key), head_only=True)) for key in keys]

    def publish(self, key: SessionKey, expect: int, spec: dict[str, Any], fingerprint: str, num_tokens: int,
                page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray,
                data: Iterable[tuple[bytes | memoryview, bool]], coding: Coding | None = None) -> Manifest:
        check_bounds(len(checksums), np.asarray(token_hashes), coding is not None)
        self._mounted()  # else it would write into the mount point
        where = self.dir_of(key)
        write = secrets.token_hex(8)
        path = os.path.join(where, f"w{write}")
        try:
            fsio.call("a page write", os.makedirs, where, exist_ok=True)
            nbytes = fsio.call("a page write", fsio.write_file, path, data)
            number = next_version(expect)
            manifest = made(number, write, fingerprint, spec, num_tokens, nbytes, page_bytes, checksums, token_hashes,
                            owner_of(key), coding)
            with self._locked(where):
                old = self._current(where)
                have = version_at(old)
                if have != expect:
                    raise FailedPrecondition(f"another node published version {have} of this session first",
                                             version=have)
                fsio.call("the manifest switch", fsio.replace, where, "m", manifest.encode())
        except BaseException:
            fsio.unlink(path)
            raise
        self.lists.add(key, nbytes)
        self._reclaim(where, old, keep=write)
        return manifest

    def _reclaim(self, where: str, old: bytes | None, keep: str = "") -> None:
        """Delete the bytes of the version `old` was, and those of publishes
        that died before their switch (or that expired)."""
        if old and not dropped_at(old):
            try:
                fsio.unlink(os.path.join(where, f"w{Manifest.decode(old).write}"))
            except DataLoss:
                pass
        try:
            names = os.listdir(where)
        except OSError:
            return
        now = time.time()
        age = min(ORPHAN_SECONDS, self.ttl) if self.ttl else ORPHAN_SECONDS
        for name in names:
            path = os.path.join(where, name)
            try:
                if name.startswith("w") and name != f"w{keep}" and now - os.stat(path).st_mtime > age:
                    fsio.unlink(path)
            except OSError:
                pass

    def read_into(self, key: SessionKey, manifest: Manifest, claim: Callable[[int], list[Any]]) -> Iterator[int]:
        step = self.chunk_bytes
        stored = manifest.stored
        sinks = [claim(min(step, stored - at)) for at in range(0, stored, step)]
        opened = self._file(os.path.join(self.dir_of(key), f"w{manifest.write}"), "a page read")
        if opened is None:
            raise NotFound("the remote copy of this session is gone (dropped or replaced)")
        fd, st = opened
        try:
            size = st.st_size
            if size != stored:
                raise DataLoss(f"the remote copy holds {size} bytes, not the {stored} its manifest says "
                               "(torn or damaged)", tier="remote")
            at = 0
            for bufs in sinks:
                at += fsio.call("a page read", fsio.read_full, fd, [memoryview(b).cast("B") for b in bufs], at)
                yield at
        finally:
            os.close(fd)

    def drop(self, key: SessionKey) -> bool:
        where = self.dir_of(key)
        old = None
        if self._current(where, head_only=True) is not None:
            with self._locked(where):
                old = self._current(where)
                if old is not None and not dropped_at(old):
                    n = version_at(old) + 1
                    fsio.call("a drop", fsio.replace, where, "m", f"{n if n <= MAX_VERSION else 1} dropped".encode())
                else:
                    old = None
        self.unlist(key.tenant, [key.session_id])
        if old is None:
            return False
        self._reclaim(where, old)
        return True

    def ping(self) -> None:
        self._mounted()
        fsio.call("a ping", os.stat, self.root)
        if not os.access(self.root, os.W_OK | os.X_OK):
            fsio.call("a ping", _raise, PermissionError(f"{self.root} cannot be written"))


def _raise(exc: OSError) -> None:
    raise exc
