"""A bad network on loopback: a TCP proxy in front of each Redis node (the
nodes announce the proxies' ports, so every client and replica goes through
them) that passes, delays, throttles, resets or blackholes what it carries,
as the campaign sets it; tests subclass it to see (and cut) each piece that
passes. Runs on threads of its own in the campaign's (or test's) process."""

from __future__ import annotations

import socket
import threading
import time


class FaultyProxy:
    MODES = ("pass", "delay", "throttle", "reset", "blackhole")

    def __init__(self, target: int) -> None:
        self.target = target
        self.mode = "pass"
        self.delay = 0.0  # seconds a piece waits (delay)
        self.rate = 0.0  # bytes a second (throttle)
        self.healed = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def set(self, mode: str, delay: float = 0.0, rate: float = 0.0) -> None:
        assert mode in self.MODES, mode
        with self.healed:
            self.mode, self.delay, self.rate = mode, delay, rate
            self.healed.notify_all()
        if mode == "reset":
            with self._lock:
                conns, self._conns = list(self._conns), set()
            for s in conns:
                _close(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)  # the node is down: as a refused connection
                continue
            with self._lock:
                self._conns |= {client, server}
            threading.Thread(target=self._pipe, args=(client, server, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, server, False), daemon=True).start()

    def passing(self, conn: socket.socket, up: bool, data: bytes) -> tuple[bytes, bool]:
        """What of a piece passes on (up: to the node; conn: the connection's
        socket to the node), and whether the connection goes on after it."""
        return data, True

    def _wait_turn(self, nbytes: int) -> None:
        with self.healed:
            while self.mode == "blackhole":  # held, not lost: TCP delivers it once the path heals
                self.healed.wait(0.5)
            mode, delay, rate = self.mode, self.delay, self.rate
        if mode == "delay":
            time.sleep(delay)
        elif mode == "throttle" and rate:
            time.sleep(nbytes / rate)

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                self._wait_turn(len(data))
                data, going = self.passing(conn, up, data)
                dst.sendall(data)
                if not going:
                    break
        except OSError:
            pass
        for s in (src, dst):
            _close(s)
        with self._lock:
            self._conns -= {src, dst}

    def close(self) -> None:
        self.set("pass")
        _close(self.listener)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
