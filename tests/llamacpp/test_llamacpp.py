"""llama-cpp-python with its conversations in tierd (tierd.adapters.llamacpp),
against a real daemon and a real llama.cpp on a random-weight GGUF: more
conversations than the context holds, each turn 2 restored from tierd with
the greedy tokens of the conversation kept in context, by llama.cpp's own
counts (the tokens it did not decode again); a restart of the Llama and of
tierd between turns; a state of another model, or of other KV settings,
refused; a damaged state, or tierd gone, a miss recomputed; a restore that
gave no reuse counted as a miss, never a hit."""

from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from tests.helpers import metric, wait_for  # noqa: E402
from tierd.adapters.llamacpp import attach  # noqa: E402

TURN1 = 600  # tokens of a conversation's first prompt
NEW = 64  # tokens the user adds for turn 2
ANSWER = 16  # tokens each turn generates


def load(path, **settings):
    return llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, seed=0, verbose=False, **settings)


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


def stored_then_killed(daemon, path, conversation):
    """A conversation's first turn stored, durable, and the daemon killed (-9): its tokens and session."""
    with daemon.client() as c:
        _, cache, held = first_turn(path, c, conversation)
        (sid,) = [s.session_id for s in c.list()]
        assert c.stat(sid).size_bytes == cache.counts.saved_bytes and c.stat(sid).num_tokens == len(held)
        wait_for(lambda: c.stat(sid).durable, 20, "the state written back")
        cache.close()
    daemon.kill()
    return held, sid


def kept_in_context(path, conversation, **settings):
    """Turn 2 of a conversation that never left the context: the reference."""
    llm = load(path, **settings)
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
    held, _ = stored_then_killed(daemon, path, 7)
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


@pytest.mark.parametrize("settings", [{"rope_freq_base": 1000.0}, {"rope_freq_scale": 0.25}, {"type_k": 8}])
def test_a_state_of_other_kv_settings_of_the_same_model_is_refused(daemon, models, settings):
    """Keys are stored rotated: under another RoPE base or scale (or another cache type) they are others."""
    path, _ = models
    with daemon.client() as c:
        _, cache, held = first_turn(path, c, 11, namespace="shared")
        cache.close()
        llm = load(path, **settings)
        other = attach(llm, c, namespace="shared")
        _, text = turn(llm, held + prompt(111, NEW))
        assert other.counts.restores == 0 and other.counts.miss_reasons == {"another model": 1}
        assert turn(load(path, **settings), held + prompt(111, NEW))[1] == text
        other.close()


def test_a_damaged_state_is_a_miss_recomputed_and_not_asked_for_again(daemon, models):
    path, _ = models
    held, sid = stored_then_killed(daemon, path, 12)
    slab = next((Path(daemon.data_dir) / "slabs").glob("slab-*.bin"))
    with open(slab, "r+b") as f:  # one bit of the state on disk, behind the daemon's back
        data = f.read()
        at = data.index(b"TIERDLLC") + 20_000
        f.seek(at)
        f.write(bytes([data[at] ^ 0x10]))
    daemon.start()
    with daemon.client() as c:
        llm = load(path)
        cache = attach(llm, c)
        _, text = turn(llm, held + prompt(112, NEW))
        assert text == kept_in_context(path, 12)
        assert cache.counts.miss_reasons == {"damaged": 1} and cache.counts.restores == 0
        assert sid not in [s.session_id for s in c.list()] and cache.counts.saves == 1  # the new turn's state
        cache.close()


def test_tierd_gone_mid_conversation_leaves_the_completions_standing(daemon, models):
    path, _ = models
    with daemon.client() as c:
        llm, cache, held = first_turn(path, c, 13)
        turn(llm, prompt(14, TURN1))
        daemon.kill()  # and not back: every call to it fails
        _, text = turn(llm, held + prompt(113, NEW))
        assert text == kept_in_context(path, 13)
        assert cache.counts.restores == 0 and cache.counts.misses == 1 and cache.counts.save_failures == 1
        cache.close()


def restored_bytes(daemon):
    return sum(metric(daemon, "tierd_restored_bytes_total", f'source="{t}"') or 0 for t in ("host", "disk"))


def test_a_prefetch_stages_the_state_and_the_turn_sets_it_from_there(daemon, models):
    path, _ = models
    with daemon.client() as c:
        llm, cache, held_a = first_turn(path, c, 15)
        sizes = {s.session_id: s.size_bytes for s in c.list()}  # a's first turn
        held_b, _ = turn(llm, prompt(16, TURN1))
        start = restored_bytes(daemon)
        assert cache.prefetch(held_a + prompt(115, NEW), wait=True)  # the daemon brings the state ahead
        held_a, text = turn(llm, held_a + prompt(115, NEW))
        assert text == kept_in_context(path, 15) and cache.counts.restores == 1
        sizes.update({s.session_id: s.size_bytes for s in c.list()})  # and b's first turn, a's second
        assert cache.prefetch(held_a + prompt(117, NEW), wait=True)  # staged, then another conversation comes
        _, text = turn(llm, held_b + prompt(116, NEW))
        assert text == kept_in_context(path, 16) and cache.counts.restores == 2
        # three restore leases, each read once: a's staged one read by its turn, a's next staged one ended
        # unread when b came, and b's (its bytes counted as each ended): none taken twice
        wait_for(lambda: restored_bytes(daemon) - start == sum(sizes.values()), 10, "the leases ended")
        assert not cache.prefetch(prompt(17, TURN1))  # nothing stored starts it
        cache.close()
