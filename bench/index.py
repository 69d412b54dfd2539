"""Index scale: 100,000 sessions and 10,000,000 pages on disk (quick: 1,000
and 100,000), each page with its checksum and token hash. Recovery time,
metadata bytes per page (index file and the memory recovery adds; the
session records beside them apart), and Stat
and List latency from a client of a daemon started on it, on a data dir
built directly (sparse slab files). The names carry the scale:
index_recovery_seconds_10m (pages), index_stat_p99_ms_100k (sessions)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import psutil

from bench.common import Result
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.index import DiskIndex, Row
from tierd.core.records import record_stmt
from tierd.core.rows import piece_stmts, row_stmt
from tierd.layout import KVSpec
from tierd.machine import build
from tierd.policy import PolicyConfig
from tierd.testing import Daemon
from tierd.tiers.allocator import Piece
from tierd.types import SessionKey

GiB = 1 << 30
SPEC = KVSpec.opaque("bench/index", page_bytes=4096)


def build_data_dir(data_dir: str, sessions: int, pages: int) -> int:
    """An index of `sessions` durable sessions of `pages` pages each, over
    sparse slab files; returns the slab size."""
    slabs = os.path.join(data_dir, "slabs")
    os.makedirs(slabs, mode=0o700)
    per_session = pages * 4096
    total = sessions * per_session
    slab = GiB
    for i in range(-(-total // slab)):
        with open(os.path.join(slabs, f"slab-{i:06d}.bin"), "wb") as f:
            f.truncate(slab)
    index = DiskIndex(os.path.join(data_dir, "index.db"))
    sums = np.arange(pages, dtype="<u8")
    hashes = np.random.default_rng(0).integers(0, 256, (pages, 16), dtype=np.uint8)  # as an engine with token ids
    row = Row(SPEC, 1, pages, per_session, 1.0, 1.0, 0)
    stmts, states = [], []
    per_slab = slab // per_session
    for s in range(sessions):
        key = SessionKey("default", f"session-{s:06d}")
        piece = Piece((s // per_slab) * slab + (s % per_slab) * per_session, per_session, 0, pages)
        stmts += piece_stmts(key, [(piece, sums, hashes)]) + [row_stmt(key, row)]
        states.append((key, row, [(piece, sums, hashes)]))
    # Each session's record beside the slab files, as the daemon writes them (synced once: a fixture).
    for first in range(0, sessions, 10_000):
        batch = states[first : first + 10_000]
        stmts += [record_stmt(key, r) for (key, _, _), r in zip(batch, index.records.describe_many(batch))
                  if r is not None]
    index.apply(stmts)  # one transaction: building the fixture, not measuring writes
    index.close()
    return slab


def recover(data_dir: str, slab: int) -> tuple[float, int]:
    """Seconds to open a store on the data dir, and the RSS it added."""
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    cfg = Config(data_dir=data_dir, host_budget=GiB, host_slab=GiB, disk_budget=64 * GiB, disk_slab=slab,
                 disk_io="posix", device="none", io_workers=2)
    machine = build(cfg, policy=PolicyConfig(), clock=FakeClock())
    seconds = time.perf_counter() - t0
    grown = psutil.Process().memory_info().rss - before
    assert len(machine.store.keys()) > 0 and not machine.store.recovery_problems
    machine.close(flush=False)
    return seconds, grown


def _scale(n: int) -> str:
    return f"{n // 1_000_000}m" if n >= 1_000_000 else f"{n // 1000}k"


def run(quick: bool) -> list[Result]:
    sessions, pages = (1000, 100) if quick else (100_000, 100)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        data_dir = os.path.join(root, "data")
        slab = build_data_dir(data_dir, sessions, pages)
        n_pages = sessions * pages
        seconds, grown = recover(data_dir, slab)
        index_bytes = sum(os.path.getsize(os.path.join(data_dir, f)) for f in os.listdir(data_dir)
                          if f.startswith("index.db"))
        records_bytes = os.stat(os.path.join(data_dir, "records.bin")).st_blocks * 512  # (sparse: what it holds)
        daemon = Daemon(root, "--disk-budget", f"{-(-sessions * pages * 4096 // GiB) + 1}GiB", "--disk-slab",
                        f"{slab}", "--writeback-idle", "off").start()
        try:
            rss = psutil.Process(daemon.pid()).memory_info().rss
            with daemon.client() as c:
                rng = np.random.default_rng(0)
                stat = []
                for s in rng.integers(0, sessions, 2000):
                    t0 = time.perf_counter()
                    c.stat(f"session-{s:06d}")
                    stat.append(time.perf_counter() - t0)
                pages_t, token = [], ""
                while True:
                    t0 = time.perf_counter()
                    page, token = c.list_page(500, token)
                    pages_t.append(time.perf_counter() - t0)
                    if not token:
                        break
        finally:
            daemon.stop()
    stat_ms = np.array(stat) * 1e3
    meta = (index_bytes + grown) / n_pages
    return [
        Result(f"index_recovery_seconds_{_scale(n_pages)}", round(seconds, 3), "s", None, None, "<= 10 s",
               seconds <= 10, note=f"{sessions} sessions, {n_pages} pages"),
        Result("index_bytes_per_page", round(meta, 1), "B", None, None, "<= 128 B", meta <= 128,
               {"index_file_bytes": index_bytes, "recovery_rss_bytes": grown, "daemon_rss_bytes": rss,
                "records_file_bytes": records_bytes},
               f"index file + memory added by recovery, per page ({n_pages} pages); the session records beside "
               f"them: {records_bytes / n_pages:.1f} B per page more"),
        Result(f"index_stat_p99_ms_{_scale(sessions)}", round(float(np.percentile(stat_ms, 99)), 3), "ms", None,
               None, "<= 2 ms", float(np.percentile(stat_ms, 99)) <= 2,
               {"p50_ms": float(np.percentile(stat_ms, 50)), "n": len(stat)}, f"over {sessions} sessions"),
        Result("index_list_page_ms", round(float(np.median(pages_t)) * 1e3, 3), "ms", None, None, "-", None,
               {"pages": len(pages_t), "max_ms": max(pages_t) * 1e3}, "500 sessions a page"),
    ]
