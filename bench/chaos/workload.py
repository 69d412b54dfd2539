"""The campaign's tenants at work: each worker owns a handful of sessions of
one tenant, writes them on its home daemon only (so their model needs no
guessing about order) and reads them back there and on the other daemons,
every page checked against the model. Kinds: opaque Put/Get, engine memory
(Save/Restore from shared regions), leases (BeginSave/CommitSave into the
host arena, BeginRestore/EndRestore), prefix sharing (Put with token ids,
the family's leading pages stored once). Runs on the campaign's threads.
"""

from __future__ import annotations

import random
import threading
import time
import zlib

import numpy as np

from bench.chaos import content
from bench.chaos.model import Key, Model
from tierd.client import Arena, DataLoss, KVSpec, NotFound, SharedKVCache, TierdError
from tierd.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable

SPEC = KVSpec("chaos/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("chaos/llama.cpp", page_bytes=64 * 1024)
BLOCKS = 32  # an engine's blocks: a save's from the first half, a restore's into the second
CLEAN = (Unavailable, DeadlineExceeded, ResourceExhausted, DataLoss, FailedPrecondition)


def tokens(num_pages: int, version: int) -> int:
    """A version's token count: it and the page count name the version."""
    return (num_pages - 1) * SPEC.block_tokens + 1 + version % SPEC.block_tokens


class Worker:
    KINDS = ("put", "engine", "lease", "prefix")

    def __init__(self, campaign, tenant: str, token: str, number: int, home: int, seed: int) -> None:
        self.c = campaign
        self.model: Model = campaign.model
        self.tenant, self.token, self.number, self.home = tenant, token, number, home
        self.rng = random.Random(seed)
        self.kind = self.KINDS[number % len(self.KINDS)]
        self.sessions = [f"{self.kind}-{number}-{j}" for j in range(3)]  # the same ids in every tenant
        self.kv: SharedKVCache | None = None
        self.engine = None
        self.engine_node_start = -1
        self.arena = Arena() if self.kind == "lease" else None
        self.clients: dict = {}

    # --- one call, its outcome tallied -----------------------------------------------------------------
    def call(self, op: str, fn, *args, **kw):
        t = self.model.tally
        try:
            out = fn(*args, **kw)
        except NotFound:
            raise
        except CLEAN as exc:
            with self.model.lock:
                t.errors[type(exc).__name__] += 1
                t.samples.setdefault((op, type(exc).__name__), str(exc)[:300])
            if isinstance(exc, Unavailable):
                time.sleep(0.1)  # the daemon is down or its store is: as a client backs off
            return exc
        except TierdError as exc:
            with self.model.lock:
                t.unexpected += 1
                t.finding(f"{op} on node {self.home}: {type(exc).__name__}: {exc}")
            return exc
        with self.model.lock:
            t.ops[op] += 1
        return out

    def client(self, node: int):
        """The worker's client of a node (a channel reconnects on its own after a restart)."""
        if node not in self.clients:
            self.clients[node] = self.c.nodes[node].client(self.token)
        return self.clients[node]

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # a fault of the campaign's own: reported, never hidden
                with self.model.lock:
                    self.model.tally.unexpected += 1
                    self.model.tally.finding(f"worker {self.tenant}/{self.number}: {type(exc).__name__}: {exc}")
        self.close()

    def step(self) -> None:
        k = self.model.key(self.tenant, self.rng.choice(self.sessions))
        roll = self.rng.random()
        if roll < 0.4:
            self.write(k)
        elif roll < 0.72:
            node = self.home if self.kind in ("engine", "lease") or self.rng.random() < 0.6 else \
                self.rng.randrange(len(self.c.nodes))
            self.read(k, node)
        elif roll < 0.9:
            self.stat(k, self.home if self.rng.random() < 0.7 else self.rng.randrange(len(self.c.nodes)))
        elif roll < 0.92:
            self.listing(self.rng.randrange(len(self.c.nodes)))
        elif roll < 0.985:
            try:
                self.call("prefetch", self.client(self.home).prefetch, k.session)
            except NotFound:
                pass
        else:
            try:
                out = self.call("drop", self.client(self.home).drop, k.session)
            except NotFound:
                out = None
            self.model.dropping(k, acknowledged=not isinstance(out, Exception))

    def listing(self, node: int) -> None:
        """List: every session listed is the tenant's own (the same ids live in every tenant)."""
        infos = self.call("list", self.client(node).list)
        if isinstance(infos, Exception):
            return
        strangers = [i for i in infos if i.tenant != self.tenant]
        if strangers:
            with self.model.lock:
                self.model.tally.cross_tenant += 1
                self.model.tally.finding(f"list on node {node} for {self.tenant} shows {strangers[0].tenant}'s "
                                         f"{strangers[0].session_id}")

    def stat(self, k: Key, node: int) -> None:
        try:
            info = self.call("stat", self.client(node).stat, k.session)
        except NotFound:
            self.model.missing(k, node)
            return
        if isinstance(info, Exception):
            return
        if info.tenant != self.tenant:
            with self.model.lock:
                self.model.tally.cross_tenant += 1
                self.model.tally.finding(f"stat of {self.tenant}/{k.session} on node {node} names {info.tenant}")
        self.model.observed(k, node, info.num_tokens, info.num_pages, info.durable, info.remote_durable)

    # --- writes ----------------------------------------------------------------------------------------
    def write(self, k: Key) -> None:
        n = self.rng.randint(1, 6) if self.kind != "put" or self.rng.random() < 0.97 else self.rng.randint(32, 128)
        v = self.model.new_version(k, lambda v: v if self.kind == "put" else tokens(n, v), n)
        c = self.client(self.home)
        try:
            info = self.store(c, k, v, n)
        except NotFound:  # a lease that expired (the daemon restarted, or a stall): nothing was stored
            return
        if info is not None and not isinstance(info, Exception):
            self.model.observed(k, self.home, info.num_tokens, info.num_pages, info.durable, info.remote_durable)
            if self.rng.random() < 0.8:  # the turn ended: the session goes idle, and down the tiers
                try:
                    self.call("release", c.release, k.session)
                except NotFound:
                    pass

    def store(self, c, k: Key, v: int, n: int):
        if self.kind == "put":
            sizes = [OPAQUE.page_bytes] * (n - 1) + [self.rng.randint(content.HEADER, OPAQUE.page_bytes)]
            data = b"".join(content.pages(k.tenant, k.session, v, sizes))
            info = self.call("put", c.put, k.session, data, OPAQUE, num_tokens=v, chunk_bytes=32 * 1024)
        elif self.kind == "prefix":
            family = self.rng.randrange(2)
            shared = min(n - 1, 2)
            data = b"".join(content.pages(k.tenant, k.session, v, [SPEC.page_bytes] * n,
                                          shared=(f"prefix-{family}", shared)))
            ids = self.token_ids(k, family, shared, v, tokens(n, v))
            info = self.call("put", c.put, k.session, data, SPEC, num_tokens=tokens(n, v), token_ids=ids)
        elif self.kind == "engine":
            info = self.engine_save(c, k, v, n)
        else:
            info = self.lease_save(c, k, v, n)
        return info

    def token_ids(self, k: Key, family: int, shared: int, v: int, count: int) -> np.ndarray:
        """The family's tokens for its shared pages, then the version's own."""
        head = np.random.default_rng([zlib.crc32(k.tenant.encode()), family]).integers(0, 50_000, count)
        tail = np.random.default_rng([zlib.crc32(f"{k.tenant}/{k.session}".encode()), v]).integers(0, 50_000, count)
        cut = shared * SPEC.block_tokens
        return np.concatenate([head[:cut], tail[cut:]])

    def engine_save(self, c, k: Key, v: int, n: int):
        if not self.ensure_engine(c):
            return None
        assert self.kv is not None
        blocks = self.rng.sample(range(BLOCKS // 2), n)
        for i, b in enumerate(blocks):
            for seg in range(len(self.kv.layout.segments)):
                view = self.kv.block(seg, b)
                view[:] = np.frombuffer(content.page(content.Label(k.tenant, k.session, v, i, seg), view.size),
                                        np.uint8)
        return self.call("save", self.engine.save, k.session, blocks, tokens(n, v))

    def ensure_engine(self, c) -> bool:
        """The engine registered with the home daemon's current process."""
        node = self.c.nodes[self.home]
        if self.engine is not None and self.engine_node_start == node.daemon.starts:
            return True
        if self.kv is None:
            self.kv = SharedKVCache(SPEC, BLOCKS)
        out = self.call("register", c.register_engine, SPEC, self.kv)
        if isinstance(out, Exception):
            return False
        self.engine = out
        self.engine_node_start = node.daemon.starts
        return True

    def lease_save(self, c, k: Key, v: int, n: int):
        lease = self.call("begin_save", c.begin_save, k.session, SPEC, tokens(n, v), ttl=5)
        if isinstance(lease, Exception):
            return None
        assert self.arena is not None
        for i, page in enumerate(self.arena.pages(lease)):
            page[:] = np.frombuffer(content.page(content.Label(k.tenant, k.session, v, i), page.size), np.uint8)
        if self.rng.random() < 0.1:
            self.call("abort_save", c.abort_save, lease)
            return None
        return self.call("commit_save", c.commit_save, lease)

    # --- reads -----------------------------------------------------------------------------------------
    def read(self, k: Key, node: int) -> None:
        c = self.client(node)
        try:
            if self.kind in ("put", "prefix"):
                self.read_get(c, k, node)
            elif self.kind == "engine":
                self.read_engine(c, k, node)
            else:
                self.read_lease(c, k, node)
        except NotFound:
            self.model.missing(k, node)

    def read_get(self, c, k: Key, node: int) -> None:
        data = self.call("get", c.get, k.session)
        if isinstance(data, Exception):
            return
        size = OPAQUE.page_bytes if self.kind == "put" else SPEC.page_bytes
        labels = [content.identify(data[i : i + size]) for i in range(0, len(data), size)]
        self.model.read(k, node, labels, shared=2 if self.kind == "prefix" else 0)

    def read_engine(self, c, k: Key, node: int) -> None:
        if not self.ensure_engine(c):
            return
        assert self.kv is not None
        dst = list(range(BLOCKS // 2, BLOCKS // 2 + 6))
        for b in dst:
            for seg in range(len(self.kv.layout.segments)):
                self.kv.block(seg, b)[:] = 0
        r = self.call("restore", self.engine.restore, k.session, dst, whole=True)
        if isinstance(r, Exception):
            return
        labels = []
        for i in range(r.num_pages):
            parts = [content.identify(self.kv.block(seg, dst[i]).tobytes())
                     for seg in range(len(self.kv.layout.segments))]
            good = all(p is not None and p.part == seg and p.page == i for seg, p in enumerate(parts)) and \
                len({(p.tenant, p.session, p.version) for p in parts if p is not None}) == 1
            labels.append(parts[0] if good else None)
        self.model.read(k, node, labels)

    def read_lease(self, c, k: Key, node: int) -> None:
        lease = self.call("begin_restore", c.begin_restore, k.session, ttl=5)
        if isinstance(lease, Exception):
            return
        assert self.arena is not None
        labels = [content.identify(p.tobytes()) for p in self.arena.pages(lease)]
        try:
            self.call("end_restore", c.end_restore, lease)
        except NotFound:  # the lease expired before it ended: what was read may be wrong, and is not checked
            return
        self.model.read(k, node, labels)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.kv is not None:
            self.kv.close()
        for c in self.clients.values():
            c.close()
