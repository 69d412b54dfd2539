"""KV codecs on real KV: the cache a transformers Llama (random weights,
built from a config; bfloat16) fills on a prompt, cut into pages of 16
tokens. For each codec: how much smaller its pages are (codec_<name>_ratio),
how fast it encodes and decodes on one core beside a plain copy of the
same bytes (codec_<name>_encode_gbps, codec_<name>_decode_gbps: the ratio
is to the copy), and the relative L2 error it reports
(codec_<name>_rel_error: the mean over pages; the worst in the note)."""

from __future__ import annotations

import numpy as np
import torch

from bench.common import Result, spread, timed
from tierd import codecs
from tierd.adapters.hf import forward
from tierd.layout import KVSpec

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
    return out
