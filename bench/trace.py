"""Trace replay: many multi-turn sessions against a real daemon whose budgets
force sessions down to disk between turns. Turns arrive after exponential
think times, each adding context; an engine stand-in calls Prefetch a lead
time before each turn. Reports where each resume found its session, how
often the prefetch was in time, the bytes moved, and the prefill time the
restores saved (against recomputing every resumed context)."""

from __future__ import annotations

import heapq
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import Result
from tierd.client import KVSpec, SharedKVCache
from tierd.testing import Daemon

# A small model's KV: 4 layers, 2 KV heads, head dim 64, fp16 -> 2 KiB per token, 32 KiB pages.
SPEC = KVSpec("bench/trace", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
PREFILL_TOKENS_PER_S = 8_000.0  # the recompute the restores replace: a mid-size model on one GPU


def run(quick: bool, lead: float = 1.0) -> list[Result]:
    # Turns arrive at sessions / think a second, 50 in both modes; the host holds
    # what the prefetched sessions need, a small part of what all of them do.
    sessions, turns, think, tokens_per_turn, host_mib = (200, 3, 4.0, 256, 48) if quick else (1000, 4, 20.0, 256, 64)
    workers = 4
    max_pages = SPEC.pages_for_tokens(turns * tokens_per_turn)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        daemon = Daemon(root, "--host-budget", f"{host_mib}MiB", "--disk-budget", "8GiB", "--writeback-idle", "0.5",
                        "--host-idle", "2", "--tick-seconds", "0.2").start()
        kv = SharedKVCache(SPEC, workers * max_pages, kind="cross_layer")
        kv.regions[0][:] = rng.integers(0, 256, kv.regions[0].size, dtype=np.uint8)
        counts = {"host": 0, "device": 0, "disk": 0, "new": 0}
        on_time = prefetched = restored_tokens = 0
        lock = threading.Lock()
        try:
            client = daemon.client()
            engine = client.register_engine(SPEC, kv)
            start = time.monotonic()
            events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, session)
            for s in range(sessions):
                t = float(rng.exponential(think))
                heapq.heappush(events, (t, len(events), "turn", s))
                heapq.heappush(events, (max(0.0, t - lead), len(events), "prefetch", s))
            done_turns = {s: 0 for s in range(sessions)}
            slots = list(range(workers))

            def turn(s: int, slot: int, n: int) -> None:
                nonlocal on_time, prefetched, restored_tokens
                sid = f"trace-{s}"
                blocks = range(slot * max_pages, slot * max_pages + SPEC.pages_for_tokens((n + 1) * tokens_per_turn))
                if n:
                    where = client.stat(sid).tier
                    engine.restore(sid, list(blocks)[: SPEC.pages_for_tokens(n * tokens_per_turn)])
                    with lock:
                        counts[where] += 1
                        prefetched += 1
                        on_time += where in ("host", "device")
                        restored_tokens += n * tokens_per_turn
                else:
                    with lock:
                        counts["new"] += 1
                first = (n * tokens_per_turn) // SPEC.block_tokens
                new_blocks = list(blocks)[first:]
                engine.save(sid, new_blocks, (n + 1) * tokens_per_turn, start_token=first * SPEC.block_tokens)
                client.release(sid)
                with lock:
                    slots.append(slot)

            occupancy: dict[str, list[float]] = {"t": [], "host": [], "disk": []}
            sampling = threading.Event()

            def sample() -> None:
                with daemon.client() as watcher:
                    while not sampling.wait(0.25):
                        tiers = {t.name: t.used for t in watcher.stats()["tiers"]}
                        occupancy["t"].append(time.monotonic() - start)
                        occupancy["host"].append(tiers["host"])
                        occupancy["disk"].append(tiers["disk"])

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            running: dict[int, object] = {}
            late: list[float] = []  # how far behind schedule turns started
            with ThreadPoolExecutor(workers) as pool:
                while events:
                    t, _, kind, s = heapq.heappop(events)
                    delay = start + t - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    elif kind == "turn":
                        late.append(-delay)
                    if kind == "prefetch":
                        if done_turns[s]:
                            running[s].result()  # the last turn's save is in
                            client.prefetch(f"trace-{s}", deadline_seconds=lead)
                        continue
                    while True:
                        with lock:
                            slot = slots.pop() if slots else None
                        if slot is not None:
                            break
                        time.sleep(0.001)
                    if s in running:
                        running[s].result()  # a session's turns never overlap
                    running[s] = pool.submit(turn, s, slot, done_turns[s])
                    done_turns[s] += 1
                    if done_turns[s] < turns:
                        nxt = t + max(0.2, float(rng.exponential(think)))
                        heapq.heappush(events, (nxt, len(events) + sessions * 10, "turn", s))
                        heapq.heappush(events, (max(t, nxt - lead), len(events) + sessions * 10, "prefetch", s))
            for future in running.values():
                future.result()  # a turn that failed fails the benchmark
            elapsed = time.monotonic() - start
            sampling.set()
            sampler.join()
            stats = client.stats()

            engine.close()
            client.close()
        finally:
            kv.close()
            daemon.stop()
    resumes = sum(counts[t] for t in ("host", "device", "disk"))
    ratio = on_time / prefetched if prefetched else 0.0
    moved = {k: v for k, v in stats["moved_bytes"].items() if "->" in k}
    return [
        Result("trace_prefetch_on_time", round(ratio, 4), "ratio", None, None, ">= 0.95", ratio >= 0.95,
               {"resumes": resumes, "from_host": counts["host"], "from_device": counts["device"],
                "from_disk": counts["disk"], "new_sessions": counts["new"], "lead_seconds": lead,
                "disk_to_host_bytes_per_s": stats["bandwidth"].get("disk->host", 0.0),
                "turns_late": len(late), "p99_lateness_s": float(np.percentile(late, 99)) if late else 0.0},
               f"{sessions} sessions x {turns} turns over {elapsed:.0f} s, {tokens_per_turn} tokens a turn, "
               f"prefetch {lead} s ahead; {counts['disk']} resumes found their session on disk",
               {**occupancy, "host_budget": host_mib << 20}),
        Result("trace_bytes_moved", sum(moved.values()), "B", None, None, "-", None, moved),
        Result("trace_prefill_seconds_saved", round(restored_tokens / PREFILL_TOKENS_PER_S, 1), "s", None, None, "-",
               None, {"restored_tokens": restored_tokens, "prefill_tokens_per_s": PREFILL_TOKENS_PER_S},
               "every resumed context restored instead of recomputed"),
    ]
