"""The faults a campaign injects, each a function of the campaign and its
seeded generator that sets the fault off, holds it a while, clears it, and
returns what it did. Each takes the lock of what it breaks (a daemon, the
Redis Cluster, the network), so two faults of different kinds overlap but a
daemon is never killed while it is being damaged. Runs on the campaign's
fault threads."""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tierd.testing import ROOT

HOSTILE = r"""
import os, signal, sys
from tierd.client import Client, KVSpec, SharedKVCache
spec = KVSpec("chaos/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
c = Client(sys.argv[1], token=sys.argv[2], timeout=20)
try:
    if sys.argv[3] == "lease":
        c.begin_save("hostile-lease", spec, 64, ttl=2)
    else:
        kv = SharedKVCache(spec, 8)
        c.register_engine(spec, kv)
        c.begin_restore("engine-0-0", ttl=2)
except Exception:
    pass
os.kill(os.getpid(), signal.SIGKILL)
"""


@contextmanager
def held(lock: threading.Lock, timeout: float = 1.0) -> Iterator[bool]:
    """The lock, where it can be had within `timeout` seconds (False: another fault has it now)."""
    got = lock.acquire(timeout=timeout)
    try:
        yield got
    finally:
        if got:
            lock.release()


@contextmanager
def _node(c, rng: random.Random) -> Iterator:
    """A daemon chosen by rng, its lock held (None: another fault has it now)."""
    node = rng.choice(c.nodes)
    with held(node.lock) as got:
        yield node if got else None


def kill9(c, rng: random.Random) -> str:
    with _node(c, rng) as node:
        if node is None:
            return ""
        time.sleep(rng.uniform(0, 1))  # anywhere in whatever it is doing: a save, a demotion, a publish
        node.kill()
        if rng.random() < 0.3:
            node.clock = rng.choice(["", "+1h", "+26h", "+3d"])  # a wall clock moved, either way
        node.start()
        c.alive(node, "restart after kill -9")
        return "kill9" + (" clock" if node.clock else "")


def sigstop(c, rng: random.Random) -> str:
    with _node(c, rng) as node:
        if node is None or not node.up:  # (one that did not start again: its failure is counted)
            return ""
        node.pause(True)
        time.sleep(rng.uniform(0.5, 6))
        node.pause(False)
        c.alive(node, "SIGCONT")
        return "sigstop"


def disk(c, rng: random.Random) -> str:
    with _node(c, rng) as node:
        err = rng.choice([errno.ENOSPC, errno.EIO])
        if node is None or not node.disk_faults(err, rng.choice([0.05, 0.3, 1.0])):
            return ""
        time.sleep(rng.uniform(1, 6))
        node.disk_faults(None)
        c.alive(node, "disk faults cleared")
        return "enospc" if err == errno.ENOSPC else "eio"


def damage(c, rng: random.Random) -> str:
    with _node(c, rng) as node:
        if node is None:
            return ""
        node.kill()
        what = node.damage(rng)
        with c.model.lock:
            c.model.damage[node.index] += 1
        c.log(f"{c.now():7.1f} s: node {node.index}: {what}")
        node.start()
        c.alive(node, f"restart after {what}")
        return "damage " + " ".join(what.split()[:2]).rstrip(":")


def redis_master(c, rng: random.Random) -> str:
    with held(c.redis_lock) as got:
        if not got:
            return ""
        masters = [p for p, role in c.cluster.nodes() if role == "master"]
        port = rng.choice(masters)
        c.cluster.kill(port)
        c.cluster.wait_ok(120)  # a replica took over: only now may the old master come back (as a replica)
        c.cluster.restart(port)
        return "redis failover"


def redis_down(c, rng: random.Random) -> str:
    with held(c.redis_lock) as got:
        if not got:
            return ""
        procs = [p for p in c.cluster.procs.values() if p.poll() is None]
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(rng.uniform(1, 8))
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        c.cluster.wait_ok(120)
        return "redis down"


def network(c, rng: random.Random) -> str:
    with held(c.net_lock) as got:
        if not got:
            return ""
        mode = rng.choice(["delay", "throttle", "reset", "blackhole"])
        proxies = list(c.proxies.values())
        chosen = proxies if rng.random() < 0.5 else rng.sample(proxies, rng.randint(1, len(proxies)))
        for p in chosen:
            p.set(mode, delay=rng.uniform(0.005, 0.2), rate=rng.choice([256e3, 4e6]))
        time.sleep(rng.uniform(1, 8))
        for p in chosen:
            p.set("pass")
        return f"net {mode}"


def hostile(c, rng: random.Random) -> str:
    """A client that sends garbage, floods, stalls a stream, cancels a Put, or
    dies holding a lease or in the middle of an engine's restore."""
    node = rng.choice(c.nodes)
    tenant, token = rng.choice(list(c.tokens.items()))
    way = rng.choice(["garbage", "flood", "stall", "cancel", "die"])
    try:
        if way == "garbage":
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(node.socket)
                s.sendall(rng.choice([b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b""]) + os.urandom(rng.randrange(1, 65536)))
        elif way == "flood":
            c.flood(node, token, rng.randint(50, 200))
        elif way == "stall":
            with node.client(token) as client:
                _, chunks = client.get_stream(f"put-{rng.randrange(4)}-0", chunk_bytes=4096)
                time.sleep(rng.uniform(1, 5))
                del chunks
        elif way == "cancel":
            c.cancelled_put(node, token)
        else:
            subprocess.run([sys.executable, "-c", HOSTILE, node.socket, token, rng.choice(["lease", "engine"])],
                           cwd=ROOT, capture_output=True, timeout=60)
    except Exception:  # the hostile client's own failures are its business; the daemon's answers are checked after
        pass
    c.alive(node, f"hostile {way}")
    return f"hostile {way}"


KINDS = {"kill9": kill9, "sigstop": sigstop, "disk": disk, "damage": damage, "redis_master": redis_master,
         "redis_down": redis_down, "network": network, "hostile": hostile}
WEIGHTS = {"kill9": 3, "sigstop": 2, "disk": 3, "damage": 2, "redis_master": 1, "redis_down": 1, "network": 3,
           "hostile": 4}
