"""Results, timing and reporting shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import xxhash


@dataclass
class Result:
    name: str
    value: float
    unit: str
    limit: float | None = None  # the physical limit or peer measured in the same run
    ratio: float | None = None
    target: str = ""
    ok: bool | None = None
    spread: dict = field(default_factory=dict)
    note: str = ""
    series: dict = field(default_factory=dict, repr=False)  # raw samples for plots; not written to JSON


def timed(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of `repeat` runs (setup, untimed, before each)."""
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def spread(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio_result(name: str, ours: list[float], limit: list[float], nbytes: int, target: float, higher_is_better: bool = True,
                 note: str = "", paired: bool = False) -> Result:
    """A bandwidth figure beside its limit: ratio = limit time / our time, of
    the medians; paired: the median of each turn's own ratio (ours[i] and
    limit[i] measured one after the other), which a host whose speed drifts
    during the run shifts far less."""
    ours_s, limit_s = statistics.median(ours), statistics.median(limit)
    ratio = statistics.median(li / o for li, o in zip(limit, ours)) if paired else limit_s / ours_s
    sp = {"ours_seconds": spread(ours), "limit_seconds": spread(limit)}
    if paired:
        sp["ratio_of_medians"] = round(limit_s / ours_s, 3)
    return Result(name, nbytes / ours_s / 1e9, "GB/s", nbytes / limit_s / 1e9, round(ratio, 3),
                  f"ratio >= {target}", ratio >= target, sp, note)


def copy_and_hash(src: np.ndarray, dst: np.ndarray, piece: int = 256 << 10) -> Callable[[], None]:
    """src copied into dst and every piece of it hashed (XXH3, as page
    checksums are), each core taking its share: no more than a copy that
    checks its bytes must do."""
    cores = os.cpu_count() or 1
    share = -(-len(src) // cores // piece) * piece
    pool = ThreadPoolExecutor(cores)

    def part(lo: int) -> None:
        for a in range(lo, min(lo + share, len(src)), piece):
            np.copyto(dst[a : a + piece], src[a : a + piece])  # (numpy and xxhash let go of the GIL)
            xxhash.xxh3_64_intdigest(src[a : a + piece])

    return lambda: list(pool.map(part, range(0, len(src), share)))


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def table(results: list[Result]) -> str:
    lines = ["| name | value | limit | ratio | target | ok |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        limit = f"{r.limit:.3g} {r.unit}" if r.limit is not None else "-"
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        ok = {True: "yes", False: "NO", None: "-"}[r.ok]
        lines.append(f"| {r.name} | {r.value:.3g} {r.unit} | {limit} | {ratio} | {r.target or '-'} | {ok} |")
    return "\n".join(lines)


def write_json(path: str, results: list[Result]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"results": [{k: v for k, v in asdict(r).items() if k != "series"} for r in results],
                   "machine": machine()}, f, indent=2)
