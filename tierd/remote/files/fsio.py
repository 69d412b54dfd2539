"""File operations of the shared-directory backend: whole writes, synced
renames, reads into caller memory, and OSErrors turned into the backend's
errors (a full file system: Refused; anything else: Unavailable). Runs on
the thread that calls the backend."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any

from tierd.errors import DataLoss, Unavailable
from tierd.remote.backend import Refused

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the store answered: no room


def call(what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except OSError as exc:
        if exc.errno in _FULL:
            raise Refused(f"the remote directory refused {what}: {exc.strerror}") from None
        raise Unavailable(f"the remote directory did not answer ({what}): {exc}") from None


def replace(where: str, name: str, data: bytes) -> None:
    """Write `data` to where/name whole or not at all, synced."""
    tmp = os.path.join(where, f".{name}.{secrets.token_hex(6)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(where, name))
        sync_dir(where)
    except BaseException:
        unlink(tmp)
        raise

def write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


def write_file(path: str, data: Iterable[tuple[bytes | memoryview, bool]]) -> int:
    """Write the pieces to a new file at path, synced; how many bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    nbytes = 0
    try:
        for piece, _ in data:
            view = memoryview(piece).cast("B")
            write_all(fd, view)
            nbytes += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    sync_dir(os.path.dirname(path))
    return nbytes


def read_full(fd: int, views: list[memoryview], at: int) -> int:
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


def sync_dir(where: str) -> None:
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
