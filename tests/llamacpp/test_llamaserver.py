"""llama-server, unmodified, behind tierd's front (tierd llama-front), all
real processes: a llama-server built from the llama.cpp that
llama-cpp-python vendors, the front, a tierd daemon, on a random-weight
GGUF. More conversations than slots, each turn 2 restored from tierd with
the greedy tokens of the conversation kept in its slot, by llama-server's
own counts (cache_n); a restart of llama-server and of tierd between
turns; a state of another model refused; a restore that gave no reuse a
miss; hostile calls refused with nothing changed."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import wait_for
from tests.llamacpp.servers import ROOT, SERVER, FrontProc, LlamaServer, call

if not SERVER.exists():
    pytest.skip("llama-server is not built here (make test-llamacpp builds it)", allow_module_level=True)

TURN1, NEW, ANSWER = 600, 64, 16


@pytest.fixture
def stack(tmp_path, daemon, models):
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(mode=0o700)
    server = LlamaServer(tmp_path, slot_dir).start(models[0])
    front = FrontProc(tmp_path, daemon.socket, server).start()
    yield server, front
    front.stop()
    server.stop()


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def complete(port, tokens, session=None, slot=None, **extra):
    """A greedy completion: (the tokens it generated, the prompt tokens llama-server did not decode again)."""
    body = {"prompt": tokens, "n_predict": ANSWER, "temperature": 0.0, "top_k": 1, "return_tokens": True,
            "cache_prompt": True} | extra
    if slot is not None:
        body["id_slot"] = slot
    status, out = call(port, "POST", "/completion", body, {"X-Tierd-Session": session} if session else None)
    assert status == 200, out
    return out["tokens"], out["timings"]["cache_n"]


def kept_in_slot(server, conversation):
    """Turn 2 of a conversation that never left its slot (llama-server alone): the reference."""
    first = prompt(conversation, TURN1)
    answer, _ = complete(server.port, first, slot=0)
    second, reused = complete(server.port, first + answer + prompt(100 + conversation, NEW), slot=0)
    assert reused >= TURN1
    return first, answer, second


def test_more_conversations_than_slots_each_resume_from_tierd_with_the_same_tokens(stack, daemon):
    server, front = stack
    refs = {conv: kept_in_slot(server, conv) for conv in (1, 2, 3)}
    for conv in (1, 2, 3):  # three first turns in two slots: the third takes the first's
        first, answer, _ = refs[conv]
        got, _ = complete(front.port, first, f"c{conv}")
        assert got == answer
    before = front.stored(3)
    with daemon.client() as c:
        stored = {s.session_id: s for s in c.list()}
    assert sorted(stored) == ["llama-server-c1", "llama-server-c2", "llama-server-c3"]
    assert before["saves"] == 3 and before["save_failures"] == 0
    for conv in (1, 2, 3):  # each second turn: its state set from tierd, then only the new tokens decoded
        first, answer, second = refs[conv]
        got, reused = complete(front.port, first + answer + prompt(100 + conv, NEW), f"c{conv}")
        assert got == second
        assert reused >= TURN1
    after = front.stored(6)
    assert after["restores"] - before["restores"] == 3 and after["misses"] == 0, after
    assert after["reused_tokens"] >= 3 * TURN1 and after["saves"] == 6
    # a conversation still in its slot: served from it, nothing set
    first, answer, second = refs[3]
    complete(front.port, first + answer + prompt(100 + 3, NEW) + second, "c3")
    front.stored(7)
    assert front.stats()["hot"] == after["hot"] + 1 and front.stats()["restores"] == after["restores"]


def test_turn_2_restored_after_llama_server_and_tierd_restart(stack, daemon, models):
    server, front = stack
    first, answer, second = kept_in_slot(server, 7)
    got, _ = complete(front.port, first, "c7")
    assert got == answer
    front.stored(1)
    with daemon.client() as c:
        wait_for(lambda: c.stat("llama-server-c7").durable, 30, "the state written back")
    daemon.kill()
    server.stop()
    daemon.start()
    server.start(models[0])
    got, reused = complete(front.port, first + answer + prompt(107, NEW), "c7")
    assert got == second and reused >= TURN1
    stats = front.stats()
    assert stats["restores"] == 1 and stats["misses"] == 0, stats


def test_a_state_of_another_model_is_refused_and_the_turn_decoded_anew(stack, daemon, models):
    server, front = stack
    first = prompt(8, TURN1)
    answer, _ = complete(front.port, first, "c8")
    front.stored(1)
    server.stop()
    server.start(models[1])  # same shapes, other weights
    turn2 = first + answer + prompt(108, NEW)
    fresh, _ = complete(server.port, turn2, slot=1)  # the other model, from nothing
    complete(server.port, prompt(9, 8), slot=1)  # (its slot now holds something else)
    got, reused = complete(front.port, turn2, "c8")
    assert got == fresh and reused == 0
    stats = front.stored(2)
    assert stats["misses"] == 1 and stats["miss_reasons"] == {"another model": 1} and stats["restores"] == 0
    assert "restore miss (dense model): another model" in front.log.read_text()


def test_a_restore_that_gave_no_reuse_is_a_miss(stack):
    server, front = stack
    complete(front.port, prompt(10, TURN1), "c10")
    complete(front.port, prompt(11, TURN1), "c11")
    complete(front.port, prompt(12, TURN1), "c12")  # c10 out of its slot
    complete(front.port, prompt(13, TURN1), "c10")  # another prompt under its name: nothing of it reused
    stats = front.stored(4)
    assert stats["restores"] == 0 and stats["misses"] == 1 and stats["miss_reasons"] == {"no reuse": 1}, stats


def test_hostile_calls_are_refused_and_change_nothing(stack, daemon):
    server, front = stack
    first = prompt(14, TURN1)
    complete(front.port, first, "c14")
    front.stored(1)
    with daemon.client() as c:
        before = [(s.session_id, s.size_bytes) for s in c.list()]
    refused = [
        call(front.port, "POST", "/slots/0?action=restore", {"filename": "tierd-0-1.bin"}),
        call(front.port, "POST", "/slots/1?action=erase"),
        call(front.port, "POST", "/completion", {"prompt": first, "n_predict": 1}, {"X-Tierd-Session": "../x"}),
        call(front.port, "POST", "/completion", {"prompt": first, "n_predict": 1}, {"X-Tierd-Session": "a" * 201}),
        call(front.port, "POST", "/completion", b"{not json"),
        call(front.port, "POST", "/completion", b"[1, 2]"),
        call(front.port, "POST", "/tierd/prefetch", {"session": 7}),
    ]
    assert [status for status, _ in refused] == [403, 403, 400, 400, 400, 400, 400]
    assert all(isinstance(body, dict) and body["error"]["message"] for _, body in refused)
    with daemon.client() as c:
        assert [(s.session_id, s.size_bytes) for s in c.list()] == before
    assert os.listdir(server.slot_dir) == []  # no slot file left behind
    # the conversation still resumes where it was
    _, reused = complete(front.port, first + prompt(15, NEW), "c14")
    assert reused >= TURN1


def test_prefetch_on_a_hint_stages_the_state_for_the_turn(stack, daemon):
    server, front = stack
    first = prompt(16, TURN1)
    answer, _ = complete(front.port, first, "c16")
    complete(front.port, prompt(17, TURN1), "c17")
    complete(front.port, prompt(18, TURN1), "c18")  # c16 out of its slot
    front.stored(3)
    status, body = call(front.port, "POST", "/tierd/prefetch", {"session": "c16"})
    assert status == 202 and body == {"session": "llama-server-c16"}
    wait_for(lambda: "llama-server-c16" in front.stats()["staged"], timeout=60, what="staged")
    # staged: a name in the slot dir linked to the shared memory of the daemon's restore lease (no copy)
    [name] = [n for n in os.listdir(server.slot_dir) if n.startswith("tierd-stage-")]
    target = os.readlink(os.path.join(server.slot_dir, name))
    with daemon.client() as c:
        state = c.get("llama-server-c16")
    with open(target, "rb") as f:
        assert os.path.dirname(target) == "/dev/shm" and f.read(len(state)) == state
    _, reused = complete(front.port, first + answer + prompt(116, NEW), "c16")
    assert reused >= TURN1 and front.stats()["restores"] == 1
    front.stored(4)  # (its turn stored after it was answered, through a slot file of llama-server's)
    assert os.listdir(server.slot_dir) == []  # nothing left placed


def test_a_slot_dir_others_may_write_is_refused(tmp_path, daemon):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out = subprocess.run([sys.executable, "-m", "tierd", "llama-front", "--upstream", "http://127.0.0.1:1",
                          "--slot-dir", str(shared), "--address", daemon.socket, "--wait", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "not writable by group or others" in out.stderr, out.stderr
