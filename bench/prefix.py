"""Prefix sharing: sessions that open with the same prompt hold its pages once.

prefix_bytes_vs_naive: 1,000 sessions of a 4,096-token shared prompt plus
256 tokens each, saved with their token ids: the host tier's bytes against
what the same sessions take stored one by one (the naive figure is computed
from the same allocator: every session's own allocation of all its pages).
prefix_save_vs_full: the time to save such a session (pages of 128 KiB)
while the prompt is held already, against a full save of the same size (a
prompt held by no one), both in the same store, paired turn by turn. Lookup p50/p99: a new
session's Lookup through a daemon holding 10,000 shared pages, against a
Lookup of the session that holds those pages itself (no sharing looked at).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from bench.common import Result, spread
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import make_key
from tierd.layout import EngineLayout, KVSpec
from tierd.machine import build
from tierd.policy import PolicyConfig
from tierd.testing import Daemon
from tierd.transfer.copier import EngineMemory
from tierd.transfer.runs import page_stride

SPEC = KVSpec("bench/prefix", "r1", num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
SAVE_SPEC = KVSpec("bench/prefix-save", "r1", num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16",
                   block_tokens=16)
PROMPT_TOKENS, OWN_TOKENS = 4096, 256
MiB, GiB = 1 << 20, 1 << 30


def _engine(n_blocks: int, spec: KVSpec = SPEC) -> EngineMemory:
    layout = EngineLayout.layer_major(spec, n_blocks)
    sizes = [0] * (max(s.region for s in layout.segments) + 1)
    for s in layout.segments:
        sizes[s.region] = max(sizes[s.region], s.offset + n_blocks * s.stride)
    rng = np.random.default_rng(0)
    return EngineMemory(layout, [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes])


def _tokens(prompt: int, own: int) -> list[int]:
    """A session's tokens: prompt `prompt`'s, then `own` tokens of its own."""
    base = 1_000_000 * (prompt + 1)
    return list(range(base, base + PROMPT_TOKENS)) + [base + PROMPT_TOKENS + own] * OWN_TOKENS


def _store(root: str, host_budget: int):
    cfg = Config(data_dir=root, host_budget=host_budget, host_slab=min(host_budget, GiB), disk_budget=GiB,
                 disk_slab=256 * MiB, disk_io="posix", device="none", io_workers=2, movers=1, writeback_idle=None)
    return build(cfg, policy=PolicyConfig(writeback_idle=None), clock=FakeClock())


def stored_once(quick: bool) -> list[Result]:
    sessions = 1000
    pages = (PROMPT_TOKENS + OWN_TOKENS) // SPEC.block_tokens
    engine = _engine(pages)
    blocks = list(range(pages))
    stride = page_stride(SPEC.page_bytes)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        machine = _store(root, 2 * GiB)
        store = machine.store
        try:
            host = store.tiers["host"]
            naive = 0
            for s in range(sessions):
                toks = _tokens(0, s)
                store.save(make_key("bench", f"s{s}"), engine, SPEC, blocks, len(toks), token_ids=toks)
                naive += host.allocator.round(pages * stride)
            held = host.used
            problems = store.check_accounting()
            assert not problems, problems
        finally:
            machine.close(False)
    shared_t, full_t = save_times(quick)
    ratio = held / naive
    speedup = statistics.median(f / s for f, s in zip(full_t, shared_t))
    own = OWN_TOKENS / (PROMPT_TOKENS + OWN_TOKENS)
    return [
        Result("prefix_bytes_vs_naive", held, "bytes", naive, round(ratio, 4), "ratio <= 0.1", ratio <= 0.1,
               {"sessions": sessions, "pages_each": pages},
               f"{sessions} sessions of {PROMPT_TOKENS} shared + {OWN_TOKENS} own tokens; "
               f"the least it can be: {(pages + (sessions - 1) * OWN_TOKENS // SPEC.block_tokens) / (sessions * pages):.4f}"),
        Result("prefix_save_vs_full", statistics.median(shared_t) * 1e3, "ms", statistics.median(full_t) * 1e3,
               round(speedup, 2), "ratio >= 3", speedup >= 3,
               {"shared_seconds": spread(shared_t), "full_seconds": spread(full_t)},
               f"full save time / save time with the prompt held, paired turns; {own:.3f} of the pages are "
               f"the session's own (at most {1 / own:.0f}x by bytes); hashing the whole prompt's token ids, "
               "which both do, takes about 0.3 ms"),
    ]


def save_times(quick: bool) -> tuple[list[float], list[float]]:
    """Seconds to save a session of SAVE_SPEC (pages of 128 KiB, as a small
    model's) whose prompt another session holds, and of a full save of the
    same size, in turns."""
    pages = (PROMPT_TOKENS + OWN_TOKENS) // SAVE_SPEC.block_tokens
    engine = _engine(pages, SAVE_SPEC)
    blocks = list(range(pages))
    shared_t, full_t = [], []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        machine = _store(root, GiB)
        store = machine.store
        try:
            toks = _tokens(0, 0)
            store.save(make_key("bench", "holder"), engine, SAVE_SPEC, blocks, len(toks), token_ids=toks)
            for turn in range(9 if quick else 25):
                toks = _tokens(0, 1 + turn)
                t0 = time.perf_counter()
                store.save(make_key("bench", f"t{turn}"), engine, SAVE_SPEC, blocks, len(toks), token_ids=toks)
                shared_t.append(time.perf_counter() - t0)
                toks = _tokens(1 + turn, 0)
                t0 = time.perf_counter()
                store.save(make_key("bench", f"f{turn}"), engine, SAVE_SPEC, blocks, len(toks), token_ids=toks)
                full_t.append(time.perf_counter() - t0)
                store.drop(make_key("bench", f"t{turn}"))
                store.drop(make_key("bench", f"f{turn}"))
        finally:
            machine.close(False)
    return shared_t, full_t


def lookups(quick: bool) -> list[Result]:
    prompts = 40  # 40 prompts of 256 pages: 10,240 shared pages, each held by two sessions
    pages = PROMPT_TOKENS // SPEC.block_tokens
    data = np.random.default_rng(1).integers(0, 256, pages * SPEC.page_bytes, dtype=np.uint8).tobytes()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        daemon = Daemon(root, "--host-budget", "512MiB", "--writeback-idle", "off").start()
        try:
            with daemon.client() as c:
                for p in range(prompts):
                    toks = _tokens(p, 0)[:PROMPT_TOKENS]
                    for holder in range(2):
                        c.put(f"p{p}-{holder}", data, SPEC, len(toks), token_ids=toks)
                shared_pages = {t.name: t.saved for t in c.stats()["tiers"]}["host"] // page_stride(SPEC.page_bytes)
                rng = np.random.default_rng(2)
                ours, own = [], []
                for i in range(500 if quick else 2000):
                    p = int(rng.integers(prompts))
                    prompt = _tokens(p, 10_000 + i)
                    t0 = time.perf_counter()
                    got = c.lookup(f"new-{i}", prompt, SPEC)
                    ours.append(time.perf_counter() - t0)
                    assert got.num_pages == pages, got
                    t0 = time.perf_counter()
                    c.lookup(f"p{p}-0", prompt)  # its own pages: no spec, nothing shared looked at
                    own.append(time.perf_counter() - t0)
        finally:
            daemon.stop()
    out = []
    for q in (50, 99):
        a, b = float(np.percentile(ours, q)) * 1e3, float(np.percentile(own, q)) * 1e3
        out.append(Result(f"prefix_lookup_p{q}_ms", round(a, 3), "ms", round(b, 3), round(b / a, 3), "ratio >= 0.5",
                          b / a >= 0.5, {}, f"a new session's Lookup of a {PROMPT_TOKENS + OWN_TOKENS}-token prompt, "
                          f"{shared_pages} shared pages held; limit: the holder's own Lookup of it"))
    return out


def run(quick: bool) -> list[Result]:
    return stored_once(quick) + lookups(quick)
