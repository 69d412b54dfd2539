"""Control calls while policy runs over many sessions: Stat latency from a
client against a daemon holding 20,000 (quick: 2,000) small released
sessions, each in host with its disk copy (waiting for its host idle time),
with the policy tick every 0.5 s. Its tail beside its own median: a tick
that looks at every session holds the store lock and the GIL, and calls
wait behind it."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import Result
from tierd.client import KVSpec
from tierd.testing import Daemon

SPEC = KVSpec.opaque("bench/tick", page_bytes=4096)
FILLERS = 4


def run(quick: bool) -> list[Result]:
    sessions, seconds = (2000, 5.0) if quick else (20_000, 10.0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        daemon = Daemon(root, "--tick-seconds", "0.5", "--writeback-idle", "1", "--host-budget",
                        f"{sessions * 4096 * 2}", "--host-slab", "auto", "--disk-budget", f"{sessions * 4096 * 2}",
                        "--disk-slab", f"{-(-sessions * 4096 * 2 // (1 << 20))}MiB").start()
        try:
            def fill(first: int) -> None:
                with daemon.client() as c:
                    for i in range(first, sessions, FILLERS):
                        c.put(f"s{i}", b"x" * 4096, SPEC, num_tokens=1)
                        c.release(f"s{i}")

            with ThreadPoolExecutor(FILLERS) as pool:
                list(pool.map(fill, range(FILLERS)))
            with daemon.client() as c:
                deadline = time.monotonic() + 600
                while {t.name: t.sessions for t in c.stats()["tiers"]}["disk"] < sessions:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the write-backs did not finish in 10 minutes")
                    time.sleep(0.5)
                stat = []
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    c.stat(f"s{len(stat) % sessions}")
                    stat.append(time.perf_counter() - t0)
        finally:
            daemon.stop()
    ms = np.array(stat) * 1e3
    p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
    return [
        Result("tick_stat_p99_ms", round(p99, 3), "ms", round(p50, 3), round(p99 / p50, 2), "<= 3 x p50",
               p99 <= 3 * p50, {"p999_ms": float(np.percentile(ms, 99.9)), "max_ms": float(ms.max()), "n": len(stat)},
               f"{sessions} released sessions, tick 0.5 s; limit: the median Stat of the same run"),
    ]
