"""KV codecs against what a model needs of its cache: recall. A small Llama
(transformers, built from a config, seeded; never downloaded) is trained
on the spot, on the CPU, on multi-query associative recall (as in Zoology):
key-value pairs spread through a context of filler tokens, then keys to
answer with the value each was paired with. Each context is prefilled in
bfloat16 into a DynamicCache, cut into pages of 16 tokens as tierd's
transformers adapter cuts it, and every page is run through a codec and
decoded back into the cache; then the queries are fed and each answer is
the argmax. recall_<codec>_<ctx>: the fraction of queries answered
exactly at a context of ctx tokens (whole pages, so all of it is coded; a
partial last page would be left as it is), beside the same model's on the
cache as the prefill left it (recall_uncoded_<ctx>, whose limit is perfect
recall); the note gives the mean relative L2 error the codec reported on
those pages and the answers' mean log-probability. `none` and `lossless`
must give exactly the uncoded answers (checked). All on the CPU, torch's
default threads; recall_train_seconds: the training."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from bench.common import Result
from tierd import codecs
from tierd.adapters.hf import forward, spec_for
from tierd.layout import KVSpec

BLOCK = 16
BOS, KEYS, VALUES, FILLERS = 0, range(1, 65), range(65, 129), range(129, 193)
CONTEXTS = (256, 2048)
PAIRS, QUERIES = 32, 16  # as evaluated: 32 pairs in the context, 16 of them asked
# Training, stage by stage: (steps, context lengths taken in turn, pairs, queries, tokens a step). The
# first stage is short contexts with few pairs, where the circuit that recall needs (a head reading
# each value's key from the token before it, and one matching a query against those) forms within
# a few hundred steps; later ones reach the evaluated pairs and lengths, and the last one's learning
# rate falls to nothing.
Stage = tuple[int, tuple[int, ...], int, int, int]
STAGES: tuple[Stage, ...] = ((800, (12,), 3, 3, 1024), (300, (32, 64, 128, 256), 8, 4, 2048),
          (2000, (256, 512, 1024, 2048), PAIRS, QUERIES, 4096))
QUICK_STAGES: tuple[Stage, ...] = STAGES[:2] + ((700, (256, 512, 1024, 2048), PAIRS, QUERIES, 4096),)
LR = 2e-3
CHUNK = 16  # contexts prefilled and coded at a time


@dataclass(frozen=True)
class Task:
    """Contexts of `context` tokens, each followed by its queries: each
    query's key, then the value it was paired with (fed as it is: what a
    query is read for is the prediction at its key)."""

    tokens: torch.Tensor  # [n, context + 2 * queries]
    answers: torch.Tensor  # [n, queries]
    context: int


def task(rng: np.random.Generator, context: int, n: int, pairs: int = PAIRS, queries: int = QUERIES) -> Task:
    """n contexts: BOS, then `pairs` distinct keys each followed by its value
    (a value may repeat) at random places among fillers, then `queries` of
    the keys (distinct, in random order) each followed by its value."""
    tokens = np.empty((n, context + 2 * queries), dtype=np.int64)
    answers = np.empty((n, queries), dtype=np.int64)
    fill = context - 1 - 2 * pairs
    for i in range(n):
        keys = rng.choice(np.arange(KEYS.start, KEYS.stop), pairs, replace=False)
        values = rng.integers(VALUES.start, VALUES.stop, pairs)
        order = rng.permutation(np.r_[np.full(fill, -1), np.arange(pairs)])  # -1: a filler, else a pair
        fillers = iter(rng.integers(FILLERS.start, FILLERS.stop, fill))
        body = [[next(fillers)] if j < 0 else [keys[j], values[j]] for j in order]
        asked = rng.choice(pairs, queries, replace=False)
        tokens[i] = np.r_[BOS, np.concatenate(body), np.stack([keys[asked], values[asked]], 1).reshape(-1)]
        answers[i] = values[asked]
    return Task(torch.from_numpy(tokens), torch.from_numpy(answers), context)


def build() -> torch.nn.Module:
    """2 layers, hidden 64, 2 heads of 32 (2 KV heads), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # (biases on q and k let a head attend by position alone, as the one reading the previous token does)
    config = LlamaConfig(vocab_size=FILLERS.stop, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=2, num_hidden_layers=2, attention_bias=True,
                         max_position_embeddings=2 * max(CONTEXTS), tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    # torch's own initialisation rather than Llama's (normal, std 0.02): from that one the recall
    # circuit forms thousands of steps later, if at all.
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.reset_parameters()
    return model


def answered(model: torch.nn.Module, t: Task) -> torch.Tensor:
    """Logits [n, queries, vocab] at each query's key, without a cache."""
    return model.lm_head(model.model(t.tokens).last_hidden_state[:, t.context :: 2])


def train(model: torch.nn.Module, stages: tuple[Stage, ...] = STAGES) -> tuple[float, float]:
    """Train in place; the loss and recall over the last 20 steps."""
    rng = np.random.default_rng(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    history: list[tuple[float, float]] = []
    for stage, (steps, lengths, pairs, queries, tokens) in enumerate(stages):
        for step in range(steps):
            if stage == len(stages) - 1:
                optimizer.param_groups[0]["lr"] = LR * (1 - step / steps)
            n = lengths[step % len(lengths)]
            t = task(rng, n, max(1, tokens // (n + 2 * queries)), pairs, queries)
            logits = answered(model, t)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.answers.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            history.append((loss.item(), (logits.argmax(-1) == t.answers).float().mean().item()))
    model.eval()
    loss, acc = np.mean(history[-20:], axis=0)
    return float(loss), float(acc)


def kv_of(cache: object) -> torch.Tensor:
    """A DynamicCache's KV as [n, layers, 2, heads, tokens, dim]."""
    return torch.stack([torch.stack([layer.keys, layer.values], 1) for layer in cache.layers], 1)


def pages_of(kv: torch.Tensor) -> np.ndarray:
    """KV [n, L, 2, H, S, D] as the pages of its whole pages, [n * (S // BLOCK), page_bytes], each
    context's in turn (the adapter's arrangement: per page, layer, K/V, head, token, dim)."""
    n, L, _, H, S, D = kv.shape
    p = S // BLOCK
    x = kv[..., : p * BLOCK, :].reshape(n, L, 2, H, p, BLOCK, D).permute(0, 4, 1, 2, 3, 5, 6)
    return x.contiguous().view(torch.uint8).reshape(n * p, -1).numpy()


def with_pages(kv: torch.Tensor, pages: np.ndarray) -> torch.Tensor:
    """KV with its whole pages replaced by these (a partial last page stays as it is)."""
    n, L, _, H, S, D = kv.shape
    p = S // BLOCK
    x = torch.from_numpy(pages.copy()).view(kv.dtype).view(n, p, L, 2, H, BLOCK, D).permute(0, 2, 3, 4, 1, 5, 6)
    out = kv.clone()
    out[..., : p * BLOCK, :] = x.reshape(n, L, 2, H, p * BLOCK, D)
    return out


def cache_of(kv: torch.Tensor, config: object) -> object:
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        layer.update(kv[:, i, 0].contiguous(), kv[:, i, 1].contiguous())
    return cache


def decoded(name: str, pages: np.ndarray, spec: KVSpec) -> tuple[np.ndarray, codecs.Coded]:
    """The pages as the codec's blobs decode, and what coding them reported."""
    codec, shape = codecs.get(name), codecs.page_shape(spec)
    coded = codecs.code(codec, pages, shape, keep=True)
    if coded.decoded is not None:
        return coded.decoded, coded
    out = np.empty_like(pages)  # (a lossless codec keeps nothing: its blobs are decoded here)
    for i, blob in enumerate(coded.blobs):
        codec.decode(blob, shape, out[i])
    return out, coded


def queried(model: torch.nn.Module, queries: torch.Tensor, cache: object) -> torch.Tensor:
    """Logits [n, queries, vocab] (float32) at each query's key, fed after the cache."""
    return forward(model, queries, cache).logits[:, ::2].float()


def recall(model: torch.nn.Module, t: Task, names: list[str],
           spec: KVSpec) -> tuple[dict[str, torch.Tensor], dict[str, list[codecs.Coded]]]:
    """Logits at each query's key (as queried) on the cache as the prefill
    left it ("uncoded") and on each codec's; and per codec, its Coded of each
    chunk of contexts. A codec that is not lossy must answer as uncoded."""
    from transformers import DynamicCache

    logits: dict[str, list[torch.Tensor]] = {name: [] for name in ["uncoded", *names]}
    coded: dict[str, list[codecs.Coded]] = {name: [] for name in names}
    for lo in range(0, len(t.tokens), CHUNK):
        context, queries = t.tokens[lo : lo + CHUNK, : t.context], t.tokens[lo : lo + CHUNK, t.context :]
        cache = DynamicCache(config=model.config)
        forward(model, context, cache)
        kv = kv_of(cache)
        pages = pages_of(kv)
        logits["uncoded"].append(queried(model, queries, cache))
        for name in names:
            back, c = decoded(name, pages, spec)
            coded[name].append(c)
            logits[name].append(queried(model, queries, cache_of(with_pages(kv, back), model.config)))
    out = {name: torch.cat(x) for name, x in logits.items()}
    for name in names:
        assert codecs.get(name).lossy or torch.equal(out[name].argmax(-1), out["uncoded"].argmax(-1)), \
            f"the {name} codec changed recall's answers: it is not bit-exact on this cache"
    return out, coded


def scored(logits: torch.Tensor, answers: torch.Tensor) -> tuple[float, float]:
    """(the fraction of queries answered exactly, the answers' mean log-probability)."""
    logp = torch.log_softmax(logits, -1).gather(-1, answers[..., None])
    return (logits.argmax(-1) == answers).float().mean().item(), logp.mean().item()


def run(quick: bool) -> list[Result]:
    stages = QUICK_STAGES if quick else STAGES
    model = build()
    t0 = time.perf_counter()
    loss, acc = train(model, stages)
    seconds = time.perf_counter() - t0
    out = [Result("recall_train_seconds", round(seconds, 1), "s",
                  note=f"{sum(s[0] for s in stages)} steps on {torch.get_num_threads()} threads; the last 20: "
                       f"loss {loss:.4f}, recall {acc:.4f}")]
    model = model.to(torch.bfloat16)
    names = codecs.names()
    spec = spec_for(model.config, torch.bfloat16, model_id="bench/recall", block_tokens=BLOCK)
    rng = np.random.default_rng(1)
    for context in CONTEXTS:
        t = task(rng, context, 32 if quick else 128)
        logits, coded = recall(model, t, names, spec)
        what = f"{t.answers.numel()} queries ({len(t.tokens)} contexts x {QUERIES}, {PAIRS} pairs each)"
        base, logp = scored(logits["uncoded"], t.answers)
        out.append(Result(f"recall_uncoded_{context}", base, "", 1.0, round(base, 4),
                          note=f"the bfloat16 cache as the prefill left it (limit: perfect recall); answers' mean "
                               f"log-probability {logp:.4g}; {what}"))
        for name in names:
            acc, logp = scored(logits[name], t.answers)
            rel = np.concatenate([c.rel_error for c in coded[name]])
            smaller = len(rel) * spec.page_bytes / sum(c.nbytes for c in coded[name])
            out.append(Result(f"recall_{name}_{context}", acc, "", base, round(acc / base, 4) if base else None,
                              note=f"mean relative L2 error {float(rel.mean()):.4g} over {len(rel)} pages "
                                   f"({smaller:.2f}x smaller); answers' mean log-probability {logp:.4g}; {what}"))
    return out
