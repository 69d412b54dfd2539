"""The processes the llama-server tests and bench run: a llama-server
(built by make test-llamacpp into the environment's bin), the tierd front
before it, and a JSON call to either."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = Path(sys.prefix) / "bin" / "llama-server"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body=None, headers=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json"} | (headers or {}))
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw


def answers(port):
    try:
        return call(port, "GET", "/health", timeout=5)[0] == 200
    except OSError:
        return False


def until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not in {timeout:g} s")
        time.sleep(0.05)


class Proc:
    """A process, its output in a log file."""

    def __init__(self, log: Path) -> None:
        self.log, self.proc = log, None

    def run(self, argv, port):
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
        until(lambda: self.proc.poll() is not None or answers(port), 120, f"{argv[0]} answering")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LlamaServer(Proc):
    """llama-server on a free port: slots of ctx tokens each, its own RAM
    cache of cache_ram MiB (0: none), slot files in slot_dir."""

    def __init__(self, tmp: Path, slot_dir: Path, slots: int = 2, ctx: int = 2048, cache_ram: int = 0,
                 name: str = "llama-server") -> None:
        super().__init__(tmp / f"{name}.log")
        self.slot_dir, self.slots, self.ctx, self.cache_ram, self.port = slot_dir, slots, ctx, cache_ram, free_port()

    def start(self, model):
        return self.run([str(SERVER), "-m", str(model), "-np", str(self.slots), "-c", str(self.ctx * self.slots),
                         "-b", "512", "-t", str(os.cpu_count() or 2), "--cache-ram", str(self.cache_ram),
                         "--slot-save-path", str(self.slot_dir), "--no-webui", "--host", "127.0.0.1",
                         "--port", str(self.port)], self.port)


class FrontProc(Proc):
    """tierd llama-front before a llama-server, on a free port."""

    def __init__(self, tmp: Path, socket_path: str, server: LlamaServer) -> None:
        super().__init__(tmp / "front.log")
        self.socket, self.server, self.port = socket_path, server, free_port()

    def start(self):
        return self.run([sys.executable, "-m", "tierd", "llama-front", "--upstream",
                         f"http://127.0.0.1:{self.server.port}", "--slot-dir", str(self.server.slot_dir),
                         "--address", self.socket, "--port", str(self.port)], self.port)

    def stats(self):
        status, body = call(self.port, "GET", "/tierd/stats")
        assert status == 200
        return body

    def stored(self, saves: int) -> dict:
        """The stats once the front has stored this many turns (it stores a turn after answering it)."""
        until(lambda: self.stats()["saves"] + self.stats()["save_failures"] >= saves, 60, f"{saves} turns stored")
        return self.stats()
