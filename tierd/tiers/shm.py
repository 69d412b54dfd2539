"""Shared-memory files the daemon creates: names nobody can predict or take first.

Runs in the daemon (start-up, the host tier's slab opening, lease calls on
the RPC threads). Every file gets a name under this run's random prefix plus
a random part, is created exclusively with mode 0600, and a name some other
process holds already is skipped, never fatal. The prefix is kept in the
data dir (mode 0600), so the next start removes what a killed daemon left:
only files of the daemon's own user, never followed through a link.

The daemon also remembers which files it created, so that engine memory
handed to it can be told apart from its own (an engine may never register
the daemon's arena as its memory).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import secrets
import stat
import threading
from typing import Any

log = logging.getLogger("tierd.tiers.shm")
SHM_DIR = "/dev/shm"
PREFIX_FILE = "shm-prefix"  # in the data dir: the prefix of the running daemon's shared memory
TRIES = 8  # names tried before giving up: each taken one is logged

_own: set[tuple[int, int]] = set()  # (st_dev, st_ino) of every file this process created and still holds
_own_lock = threading.Lock()


def new_prefix() -> str:
    return "tierd-" + secrets.token_hex(8)


def claim_prefix(data_dir: str, shm_dir: str = SHM_DIR) -> str:
    """A fresh prefix for this run, recorded in the data dir; the shared
    memory an earlier run recorded there (and left behind) is removed."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    path = os.path.join(data_dir, PREFIX_FILE)
    old = read_prefix(data_dir)
    if old is not None:
        removed = remove_owned(old, shm_dir)
        if removed:
            log.info("host arena: removed %d shared-memory files left by an earlier run", removed)
    prefix = new_prefix()
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, prefix.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, say: the start goes on
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if old is not None:
            log.warning("cannot record a new shared-memory prefix in %s (%s): keeping the last one", data_dir,
                        exc.strerror)
            return old  # recorded already, and as unguessable: its files were just removed
        log.warning("cannot record the shared-memory prefix in %s (%s): if this daemon is killed, its shared "
                    "memory stays until removed by hand (%s.*)", data_dir, exc.strerror, prefix)
    return prefix


def read_prefix(data_dir: str) -> str | None:
    """The prefix the data dir records, if any (and if it looks like one)."""
    try:
        fd = os.open(os.path.join(data_dir, PREFIX_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return text if text.startswith("tierd-") and text[6:].isalnum() else None


def remove_owned(prefix: str, shm_dir: str = SHM_DIR) -> int:
    """Delete the regular files <prefix>.* of this user in shm_dir; returns how many."""
    n = 0
    for path in glob.glob(os.path.join(shm_dir, glob.escape(prefix) + ".*")):
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                n += 1
        except FileNotFoundError:
            pass
    return n


def create(prefix: str, size: int, shm_dir: str = SHM_DIR) -> tuple[str, int]:
    """Create <shm_dir>/<prefix>.<random> exclusively, mode 0600, `size`
    bytes (sparse); returns (name, open descriptor)."""
    for _ in range(TRIES):
        name = f"{prefix}.{secrets.token_hex(8)}"
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            log.warning("shared memory %s already exists and is not ours: skipped", path)
            continue
        try:
            os.ftruncate(fd, size)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        with _own_lock:
            _own.add((st.st_dev, st.st_ino))
        return name, fd
    raise OSError(errno.EEXIST, f"no free shared-memory name under {prefix} in {TRIES} tries")


def remove(name: str, fd: int | None = None, shm_dir: str = SHM_DIR) -> None:
    """Unlink a file create() made (and close its descriptor, if given)."""
    path = os.path.join(shm_dir, name)
    try:
        st = os.fstat(fd) if fd is not None else os.lstat(path)
        with _own_lock:
            _own.discard((st.st_dev, st.st_ino))
    except OSError:
        pass
    if fd is not None:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def is_own(st: os.stat_result) -> bool:
    """Whether a file (by its stat) is one this daemon created."""
    with _own_lock:
        return (st.st_dev, st.st_ino) in _own


class Segment:
    """A shared-memory file of its own for one lease at a time, which the
    engine maps by name. The daemon never maps it: it reads and writes it
    with pread and pwrite, so an engine that cuts the file short gets a
    short read (an error for that call), not a fault in the daemon."""

    def __init__(self, prefix: str, size: int, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.size = size
        self.name, self.fd = create(prefix, size, shm_dir)
        try:
            os.posix_fallocate(self.fd, 0, size)  # a full /dev/shm fails here, not on a later write
        except BaseException:
            remove(self.name, self.fd, shm_dir)
            raise

    def read_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill views, in order, from the file's bytes at offset; OSError if it was cut short."""
        _each_batch(os.preadv, self.fd, views, offset, "read")

    def write_from(self, offset: int, views: list[memoryview]) -> None:
        """Write views, in order, at offset."""
        _each_batch(os.pwritev, self.fd, views, offset, "written")

    def clear_from(self, offset: int) -> None:
        """Zero the file's bytes from offset to its end: a segment kept from an
        earlier lease hands out nothing of it past what this one holds."""
        zeros = memoryview(bytes(min(1 << 20, max(self.size - offset, 0))))
        while offset < self.size:
            take = min(len(zeros), self.size - offset)
            _each_batch(os.pwritev, self.fd, [zeros[:take]], offset, "written")
            offset += take

    def close(self) -> None:
        """Unlink (an engine that mapped it keeps its mapping)."""
        if self.fd >= 0:
            remove(self.name, self.fd, self.shm_dir)
            self.fd = -1


_IOV_MAX = 1024


def _each_batch(call: Any, fd: int, views: list[memoryview], offset: int, what: str) -> None:
    for k in range(0, len(views), _IOV_MAX):
        batch = views[k : k + _IOV_MAX]
        want = sum(v.nbytes for v in batch)
        done = call(fd, batch, offset)
        if done != want:  # tmpfs moves whole requests; short means the file was cut short
            raise OSError(errno.EIO, f"{done} of {want} bytes {what}: the lease's segment was cut short")
        offset += want
