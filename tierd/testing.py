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
from collections.abc import Callable
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


def tokens_file(root: Path | str, tokens: dict[str, str], admins: tuple[str, ...] = ()) -> str:
    """A --auth-tokens file under root for these tenants and their tokens
    (those in `admins` with the admin role); its path."""
    import hashlib

    path = Path(root) / "tokens"
    path.write_text("".join(f"{t}:{hashlib.sha256(s.encode()).hexdigest()}{':admin' if t in admins else ''}\n"
                            for t, s in tokens.items()))
    return str(path)


def wire_accounting(client: Client) -> list[str]:
    """What a client sees of the accounting invariant: per tier, the bytes the
    daemon reports used are the sum of its sessions' bytes in that tier, less
    what sharing saves (an allocation several sessions hold counts in each)."""
    tiers = client.stats()["tiers"]
    used = {t.name: t.used for t in tiers}
    held = {t.name: -t.saved for t in tiers}
    for info in client.list(all_tenants=True):
        for tier, nbytes in info.tier_bytes.items():
            held[tier] += nbytes
    return [f"the {t} tier holds {used[t]} bytes, its sessions {held[t]}" for t in used if used[t] != held[t]]


class RedisCluster:
    """A real Redis Cluster on loopback for tests and benchmarks: `masters`
    redis-server processes with `replicas` replicas each, under a directory
    you give, made a cluster by redis-cli. Needs Debian's redis-server (the
    Makefile's install step installs it where it is missing). With `front`, a
    function of a node's port that returns the port of something in front of
    it (a proxy), each node announces that port: clients and replicas reach
    it only through there."""

    def __init__(self, root: Path | str, masters: int = 3, replicas: int = 1, password: str | None = None,
                 front: Callable[[int], int] | None = None) -> None:
        self.root = Path(root)
        self.masters, self.replicas, self.password = masters, replicas, password
        self.front = front
        self.ports: list[int] = []
        self.announced: dict[int, int] = {}  # a node's port -> the port it announces
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """redis://host:port,... of every node (what `tierd serve --remote` takes)."""
        return "redis://" + ",".join(f"127.0.0.1:{self.announced.get(p, p)}" for p in self.ports)

    def _cli(self, *args: str, port: int | None = None, timeout: float = 30.0) -> str:
        cmd = ["redis-cli", "--no-auth-warning"] + (["-a", self.password] if self.password else [])
        cmd += ["-p", str(port)] if port is not None else []
        out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)
        return out.stdout + out.stderr

    def start(self, timeout: float = 60.0) -> RedisCluster:
        while len(self.ports) < self.masters * (1 + self.replicas):
            port = _free_port()  # (bus ports are 10,000 above the range: never another node's port)
            if port not in self.ports:
                self.ports.append(port)
        self.announced = {p: self.front(p) for p in self.ports} if self.front else {}
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for port in self.ports:
            self._spawn(port)
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while "PONG" not in self._cli("ping", port=port, timeout=5):
                if time.monotonic() > deadline or not self.alive(port):
                    raise RuntimeError(f"redis-server on port {port} did not answer:\n{self.log(port)}")
                time.sleep(0.05)
        out = self._cli("--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes", timeout=timeout)
        # Its last check asks one node, which may not have heard of every other yet ("[ERR] Not all
        # 16384 slots are covered"): once the slots are assigned, wait_ok waits for every node to agree.
        if "[OK] All 16384 slots covered" not in out and ">>> Nodes configuration updated" not in out:
            raise RuntimeError(f"redis-cli could not make the cluster:\n{out}")
        self.wait_ok(deadline - time.monotonic())

    def _spawn(self, port: int) -> None:
        node = self.root / f"node-{port}"
        node.mkdir(parents=True, exist_ok=True)
        more = f"requirepass {self.password}\nmasterauth {self.password}\n" if self.password else ""
        if port in self.announced:
            more += (f"cluster-announce-ip 127.0.0.1\ncluster-announce-port {self.announced[port]}\n"
                     f"cluster-announce-bus-port {port + 10000}\n")
        (node / "redis.conf").write_text(
            f"port {port}\nbind 127.0.0.1\ndir {node}\ncluster-enabled yes\ncluster-config-file nodes.conf\n"
            f"cluster-node-timeout 1000\nsave \"\"\nappendonly no\nrepl-diskless-sync-delay 0\n"
            f"logfile {node / 'redis.log'}\n{more}")
        self.procs[port] = subprocess.Popen(["redis-server", str(node / "redis.conf")], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def log(self, port: int) -> str:
        path = self.root / f"node-{port}" / "redis.log"
        return path.read_text() if path.exists() else ""

    def nodes(self) -> list[tuple[int, str]]:
        """(port, "master" or "slave") of every node that answers, as the cluster sees them."""
        out = []
        real = {a: p for p, a in self.announced.items()}
        for line in self._cli("cluster", "nodes", port=next(p for p in self.ports if self.alive(p))).splitlines():
            fields = line.split()
            if len(fields) > 2 and "fail" not in fields[2]:
                port = int(fields[1].split(":")[1].split("@")[0])
                out.append((real.get(port, port), "master" if "master" in fields[2] else "slave"))
        return sorted(out)

    def scripts_run(self) -> int:
        """Lua scripts the masters have run (INFO commandstats: EVALSHA and
        EVAL), summed: every manifest read of tierd's is one."""
        import redis

        total = 0
        for port, role in self.nodes():
            if role == "master":
                stats = redis.Redis(port=port, password=self.password).info("commandstats")
                total += sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
        return total

    def alive(self, port: int) -> bool:
        return self.procs[port].poll() is None

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok and `masters` live
        masters serve (after a kill: once a replica has taken over)."""
        deadline = time.monotonic() + timeout
        while True:
            live = [p for p in self.ports if self.alive(p)]
            masters = [p for p, role in self.nodes() if role == "master"]
            if len(masters) == self.masters and all(self.alive(p) for p in masters) and \
                    all("cluster_state:ok" in self._cli("cluster", "info", port=p, timeout=5) for p in live):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout:.0f} s: {self.nodes()}")
            time.sleep(0.1)

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Until every master's replicas have all it wrote (offsets equal): what a
        fail-over may not lose. Redis replicates in the background."""
        deadline = time.monotonic() + timeout
        for port in [p for p, role in self.nodes() if role == "master"]:
            while True:
                info = self._cli("info", "replication", port=port, timeout=5)
                offset = re.search(r"master_repl_offset:(\d+)", info)
                replicas = re.findall(r"slave\d+:.*?state=online,offset=(\d+)", info)  # (not still syncing)
                if offset and len(replicas) >= self.replicas and all(int(o) >= int(offset.group(1))
                                                                     for o in replicas):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the replicas of {port} did not catch up in {timeout:.0f} s:\n{info}")
                time.sleep(0.05)

    def kill(self, port: int) -> None:
        """kill -9 one node."""
        self.procs[port].kill()
        self.procs[port].wait(30)

    def restart(self, port: int, timeout: float = 120.0) -> None:
        """Start a node that was killed again: it rejoins with the cluster
        configuration it saved, as a replica of whoever took its slots; returns
        once it has synced with that master (its copy is whole)."""
        self._spawn(port)
        deadline = time.monotonic() + timeout
        while True:
            info = self._cli("info", "replication", port=port, timeout=5)
            if "role:slave" in info and "master_link_status:up" in info and "master_sync_in_progress:0" in info:
                return
            if time.monotonic() > deadline or not self.alive(port):
                raise RuntimeError(f"the restarted node {port} did not sync in {timeout:.0f} s:\n{info}")
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _free_port() -> int:
    """A port that is free, with the one 10,000 above it (a cluster node's bus) free too, both
    below the range the system hands out to connections (32768 up)."""
    import random
    import socket

    while True:
        port = random.randrange(20000, 22768)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
