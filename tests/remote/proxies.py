"""TCP proxies on loopback in front of one Redis server, for faults a test
sets off: the chaos campaign's proxy (each connection piped both ways by two
threads), seeing each piece before it passes on."""

import socket
import threading
from collections import defaultdict

from bench.chaos.network import FaultyProxy


class CuttingProxy(FaultyProxy):
    """Once armed, closes the first connection whose replies since then pass
    `cut` bytes (half the piece that passes them sent); records what every
    connection carried to the store after that."""

    def __init__(self, port: int) -> None:
        self.cut: int | None = None
        self.after = bytearray()  # what connections carried to the store once one was cut
        self.was_cut = False
        self._down: dict[socket.socket, int] = defaultdict(int)
        super().__init__(port)

    def passing(self, conn, up, data):
        if up and self.was_cut:
            self.after += data
        if not up and self.cut is not None:
            self._down[conn] += len(data)
            if self._down[conn] > self.cut:
                self.cut, self.was_cut = None, True  # once
                return data[: len(data) // 2], False
        return data, True


class StallingProxy(FaultyProxy):
    """Holds back, while `flowing` is clear, what the store sends on the
    connections that subscribed (their notices and pongs); the others flow."""

    def __init__(self, port: int) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        self._subscribers: set[socket.socket] = set()
        super().__init__(port)

    def passing(self, conn, up, data):
        if up and b"SUBSCRIBE" in data.upper():
            self._subscribers.add(conn)
        if not up and conn in self._subscribers:
            self.flowing.wait()
        return data, True
