"""GET replies read off a Redis connection's socket straight into the
caller's memory (the host tier's pages): redis-py's parser would copy each
value into a bytes object of its own, and the caller would copy it again.
Several small batches of GETs stay in flight on one connection, so the
store builds the next replies while these are read. Anything else than a
value of the size asked for (a redirection while slots move, an error) is
Unexpected: the connection is closed, and the caller reads the rest through
redis-py. Runs on the thread that reads (a fetch's, see fetch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

READ_BATCH, READ_DEPTH = 4, 4  # chunks a fetch asks for per round trip, and round trips in flight


class Unexpected(Exception):
    """The store answered something else than the replies asked for."""


def read_values(pool: Any, names: list[str], sinks: list[list[Any]], read: Callable[[int, bool], None],
               stop: Callable[[], bool]) -> list[bool]:
    """GETs of names on a connection of pool, READ_BATCH a round trip with
    READ_DEPTH of them in flight (the store builds the next replies while
    these are read), each value read into its sink and read(i, found) told
    as each is; whether each was there, for those read before stop() said so.
    The connection is closed on anything unexpected and where stopped (its
    stream is then not at a reply's start)."""
    batches = [names[i : i + READ_BATCH] for i in range(0, len(names), READ_BATCH)]
    conn = pool.get_connection()
    found: list[bool] = []
    try:
        replies = Replies(conn._sock)
        for batch in batches[:READ_DEPTH]:
            conn.send_packed_command(conn.pack_commands([("GET", n) for n in batch]))
        for k in range(len(batches)):
            if stop():
                conn.disconnect()
                return found
            if k + READ_DEPTH < len(batches):
                conn.send_packed_command(conn.pack_commands([("GET", n) for n in batches[k + READ_DEPTH]]))
            for _ in batches[k]:
                found.append(replies.value_into(sinks[len(found)]))
                read(len(found) - 1, found[-1])
        if replies.buf:
            raise Unexpected("more than the replies asked for")
        return found
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class Replies:
    """RESP replies read off a socket: lines through a small buffer, a bulk
    value's bytes, past what that buffer already holds, straight into the
    caller's memory."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        got = self.sock.recv(1 << 16)
        if not got:
            raise ConnectionError("the remote store closed the connection")
        self.buf += got

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > 1024:
                raise Unexpected("a reply line without an end")
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def value_into(self, sink: list[Any]) -> bool:
        """Read one GET's reply into the buffers of sink, which together take
        exactly its value's size; False for a nil (no such key)."""
        line = self._line()
        if line == b"$-1":
            return False
        views = [memoryview(v).cast("B") for v in sink]
        if line[:1] != b"$" or line[1:] != str(sum(v.nbytes for v in views)).encode():
            raise Unexpected(line[:120].decode(errors="replace"))
        for view in views:
            take = min(view.nbytes, len(self.buf))
            view[:take] = self.buf[:take]
            del self.buf[:take]
            while take < view.nbytes:
                got = self.sock.recv_into(view[take:])
                if not got:
                    raise ConnectionError("the remote store closed the connection")
                take += got
        while len(self.buf) < 2:
            self._fill()
        if self.buf[:2] != b"\r\n":
            raise Unexpected("a value longer than it said")
        del self.buf[:2]
        return True
