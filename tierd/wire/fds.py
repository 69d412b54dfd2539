"""Engine memory handed over as open file descriptors, never named.

A name in /dev/shm proves nothing about who owns the memory behind it: a
tenant that named the daemon's arena or another tenant's segment got it
mapped. So an engine opens its shared memory itself and passes the
descriptors over a Unix socket beside the daemon's (SCM_RIGHTS), with its
token; the daemon answers with a ticket that the engine's RegisterEngine
names, or with its refusal and the refusal's status code (the client raises
the error a gRPC call would: UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...). The
daemon accepts a descriptor only if it is not one of its own files, is
owned by the connecting process's user (SO_PEERCRED), is open read-write,
and is a memfd sealed against shrinking: memory the engine could cut short
under the daemon would fault it (SIGBUS) in the middle of a copy, and take
every tenant's service down with it.

This module is the protocol and its client's side, `hand_over` (any
thread); the daemon's side is tierd/api/intake.py, on its event loop.
"""

from __future__ import annotations

import errno
import json
import socket
import time

from tierd.errors import FailedPrecondition, InvalidArgument
from tierd.wire.status import error_class

MAX_FDS = 253  # SCM_MAX_FD: the kernel's limit on descriptors in one message
CONNECT_SECONDS = 5.0  # a client's wait for the daemon's answer
MESSAGE_BYTES = 4096  # a message, either way, at most


def intake_path(socket_path: str) -> str:
    """Where the daemon listening on socket_path takes descriptors."""
    return socket_path + ".fds"


def hand_over(path: str, fds: list[int], token: str | None = None, timeout: float = CONNECT_SECONDS) -> str:
    """Pass open descriptors to the daemon; returns the ticket that names
    them in RegisterEngine. Raises the daemon's refusal as the error its
    status code names, FailedPrecondition where no daemon answers."""
    if not 0 < len(fds) <= MAX_FDS:
        raise InvalidArgument(f"hand over 1 to {MAX_FDS} descriptors at once, not {len(fds)}", field="regions")
    payload = json.dumps({"token": token or ""}).encode() + b"\n"
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = _hand_over_once(path, payload, fds, max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            # Reset or closed: every place of this process (or of the intake) was taken; EAGAIN: the
            # intake's backlog is full of connections it has yet to take (and turn away, if they flood it).
            turned_away = exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.EAGAIN)
            if not turned_away or time.monotonic() >= deadline:
                raise FailedPrecondition(f"cannot hand engine memory to the daemon at {path}: "
                                         f"{exc.strerror or exc} (shared memory needs the daemon's Unix socket, "
                                         "on the same machine)") from None
            time.sleep(0.05)  # again, shortly
            continue
        if reply or time.monotonic() >= deadline:
            break
        time.sleep(0.05)  # closed unanswered: turned away, as above
    try:
        answer = json.loads(reply)
    except ValueError:
        raise FailedPrecondition(f"the daemon at {path} gave no answer for the engine memory") from None
    if "ticket" not in answer:
        refused = error_class(answer.get("code")) or FailedPrecondition  # (a daemon that sent no code)
        raise refused(f"the daemon refused the engine memory: {answer.get('error', 'no reason given')}")
    return str(answer["ticket"])


def _hand_over_once(path: str, payload: bytes, fds: list[int], timeout: float) -> bytes:
    """One try: the daemon's answer line, or b"" if it closed without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        socket.send_fds(s, [payload], fds)
        reply = b""
        while not reply.endswith(b"\n"):
            part = s.recv(MESSAGE_BYTES)
            if not part:
                break
            reply += part
        return reply
