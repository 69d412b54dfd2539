"""Shared test helpers: a store on a temporary data dir, engine memory laid
out the way real engines lay it out (numpy regions, real bytes), and a small
file system that fills up for real."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import Store
from tierd.layout import EngineLayout, KVSpec
from tierd.machine import Machine, build
from tierd.policy import PolicyConfig
from tierd.tiers import shm
from tierd.tiers.host import HostTier
from tierd.transfer.copier import EngineMemory

MiB = 1 << 20
SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


def arena_name() -> str:
    """A shared-memory prefix no other test uses."""
    return f"tierd-test-{uuid.uuid4().hex[:12]}"


def host_tier(budget: int, slab: int) -> HostTier:
    return HostTier(budget, arena_name(), slab_bytes=slab)


@dataclass
class Harness:
    """Builds stores over one data dir; reopen() simulates a daemon restart."""

    root: str
    clock: FakeClock = field(default_factory=FakeClock)
    host_budget: int = 64 * MiB
    disk_budget: int = 256 * MiB
    device_budget: int | None = None
    host_slab: int = 16 * MiB
    disk_slab: int = 64 * MiB
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    verify: tuple[str, ...] = ("disk",)
    disk: bool = True
    disk_ops: object = None  # a FileOps for the disk tier (fault injection)
    movers: int = 2  # background move threads; 0 leaves every queued move queued
    events: object = None  # what the store reports to (tierd.metrics.Metrics, say); None: nothing
    window_bytes: int = 4 * MiB  # the copy engine's staging window
    remote: str = ""  # the remote tier's URL (none: "")
    remote_write: str = "through"
    remote_prefix: str = "tierd"
    remote_quota: int = 0  # remote tier bytes each tenant may take (0: no limit)
    remote_queue: int = 256  # sessions waiting to be published, at most
    remote_timeout: float = 0.5  # seconds a remote call may take
    remote_idle: float = 60.0  # write back: seconds idle on disk before a session is published
    remote_recheck: float = 5.0  # seconds a copy change notices vouch for is served without asking (0: always ask)
    remote_replicas: int = 1  # replicas that must acknowledge a publish before it is remote-durable
    remote_codec: str = "none"  # what pages are coded with on their way to the remote tier
    disk_codec: str = "none"  # and on their way to the disk tier
    host_codec: str = "none"  # what the host tier re-codes idle sessions with to make room ("none": nothing)
    lossy_tenants: frozenset = frozenset()  # whose KV a lossy remote codec codes
    lossy_max_error: float = 0.05
    store: Store | None = None
    machine: Machine | None = None

    def open(self) -> Store:
        # Through the daemon's composition root: a fresh shared-memory prefix per
        # open, and what a killed run left is removed.
        cfg = Config(data_dir=self.root, host_budget=self.host_budget, host_slab=self.host_slab,
                     disk_budget=self.disk_budget, disk_slab=self.disk_slab, disk_io="posix",
                     device="none" if self.device_budget is None else "cpu",
                     device_budget=self.device_budget or 0, device_slab=8 * MiB,
                     verify="all" if set(self.verify) != {"disk"} else "disk", io_workers=4, movers=self.movers,
                     remote=self.remote, remote_write=self.remote_write, remote_prefix=self.remote_prefix,
                     tenant_remote_quota=self.remote_quota, remote_queue=self.remote_queue,
                     remote_timeout=self.remote_timeout, remote_idle=self.remote_idle,
                     remote_recheck=self.remote_recheck, remote_replicas=self.remote_replicas,
                     codec={"disk": self.disk_codec, "host": self.host_codec,
                            **({"remote": self.remote_codec} if self.remote else {})},
                     lossy_tenants=self.lossy_tenants,
                     lossy_max_error=self.lossy_max_error)
        self.machine = build(cfg, policy=self.policy, clock=self.clock, events=self.events, disk=self.disk,
                             disk_ops=self.disk_ops, window_bytes=self.window_bytes)
        self.store, self.prefix = self.machine.store, self.machine.shm_prefix
        return self.store

    def close(self, flush: bool = False) -> None:
        if self.machine is not None:
            self.machine.close(flush)
            self.machine = self.store = None

    def reopen(self, flush: bool = False) -> Store:
        self.close(flush)
        return self.open()


class HostEngine:
    """An engine's paged KV memory on the host: random bytes in numpy regions."""

    def __init__(self, spec: KVSpec = SPEC, num_blocks: int = 64, kind: str = "layer_major", seed: int = 0,
                 device: str | None = None) -> None:
        self.spec = spec
        layout = EngineLayout.layer_major(spec, num_blocks) if kind == "layer_major" else \
            EngineLayout.cross_layer(spec, num_blocks)
        rng = np.random.default_rng(seed)
        sizes = [0] * (max(s.region for s in layout.segments) + 1)
        for s in layout.segments:
            sizes[s.region] = max(sizes[s.region], s.offset + num_blocks * s.stride)
        self.regions = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
        regions = self.regions
        if device is not None:
            import torch

            regions = [torch.from_numpy(r).to(device) for r in self.regions]
        self.memory = EngineMemory(layout, regions)

    @property
    def layout(self) -> EngineLayout:
        return self.memory.layout

    def page(self, block: int) -> bytes:
        """A block's bytes in page order (the concatenation of its segments)."""
        regions = [r if isinstance(r, np.ndarray) else r.cpu().numpy() for r in self.memory.regions]
        return b"".join(regions[s.region][s.offset + block * s.stride : s.offset + block * s.stride + s.nbytes]
                        .tobytes() for s in self.layout.segments)

    def pages(self, blocks) -> list[bytes]:
        return [self.page(int(b)) for b in blocks]

    def randomize(self, blocks, seed: int, levels: int = 256) -> None:
        """New random bytes in these blocks (host regions only), of `levels` values (fewer: they code smaller)."""
        rng = np.random.default_rng(seed)
        for b in blocks:
            for s in self.layout.segments:
                start = s.offset + int(b) * s.stride
                self.memory.regions[s.region][start : start + s.nbytes] = rng.integers(0, levels, s.nbytes,
                                                                                       dtype=np.uint8)

    def clear(self) -> None:
        for r in self.memory.regions:
            r[:] = 0


def kv_like(engine: HostEngine, seed: int) -> HostEngine:
    """Engine memory holding float16 values with a scale per channel, as KV has, of few significant bits (an
    8-bit cache's values widened): they code much smaller than random bytes."""
    rng = np.random.default_rng(seed)
    for region in engine.regions:
        values = region.view(np.float16).reshape(-1, engine.spec.head_dim)
        scale = rng.choice([0.05, 1.0, 8.0], engine.spec.head_dim)
        values[:] = (np.round(rng.standard_normal(values.shape) * 8) / 8 * scale).astype(np.float16)
    return engine


def published(store: Store, key) -> None:
    """Wait until the remote tier holds the session's current content."""
    wait_for(lambda: store.stat(key).remote_durable, what=f"{key} published")


def heard(store: Store, key) -> None:
    """Wait until the store's remote tier knows of no version of the session
    but the one the tier holds: the change notices of another node's publish
    or drop have arrived (until then, a copy they vouched for is served as it
    is, asking nothing: tierd/remote/redis/notices.py)."""
    backend = store.remote.store

    def caught_up() -> bool:
        known = backend.current(key)
        if known is None:
            return True
        m, at = backend.reader.head(key)  # (read past the notices: remembers nothing)
        return known == (at, m.write if m is not None else "")

    wait_for(caught_up, what=f"{key} heard of")


def metric(d, name: str, labels: str = "") -> float:
    """A daemon's metric as its endpoint shows it now (0 where absent)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def flip_in_arena(data_dir: str, needle: bytes) -> None:
    """Change one byte of a daemon's host arena (its shared memory, by the prefix
    its data dir records) where `needle` lies: damage behind the daemon's back."""
    import glob
    import mmap


    hits = 0
    for path in glob.glob(f"/dev/shm/{shm.read_prefix(data_dir)}.*"):
        if ".lease." in path:
            continue
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            at = mm.find(needle)
            if at >= 0:
                mm[at] ^= 0x01
                hits += 1
    assert hits == 1


def read_all(chunks) -> bytes:
    """A Get's chunks joined, each copied as it comes: a chunk may be a view
    valid only until the next (a disk tier's staging buffer), so collecting
    the views first (as bytes.join does) would join bytes read over them."""
    return b"".join(bytes(c) for c in chunks)


def wait_for(predicate, timeout: float = 30.0, what: str = "the condition", missing_ok: bool = False):
    """Poll predicate until it returns something true; fail after timeout seconds.
    With missing_ok, a session not found yet (NotFound) counts as not yet."""
    from tierd.errors import NotFound

    deadline = time.monotonic() + timeout
    while True:
        try:
            got = predicate()
        except NotFound:
            if not missing_ok:
                raise
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.02)


class SmallFS:
    """A tmpfs of a few MiB mounted at `path`: a file system that really fills
    up. fill() takes every free byte with a plain file; free() deletes it."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.filler = path / "filler"

    def mount(self) -> str | None:
        """Mount it; returns why it cannot be mounted here, or None."""
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                                 capture_output=True, text=True, timeout=30, check=False)
        except FileNotFoundError:
            return "there is no mount command"
        return None if out.returncode == 0 else (out.stderr.strip() or f"mount exited with {out.returncode}")

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30, check=False).returncode:
            subprocess.run(["umount", "--lazy", str(self.path)], capture_output=True, timeout=30, check=False)

    def fill(self) -> int:
        """Write a plain file until the file system refuses more; returns its size."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (MiB, 4096):
                block = b"\0" * chunk
                try:
                    while True:
                        os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)
        assert shutil.disk_usage(self.path).free < 4096, "the file system still has room"
        return os.path.getsize(self.filler)

    def free(self) -> None:
        self.filler.unlink()


@contextmanager
def masters_stopped(cluster) -> Iterator[None]:
    """Every master of a RedisCluster stopped (SIGSTOP) for the block, then
    resumed (SIGCONT) and the cluster ok again: a blip of the whole remote
    tier in which no replica takes over (no master is left to vote)."""
    masters = [port for port, role in cluster.nodes() if role == "master"]
    for port in masters:
        os.kill(cluster.procs[port].pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for port in masters:
            os.kill(cluster.procs[port].pid, signal.SIGCONT)
        cluster.wait_ok()
