"""Multi-turn resume on real transformers models (random weights, built from a
config): a session restored from any tier continues bit for bit as if it had
never left, for a grouped-query Llama and for a Gemma 2 with sliding-window
layers, through shared memory and through bytes."""


import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.helpers import wait_for
from tierd.adapters.hf import CacheStore, forward, spec_for
from tierd.client import IdentityMismatch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024)
MODELS = {
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **COMMON)),
    "gemma2-sliding": lambda: Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=24,
                                                             **COMMON)),
}


def build(name):
    torch.manual_seed(0)
    return MODELS[name]().eval()


def turn(model, ids, cache, steps=6):
    """Feed ids, then greedy-decode `steps` tokens: (logits of ids, the tokens)."""
    logits = forward(model, ids, cache).logits
    out, nxt = [], logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out.append(int(nxt))
        nxt = forward(model, nxt, cache).logits[:, -1:].argmax(-1)
    return logits, out


def wait_on_disk(client, sid, timeout=30):
    wait_for(lambda: set(client.stat(sid).tier_bytes) == {"disk"}, timeout, f"{sid} on disk alone")


@pytest.mark.parametrize("transport", ["shm", "bytes"])
@pytest.mark.parametrize("name", list(MODELS))
def test_resume_from_disk_is_bitwise_equal_to_never_leaving(daemon, name, transport):
    model = build(name)
    g = torch.Generator().manual_seed(1)
    turn1 = torch.randint(0, 256, (1, 50), generator=g)  # past the 24-token window
    turn2 = torch.randint(0, 256, (1, 13), generator=g)
    turn3 = torch.randint(0, 256, (1, 9), generator=g)

    # The uninterrupted conversation.
    ref = DynamicCache(config=model.config)
    turn(model, turn1, ref)
    ref_logits2, ref_tokens2 = turn(model, turn2, ref)
    ref_logits3, ref_tokens3 = turn(model, turn3, ref)

    with daemon.client() as client, CacheStore(client, model.config, model_id=name, transport=transport) as store:
        # turn 1: prefill, save, drop the local cache
        cache = DynamicCache(config=model.config)
        turn(model, turn1, cache)
        assert store.save("chat", cache).num_tokens == 56  # 50 prompt tokens + 6 decoded, the last not yet in
        del cache
        client.release("chat")
        wait_on_disk(client, "chat")
        # before turn 2: prefetch, restore, continue
        assert client.prefetch("chat") == "queued"
        assert client.wait_ready("chat", timeout=20) == (True, "host")
        cache = store.restore("chat")
        logits2, tokens2 = turn(model, turn2, cache)
        assert torch.equal(logits2, ref_logits2) and tokens2 == ref_tokens2
        # turn 2 saves only what it added: pages from the partial one (56 // 16 = 3) on
        route = "engine->host" if transport == "shm" else "client->host"
        sent_before = client.stats()["moved_bytes"][route]
        saved = store.save("chat", cache)
        assert (saved.num_tokens, saved.num_pages) == (56 + 13 + 6, 5)
        assert client.stats()["moved_bytes"][route] - sent_before == 2 * store.spec.page_bytes
        del cache
        client.release("chat")
        wait_on_disk(client, "chat")
        cache = store.restore("chat")
        logits3, tokens3 = turn(model, turn3, cache)
        assert torch.equal(logits3, ref_logits3) and tokens3 == ref_tokens3


def test_resume_after_kill_9_is_bitwise_equal(daemon):
    model = build("gemma2-sliding")
    g = torch.Generator().manual_seed(2)
    turn1, turn2 = torch.randint(0, 256, (1, 40), generator=g), torch.randint(0, 256, (1, 7), generator=g)
    ref = DynamicCache(config=model.config)
    turn(model, turn1, ref)
    ref_logits, ref_tokens = turn(model, turn2, ref)
    with daemon.client() as client, CacheStore(client, model.config, model_id="g") as store:
        cache = DynamicCache(config=model.config)
        turn(model, turn1, cache)
        store.save("chat", cache)
        client.release("chat")
        wait_for(lambda: client.stat("chat").durable, 20, "the write-back")
        store.close()
    daemon.kill()
    daemon.start()
    with daemon.client() as client, CacheStore(client, model.config, model_id="g") as store:
        logits, tokens = turn(model, turn2, store.restore("chat"))
        assert torch.equal(logits, ref_logits) and tokens == ref_tokens


@pytest.mark.parametrize("transport", ["shm", "bytes"])
def test_restore_into_another_model_is_refused_and_touches_nothing(daemon, transport):
    llama = build("llama-gqa")
    other = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **COMMON)).eval()
    with daemon.client() as client, \
            CacheStore(client, llama.config, model_id="m", transport=transport) as store, \
            CacheStore(client, other.config, model_id="m", transport=transport) as wrong:
        cache = DynamicCache(config=llama.config)
        turn(llama, torch.randint(0, 256, (1, 20)), cache, steps=0)
        store.save("chat", cache)
        mine = DynamicCache(config=other.config)
        turn(other, torch.randint(0, 256, (1, 5)), mine, steps=0)
        before = [layer.keys.clone() for layer in mine.layers]
        if transport == "shm":
            wrong._shm(8)
            region = wrong._kv.regions[0].copy()
        with pytest.raises(IdentityMismatch):
            wrong.restore("chat")
        assert all(torch.equal(a, layer.keys) for a, layer in zip(before, mine.layers))
        if transport == "shm":
            assert (wrong._kv.regions[0] == region).all()  # the daemon refused before copying a byte
        assert client.stat("chat").num_tokens == 20


def test_spec_follows_the_config():
    gemma = build("gemma2-sliding")
    spec = spec_for(gemma.config, torch.bfloat16, model_id="g")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (4, 2, 16, "bfloat16")
    assert "sliding_attention:24" in spec.extra
    narrower = Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=16, **COMMON)
    assert spec_for(narrower, torch.bfloat16, model_id="g").fingerprint != spec.fingerprint
