"""TCP proxies on loopback in front of one Redis server, for faults a test
sets off: each connection is piped both ways by two threads, and a proxy
sees each piece before it passes on."""

import socket
import threading
from collections import defaultdict


class Proxy:
    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def passing(self, conn: socket.socket, up: bool, data: bytes) -> tuple[bytes, bool]:
        """What of a piece passes on (up: to the store), and whether the connection goes on after it."""
        return data, True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, server, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                data, going = self.passing(conn, up, data)
                dst.sendall(data)
                if not going:
                    break
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


class CuttingProxy(Proxy):
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


class StallingProxy(Proxy):
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
