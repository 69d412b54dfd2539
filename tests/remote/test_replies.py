"""The reply reader that puts GET values straight into page memory
(tierd/remote/redis/replies.py), over a real socket pair: replies cut at every byte,
nils, and everything that is not the value asked for (an error, another
length, a value longer than it says, a connection closed in the middle)
refused before it is taken for a value."""

import socket
import threading

import numpy as np
import pytest

from tierd.remote.redis.replies import Replies, Unexpected


def _served(data: bytes, step: int):
    """A socket whose peer sends data in pieces of step bytes, then closes."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)

    def send():
        try:
            for i in range(0, len(data), step):
                theirs.sendall(data[i : i + step])
        except OSError:  # the reader refused what came and closed its end
            pass
        theirs.close()

    threading.Thread(target=send, daemon=True).start()
    return ours


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.mark.parametrize("step", [1, 7, 1 << 16, 1 << 20])
def test_values_land_in_their_buffers_whatever_the_cuts(step):
    rng = np.random.default_rng(3)
    values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (300_000, 5, 70_000)]
    sock = _served(_bulk(values[0]) + b"$-1\r\n" + _bulk(values[1]) + _bulk(values[2]), step)
    replies = Replies(sock)
    first = [np.zeros(100_000, np.uint8), np.zeros(200_000, np.uint8)]  # one value across two pages
    assert replies.value_into(first) and b"".join(a.tobytes() for a in first) == values[0]
    assert replies.value_into([np.zeros(9, np.uint8)]) is False  # nil: the buffers are left alone
    small, rest = bytearray(5), [memoryview(bytearray(70_000))]
    assert replies.value_into([small]) and bytes(small) == values[1]
    assert replies.value_into(rest) and bytes(rest[0]) == values[2]
    assert not replies.buf
    sock.close()


@pytest.mark.parametrize("reply, why", [
    (b"-MOVED 3999 127.0.0.1:7001\r\n", "MOVED"),  # a redirection while slots move
    (b"-WRONGTYPE Operation against a key\r\n", "WRONGTYPE"),
    (b"$11\r\nhello world\r\n", "11"),  # another size than the manifest's
    (b"$5\r\nhello, world\r\n", "longer"),
    (b"+" + b"x" * 5000, "without an end"),
])
def test_anything_but_the_value_asked_for_is_refused(reply, why):
    sock = _served(reply, 3)
    out = bytearray(5)
    with pytest.raises(Unexpected, match=why):
        Replies(sock).value_into([out])
    sock.close()


def test_a_connection_closed_in_the_middle_of_a_value_fails():
    sock = _served(b"$10\r\nhalf", 2)
    with pytest.raises(ConnectionError):
        Replies(sock).value_into([bytearray(10)])
    sock.close()
