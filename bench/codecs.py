"""KV codecs on real KV: the cache a transformers Llama (random weights,
built from a config; bfloat16) fills on a prompt, cut into pages of 16
tokens. For each codec: how much smaller its pages are (codec_<name>_ratio),
how fast it encodes and decodes on one core beside a plain copy of the
same bytes (codec_<name>_encode_gbps, codec_<name>_decode_gbps: the ratio
is to the copy), and the relative L2 error it reports
(codec_<name>_rel_error: the mean over pages; the worst in the note).

And the disk tier coding its pages (--codec disk=lossless) beside one that
does not, the same session demoted and restored in turns
(disk_save_lossless_vs_none, disk_restore_lossless_vs_none: our time coded
over our time as it is, the median of each turn's ratio; 1.0 or less: coding
costs no time; the bytes it takes on disk in the note). And the host tier
re-coding idle sessions fp8 when it is full (--codec host=fp8): the sessions
a fixed budget holds, over those it holds as they are
(host_sessions_fp8_vs_none)."""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np
import torch

from bench.common import Result, spread, timed
from tierd import codecs
from tierd.adapters.hf import forward
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import make_key
from tierd.layout import EngineLayout, KVSpec
from tierd.machine import build
from tierd.policy import PolicyConfig
from tierd.transfer.copier import EngineMemory

BLOCK = 16


def real_kv(tokens: int, layers: int = 8, kv_heads: int = 4, head_dim: int = 64) -> tuple[KVSpec, np.ndarray]:
    """A model's KV for `tokens` prompt tokens as pages [n, page_bytes], and their spec."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=2 * kv_heads * head_dim, intermediate_size=1024,
                         num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
                         max_position_embeddings=4 * tokens)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    cache = DynamicCache(config=config)
    forward(model, torch.randint(0, 1024, (1, tokens)), cache)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])  # [L, 2, H, S, D]
    n = tokens // BLOCK
    pages = kv[..., : n * BLOCK, :].reshape(layers, 2, kv_heads, n, BLOCK, head_dim).permute(3, 0, 1, 2, 4, 5)
    spec = KVSpec("bench/llama", num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype="bfloat16",
                  block_tokens=BLOCK, arrangement="hf-dynamic-cache:layer,kv,head,token,dim")
    return spec, pages.contiguous().view(torch.uint8).reshape(n, -1).numpy()


def run(quick: bool) -> list[Result]:
    torch.set_num_threads(1)
    spec, pages = real_kv(512 if quick else 2048)
    disk = _disk(spec, pages, quick) + _host(spec, pages)
    shape = codecs.page_shape(spec)
    repeat = 3 if quick else 7
    nbytes = pages.size
    scratch = np.empty_like(pages)
    copy = timed(lambda: np.copyto(scratch, pages), repeat)
    copy_gbps = nbytes / np.median(copy) / 1e9
    out: list[Result] = []
    for name in codecs.names():
        codec = codecs.get(name)
        blobs: list[bytes] = []
        enc = timed(lambda: blobs.__setitem__(slice(None), codec.encode(pages, shape)), repeat)
        dec = timed(lambda: [codec.decode(b, shape, scratch[i]) for i, b in enumerate(blobs)], repeat)
        coded = codecs.code(codec, pages, shape)
        ratio = nbytes / coded.nbytes
        note = f"{len(pages)} pages of {pages.shape[1]} bytes, bfloat16 KV of a random-weight Llama"
        out.append(Result(f"codec_{name}_ratio", round(ratio, 3), "x", note=note))
        for what, samples in (("encode", enc), ("decode", dec)):
            gbps = nbytes / np.median(samples) / 1e9
            out.append(Result(f"codec_{name}_{what}_gbps", round(gbps, 3), "GB/s", round(copy_gbps, 3),
                              round(gbps / copy_gbps, 4), spread={"seconds": spread(samples)},
                              note="one core; limit: a copy of the same bytes"))
        out.append(Result(f"codec_{name}_rel_error", float(coded.rel_error.mean()), "",
                          note=f"worst page {float(coded.rel_error.max()):.4g}, largest absolute error "
                               f"{float(coded.max_error.max()):.4g}"))
    return out + disk


def _held(spec: KVSpec, pages: np.ndarray, per: int, budget: int, root: str, codec: str) -> tuple[int, float, float]:
    """Sessions of `per` of these pages saved one after another into a host
    tier of `budget`, each released after its save, twice as many as fit as
    they are: how many the host tier holds at the end, the worst relative
    error of a page served, and the seconds of one restore from the host tier."""
    clock = FakeClock()
    m = build(Config(data_dir=os.path.join(root, f"{codec}-{per}"), host_budget=budget, host_slab=budget,
                     disk_budget=4 * budget, disk_slab=1 << 30, disk_io="posix", device="none", codec={"host": codec},
                     lossy_tenants=frozenset({"*"})), policy=PolicyConfig(), clock=clock)
    try:
        engine = EngineMemory(EngineLayout.cross_layer(spec, per), [np.resize(pages, (per, pages.shape[1])).reshape(-1)])
        keys = [make_key("default", f"s{i:04d}") for i in range(2 * budget // (per * spec.page_bytes) + 16)]
        for key in keys:
            m.store.save(key, engine, spec, np.arange(per), per * spec.block_tokens)
            m.store.release(key)
            clock.advance(1.0)
        infos = [m.store.stat(k) for k in keys]
        oldest = next(k for k, i in zip(keys, infos) if "host" in i.tier_bytes)
        out = EngineMemory(EngineLayout.cross_layer(spec, per), [np.empty(per * spec.page_bytes, np.uint8)])
        seconds = statistics.median(timed(lambda: m.store.restore(oldest, out, spec, np.arange(per)), 5))
        return sum("host" in i.tier_bytes for i in infos), max(i.rel_error for i in infos), seconds
    finally:
        m.close(flush=False)


def _host(spec: KVSpec, pages: np.ndarray) -> list[Result]:
    """The sessions a 128 MiB host tier holds when it re-codes idle sessions
    fp8 as it fills (every tenant consents), over those it holds as they are:
    sessions of 4 MiB (32 pages), and of 2 MiB in the note; one restore from
    the host tier of each (fp8: decoded)."""
    budget = 128 << 20
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        got = {(codec, per): _held(spec, pages, per, budget, root, codec) for per in (32, 16) for codec in ("none", "fp8")}
    (fp8, error, fp8_s), (plain, _, plain_s) = got[("fp8", 32)], got[("none", 32)]
    mib = 32 * spec.page_bytes / (1 << 20)
    small = got[("fp8", 16)][0] / got[("none", 16)][0]
    return [Result("host_sessions_fp8_vs_none", fp8, "sessions", plain, round(fp8 / plain, 3), "ratio >= 1.9",
                   fp8 / plain >= 1.9,
                   note=f"sessions of {mib:g} MiB of a random-weight Llama's bfloat16 KV saved one after another "
                        f"into a {budget >> 20} MiB host tier, re-coded fp8 in place as it fills, beside as they are "
                        f"(worst page served: relative error {error:.4f}); sessions of {mib / 2:g} MiB: "
                        f"{small:.3f} (fragments between coded pieces and pages). One restore from the host tier: "
                        f"fp8 {mib / 1024 / fp8_s:.2f} GB/s (decoded on the CPU), as it is "
                        f"{mib / 1024 / plain_s:.2f} GB/s")]


def _disk(spec: KVSpec, pages: np.ndarray, quick: bool) -> list[Result]:
    """A session of this KV (repeated to 64 MiB, 256 MiB in full) demoted to
    disk and restored from it, by a store coding its disk pages lossless and
    by one that does not, in turns."""
    copies = -(-((64 if quick else 256) << 20) // pages.nbytes)
    memory = np.tile(pages.reshape(-1), copies)
    n = len(pages) * copies
    engine = EngineMemory(EngineLayout.cross_layer(spec, n), [memory])
    out = EngineMemory(EngineLayout.cross_layer(spec, n), [np.zeros_like(memory)])
    blocks, key, repeat = np.arange(n), make_key("default", "bench"), 5 if quick else 9
    times: dict[str, dict[str, list[float]]] = {c: {"save": [], "restore": []} for c in ("none", "lossless")}
    stored = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        budget = -(-(memory.nbytes * 2 + (64 << 20)) // 4096) * 4096
        machines = {c: build(Config(data_dir=os.path.join(root, c), host_budget=budget, host_slab=budget,
                                    disk_budget=budget, disk_slab=1 << 30, disk_io="posix", device="none",
                                    codec={"disk": c}), policy=PolicyConfig(), clock=FakeClock())
                    for c in times}
        try:
            for _ in range(repeat):
                for codec, m in machines.items():
                    m.store.save(key, engine, spec, blocks, n * spec.block_tokens)
                    times[codec]["save"] += timed(lambda: m.store.demote(key, reason="bench"), 1)
                    times[codec]["restore"] += timed(lambda: m.store.restore(key, out, spec, blocks), 1)
                    assert np.array_equal(out.regions[0], memory)
                    stored[codec] = m.store.stat(key).tier_bytes["disk"]
        finally:
            for m in machines.values():
                m.close(flush=False)
    results = []
    for what in ("save", "restore"):
        ours, plain = times["lossless"][what], times["none"][what]
        ratio = statistics.median(c / p for c, p in zip(ours, plain))
        results.append(Result(
            f"disk_{what}_lossless_vs_none", memory.nbytes / statistics.median(ours) / 1e9, "GB/s",
            memory.nbytes / statistics.median(plain) / 1e9, round(ratio, 3), "ratio <= 1.0", ratio <= 1.0,
            {"lossless_seconds": spread(ours), "none_seconds": spread(plain)},
            f"{memory.nbytes >> 20} MiB of a random-weight Llama's bfloat16 KV {'demoted to' if what == 'save' else 'restored from'}"
            f" disk (ratio: our time coded lossless over our time as it is, in turns); coded, it takes "
            f"{stored['lossless'] / stored['none']:.3f} of the disk room"))
    return results
