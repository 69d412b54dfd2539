"""Prefix sharing against a real daemon process: 50 sessions with one prompt
store it once, every one reads back byte-exact, drops leave the others
whole, a damaged shared page fails every holder and heals on the next save,
a kill -9 in the middle of sharing saves leaves exact holder counts (all
dropped: nothing left), another tenant never finds the prompt, an
engine's Restore starts a new conversation from the shared pages, and no
read replaces a session holding other tokens with them."""

import json
import random
import signal
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from tests.api.test_cli import tierd
from tests.helpers import metric, wait_for
from tierd.client import DataLoss, FailedPrecondition, InvalidArgument, KVSpec, NotFound, SharedKVCache
from tierd.sizes import format_size
from tierd.testing import ROOT, Daemon, tokens_file, wire_accounting
from tierd.transfer.runs import page_stride

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
PAGE = SPEC.page_bytes
PREFIX_PAGES = 8
PREFIX = list(range(7000, 7000 + PREFIX_PAGES * SPEC.block_tokens))
PREFIX_BYTES = np.random.default_rng(0).integers(0, 256, PREFIX_PAGES * PAGE, dtype=np.uint8).tobytes()


def session(i: int) -> tuple[list[int], bytes]:
    """Session i's tokens and bytes: the shared prompt, then a page of its own."""
    own = np.random.default_rng(1000 + i).integers(0, 256, PAGE, dtype=np.uint8).tobytes()
    return PREFIX + [i + 1] * SPEC.block_tokens, PREFIX_BYTES + own


def put(c, i: int, sid: str | None = None) -> None:
    toks, data = session(i)
    c.put(sid or f"s{i}", data, SPEC, len(toks), token_ids=toks)


def used(c) -> dict[str, int]:
    return {t.name: t.used for t in c.stats()["tiers"]}


def test_fifty_sessions_store_their_prompt_once(daemon):
    stride = page_stride(PAGE)
    with daemon.client() as c:
        for i in range(50):
            put(c, i)
        # one allocation of 9 pages, then one page each (4 KiB granules: the stride is a multiple)
        assert used(c)["host"] == (9 + 49) * stride
        assert {t.name: t.saved for t in c.stats()["tiers"]}["host"] == 49 * 9 * stride
        for i in range(50):
            assert c.get(f"s{i}") == session(i)[1]
            info = c.stat(f"s{i}")
            assert (info.shared_bytes, info.own_bytes) == (PREFIX_PAGES * PAGE, PAGE)
        assert metric(daemon, "tierd_prefix_hits_total", 'call="save"') == 49
        assert metric(daemon, "tierd_prefix_pages_total", 'call="save"') == 49 * PREFIX_PAGES
        assert wire_accounting(c) == []
        # a new conversation with the same prompt is told about the shared pages
        found = c.lookup("new", PREFIX + [999] * 40, SPEC)
        assert (found.num_tokens, found.num_pages) == (len(PREFIX), PREFIX_PAGES)
        # drops leave the others whole; the last one alone still holds the first allocation
        for i in range(49):
            c.drop(f"s{i}")
        assert c.get("s49") == session(49)[1]
        assert used(c)["host"] == (9 + 1) * stride and wire_accounting(c) == []
        c.drop("s49")
        assert used(c)["host"] == 0


def test_another_tenant_never_finds_the_prompt(tmp_path):
    tokens = tokens_file(tmp_path, {"alice": "tok-a", "bob": "tok-b"})
    d = Daemon(tmp_path, "--auth-tokens", tokens).start()
    try:
        with d.client(token="tok-a") as a, d.client(token="tok-b") as b:
            for i in range(3):
                put(a, i)
            before = used(a)["host"]
            with pytest.raises(NotFound):
                b.lookup("s0", PREFIX, SPEC)
            put(b, 0)
            assert b.stat("s0").shared_bytes == 0
            assert b.get("s0") == session(0)[1]
            assert used(b)["host"] == 9 * page_stride(PAGE)  # all its own
            assert used(a)["host"] == before
    finally:
        d.close()


def test_a_damaged_shared_page_fails_every_holder_and_heals_on_the_next_save(daemon):
    with daemon.client() as c:
        for i in range(4):
            put(c, i)
            c.release(f"s{i}")
        for i in range(4):
            wait_for(lambda i=i: set(c.stat(f"s{i}").tier_bytes) == {"disk"}, 30, f"s{i} on disk alone")
    db = sqlite3.connect(f"file:{daemon.data_dir}/index.db?mode=ro", uri=True)
    offsets = {row[0] for row in db.execute("SELECT offset FROM pieces WHERE first_page = 0")}
    db.close()
    assert len(offsets) == 1  # four sessions, one allocation of the shared pages
    slab, at = divmod(offsets.pop() + 2 * page_stride(PAGE) + 10, 64 << 20)
    with open(f"{daemon.data_dir}/slabs/slab-{slab:06d}.bin", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x55]))
    with daemon.client() as c:
        with pytest.raises(DataLoss):
            c.get("s1")
        for i in range(4):
            with pytest.raises(DataLoss):
                c.get(f"s{i}")
        put(c, 2)  # stored again from token 0: a good copy of its own
        assert c.get("s2") == session(2)[1] and c.stat("s2").shared_bytes == 0
        put(c, 3)  # and the next one shares it
        assert c.get("s3") == session(3)[1] and c.stat("s3").shared_bytes == PREFIX_PAGES * PAGE


SAVER = """
import sys
import numpy as np
from tests.api.test_sharing_e2e import put
from tierd.client import Client
c = Client(sys.argv[1])
for i in range(10_000):
    put(c, i % 200, f"k{i}")
    c.release(f"k{i}")
    print(i, flush=True)
"""


def test_kill_9_in_the_middle_of_sharing_saves_leaves_exact_counts(tmp_path):
    rnd = random.Random(7)
    d = Daemon(tmp_path, "--writeback-idle", "0.05", "--host-idle", "0.2", "--tick-seconds", "0.05").start()
    try:
        for cycle in range(3):
            saver = subprocess.Popen([sys.executable, "-c", SAVER, d.socket], cwd=ROOT, stdout=subprocess.PIPE,
                                     text=True)
            wait_for(lambda: int(saver.stdout.readline() or -1) >= 20, 60, "20 saves")
            with d.client() as c:
                wait_for(lambda c=c: c.stat("k10").durable, 30, "the first saves written back")
            more = rnd.randint(0, 15)  # a moment of the saver's own progress, not of the clock
            wait_for(lambda: (n := int(saver.stdout.readline() or -1)) < 0 or n >= 20 + more, 60, f"{more} more saves")
            d.kill()  # SIGKILL: in the middle of saves, write-backs and demotions sharing pages
            saver.send_signal(signal.SIGKILL)
            saver.communicate()
            d.start()
            with d.client() as c:
                listed = [s.session_id for s in c.list()]
                assert listed, d.log()[-3000:]  # (what recovery said, if it kept nothing)
                for sid in listed:  # whatever survived reads back whole
                    assert c.get(sid) == session(int(sid[1:]) % 200)[1]
                assert wire_accounting(c) == []
        with d.client() as c:
            for sid in [s.session_id for s in c.list()]:
                c.drop(sid)
            assert used(c) == {t: 0 for t in used(c)}  # no holder counted twice, none forgotten
    finally:
        d.close()


def test_the_operator_sees_the_saving_and_bad_salts_change_nothing(daemon):
    with daemon.client() as c:
        for i in range(3):
            put(c, i)
        saved = {t.name: t.saved for t in c.stats()["tiers"]}["host"]
        assert saved == 2 * 9 * page_stride(PAGE)
        with pytest.raises(InvalidArgument, match="cache salt"):
            c.lookup("s9", PREFIX, SPEC, cache_salt="x" * 257)
        toks, data = session(9)
        with pytest.raises(InvalidArgument, match="cache salt"):
            c.put("s9", data, SPEC, len(toks), token_ids=toks, cache_salt="x" * 257)
        with pytest.raises(NotFound):
            c.stat("s9")
        assert {t.name: t.saved for t in c.stats()["tiers"]}["host"] == saved
    top = tierd("top", "--once", "--address", daemon.socket)
    host = next(line for line in top.stdout.splitlines() if line.startswith("host "))
    assert "SHARED" in top.stdout and format_size(saved) in host
    stat = json.loads(tierd("stat", "s1", "--json", "--address", daemon.socket).stdout)
    assert stat["shared_bytes"] == PREFIX_PAGES * PAGE


def test_engines_save_once_and_restore_a_new_conversation_from_the_shared_pages(daemon):
    with daemon.client() as c, SharedKVCache(SPEC, 32) as kv:
        for r in kv.regions:
            r[:] = np.random.default_rng(3).integers(0, 256, r.size, dtype=np.uint8)
        engine = c.register_engine(SPEC, kv)
        blocks = list(range(9))
        saved = [kv.block(seg, b).tobytes() for b in blocks for seg in range(len(kv.layout.segments))]
        toks = PREFIX + [1] * SPEC.block_tokens
        engine.save("e0", blocks, len(toks), token_ids=toks)
        before = used(c)["host"]
        info = engine.save("e1", list(range(8)) + [20], len(toks), token_ids=PREFIX + [2] * SPEC.block_tokens)
        assert info.shared_bytes == PREFIX_PAGES * PAGE and used(c)["host"] == before + page_stride(PAGE)
        for r in kv.regions:
            r[:] = 0
        # a conversation tierd never saw, restored through engine memory from the prompt's pages
        r = engine.restore("new", list(range(10, 18)), token_ids=PREFIX + [9] * 5)
        assert (r.num_pages, r.num_tokens) == (PREFIX_PAGES, len(PREFIX))
        got = [kv.block(seg, b).tobytes() for b in range(10, 18) for seg in range(len(kv.layout.segments))]
        assert got == saved[: len(got)]
        assert c.stat("new").shared_bytes == PREFIX_PAGES * PAGE
        with pytest.raises(FailedPrecondition):  # its pages hold other tokens than this prompt's
            engine.restore("e0", list(range(10, 19)), token_ids=PREFIX + [3] * SPEC.block_tokens)
        engine.close()


def test_a_read_never_replaces_a_session_with_the_shared_pages_of_another_prompt(daemon):
    """Restore and BeginRestore with another prompt's token ids, of a session
    that exists and holds other tokens (from page 0, or past a few of the
    prompt's pages), on the host or on disk: FAILED_PRECONDITION, and its
    bytes, tiers and Stat stay as they were, though another session holds
    the whole prompt. A session whose pages are a prefix of the prompt is
    extended from the shared pages."""
    with daemon.client() as c, SharedKVCache(SPEC, 64) as kv:
        for r in kv.regions:
            r[:] = np.random.default_rng(5).integers(0, 256, r.size, dtype=np.uint8)
        engine = c.register_engine(SPEC, kv)
        prompt = PREFIX + [1] * SPEC.block_tokens  # 9 pages, all held by "donor"
        engine.save("donor", range(9), len(prompt), token_ids=prompt)
        other = list(range(90_000, 90_000 + 9 * SPEC.block_tokens))
        half = PREFIX[: 4 * SPEC.block_tokens] + list(range(80_000, 80_000 + 2 * SPEC.block_tokens))
        engine.save("host", range(10, 19), len(other), token_ids=other)  # sessions not released stay in place
        engine.save("disk", range(20, 29), len(other), token_ids=[t + 1 for t in other])
        engine.save("half", range(30, 36), len(half), token_ids=half)  # the prompt's first 4 pages, then others
        c.release("disk")
        wait_for(lambda: set(c.stat("disk").tier_bytes) == {"disk"}, 30, "disk on disk alone")
        victims = {}
        for sid in ("host", "disk", "half"):
            data = c.get(sid)  # (a read: its last access)
            victims[sid] = c.stat(sid), data
        assert set(victims["disk"][0].tier_bytes) == {"disk"} and set(victims["host"][0].tier_bytes) == {"host"}
        for sid, (info, data) in victims.items():
            for num_pages in (9, 0, 6):
                with pytest.raises(FailedPrecondition, match="other tokens"):
                    c.begin_restore(sid, SPEC, num_pages, token_ids=prompt)
            with pytest.raises(FailedPrecondition, match="other tokens"):
                engine.restore(sid, range(40, 49), token_ids=prompt)
            assert c.stat(sid) == info, sid
            assert c.get(sid) == data, sid
            # what Lookup answers is what a restore grants: the session's own pages of the prompt
            assert c.lookup(sid, prompt, SPEC).num_pages == (4 if sid == "half" else 0)
        lease = c.begin_restore("half", SPEC, 4, token_ids=prompt)  # its own pages of the prompt, still
        c.end_restore(lease)
        # a session whose pages are a prefix of the prompt is extended from the shared pages
        engine.save("short", range(50, 54), 4 * SPEC.block_tokens, token_ids=prompt[: 4 * SPEC.block_tokens])
        assert c.lookup("short", prompt, SPEC).num_pages == 9
        r = engine.restore("short", range(40, 49), token_ids=prompt)
        assert r.num_pages == 9 and c.get("short") == c.get("donor")
        assert wire_accounting(c) == []
        engine.close()
