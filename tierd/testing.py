"""A real tierd daemon in a subprocess, for tests, benchmarks and examples:
its own socket and data dir under a directory you give, small budgets, and
flags of your choice."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierd.client import Client
from tierd.tiers import shm

ROOT = Path(__file__).resolve().parents[1]  # the checkout, so `python -m tierd` finds this tree


class Daemon:
    def __init__(self, root: Path | str, *flags: str, env: dict[str, str] | None = None) -> None:
        root = Path(root)
        self.root = root
        self.socket = str(root / "run" / "tierd.sock")
        self.data_dir = str(root / "data")
        self.flags = list(flags)
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.metrics_url: str | None = None
        self.log_path = root / "daemon.log"
        self.starts = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tierd", "serve", "--socket", self.socket, "--data-dir", self.data_dir,
                "--metrics", "127.0.0.1:0", "--device", "none", "--host-budget", "64MiB", "--disk-budget", "512MiB",
                "--host-slab", "16MiB", "--disk-slab", "64MiB", "--tick-seconds", "0.1", *self.flags]

    def start(self, timeout: float = 60.0) -> Daemon:
        self.root.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"--- start {self.starts}\n")
        log.flush()
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log().split(f"--- start {self.starts}\n")[-1]
            if "serving on" in text:
                m = re.search(r"metrics on (http://\S+)", text)
                self.metrics_url = m.group(1) if m else None
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierd exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(f"tierd did not start in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kw) -> Client:
        return Client(self.socket, **kw)

    def close(self) -> None:
        """Stop the daemon (SIGTERM, SIGKILL if it does not go) and remove the
        shared memory a killed daemon leaves behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        prefix = shm.read_prefix(self.data_dir)
        if prefix is not None:
            shm.remove_owned(prefix)
