"""The daemon's side of the descriptor hand-over (the protocol and the
client's side: tierd/wire/fds.py): a Unix socket beside the daemon's taking
engine memory as open descriptors, each checked (not the daemon's own, the
connecting user's, read-write, a memfd of ordinary pages sealed against
shrinking), and the tickets that name them until RegisterEngine takes them
or they expire. Runs on the daemon's event loop, never blocking it: one
message a connection, a few seconds to send it.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, TierdError
from tierd.wire.fds import MAX_FDS, MESSAGE_BYTES

log = logging.getLogger("tierd.api.intake")
FDS_PER_TENANT = 1024  # descriptors one tenant may have handed over and not yet registered
TICKET_SECONDS = 60.0
SEND_SECONDS = 2.0  # a connection's time to send its message (a client sends at once)
MAX_PENDING = 256  # hand-overs in progress at once
# ... of one process: a connection is taken before any tenant is known, and 80
# silent ones, reopened as they were dropped, turned every other engine away.
PER_PROCESS = 4


@dataclass(eq=False)
class Ticket:
    tenant: str
    fds: list[int]
    pid: int  # the process that handed them over
    expires: float = field(default=0.0)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def check_shared_memory(fd: int, uid: int, own: Callable[[os.stat_result], bool]) -> str | None:
    """Why descriptor fd may not be engine memory of user uid, or None if it may."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if own(st):
        return "the daemon's own memory"
    if st.st_uid != uid:
        return "owned by another user than the process handing it over"
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        return "not open for reading and writing"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        return ("memory that can be cut short under the daemon: a memfd sealed against shrinking is needed "
                "(tierd.client.SharedKVCache makes them)")
    if _fs_type(fd) != TMPFS_MAGIC:
        # A hugetlb page can be taken away under the daemon however the file is sealed (punch a
        # hole, let another process take every free huge page): the next copy faults.
        return "not plain shared memory (a hugetlb memfd, say): a memfd of ordinary pages is needed"
    return None


TMPFS_MAGIC = 0x01021994  # statfs f_type of shmem: /dev/shm and memfds of ordinary pages


def _fs_type(fd: int) -> int:
    """statfs's f_type of the file system holding fd (0 where it cannot be told)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs, f_type first
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value


_libc = ctypes.CDLL(None, use_errno=True)


class FdIntake:
    """The daemon's side: a Unix socket taking descriptors, and the tickets
    that name them until RegisterEngine takes them (or they expire)."""

    def __init__(self, path: str, identify: Callable[[str], str], own: Callable[[os.stat_result], bool]) -> None:
        self.path = path
        self._identify = identify  # token -> tenant; raises Unauthenticated
        self._own = own
        self._tickets: dict[str, Ticket] = {}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0  # connections accepted, their message not yet taken
        self._by_pid: dict[int, int] = {}  # the same, per connecting process

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # left by a daemon that died: the socket's lock says none runs
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(64)
        sock.setblocking(False)
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        for ticket in self._tickets.values():
            ticket.close()
        self._tickets.clear()

    def take(self, tenant: str, ticket_id: str) -> Ticket:
        """The descriptors a ticket names, once, for their tenant; the caller closes them."""
        self._expire()
        ticket = self._tickets.get(ticket_id)
        if ticket is None or ticket.tenant != tenant:
            raise NotFound("no such descriptor ticket (it expired, was used, or is another tenant's): hand the "
                           "memory over again", field="fd_ticket")
        del self._tickets[ticket_id]
        return ticket

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._tickets.items() if t.expires <= now]:
            self._tickets.pop(key).close()

    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            # Out of descriptors: accept nothing for a while (retrying at once spun the loop, logging each time).
            log.warning("descriptor intake: %s; taking no connections for a second", exc.strerror)
            self._loop.remove_reader(self._sock.fileno())
            self._loop.call_later(1.0, self._resume)
            return
        pid = _peer(conn)[0]
        if self._pending >= MAX_PENDING or self._by_pid.get(pid, 0) >= PER_PROCESS:
            conn.close()  # too many half-done hand-overs at once (of this process): this one is turned away
            return
        self._pending += 1
        self._by_pid[pid] = self._by_pid.get(pid, 0) + 1
        conn.setblocking(False)
        timer = self._loop.call_later(SEND_SECONDS, self._drop, conn, pid)
        self._loop.add_reader(conn.fileno(), self._receive, conn, timer, pid)

    def _resume(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _done(self, pid: int) -> None:
        self._pending -= 1
        left = self._by_pid.pop(pid) - 1
        if left:
            self._by_pid[pid] = left

    def _drop(self, conn: socket.socket, pid: int) -> None:
        if conn.fileno() >= 0 and self._loop is not None:
            self._loop.remove_reader(conn.fileno())
            self._done(pid)
        conn.close()

    def _receive(self, conn: socket.socket, timer: asyncio.TimerHandle, pid: int) -> None:
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg = b""
        timer.cancel()
        assert self._loop is not None
        self._loop.remove_reader(conn.fileno())
        self._done(pid)
        try:
            answer = {"ticket": self._admit(conn, msg, fds)}
            fds = []  # the ticket holds them now
        except TierdError as exc:
            log.info("engine memory refused: %s", exc.message)
            answer = {"error": exc.message, "code": exc.code}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            conn.send(json.dumps(answer).encode() + b"\n")  # a few bytes: fits the socket's buffer
        except OSError:
            pass
        conn.close()

    def _admit(self, conn: socket.socket, msg: bytes, fds: list[int]) -> str:
        if not msg.endswith(b"\n"):
            raise InvalidArgument("send one line of JSON with the descriptors")
        try:
            request = json.loads(msg)
        except (ValueError, RecursionError):  # (not UTF-8, not JSON, or nested deeper than the parser goes)
            raise InvalidArgument("send one line of JSON with the descriptors") from None
        if not isinstance(request, dict) or not isinstance(request.get("token", ""), str):
            raise InvalidArgument('send one line of JSON with the descriptors: {"token": "TOKEN"}')
        tenant = self._identify(request.get("token", ""))
        if not fds:
            raise InvalidArgument("no descriptors came with the message")
        self._expire()
        held = sum(len(t.fds) for t in self._tickets.values() if t.tenant == tenant)
        if held + len(fds) > FDS_PER_TENANT:
            # Each ticket holds its descriptors open: without a cap, one tenant ran the daemon out of them.
            raise ResourceExhausted(f"{held} descriptors this tenant handed over wait to be registered; "
                                    f"{len(fds)} more would pass {FDS_PER_TENANT}: register them, or let them "
                                    "expire, first")
        pid, uid = _peer(conn)
        for i, fd in enumerate(fds):
            why = check_shared_memory(fd, uid, self._own)
            if why is not None:
                raise FailedPrecondition(f"descriptor {i} is {why}", field="regions")
        ticket_id = secrets.token_hex(16)
        self._tickets[ticket_id] = Ticket(tenant, fds, pid, time.monotonic() + TICKET_SECONDS)
        if self._loop is not None:  # its descriptors closed when it expires, whatever comes next
            self._loop.call_later(TICKET_SECONDS, self._expire)
        return ticket_id


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid
