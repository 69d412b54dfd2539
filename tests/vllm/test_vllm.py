"""The TierdConnector on a real vLLM server (CPU), against a real tierd daemon.

Each conversation runs first on a server without the connector; its greedy
outputs are the reference. With the connector: turn 1 is saved, the daemon
demotes it to disk, Prefetch brings it back, and turn 2 is served from it (vLLM
reports the prompt tokens it did not compute) with outputs equal to the
reference; the same across a kill -9 of the daemon; a new conversation that
opens with another one's system prompt loads its pages on its first turn; and
a session the daemon cannot serve (a damaged page, or no daemon at all) is
recomputed, still equal.

Runs in its own environment (`make test-vllm`): vLLM pins its own torch and
transformers.
"""

import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from tests.vllm.server import BLOCK, OUT, VllmServer, conversation, expected_served, served, text, wait_for
from tierd.testing import ROOT, Daemon


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Outputs of every conversation on a server without the connector."""
    path, tok = model
    server = VllmServer(path, tmp_path_factory.mktemp("ref") / "vllm.log").wait()
    try:
        out = {}
        for seed in (1, 2, 3):
            p1, more = conversation(tok, seed)
            r1 = server.complete(p1, OUT)
            p2 = p1 + r1["token_ids"] + more
            out[seed] = (p1, r1["token_ids"], p2, server.complete(p2, OUT)["token_ids"])
        system = tok(text(300, 50))["input_ids"]  # one system prompt, two conversations that open with it
        for name, seed in (("sys-a", 51), ("sys-b", 52)):
            prompt = system + tok(" " + text(40, seed))["input_ids"]
            out[name] = (system, prompt, server.complete(prompt, OUT)["token_ids"])
        return out
    finally:
        server.close()


@pytest.fixture(scope="module")
def world(model, reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("tierd")
    daemon = Daemon(root, "--host-idle", "1", "--writeback-idle", "0.3", "--codec", "disk=lossless").start()
    server = VllmServer(model[0], root / "vllm.log", tierd_socket=daemon.socket)
    try:
        server.wait()
        yield daemon, server
    finally:
        server.close()
        daemon.close()


def test_turn_two_resumes_from_disk_after_prefetch(world, reference):
    daemon, server = world
    p1, out1, p2, out2 = reference[1]
    r1 = server.complete(p1, OUT, session="chat-1")
    assert r1["token_ids"] == out1 and served(r1) == 0
    with daemon.client() as c:
        # the connector released the session: the daemon demotes it to disk by itself
        wait_for(lambda: c.stat("chat-1").tier_bytes.keys() == {"disk"})
        info = c.stat("chat-1")
        assert info.num_tokens == len(p1) + len(out1) - 1 and info.durable
        assert info.codecs == {"disk": "lossless"} and info.coded_bytes["disk"] < info.size_bytes
        assert c.prefetch("chat-1") == "queued"
        assert c.wait_ready("chat-1", timeout=30) == (True, "host")
    r2 = server.complete(p2, OUT, session="chat-1")
    assert served(r2) == expected_served(p1, out1, p2) > 0
    assert r2["token_ids"] == out2
    with daemon.client() as c:
        # turn 2 appended its new blocks: the snapshot now covers the whole second turn
        wait_for(lambda: c.stat("chat-1").num_tokens == len(p2) + OUT - 1)


def test_the_pages_vllm_saves_hold_its_kv_in_the_order_the_lossy_codecs_read_them(world, reference, model):
    """vLLM's CPU pages, read as tierd's codecs read them (K and V per
    layer, head, token, dim), against the K and V transformers computes for
    the same prompt with the same weights: a lossy codec scales and groups
    what it thinks it does."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from tierd import codecs
    from tierd.adapters.hf import forward

    daemon, server = world
    p1, out1, _, _ = reference[1]
    assert server.complete(p1, OUT, session="layout")["token_ids"] == out1
    with daemon.client() as c:
        wait_for(lambda: c.stat("layout").num_tokens == len(p1) + OUT - 1)
        info, data = c.stat("layout"), c.get("layout")
    assert info.spec.arrangement.startswith("vllm:cpu:")  # and the ISA of its attention kernels
    shape = codecs.page_shape(info.spec)
    if shape is None:
        pytest.skip(f"vLLM's pages here ({info.spec.arrangement}) are in a layout the lossy codecs do not read")
    n = info.num_pages
    saved = shape.values(np.frombuffer(data, dtype=np.uint8).reshape(n, -1))  # [n, L, 2, H, T, D]
    saved = saved.permute(1, 2, 3, 0, 4, 5).reshape(shape.layers, 2, shape.heads, n * shape.tokens, shape.dim)
    hf = AutoModelForCausalLM.from_pretrained(model[0], torch_dtype=torch.float32).eval()
    cache = DynamicCache(config=hf.config)
    forward(hf, torch.tensor([p1]), cache)
    want = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
    t = min(len(p1), n * shape.tokens)
    for kv in (0, 1):
        got, ref = saved[:, kv, :, :t], want[:, kv, :, :t]
        assert float((got - ref).norm() / ref.norm()) < 1e-3, ("K", "V")[kv]


def test_a_new_conversation_starts_from_another_ones_system_prompt(world, reference):
    # (before the tests that restart the daemon: the scheduler's client may wait out a reconnect after those)
    daemon, server = world
    system, prompt_a, out_a = reference["sys-a"]
    _, prompt_b, out_b = reference["sys-b"]
    r = server.complete(prompt_a, OUT, session="sys-a")
    assert r["token_ids"] == out_a and served(r) == 0
    with daemon.client() as c:
        wait_for(lambda: c.stat("sys-a").num_tokens == len(prompt_a) + OUT - 1)
    # another conversation, a session id tierd has never seen: its first turn loads the system prompt's pages
    r = server.complete(prompt_b, OUT, session="sys-b")
    assert served(r) == len(system) // BLOCK * BLOCK > 0
    assert r["token_ids"] == out_b
    with daemon.client() as c:
        wait_for(lambda: c.stat("sys-b").num_tokens == len(prompt_b) + OUT - 1)
        # and holds them once: its snapshot shares the system prompt's pages with the first conversation's
        assert c.stat("sys-b").shared_bytes == len(system) // BLOCK * c.stat("sys-b").spec.page_bytes


def test_turn_two_resumes_after_the_daemon_was_killed(world, reference):
    daemon, server = world
    p1, out1, p2, out2 = reference[2]
    assert server.complete(p1, OUT, session="chat-2")["token_ids"] == out1
    with daemon.client() as c:
        wait_for(lambda: c.stat("chat-2").durable)
    daemon.kill()
    daemon.start()
    r2 = server.complete(p2, OUT, session="chat-2")
    assert served(r2) == expected_served(p1, out1, p2) > 0
    assert r2["token_ids"] == out2


def test_a_session_tierd_cannot_serve_is_recomputed(world, reference):
    daemon, server = world
    p1, out1, p2, out2 = reference[3]
    assert server.complete(p1, OUT, session="chat-3")["token_ids"] == out1
    with daemon.client() as c:
        wait_for(lambda: c.stat("chat-3").tier_bytes.keys() == {"disk"})
    # damage the session's first page on disk: Lookup still matches it (metadata), the load fails its checksum
    db = sqlite3.connect(f"file:{daemon.data_dir}/index.db?mode=ro", uri=True)
    (offset,) = db.execute("SELECT offset FROM pieces WHERE session_id='chat-3' ORDER BY first_page").fetchone()
    db.close()
    slab, at = divmod(offset, 64 << 20)
    with open(f"{daemon.data_dir}/slabs/slab-{slab:06d}.bin", "r+b") as f:
        f.seek(at + 100)
        f.write(b"\xff" * 64)
    r2 = server.complete(p2, OUT, session="chat-3")
    assert r2["token_ids"] == out2
    # the connector logs from its loader thread, which may finish after the response
    wait_for(lambda: "loading session 'chat-3' failed" in server.log())
    assert "chat-3 is damaged" in daemon.log()
    with daemon.client() as c:
        # the turn was stored whole again, from recomputed KV: the session is whole and serves again
        wait_for(lambda: c.stat("chat-3").num_tokens == len(p2) + OUT - 1)
        assert c.stat("chat-3").state != "damaged"
    # with no daemon at all, a request with a session is computed as if the connector were absent
    daemon.kill()
    r2 = server.complete(p2, OUT, session="chat-3")
    assert served(r2) == 0 and r2["token_ids"] == out2
    daemon.start()


def test_requests_without_a_session_pass_through(world, reference):
    daemon, server = world
    p1, out1, _, _ = reference[1]
    with daemon.client() as c:
        before = {s.session_id for s in c.list()}
        r = server.complete(p1, OUT)
        assert r["token_ids"] == out1 and served(r) == 0
        time.sleep(0.5)
        assert {s.session_id for s in c.list()} == before


def test_the_router_example_resumes_each_turn(world):
    daemon, server = world
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_session.py"), "--vllm", server.url,
                          "--session", "example"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TIERD_SOCKET": daemon.socket})
    assert out.returncode == 0, out.stderr
    served = [int(n) for n in re.findall(r"turn \d: (\d+) of \d+ prompt tokens from tierd", out.stdout)]
    assert len(served) == 3 and served[0] == 0 and all(n > 0 for n in served[1:]), out.stdout


@pytest.fixture(scope="module")
def cached_world(model, reference, world, tmp_path_factory):
    """A second server, with vLLM's own prefix cache on (vLLM's default)."""
    daemon, first = world
    first.close()  # one server at a time on two cores
    server = VllmServer(model[0], tmp_path_factory.mktemp("cached") / "vllm.log", tierd_socket=daemon.socket,
                        prefix_caching=True, extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield daemon, server.wait()
    finally:
        server.close()


def reset_vllm_cache(server, timeout=30.0):
    """Empty vLLM's prefix cache. vLLM answers 200 but resets nothing while a
    request's blocks are not freed yet (a save in flight holds them): its log
    says so, and then it is asked again."""
    refused = "Failed to reset prefix cache"

    def reset() -> bool:
        before = server.log().count(refused)
        req = urllib.request.Request(server.url + "/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        return server.log().count(refused) == before

    wait_for(reset, timeout, "vLLM emptying its prefix cache")


def test_with_vllm_prefix_caching_on(cached_world, reference):
    daemon, server = cached_world
    # vLLM's cache and tierd together: outputs unchanged, at least as many tokens not computed
    p1, out1, p2, out2 = reference[1]
    assert server.complete(p1, OUT, session="cached-1")["token_ids"] == out1
    r2 = server.complete(p2, OUT, session="cached-1")
    assert r2["token_ids"] == out2 and served(r2) >= expected_served(p1, out1, p2)
    with daemon.client() as c:
        wait_for(lambda: c.stat("cached-1").num_tokens == len(p2) + OUT - 1)
    # vLLM's cache emptied between the turns: tierd supplies the whole history
    p1, out1, p2, out2 = reference[2]
    assert server.complete(p1, OUT, session="cached-2")["token_ids"] == out1
    with daemon.client() as c:
        wait_for(lambda: c.stat("cached-2").num_tokens == len(p1) + OUT - 1)
    reset_vllm_cache(server)
    r2 = server.complete(p2, OUT, session="cached-2")
    # (at least: chat-2, the same conversation, holds turn 2 too where it ran first, and its pages supply more)
    assert r2["token_ids"] == out2 and served(r2) >= expected_served(p1, out1, p2)
    wait_for(lambda: "tierd connector: loaded" in server.log())
