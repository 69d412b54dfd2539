"""A seeded chaos campaign: a Redis Cluster (3 masters, 3 replicas) behind a
faulty network, two daemons on it sharing the remote tier, three tenants'
workers on both, and two fault threads injecting every kind of fault at
random while every read is checked against the model. `run` returns the
tally; `summary` prints its one line. Runs in the campaign's process: the
workers, fault threads and a sampler on threads of their own."""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.chaos import faults
from bench.chaos.model import Model
from bench.chaos.network import FaultyProxy
from bench.chaos.nodes import Node, have_faketime, have_fiu
from bench.chaos.workload import OPAQUE, Worker
from tierd.errors import NotFound, TierdError
from tierd.testing import RedisCluster, tokens_file, wire_accounting

TENANTS = {"alice": "alice-token", "bob": "bob-token", "carol": "carol-token"}
ADMIN = "ops-token"
WORKERS_PER_TENANT = 4  # one of each kind (put, engine, lease, prefix)
LIVENESS_S = 30.0  # after a fault clears (a restarted daemon: once it serves), a daemon answers within this
INFLIGHT = 16 << 20  # --tenant-inflight-bytes
HEAP_ALLOWANCE = 256 << 20  # working memory beyond the in-flight caps: gRPC, Redis and codec buffers


class Campaign:
    def __init__(self, root: Path, seed: int, seconds: float, log=print) -> None:
        self.root, self.seed, self.seconds, self.log = root, seed, seconds, log
        self.model = Model(nodes=2)
        self.tokens = dict(TENANTS)
        self.stop = threading.Event()
        self.redis_lock, self.net_lock = threading.Lock(), threading.Lock()
        self.proxies: dict[int, FaultyProxy] = {}
        self.cluster = RedisCluster(root / "redis", masters=3, replicas=1, front=self._front)
        self.nodes: list[Node] = []
        self.heap_start = [0, 0]
        self.heap_peak = [0, 0]

    def now(self) -> float:
        return time.monotonic() - self.model.tally.started

    def _front(self, port: int) -> int:
        self.proxies[port] = FaultyProxy(port)
        return self.proxies[port].port

    def alive(self, node: Node, after: str) -> None:
        """Liveness: the daemon answers a health check within the deadline."""
        deadline = time.monotonic() + LIVENESS_S
        with node.client(ADMIN, timeout=5) as c:
            while True:
                try:
                    c.health(timeout=5)
                    return
                except TierdError:
                    pass
                if time.monotonic() > deadline:
                    with self.model.lock:
                        self.model.tally.liveness += 1
                        self.model.tally.finding(f"node {node.index} did not answer {LIVENESS_S:.0f} s after {after}")
                    return
                time.sleep(0.2)

    def flood(self, node: Node, token: str, n: int) -> None:
        """n calls at once from 32 threads of one client: Stats, and Gets of sessions that may not be."""
        def one(i: int) -> None:
            try:
                c.stats() if i % 2 else c.get(f"put-{i % 4}-0")
            except TierdError:
                pass
        with node.client(token, timeout=10) as c, ThreadPoolExecutor(32) as pool:
            list(pool.map(one, range(n)))

    def cancelled_put(self, node: Node, token: str) -> None:
        def chunks():
            yield b"x" * 65536
            raise RuntimeError("the client gives up")
        with node.client(token, timeout=10) as c:
            try:
                c.put("hostile-cancel", chunks(), OPAQUE, num_tokens=1)
            except Exception:
                pass

    def _sample(self) -> None:
        """Each daemon's heap, every half second; accounting, every 30 s."""
        next_accounting = time.monotonic() + 30
        while not self.stop.wait(0.5):
            for node in self.nodes:
                if node.up:
                    self.heap_peak[node.index] = max(self.heap_peak[node.index], node.heap())
            if time.monotonic() > next_accounting:
                next_accounting = time.monotonic() + 30
                self.check_accounting()

    def check_accounting(self) -> None:
        """Per tier, bytes used = the sessions' bytes (less sharing's saving),
        and no more than its budget: asked until it holds while the movers run
        and leases end, for 15 s at most (a lease a failed call left open ends
        in 5 s)."""
        for node in self.nodes:
            with faults.held(node.lock, 5) as got:
                problems = self._accounting(node) if got else []
            if problems:
                with self.model.lock:
                    self.model.tally.accounting += 1
                    self.model.tally.finding(f"accounting on node {node.index}: {problems}")

    @staticmethod
    def _accounting(node: Node) -> list[str]:
        """What still differs after 15 s of asking ([]: it held, or the daemon never answered)."""
        problems: list[str] | None = None
        with node.client(ADMIN, timeout=10) as c:
            for _ in range(50):
                try:
                    problems = wire_accounting(c) + [
                        f"the {t.name} tier uses {t.used} bytes of its budget of {t.budget}"
                        for t in c.stats()["tiers"] if t.budget and t.used > t.budget]
                except TierdError:
                    problems = None
                if problems == []:
                    return []
                time.sleep(0.3)
        return problems or []

    def _faults(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds = list(faults.WEIGHTS)
        while not self.stop.wait(rng.uniform(0.5, 4)):
            kind = rng.choices(kinds, [faults.WEIGHTS[k] for k in kinds])[0]
            began = self.now()
            try:
                done = faults.KINDS[kind](self, rng)
            except Exception as exc:
                done = ""
                with self.model.lock:
                    self.model.tally.unexpected += 1
                    self.model.tally.finding(f"fault {kind}: {type(exc).__name__}: {exc}")
            if done:
                self.log(f"{began:7.1f}-{self.now():7.1f} s: {done}")
                with self.model.lock:
                    self.model.tally.faults[done] += 1

    def run(self) -> Model:
        self.log(f"chaos: seed {self.seed}, {self.seconds:.0f} s; libfiu {'yes' if have_fiu() else 'absent'}, "
                 f"libfaketime {'yes' if have_faketime() else 'absent'}")
        tokens = tokens_file(self.root, {**TENANTS, "ops": ADMIN}, admins=("ops",))
        self.cluster.start(120)
        flags = ["--remote", self.cluster.url, "--remote-replicas", "1", "--remote-timeout", "5",
                 "--auth-tokens", tokens, "--writeback-idle", "0.5", "--host-idle", "3", "--remote-write", "through",
                 "--tenant-inflight-bytes", str(INFLIGHT), "--disk-budget", "1GiB", "--codec", "disk=lossless",
                 "--codec", "remote=lossless"]
        self.nodes = [Node(i, self.root, flags) for i in range(2)]
        threads = []
        try:
            for node in self.nodes:
                node.start()
                self.heap_start[node.index] = node.heap()
            workers = [Worker(self, tenant, token, n, (i + n) % 2, self.seed * 1000 + 10 * i + n)
                       for i, (tenant, token) in enumerate(TENANTS.items()) for n in range(WORKERS_PER_TENANT)]
            threads = [threading.Thread(target=w.run, args=(self.stop,), daemon=True) for w in workers]
            threads += [threading.Thread(target=self._faults, args=(self.seed * 7 + i,), daemon=True)
                        for i in range(2)]
            threads.append(threading.Thread(target=self._sample, daemon=True))
            for t in threads:
                t.start()
            self.stop.wait(self.seconds)
        finally:
            self.stop.set()
            for t in threads:
                t.join(120)  # (each fault clears what it set off before it returns)
            self.finish()
        return self.model

    def finish(self) -> None:
        """After the last fault: every daemon answers, its accounting holds."""
        for p in self.proxies.values():
            p.set("pass")
        for node in self.nodes:
            if node.daemon.proc is not None and node.daemon.proc.poll() is None:
                node.pause(False)
                self.alive(node, "the campaign's end")
        self.check_accounting()
        self.check_durable()
        for node in self.nodes:
            node.close()
        self.cluster.close()
        for p in self.proxies.values():
            p.close()

    def check_durable(self) -> None:
        """Every session reported durable (and not dropped since) is served
        where its floor binds, at that version or a newer one: asked until
        it is, for 60 s at most, now that every fault has cleared."""
        clients = {(t, n.index): n.client(token) for t, token in TENANTS.items() for n in self.nodes}
        try:
            for k, node in self.model.durable():
                c = clients[k.tenant, node]
                deadline = time.monotonic() + 60
                while True:
                    try:
                        info = c.stat(k.session)
                    except NotFound:
                        info = None
                    except TierdError:
                        info = "unavailable"
                    if info is not None and not isinstance(info, str):
                        break
                    if time.monotonic() > deadline:  # not found, or no answer: not served
                        info = None
                        break
                    time.sleep(0.5)
                if info is None:
                    self.model.missing(k, node, final=True)
                else:
                    v = self.model.version_of(k, info.num_tokens, info.num_pages)
                    if v is not None:
                        self.model.older(k, node, v)
                with self.model.lock:
                    self.model.tally.final_checked += 1
        finally:
            for c in clients.values():
                c.close()

    def heap_bound(self, index: int) -> int:
        return self.heap_start[index] + len(TENANTS) * INFLIGHT + HEAP_ALLOWANCE


def run(seed: int, seconds: float, root: str | None = None, log=print,
        keep: str | None = None) -> tuple[Campaign, Model]:
    """One campaign under a temporary directory; with keep, where the daemons'
    and Redis nodes' logs are copied when it found anything."""
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        campaign = Campaign(Path(tmp), seed, seconds, log)
        model = campaign.run()
        if keep and model.tally.findings:
            for path in Path(tmp).glob("**/*.log"):
                dest = Path(keep) / path.relative_to(tmp)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
            log(f"logs of the daemons and Redis nodes: {keep}")
    return campaign, model
