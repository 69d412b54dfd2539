"""llama-cpp-python with its conversations in tierd (tierd.adapters.llamacpp),
against a real daemon and a real llama.cpp on a random-weight GGUF: more
conversations than the context holds, each turn 2 restored from tierd with
the greedy tokens of the conversation kept in context, by llama.cpp's own
counts (the tokens it did not decode again); a restart of the Llama and of
tierd between turns; a state of another model refused; a restore that gave
no reuse counted as a miss, never a hit."""

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from tests.helpers import wait_for  # noqa: E402
from tierd.adapters.llamacpp import attach  # noqa: E402

TURN1 = 600  # tokens of a conversation's first prompt
NEW = 64  # tokens the user adds for turn 2
ANSWER = 16  # tokens each turn generates


def load(path):
    return llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, seed=0, verbose=False)


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def turn(llm, tokens):
    """A greedy completion; returns (the tokens the context then holds, the answer's text)."""
    out = llm.create_completion(tokens, max_tokens=ANSWER, temperature=0.0, top_k=1)
    return [int(t) for t in llm._input_ids[: llm.n_tokens]], out["choices"][0]["text"]


def decoded(llm):
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return perf.n_p_eval + perf.n_eval


def first_turn(path, c, conversation, **kw):
    """A Llama with the cache attached, and the tokens its context holds after the conversation's first turn."""
    llm = load(path)
    cache = attach(llm, c, **kw)
    held, _ = turn(llm, prompt(conversation, TURN1))
    return llm, cache, held


def kept_in_context(path, conversation):
    """Turn 2 of a conversation that never left the context: the reference."""
    llm = load(path)
    held, _ = turn(llm, prompt(conversation, TURN1))
    return turn(llm, held + prompt(100 + conversation, NEW))[1]


def test_more_conversations_than_the_context_holds_each_resume_from_tierd_with_the_same_tokens(daemon, models):
    path, _ = models
    with daemon.client() as c:
        llm = load(path)
        cache = attach(llm, c)
        held = {}
        for conv in (1, 2, 3):  # each first turn takes the context from the one before
            held[conv], _ = turn(llm, prompt(conv, TURN1))
        assert cache.counts.saves == 3 and len(c.list()) == 3
        for conv in (1, 2, 3):  # each second turn: from tierd, not decoded again
            before = decoded(llm)
            _, text = turn(llm, held[conv] + prompt(100 + conv, NEW))
            assert text == kept_in_context(path, conv)
            # llama.cpp decoded the new tokens, one token again (its logits are not kept) and the answer
            assert decoded(llm) - before <= NEW + 1 + ANSWER
        assert cache.counts.restores == 3 and cache.counts.misses == 0
        assert cache.counts.reused_tokens >= 3 * (len(held[1]) - 1)
        assert len(c.list()) == 3  # each conversation one session: its latest turn, the first dropped
        cache.close()


def test_a_conversation_resumes_after_the_llama_and_tierd_restart(daemon, models):
    path, _ = models
    with daemon.client() as c:
        llm, cache, held = first_turn(path, c, 7)
        (sid,) = [s.session_id for s in c.list()]
        assert c.stat(sid).size_bytes == cache.counts.saved_bytes and c.stat(sid).num_tokens == len(held)
        wait_for(lambda: c.stat(sid).durable, 20, "the state written back")
        cache.close()
        del llm
    daemon.kill()  # kill -9
    daemon.start()
    with daemon.client() as c:
        llm = load(path)  # a new process's Llama: its context holds nothing
        cache = attach(llm, c)
        before = decoded(llm)
        _, text = turn(llm, held + prompt(107, NEW))
        assert text == kept_in_context(path, 7)
        assert cache.counts.restores == 1 and decoded(llm) - before <= NEW + 1 + ANSWER
        cache.close()


def test_a_state_of_another_model_is_refused_and_the_turn_recomputed(daemon, models):
    path, other = models
    with daemon.client() as c:
        _, cache, held = first_turn(path, c, 8, namespace="shared")
        cache.close()
        llm2 = load(other)
        cache2 = attach(llm2, c, namespace="shared")  # the same names, another model's GGUF
        assert cache2.spec != cache.spec
        before = decoded(llm2)
        _, text = turn(llm2, held + prompt(108, NEW))
        assert cache2.counts.restores == 0 and cache2.counts.miss_reasons == {"another model": 1}
        assert decoded(llm2) - before >= len(held)  # every token decoded: nothing of the other model's used
        reference = load(other)
        assert turn(reference, held + prompt(108, NEW))[1] == text
        cache2.close()


def test_a_restore_that_gives_no_reuse_is_a_miss_never_a_hit(daemon, models):
    path, _ = models
    with daemon.client() as c:
        llm, cache, held = first_turn(path, c, 9)
        turn(llm, prompt(10, TURN1))  # another conversation takes the context
        # A memory that cannot drop part of a sequence (a recurrent model's): llama-cpp-python decodes
        # every token again.
        whole = llm._ctx.kv_cache_seq_rm
        llm._ctx.kv_cache_seq_rm = lambda seq, p0, p1: False if p0 > 0 else whole(seq, p0, p1)
        _, text = turn(llm, held + prompt(109, NEW))
        assert text == kept_in_context(path, 9)
        assert cache.counts.restores == 0 and cache.counts.miss_reasons == {"no reuse": 1}
        cache.close()
