"""The recall benchmark's parts (bench/recall.py), on its model untrained:
the task holds what it says it does; its pages are the transformers
adapter's; a lossless codec gives back the cache bit for bit and the
uncoded answers; a lossy one's reported error is the one the cache
tensors show, and a partial last page is left as it is."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from bench import recall
from tierd.adapters.hf import CacheStore, forward, spec_for

CONTEXT = 88  # five whole pages and half of one


@pytest.fixture(scope="module")
def model():
    return recall.build().to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def spec(model):
    return spec_for(model.config, torch.bfloat16, model_id="test/recall", block_tokens=recall.BLOCK)


@pytest.fixture(scope="module")
def prefilled(model):
    """A task of 3 contexts, and the KV their prefill leaves [n, layers, 2, heads, tokens, dim]."""
    t = recall.task(np.random.default_rng(0), CONTEXT, 3)
    cache = DynamicCache(config=model.config)
    forward(model, t.tokens[:, :CONTEXT], cache)
    return t, recall.kv_of(cache)


@pytest.mark.parametrize("context,pairs,queries", [(12, 3, 3), (256, recall.PAIRS, recall.QUERIES)])
def test_a_context_holds_its_pairs_among_fillers_and_the_queries_ask_for_their_values(context, pairs, queries):
    t = recall.task(np.random.default_rng(0), context, 5, pairs, queries)
    assert t.context == context and t.tokens.shape == (5, context + 2 * queries) and t.answers.shape == (5, queries)
    for tokens, answers in zip(t.tokens.tolist(), t.answers.tolist()):
        body, asked = tokens[1:context], tokens[context:]
        assert tokens[0] == recall.BOS
        keys = [i for i, x in enumerate(body) if x in recall.KEYS]
        assert len(keys) == len({body[i] for i in keys}) == pairs  # each key once, in a pair
        paired = {body[i]: body[i + 1] for i in keys}
        assert all(v in recall.VALUES for v in paired.values())
        rest = set(range(len(body))) - set(keys) - {i + 1 for i in keys}
        assert len(rest) == context - 1 - 2 * pairs and all(body[i] in recall.FILLERS for i in rest)
        assert len(set(asked[::2])) == queries and all(k in paired for k in asked[::2])
        assert asked[1::2] == answers == [paired[k] for k in asked[::2]]


def test_the_pages_are_the_adapters(model, spec, prefilled):
    t, kv = prefilled
    pages = recall.pages_of(kv)
    whole = CONTEXT // recall.BLOCK
    assert pages.shape == (3 * whole, spec.page_bytes)
    cache = DynamicCache(config=model.config)
    forward(model, t.tokens[:1, :CONTEXT], cache)
    out = torch.empty(whole * spec.page_bytes, dtype=torch.uint8)
    CacheStore(None, model.config, dtype=torch.bfloat16)._pack(cache, 0, whole, out)
    assert np.array_equal(out.numpy().reshape(whole, -1), pages[:whole])


def test_lossless_gives_back_the_cache_bit_for_bit_and_the_uncoded_answers(model, spec, prefilled):
    t, kv = prefilled
    back, coded = recall.decoded("lossless", recall.pages_of(kv), spec)
    assert coded.nbytes < back.size and not coded.rel_error.any()
    rebuilt = recall.cache_of(recall.with_pages(kv, back), model.config)
    for i, layer in enumerate(rebuilt.layers):
        assert torch.equal(layer.keys.view(torch.int16), kv[:, i, 0].view(torch.int16))
        assert torch.equal(layer.values.view(torch.int16), kv[:, i, 1].view(torch.int16))
    logits, _ = recall.recall(model, t, ["lossless", "none"], spec)
    assert torch.equal(logits["lossless"], logits["uncoded"]) and torch.equal(logits["none"], logits["uncoded"])


@pytest.mark.parametrize("name", ["int4", "fp8"])
def test_a_lossy_codec_reports_the_error_the_cache_shows(model, spec, prefilled, name):
    t, kv = prefilled
    back, coded = recall.decoded(name, recall.pages_of(kv), spec)
    after = recall.with_pages(kv, back)
    cut = CONTEXT // recall.BLOCK * recall.BLOCK
    assert torch.equal(after[..., cut:, :].view(torch.int16), kv[..., cut:, :].view(torch.int16))

    def per_page(x: torch.Tensor) -> torch.Tensor:  # [n, L, 2, H, S, D] -> each page's values, flat
        n, L, _, H, _, D = x.shape
        x = x[..., :cut, :].float().reshape(n, L, 2, H, -1, recall.BLOCK, D)
        return x.permute(0, 4, 1, 2, 3, 5, 6).reshape(-1, L * 2 * H * recall.BLOCK * D)

    x, y = per_page(kv), per_page(after)
    rel = torch.linalg.vector_norm(y - x, dim=1) / torch.linalg.vector_norm(x, dim=1)
    assert (rel > 0).all()
    np.testing.assert_allclose(coded.rel_error, rel.numpy(), rtol=1e-4)
    logits, _ = recall.recall(model, t, [name], spec)
    assert not torch.equal(logits[name], logits["uncoded"])  # the coded cache is what the queries read
