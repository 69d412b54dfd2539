"""A remote store in a directory every node mounts (NFS, Lustre, 3FS, CephFS):
`--remote file:///mnt/kv`. The same contracts as the Redis backend
(backend.py), with the file system's own atomicity.

Layout under ROOT/PREFIX: `s/TAG[:2]/TAG/` per session, TAG a hash of tenant
and session id (no path names either): `m` its manifest (or tombstone),
`wWRITE` the bytes of one version, `lock` the file whose lock makes the
manifest's switch a compare-and-set across nodes. `t/TENANT TAG/TAG` lists a
tenant's sessions: the session's bytes and its id.

Publishing writes the version's bytes to a file of its own and syncs them;
then, holding the session's lock (a POSIX record lock, which NFS and Lustre
carry between nodes, and a thread lock, since record locks are per
process), it reads the manifest's version, compares it with the one
expected, and renames a synced new manifest over the old one (rename is
atomic: a reader opens the old file or the new, never a mix). The loser of
a race deletes its bytes; the winner deletes those of the version it
replaced. A reader holding the old manifest then finds its bytes gone:
NotFound, as for a chunk evicted from Redis. A version's file of another
size than its manifest says (torn, cut short, grown) is DataLoss; changed
bytes are found by the caller's page checksums. A drop renames a tombstone
over the manifest, then deletes the bytes: no node can resume what is
dropped. Bytes of a publish that died between its write and its switch are
deleted by the next publish of the session an hour on.

With a TTL, a manifest or tombstone last written longer ago than it counts
as gone, as a Redis key that expired (its bytes are deleted by the next
publish or drop of the session).

Runs on the thread that calls it (RPC threads, movers, the publisher).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tierd.errors import DataLoss, FailedPrecondition, NotFound, Unavailable
from tierd.remote.backend import Refused
from tierd.tiers.remote import (FIRST_VERSIONS, MAX_MANIFEST_BYTES, MAX_VERSION, Manifest, _dropped_at, _owned,
                                _version, owner_of, tag_of)
from tierd.types import SessionKey

ORPHAN_SECONDS = 3600.0  # a version's bytes no manifest names, this old, are a dead publish's
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the store answered: no room
# Record locks are the process's, whichever file descriptor took them: threads (and backends) of one
# process take one of these first.
_LOCKS = [threading.Lock() for _ in range(64)]


class FileBackend:
    """Versions of sessions in a shared directory (see the module docstring)."""

    chunk_bytes = 4 << 20
    publish_window = 16 << 20

    def __init__(self, root: str, prefix: str = "tierd", ttl: float | None = None) -> None:
        self.root = os.path.join(root, prefix)
        self.ttl = ttl or 0.0
        self._call("opening the directory", os.makedirs, os.path.join(self.root, "s"), exist_ok=True)
        self._call("opening the directory", os.makedirs, os.path.join(self.root, "t"), exist_ok=True)

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"directory {self.root}"

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except OSError as exc:
            if exc.errno in _FULL:
                raise Refused(f"the remote directory refused {what}: {exc.strerror}") from None
            raise Unavailable(f"the remote directory did not answer ({what}): {exc}") from None

    def _dir(self, key: SessionKey) -> str:
        tag = tag_of(key)
        return os.path.join(self.root, "s", tag[:2], tag)

    def _tenant(self, tenant: str) -> str:
        return os.path.join(self.root, "t", hashlib.sha256(tenant.encode()).hexdigest()[:24])

    @contextmanager
    def _locked(self, key: SessionKey, where: str) -> Iterator[None]:
        import fcntl

        with _LOCKS[hash(where) % len(_LOCKS)]:
            fd = self._call("a lock", os.open, os.path.join(where, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                            0o600)
            try:
                self._call("a lock", fcntl.lockf, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # the record lock goes with it

    def _current(self, where: str, head_only: bool = False) -> bytes | None:
        """What the manifest's file holds (None: none, or older than the TTL),
        or with head_only its first 32 bytes (enough for a tombstone); DataLoss
        for one larger than a manifest can be, found by its size before
        anything is read."""
        try:
            fd = os.open(os.path.join(where, "m"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Unavailable(f"the remote directory did not answer (a manifest read): {exc}") from None
        try:
            st = os.fstat(fd)
            if self.ttl and time.time() - st.st_mtime > self.ttl:
                return None
            if head_only:
                return self._call("a manifest read", os.pread, fd, 32, 0)
            if st.st_size > MAX_MANIFEST_BYTES:
                raise DataLoss(f"a remote manifest does not parse ({st.st_size} bytes)", tier="remote")
            return self._call("a manifest read", os.pread, fd, st.st_size, 0)
        finally:
            os.close(fd)

    def _replace(self, where: str, name: str, data: bytes) -> None:
        """Write `data` to where/name whole or not at all, synced."""
        tmp = os.path.join(where, f".{name}.{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(where, name))
            _sync_dir(where)
        except BaseException:
            _unlink(tmp)
            raise

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        raw = self._current(self._dir(key))
        if raw is None:
            return None, 0
        if _dropped_at(raw):
            return None, _dropped_at(raw)
        m = _owned(key, Manifest.decode(raw))
        return m, m.version

    def version_of(self, key: SessionKey) -> int:
        return _version(self._current(self._dir(key), head_only=True))

    def manifests(self, keys: list[SessionKey]) -> list[Manifest | None]:
        out: list[Manifest | None] = []
        for key in keys:
            try:
                out.append(self.head(key)[0])
            except DataLoss:
                out.append(None)
        return out

    def tombstones(self, keys: list[SessionKey]) -> list[int]:
        return [_dropped_at(self._current(self._dir(key), head_only=True)) for key in keys]

    def publish(self, key: SessionKey, expect: int, spec: dict[str, Any], fingerprint: str, num_tokens: int,
                page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray,
                data: Iterable[tuple[bytes | memoryview, bool]]) -> Manifest:
        where = self._dir(key)
        write = secrets.token_hex(8)
        path = os.path.join(where, f"w{write}")
        try:
            self._call("a page write", os.makedirs, where, exist_ok=True)
            nbytes = self._call("a page write", _write_file, path, data)
            # A history's first version is numbered at random, as in every backend (see backend.py).
            number = expect + 1 if 0 < expect < MAX_VERSION else FIRST_VERSIONS + secrets.randbelow(FIRST_VERSIONS)
            manifest = Manifest(number, write, fingerprint, spec, num_tokens, nbytes, page_bytes,
                                np.asarray(checksums, dtype=np.uint64), np.asarray(token_hashes), time.time(),
                                owner_of(key))
            with self._locked(key, where):
                old = self._current(where)
                have = _version(old)
                if have != expect:
                    raise FailedPrecondition(f"another node published version {have} of this session first",
                                             version=have)
                self._call("the manifest switch", self._replace, where, "m", manifest.encode())
        except BaseException:
            _unlink(path)
            raise
        self._list(key, nbytes)
        self._reclaim(where, old, keep=write)
        return manifest

    def _reclaim(self, where: str, old: bytes | None, keep: str = "") -> None:
        """Delete the bytes of the version `old` was, and those of publishes
        that died before their switch (or that expired)."""
        if old and not _dropped_at(old):
            try:
                _unlink(os.path.join(where, f"w{Manifest.decode(old).write}"))
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
                    _unlink(path)
            except OSError:
                pass

    def read_into(self, key: SessionKey, manifest: Manifest, claim: Callable[[int], list[Any]]) -> Iterator[int]:
        step = self.chunk_bytes
        sinks = [claim(min(step, manifest.nbytes - at)) for at in range(0, manifest.nbytes, step)]
        try:
            fd = os.open(os.path.join(self._dir(key), f"w{manifest.write}"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound("the remote copy of this session is gone (dropped or replaced)") from None
        except OSError as exc:
            raise Unavailable(f"the remote directory did not answer (a page read): {exc}") from None
        try:
            size = self._call("a page read", os.fstat, fd).st_size
            if size != manifest.nbytes:
                raise DataLoss(f"the remote copy holds {size} bytes, not the {manifest.nbytes} its manifest says "
                               "(torn or damaged)", tier="remote")
            at = 0
            for bufs in sinks:
                views = [memoryview(b).cast("B") for b in bufs]
                at += self._call("a page read", _read_full, fd, views, at)
                yield at
        finally:
            os.close(fd)

    def drop(self, key: SessionKey) -> bool:
        where = self._dir(key)
        old = None
        if self._current(where, head_only=True) is not None:
            with self._locked(key, where):
                old = self._current(where)
                if old is not None and not _dropped_at(old):
                    n = _version(old) + 1
                    self._call("a drop", self._replace, where, "m", f"{n if n <= MAX_VERSION else 1} dropped".encode())
                else:
                    old = None
        self.unlist(key.tenant, [key.session_id])
        if old is None:
            return False
        self._reclaim(where, old)
        return True

    def _list(self, key: SessionKey, nbytes: int) -> None:
        """List the session for its tenant; where this fails, the session is
        served, only not listed."""
        where = self._tenant(key.tenant)
        try:
            os.makedirs(where, exist_ok=True)
            self._replace(where, tag_of(key), f"{nbytes}\n{key.session_id}".encode())
        except OSError:
            pass

    def _entries(self, tenant: str) -> Iterator[tuple[str, str, int]]:
        """(session id, its listing's name, bytes) of each listed session; a
        listing that does not parse is skipped."""
        where = self._tenant(tenant)
        try:
            names = os.listdir(where)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise Unavailable(f"the remote directory did not answer (a list): {exc}") from None
        for name in names:
            if name.startswith("."):
                continue
            try:
                with open(os.path.join(where, name), "rb") as f:
                    size, _, sid = f.read(1 << 16).partition(b"\n")
                yield sid.decode(), name, int(size)
            except (OSError, ValueError):
                continue

    def usage(self, tenant: str, session_id: str) -> tuple[int, int]:
        total = own = 0
        for sid, _, nbytes in self._entries(tenant):
            total += nbytes
            own = nbytes if sid == session_id else own
        return total, own

    def listed(self, tenant: str, after: str = "", count: int = 100) -> list[str]:
        return sorted(sid for sid, _, _ in self._entries(tenant) if sid > after)[:count]

    def unlist(self, tenant: str, session_ids: list[str]) -> None:
        where = self._tenant(tenant)
        for sid in session_ids:
            _unlink(os.path.join(where, tag_of(SessionKey(tenant, sid))))

    def ping(self) -> None:
        st = self._call("a ping", os.stat, self.root)
        if not os.access(self.root, os.W_OK | os.X_OK) or st.st_nlink == 0:
            raise Unavailable(f"the remote directory {self.root} cannot be written")


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


def _write_file(path: str, data: Iterable[tuple[bytes | memoryview, bool]]) -> int:
    """Write the pieces to a new file at path, synced; how many bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    nbytes = 0
    try:
        for piece, _ in data:
            view = memoryview(piece).cast("B")
            _write_all(fd, view)
            nbytes += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    _sync_dir(os.path.dirname(path))
    return nbytes


def _read_full(fd: int, views: list[memoryview], at: int) -> int:
    """Fill views from the file at offset `at`; how many bytes. DataLoss where
    the file ends first (cut short since it was opened)."""
    total = sum(v.nbytes for v in views)
    done = 0
    while views:
        n = os.preadv(fd, views, at + done)
        if n == 0:
            raise DataLoss("the remote copy ends before its manifest says (torn or damaged)", tier="remote")
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if views and n:
            views[0] = views[0][n:]
    return total


def _sync_dir(where: str) -> None:
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_backend(url: str, options: Any) -> FileBackend:
    """The backend for file:///PATH (an absolute path to a directory)."""
    path = url.partition("://")[2]
    if not path.startswith("/"):
        raise Unavailable(f"expected file:///ABSOLUTE/PATH, got {url!r}")
    if not os.path.isdir(path):
        raise Unavailable(f"the remote directory {path} does not exist (mount it, or create it)")
    return FileBackend(path, options.prefix, options.ttl)
