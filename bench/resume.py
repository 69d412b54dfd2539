"""Resume versus recompute: a 4,096-token session of a random-weight
Llama-style model, restored from the host tier and from the disk tier through
a real daemon, beside a prefill of the same tokens."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from bench.common import Result, spread
from tierd.testing import Daemon

TOKENS = 4096


def model_and_cache(tokens: int):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tierd.adapters.hf import forward

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))

    def prefill():
        cache = DynamicCache(config=config)
        forward(model.model, ids, cache)  # the decoder alone: an engine computes logits for the last token only
        return cache

    return model, prefill


def run(quick: bool) -> list[Result]:
    from tierd.adapters.hf import CacheStore

    tokens = 1024 if quick else TOKENS
    repeat = 3 if quick else 5
    model, prefill = model_and_cache(tokens)
    recompute = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        cache = prefill()
        recompute.append(time.perf_counter() - t0)
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        daemon = Daemon(root, "--writeback-idle", "off", "--host-idle", "600").start()
        try:
            with daemon.client() as client, CacheStore(client, model.config, model_id="bench/llama") as store:
                store.save("s", cache)
                for tier in ("host", "disk"):
                    if tier == "disk":
                        client.set_budget("host", 0)  # push the session down, as a busy node would
                        client.set_budget("host", 1 << 30)
                    assert client.stat("s").tier == tier
                    restore = []
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        store.restore("s")
                        restore.append(time.perf_counter() - t0)
                    ratio = float(torch.tensor(recompute).median() / torch.tensor(restore).median())
                    results.append(Result(
                        f"resume_from_{tier}_vs_recompute", float(torch.tensor(restore).median() * 1e3), "ms",
                        float(torch.tensor(recompute).median() * 1e3), round(ratio, 2), "faster than prefill",
                        ratio > 1, {"restore_seconds": spread(restore), "prefill_seconds": spread(recompute)},
                        f"{tokens} tokens, {store.spec.page_bytes * store.spec.pages_for_tokens(tokens) >> 20} MiB of "
                        f"KV, 8-layer Llama-style model (float32) on this CPU; restore = daemon copy + cache rebuild"))
        finally:
            daemon.stop()
    return results
