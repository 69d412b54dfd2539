"""Host and disk tier figures through the store, each beside its limit:
memcpy of the same bytes for the host tier, raw O_DIRECT I/O of the same
size on the same file system for the disk tier.

A host save or restore also checksums every page, and a copy that hashes
what it copies cannot go as fast as a plain memcpy: hashing (XXH3) runs
at about memcpy's speed on one core. host_save_vs_copy_and_hash and
host_restore_vs_copy_and_hash put the same figures beside that limit: the
same bytes copied and hashed in 256 KiB pieces on every core, nothing else
(host_copy_and_hash_vs_memcpy says where it stands against memcpy)."""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import Result, copy_and_hash, random_bytes, ratio_result, timed
from tierd.client.shm import SharedKVCache
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import Store, make_key
from tierd.layout import KVSpec
from tierd.machine import build
from tierd.policy import PolicyConfig
from tierd.tiers.fileops import aligned_buffer

MiB = 1 << 20
# Qwen2.5-7B's KV shape: 28 layers, 4 KV heads, head dim 128, bf16: 57,344 bytes per token.
QWEN = KVSpec("Qwen/Qwen2.5-7B", "main", num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16",
              block_tokens=16)
KEY = make_key("default", "bench")


class World:
    """A store with host and disk tiers in a temporary data dir."""

    def __init__(self, nbytes: int, root: str) -> None:
        budget = -(-(nbytes * 2 + 64 * MiB) // 4096) * 4096
        # One host slab, as the daemon has; POSIX disk I/O, as beside the raw O_DIRECT limit.
        cfg = Config(data_dir=root, host_budget=budget, host_slab=budget, disk_budget=nbytes * 2 + 64 * MiB,
                     disk_slab=1 << 30, disk_io="posix", device="none")
        self.machine = build(cfg, policy=PolicyConfig(), clock=FakeClock())
        self.io_workers = cfg.io_workers
        self.store = self.machine.store

    def close(self) -> None:
        self.machine.close(flush=False)


class _RawFile:
    """O_DIRECT write + fsync, and read, of nbytes on the same file system:
    the disk tier's limit, one request at a time (sequential) or `depth` in
    flight from as many threads, as the daemon's disk I/O threads keep them
    (parallel)."""

    def __init__(self, path: str, nbytes: int, chunk: int = 16 * MiB, depth: int = 1) -> None:
        self.path, self.nbytes, self.chunk, self.depth = path, nbytes, chunk, depth
        self.bufs = [aligned_buffer(chunk) for _ in range(depth)]
        for buf in self.bufs:
            buf[:] = random_bytes(chunk, 7)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.pool = ThreadPoolExecutor(depth) if depth > 1 else None

    def _each(self, call: Callable) -> None:
        def lane(i: int) -> None:  # each thread its own buffer and every depth-th chunk
            for off in range(i * self.chunk, self.nbytes, self.depth * self.chunk):
                call(self.fd, [self.bufs[i][: min(self.chunk, self.nbytes - off)]], off)

        if self.pool is None:
            lane(0)
        else:
            list(self.pool.map(lane, range(self.depth)))

    def write(self) -> None:
        self._each(os.pwritev)
        os.fsync(self.fd)

    def read(self) -> None:
        self._each(os.preadv)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


def _alternating(ours: Callable[[], object], limit: Callable[[], object], repeat: int,
                 setup: Callable[[], object] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of ours and of its limit, taken in turns: a virtual disk's speed
    drifts by 2x within a minute, and both must see the same disk."""
    mine, raw = [], []
    for _ in range(repeat):
        raw += timed(limit, 1)
        mine += timed(ours, 1, setup)
    return mine, raw


def run(quick: bool) -> list[Result]:
    nbytes = (256 if quick else 1024) * MiB
    pages = nbytes // QWEN.page_bytes
    nbytes = pages * QWEN.page_bytes
    repeat = 3 if quick else 5
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        world = World(nbytes, root)
        raw = deep = None
        kv = SharedKVCache(QWEN, pages, kind="layer_major")
        try:
            for r in kv.regions:
                r[:] = random_bytes(r.size, 1)
            blocks = np.arange(pages)
            store = world.store
            src, dst = random_bytes(nbytes, 2), np.empty(nbytes, dtype=np.uint8)
            dst[:] = 0
            memcpy = timed(lambda: np.copyto(dst, src), repeat)
            checked = timed(copy_and_hash(src, dst), repeat)
            results.append(Result("host_copy_and_hash_vs_memcpy", nbytes / statistics.median(checked) / 1e9, "GB/s",
                                  nbytes / statistics.median(memcpy) / 1e9,
                                  round(statistics.median(memcpy) / statistics.median(checked), 3),
                                  note=f"the limit of a copy that checks: the same bytes copied and XXH3-hashed in "
                                       f"256 KiB pieces on {os.cpu_count()} cores, beside memcpy (ratio: memcpy's "
                                       "time over its time)"))
            for _ in range(2):  # warm: both arena regions a replacing save alternates between are resident
                store.save(KEY, _memory(kv), QWEN, blocks, pages * 16)
            save = timed(lambda: store.save(KEY, _memory(kv), QWEN, blocks, pages * 16), repeat)
            results.append(ratio_result("host_save_vs_memcpy", save, memcpy, nbytes, 0.7,
                                        note=f"{nbytes >> 20} MiB, 56 per-layer K/V regions, checksums included"))
            results.append(ratio_result("host_save_vs_copy_and_hash", save, checked, nbytes, 0.85,
                                        note="the save beside the limit of a copy that checks what it copies"))
            restore = timed(lambda: store.restore(KEY, _memory(kv), QWEN, blocks), repeat)
            results.append(ratio_result("host_restore_vs_memcpy", restore, memcpy, nbytes, 0.7,
                                        note=f"{nbytes >> 20} MiB into a contiguous block table"))
            results.append(ratio_result("host_restore_vs_copy_and_hash", restore, checked, nbytes, 0.85,
                                        note="the restore beside the limit of a copy that checks what it copies"))
            results[-1].series = _sweep(store, kv, pages, repeat)

            raw = _RawFile(os.path.join(root, "raw.bin"), nbytes)
            deep = _RawFile(os.path.join(root, "deep.bin"), nbytes, depth=world.io_workers)

            def demote() -> None:
                store.demote(KEY, reason="bench")

            def fresh_in_host() -> None:
                store.save(KEY, _memory(kv), QWEN, blocks, pages * 16)

            demotions, raw_write = _alternating(demote, raw.write, repeat, setup=fresh_in_host)
            results.append(ratio_result("disk_save_vs_raw_write", demotions, raw_write, nbytes, 0.8,
                                        note="host -> disk demotion, fdatasync and index commit included"))
            store.restore(KEY, _memory(kv), QWEN, blocks)  # warm: staging buffers are pooled after the first
            disk_restore, raw_read = _alternating(lambda: store.restore(KEY, _memory(kv), QWEN, blocks), raw.read,
                                                  repeat)
            assert store.stat(KEY).tier == "disk"
            results.append(ratio_result("disk_restore_vs_raw_read", disk_restore, raw_read, nbytes, 0.8,
                                        note="O_DIRECT, checksums verified, into engine memory; taken in turns "
                                             "with the raw read (one request at a time)"))
            # The same, beside the device at the daemon's queue depth: the limit a ratio above 1 says it outran.
            demotions, deep_write = _alternating(demote, deep.write, repeat, setup=fresh_in_host)
            results.append(ratio_result("disk_save_vs_parallel_write", demotions, deep_write, nbytes, 0.8,
                                        note=f"raw: {deep.depth} threads of 16 MiB O_DIRECT writes + fsync, the "
                                             "daemon's disk I/O threads"))
            store.restore(KEY, _memory(kv), QWEN, blocks)
            disk_restore, deep_read = _alternating(lambda: store.restore(KEY, _memory(kv), QWEN, blocks), deep.read,
                                                   repeat)
            results.append(ratio_result("disk_restore_vs_parallel_read", disk_restore, deep_read, nbytes, 0.8,
                                        note=f"raw: {deep.depth} threads of 16 MiB O_DIRECT reads, the daemon's "
                                             "disk I/O threads"))
        finally:
            kv.close()
            world.close()
            for f in (raw, deep):
                if f is not None:
                    f.close()
    return results


def _sweep(store: Store, kv: SharedKVCache, pages: int, repeat: int) -> dict:
    """Save, restore and memcpy bandwidth (GB/s) by snapshot size, for the plot."""
    out: dict = {"bytes": [], "save": [], "restore": [], "memcpy": []}
    n = 4
    while n <= pages:
        nbytes = n * QWEN.page_bytes
        blocks = np.arange(n)
        key = make_key("default", f"sweep-{n}")
        src, dst = random_bytes(nbytes, 5), np.zeros(nbytes, dtype=np.uint8)
        store.save(key, _memory(kv), QWEN, blocks, n * 16)
        out["bytes"].append(nbytes)
        for name, fn in (("save", lambda: store.save(key, _memory(kv), QWEN, blocks, n * 16)),
                         ("restore", lambda: store.restore(key, _memory(kv), QWEN, blocks)),
                         ("memcpy", lambda: np.copyto(dst, src))):
            out[name].append(nbytes / min(timed(fn, repeat)) / 1e9)
        store.drop(key)
        n *= 4
    return out


def _memory(kv: SharedKVCache):
    from tierd.transfer.copier import EngineMemory

    return EngineMemory(kv.layout, kv.regions)
