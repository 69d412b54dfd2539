"""llama.cpp's shape: a 42,603-token, 28-layer snapshot restored into a block
table of 4 runs, beside the same restore into a contiguous table."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from bench.common import Result, random_bytes, spread, timed
from bench.tiers import World, _memory
from tierd.client.shm import SharedKVCache
from tierd.layout import KVSpec
from tierd.core.store import make_key

TOKENS = 42_603
KEY = make_key("default", "fragmented")


def run(quick: bool) -> list[Result]:
    # Full mode: Qwen2.5-7B's shape (2.4 GB). Quick mode: the same 28 layers with 1 head of 64 dims.
    heads, dim = (1, 64) if quick else (4, 128)
    spec = KVSpec("bench/qwen-shape", num_layers=28, num_kv_heads=heads, head_dim=dim, dtype="bfloat16",
                  block_tokens=16)
    pages = spec.pages_for_tokens(TOKENS)
    num_blocks = pages + 3 * 300
    bounds = np.linspace(0, pages, 5).astype(int)
    table = np.concatenate([np.arange(a, b) + 300 * i for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    contiguous = np.arange(pages)
    repeat = 3 if quick else 5
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        world = World(pages * spec.page_bytes, root)
        kv = SharedKVCache(spec, num_blocks)
        try:
            for r in kv.regions:
                r[:] = random_bytes(r.size, 3)
            store = world.store
            store.save(KEY, _memory(kv), spec, contiguous, TOKENS)
            ops = store.copier.copy_ops
            frag = timed(lambda: store.restore(KEY, _memory(kv), spec, table), repeat)
            copies = (store.copier.copy_ops - ops) // repeat
            cont = timed(lambda: store.restore(KEY, _memory(kv), spec, contiguous), repeat)
        finally:
            kv.close()
            world.close()
    ratio = np.median(frag) / np.median(cont)
    return [
        Result("fragmented_vs_contiguous", float(np.median(frag) * 1e3), "ms", float(np.median(cont) * 1e3),
               round(float(ratio), 3), "time ratio <= 1.2", bool(ratio <= 1.2),
               {"fragmented_seconds": spread(frag), "contiguous_seconds": spread(cont)},
               f"{pages * spec.page_bytes >> 20} MiB from host, 4 runs"),
        Result("fragmented_copies", copies, "copies", 224, round(copies / 224, 3), "copies <= 224", copies <= 224),
    ]
