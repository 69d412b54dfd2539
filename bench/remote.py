"""The remote tier against a real Redis Cluster on loopback (3 masters, 3
replicas, started here from redis-server).

- remote_save_vs_raw_set: publishing a session held in host memory (read,
  chunked, every chunk SET, the manifest switched by compare-and-set; the
  pages are checked by every reader, as a move out of host memory is)
  against redis-py's pipelined SETs of the same bytes in the same chunk
  sizes and batches, in turns (the ratio: the median of each turn's own).
- remote_restore_vs_raw_get: restoring a session that only the remote tier
  holds into engine blocks on another node (manifest, GETs, every page
  checked, into the host tier, scattered) against redis-py's pipelined GETs
  of the same chunks, in turns (likewise); the note adds the store's own
  reader alone (its GETs in flight, into one buffer, nothing checked).
- remote_restore_lossless_vs_none, remote_save_lossless_vs_none: the same
  session of real KV (a random-weight Llama's, bfloat16), published by a
  node that codes its remote pages lossless and by one that does not, and
  restored from each on a third node: our time with lossless over our time
  without (below 1.0: the coding pays on this link); the note gives the
  bytes each version takes in the store.
- remote_read_round_trips: calls on the store (manifest reads: script runs,
  counted by the cluster's primaries) per local read of a session another
  node published and nothing changed since (a Restore into engine blocks
  on the node that fetched it), while the tier's change notices are live,
  beside the same reads with --remote-recheck 0 (each asks); the note gives
  the median time of a read each way.
- trace_multinode_served: three daemons and one cluster; a router sends each
  turn of each session to a random node, which is told to prefetch it a
  lead time before. The share of resumes served from tierd, beside the same
  trace without the remote tier (where a turn on another node than the
  last one's finds nothing and recomputes).
"""

from __future__ import annotations

import heapq
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import Result, random_bytes, ratio_result, spread, timed
from tierd.client import KVSpec, SharedKVCache
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import make_key
from tierd.errors import InvalidArgument, NotFound
from tierd.machine import build
from tierd.policy import PolicyConfig
from tierd.testing import Daemon, RedisCluster
from tierd.remote.manifest import tag_of
from tierd.remote.redis.link import CHUNK_BYTES, PIPELINE
from tierd.remote.redis.replies import READ_BATCH, READ_DEPTH, read_values
from tierd.transfer.copier import EngineMemory

MiB = 1 << 20
# Qwen2.5-7B's KV shape, as in the tier benchmarks: 57,344 bytes per token.
QWEN = KVSpec("Qwen/Qwen2.5-7B", "main", num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16",
              block_tokens=16)
# The trace's small model: 2 KiB per token, 32 KiB pages.
SMALL = KVSpec("bench/remote-trace", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
KEY = make_key("default", "bench-remote")


def run(quick: bool) -> list[Result]:
    if shutil.which("redis-server") is None:
        return [Result("remote_skipped", 0, "-", note="redis-server is not installed (make install installs it)")]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        cluster = RedisCluster(os.path.join(root, "redis")).start()
        try:
            return (_copies(root, cluster, quick) + _coded(root, cluster, quick) + _round_trips(root, cluster) +
                    _trace(root, cluster, quick))
        finally:
            cluster.close()


def _machine(root: str, name: str, url: str, nbytes: int, codec: str = "none", recheck: float = 5.0):
    budget = -(-(nbytes * 2 + 64 * MiB) // 4096) * 4096
    cfg = Config(data_dir=os.path.join(root, name), host_budget=budget, host_slab=budget, disk_budget=nbytes * 2,
                 disk_io="posix", device="none", remote=url, remote_write="off", remote_prefix="bench",
                 codec={"remote": codec}, remote_recheck=recheck)
    return build(cfg, policy=PolicyConfig(writeback_idle=None), clock=FakeClock())


def _copies(root: str, cluster: RedisCluster, quick: bool) -> list[Result]:
    nbytes = (64 if quick else 256) * MiB
    pages = nbytes // QWEN.page_bytes
    nbytes = pages * QWEN.page_bytes
    repeat = 15  # the box is shared with six redis-servers, whose speed drifts: medians of many turns
    a = _machine(root, "a", cluster.url, nbytes)  # writes off: publishes only when asked, on this thread
    b = _machine(root, "b", cluster.url, nbytes)  # off: its drops leave the remote copy
    kv = SharedKVCache(QWEN, pages, kind="layer_major")
    try:
        for r in kv.regions:
            r[:] = random_bytes(r.size, 1)
        memory = EngineMemory(kv.layout, kv.regions)
        blocks = np.arange(pages)
        a.store.save(KEY, memory, QWEN, blocks, pages * 16)
        client = a.store.remote.store.client
        _, reader = a.store.get(KEY)
        data = b"".join(bytes(c) for c in reader)  # the session's bytes, cut as a publish cuts them
        raw = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        del data
        tag = tag_of(KEY)
        raw_keys = [f"bench-raw:{{{tag}}}:{i}" for i in range(len(raw))]
        generation = [0]

        def set_all(keys: list[str]) -> None:
            for first in range(0, len(keys), PIPELINE):
                pipe = client.pipeline(transaction=False)
                for name, chunk in zip(keys[first : first + PIPELINE], raw[first : first + PIPELINE]):
                    pipe.set(name, chunk)
                pipe.execute()

        def raw_set() -> None:
            """The bytes under new keys, then the last copy's deleted: what storing a
            second copy costs the store (a version can never overwrite the one it replaces)."""
            g = generation[0] = generation[0] + 1
            set_all([f"bench-raw{g}:{{{tag}}}:{i}" for i in range(len(raw))])
            client.delete(*[f"bench-raw{g - 1}:{{{tag}}}:{i}" for i in range(len(raw))])

        def raw_overwrite() -> None:
            set_all(raw_keys)

        def raw_get() -> None:
            for first in range(0, len(raw_keys), PIPELINE):
                pipe = client.pipeline(transaction=False)
                for name in raw_keys[first : first + PIPELINE]:
                    pipe.get(name)
                assert all(v is not None for v in pipe.execute())

        into = memoryview(bytearray(sum(len(c) for c in raw)))
        ends = np.cumsum([len(c) for c in raw])
        sinks = [[into[end - len(c) : end]] for c, end in zip(raw, ends)]

        def store_reader() -> None:
            """The store's own reader alone: its GETs in flight, into one buffer, nothing checked."""
            pool = a.store.remote.store.fetcher.pool_of(raw_keys[0])
            assert all(read_values(pool, raw_keys, sinks, lambda i, found: None, lambda: False))

        def publish() -> None:
            assert a.store.publish(KEY)

        def fresh() -> None:
            a.store.save(KEY, memory, QWEN, blocks, pages * 16)  # a new history each time: published whole

        ours, limit, overwrite = [], [], []
        fresh()
        publish()  # warm: connections to every master, the script loaded
        raw_set()
        raw_overwrite()
        for _ in range(repeat):
            limit += timed(raw_set, 1)
            overwrite += timed(raw_overwrite, 1)
            ours += timed(publish, 1, fresh)
        results = [ratio_result("remote_save_vs_raw_set", ours, limit, nbytes, 0.8, paired=True,
                                note=f"{nbytes >> 20} MiB in chunks of {CHUNK_BYTES} B, {PIPELINE} a round trip, "
                                     "read from the host tier (every reader checks each page), manifest switched by "
                                     "compare-and-set; "
                                     "limit: SETs of the same chunks under new keys, the last copy deleted")]
        over = statistics.median(overwrite)
        results[-1].spread["overwrite_seconds"] = spread(overwrite)
        results[-1].note += f"; SETs over the same keys: {nbytes / over / 1e9:.2f} GB/s " \
                            f"({over / statistics.median(ours):.3f} of it)"

        out = EngineMemory(kv.layout, kv.regions)

        def restore() -> None:
            r = b.store.restore(KEY, out, QWEN, blocks)
            assert r.num_pages == pages

        def forget() -> None:
            _forget(b, KEY)

        forget()
        restore()  # warm
        store_reader()
        ours, limit, reader = [], [], []
        for _ in range(repeat):
            limit += timed(raw_get, 1)
            reader += timed(store_reader, 1)
            ours += timed(restore, 1, forget)
        results.append(ratio_result("remote_restore_vs_raw_get", ours, limit, nbytes, 0.8, paired=True,
                                    note="a session only the remote tier holds, restored on another node: "
                                         "every page checked, into the host tier and, as they arrive, into "
                                         f"engine blocks; limit: redis-py's pipelined GETs, {PIPELINE} a round "
                                         "trip"))
        alone = statistics.median(reader)
        results[-1].spread["store_reader_seconds"] = spread(reader)
        results[-1].note += f"; the store's reader alone ({READ_BATCH} GETs a round trip, {READ_DEPTH} in flight, " \
                            f"into one buffer, nothing checked): {nbytes / alone / 1e9:.2f} GB/s " \
                            f"({alone / statistics.median(ours):.3f} of it)"
        client.delete(*raw_keys, *[f"bench-raw{generation[0]}:{{{tag}}}:{i}" for i in range(len(raw))])
        return results
    finally:
        kv.close()
        a.close(flush=False)
        b.close(flush=False)


def _forget(node, key) -> None:  # noqa: ANN001 - a Machine
    """Drop a node's copy of a session (writes off: the remote copy stays), so that its next restore fetches."""
    try:
        node.store.drop(key)
    except NotFound:
        pass


def _coded(root: str, cluster: RedisCluster, quick: bool) -> list[Result]:
    from bench.codecs import real_kv

    spec, kv_pages = real_kv(1024)
    pages = np.tile(kv_pages, ((64 if quick else 256) * MiB // kv_pages.nbytes, 1))
    n, nbytes = len(pages), pages.nbytes
    repeat = 7 if quick else 15
    nodes = {codec: _machine(root, f"coded-{codec}", cluster.url, nbytes, codec) for codec in ("none", "lossless")}
    reader = _machine(root, "coded-reader", cluster.url, nbytes)
    keys = {codec: make_key("default", f"bench-{codec}") for codec in nodes}
    kv = SharedKVCache(spec, n, kind="layer_major")
    try:
        memory, blocks = EngineMemory(kv.layout, kv.regions), np.arange(n)
        for codec, node in nodes.items():
            node.store.put(keys[codec], spec, n * spec.block_tokens, nbytes, [pages])
        times: dict[str, dict[str, list[float]]] = {"save": {}, "restore": {}}

        for codec in nodes:  # warm: connections, scripts
            assert nodes[codec].store.publish(keys[codec])
            reader.store.restore(keys[codec], memory, spec, blocks)
        for _ in range(repeat):
            for codec, node in nodes.items():
                key = keys[codec]
                times["save"].setdefault(codec, []).extend(
                    timed(lambda: node.store.publish(key), 1,
                          lambda: node.store.put(key, spec, n * spec.block_tokens, nbytes, [pages])))
                times["restore"].setdefault(codec, []).extend(
                    timed(lambda: reader.store.restore(key, memory, spec, blocks), 1, lambda: _forget(reader, key)))
        stored = {c: nodes[c].store.remote.store.head(keys[c])[0].stored for c in nodes}
        out = []
        for what, got in times.items():
            ratio = statistics.median(c / p for c, p in zip(got["lossless"], got["none"]))
            out.append(Result(f"remote_{what}_lossless_vs_none", nbytes / statistics.median(got["lossless"]) / 1e9,
                              "GB/s", nbytes / statistics.median(got["none"]) / 1e9, round(ratio, 3),
                              "ratio <= 0.8" if what == "restore" else "", ratio <= 0.8 if what == "restore" else None,
                              {"lossless_seconds": spread(got["lossless"]), "none_seconds": spread(got["none"])},
                              f"{nbytes >> 20} MiB of real KV (bfloat16, a random-weight Llama's); ratio: our time "
                              f"coded lossless over our time as it is, same run (value: lossless GB/s, limit: as it "
                              f"is); the version takes {stored['lossless'] / nbytes:.3f} of its bytes coded"))
        return out
    finally:
        kv.close()
        for node in (*nodes.values(), reader):
            node.close(flush=False)


def _round_trips(root: str, cluster: RedisCluster, reads: int = 200) -> list[Result]:
    pages = 8
    writer = _machine(root, "rt-writer", cluster.url, pages * SMALL.page_bytes)
    kv = SharedKVCache(SMALL, pages, kind="layer_major")
    counted: dict[str, tuple[float, float]] = {}
    try:
        memory, blocks = EngineMemory(kv.layout, kv.regions), np.arange(pages)
        key = make_key("default", "bench-round-trips")
        writer.store.put(key, SMALL, pages * 16, pages * SMALL.page_bytes, [random_bytes(pages * SMALL.page_bytes, 7)])
        assert writer.store.publish(key)
        for how, recheck in (("notices", 5.0), ("asking", 0.0)):
            node = _machine(root, f"rt-{how}", cluster.url, pages * SMALL.page_bytes, recheck=recheck)
            try:
                deadline = time.monotonic() + 30
                while recheck and not node.store.remote.store.hears_changes() and time.monotonic() < deadline:
                    time.sleep(0.01)
                node.store.restore(key, memory, SMALL, blocks)  # fetched: a copy of the published version
                before, seconds = cluster.scripts_run(), []
                for _ in range(reads):
                    t0 = time.perf_counter()
                    node.store.restore(key, memory, SMALL, blocks)
                    seconds.append(time.perf_counter() - t0)
                counted[how] = ((cluster.scripts_run() - before) / reads, statistics.median(seconds))
            finally:
                node.close(flush=False)
    finally:
        kv.close()
        writer.close(flush=False)
    ours, limit = counted["notices"], counted["asking"]
    return [Result("remote_read_round_trips", round(ours[0], 3), "per read", round(limit[0], 3), None,
                   "0 per read", ours[0] == 0, {"read_ms": ours[1] * 1e3, "read_ms_asking": limit[1] * 1e3},
                   f"{reads} restores of a {pages}-page session published by another node, nothing changed: calls "
                   f"on the store per read while change notices are live (limit: the same with --remote-recheck 0); "
                   f"a read took {ours[1] * 1e3:.2f} ms, {limit[1] * 1e3:.2f} ms asking")]


def _trace(root: str, cluster: RedisCluster, quick: bool) -> list[Result]:
    sessions, turns, think = (60, 3, 3.0) if quick else (200, 4, 6.0)
    with_remote = _replay(root, "with", cluster.url, sessions, turns, think)
    without = _replay(root, "without", "", sessions, turns, think)
    served = with_remote["served"] / with_remote["resumes"]
    alone = without["served"] / without["resumes"]
    return [Result("trace_multinode_served", round(served, 4), "ratio", round(alone, 4), round(served / alone, 2),
                   ">= 0.95", served >= 0.95, {"with_remote": with_remote, "without_remote": without},
                   f"3 daemons, {sessions} sessions x {turns} turns, each turn on a random node prefetched 1 s "
                   "ahead; limit: the same trace without the remote tier")]


def _replay(root: str, name: str, url: str, sessions: int, turns: int, think: float, lead: float = 1.0,
            tokens_per_turn: int = 256, workers: int = 2) -> dict:
    rng = np.random.default_rng(1)
    max_pages = SMALL.pages_for_tokens(turns * tokens_per_turn)
    flags = ["--remote", url, "--remote-prefix", f"bench{name}"] if url else []
    daemons = [Daemon(os.path.join(root, f"{name}-{i}"), "--writeback-idle", "0.5", "--host-idle", "5",
                      "--tick-seconds", "0.2", *flags).start() for i in range(3)]
    caches = [SharedKVCache(SMALL, workers * max_pages, kind="cross_layer") for _ in daemons]
    for kv in caches:
        kv.regions[0][:] = rng.integers(0, 256, kv.regions[0].size, dtype=np.uint8)
    clients = [d.client() for d in daemons]
    engines = [c.register_engine(SMALL, kv) for c, kv in zip(clients, caches)]
    counts = {"served": 0, "resumes": 0, "recomputed": 0, "from": {}}
    lock = threading.Lock()
    slots = [list(range(workers)) for _ in daemons]
    try:
        events: list[tuple[float, int, str, int]] = []
        for s in range(sessions):
            t = float(rng.exponential(think))
            heapq.heappush(events, (t, len(events), "turn", s))
            heapq.heappush(events, (max(0.0, t - lead), len(events), "prefetch", s))
        done = {s: 0 for s in range(sessions)}
        node_of: dict[int, int] = {}  # the node the router picked for the session's next turn
        running: dict[int, object] = {}

        def turn(s: int, node: int, slot: int, n: int) -> None:
            sid, client, engine = f"s{s}", clients[node], engines[node]
            base = slot * max_pages
            have = SMALL.pages_for_tokens(n * tokens_per_turn)
            total = SMALL.pages_for_tokens((n + 1) * tokens_per_turn)
            start = 0
            if n:
                try:
                    where = client.stat(sid).tier
                    engine.restore(sid, list(range(base, base + have)))
                    start = have
                    with lock:
                        counts["served"] += 1
                        counts["from"][where] = counts["from"].get(where, 0) + 1
                except (NotFound, InvalidArgument):  # not here, or an older turn than the last: recompute
                    with lock:
                        counts["recomputed"] += 1
                with lock:
                    counts["resumes"] += 1
            engine.save(sid, list(range(base + start, base + total)), (n + 1) * tokens_per_turn,
                        start_token=start * SMALL.block_tokens)
            client.release(sid)
            with lock:
                slots[node].append(slot)

        t0 = time.monotonic()
        with ThreadPoolExecutor(3 * workers) as pool:
            while events:
                t, _, kind, s = heapq.heappop(events)
                delay = t0 + t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if kind == "prefetch":
                    node_of[s] = int(rng.integers(0, 3))
                    if done[s]:
                        running[s].result()
                        try:
                            clients[node_of[s]].prefetch(f"s{s}", deadline_seconds=lead)
                        except NotFound:
                            pass  # not on that node, and no remote tier to fetch it from
                    continue
                node = node_of.pop(s, int(rng.integers(0, 3)))
                if s in running:
                    running[s].result()  # a session's turns never overlap
                while True:
                    with lock:
                        slot = slots[node].pop() if slots[node] else None
                    if slot is not None:
                        break
                    time.sleep(0.001)
                running[s] = pool.submit(turn, s, node, slot, done[s])
                done[s] += 1
                if done[s] < turns:
                    nxt = t + max(0.2, float(rng.exponential(think)))
                    heapq.heappush(events, (nxt, len(events) + sessions * 10, "turn", s))
                    heapq.heappush(events, (max(t, nxt - lead), len(events) + sessions * 10, "prefetch", s))
            for future in running.values():
                future.result()
        counts["seconds"] = round(time.monotonic() - t0, 1)
        return counts
    finally:
        for engine in engines:
            engine.close()
        for client in clients:
            client.close()
        for kv in caches:
            kv.close()
        for d in daemons:
            d.stop()
