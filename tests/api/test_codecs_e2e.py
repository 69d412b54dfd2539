"""A save's consent to lossy codes and the error a restore carries, through
a real daemon (--codec host=fp8 over a small host tier, no tenant allowed
lossy): the Save, Put and BeginSave that ask are re-coded fp8 when the host
tier fills, and their Restore, restore lease and Stat say what error they
carry; the sessions that did not ask come back bit-exact, saying 0."""

import numpy as np

from tests.helpers import wait_for
from tierd.client import Arena, KVSpec, SharedKVCache
from tierd.testing import Daemon

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
BLOCKS = list(range(8))  # 8 pages of 32 KiB: a session is 256 KiB
TOKENS = 16 * len(BLOCKS)


def kv_values(kv, seed):
    """KV-like float16 in every region (random bytes would hold NaNs a lossy codec keeps as they are)."""
    rng = np.random.default_rng(seed)
    for r in kv.regions:
        r.view(np.float16)[:] = rng.standard_normal(r.size // 2).astype(np.float16)


def blocks(kv, ids):
    return [kv.block(seg, b).tobytes() for b in ids for seg in range(len(kv.layout.segments))]


def error(got, want):
    a = np.frombuffer(b"".join(got), np.float16).astype(np.float64)
    b = np.frombuffer(b"".join(want), np.float16).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def carries(got, said, coded, saved):
    """What a restore served is what it said: exact, or the coded copy's error."""
    if said == 0:
        assert b"".join(got) == b"".join(saved)
    else:
        assert said == coded and 0 < error(got, saved) <= said * 1.001


def test_saves_that_ask_are_recoded_and_every_restore_says_the_error_it_carries(tmp_path):
    d = Daemon(tmp_path, "--host-budget", "4MiB", "--host-slab", "4MiB", "--codec", "host=fp8",
               "--writeback-idle", "0", "--host-idle", "600").start()
    arena = Arena()
    try:
        with d.client() as c, SharedKVCache(SPEC, 64) as kv:
            kv_values(kv, 1)
            engine = c.register_engine(SPEC, kv)
            saved = blocks(kv, BLOCKS)
            engine.save("asks", BLOCKS, TOKENS, lossy_max_error=0.05)
            c.put("put-asks", b"".join(saved), SPEC, TOKENS, lossy_max_error=0.05)
            lease = c.begin_save("lease-asks", SPEC, TOKENS, lossy_max_error=0.05)
            whole = np.frombuffer(b"".join(saved), np.uint8).reshape(len(BLOCKS), SPEC.page_bytes)
            for page, data in zip(arena.pages(lease), whole):
                page[:] = data
            c.commit_save(lease)
            engine.save("silent", BLOCKS, TOKENS)
            asked = ["asks", "put-asks", "lease-asks"]
            for sid in asked + ["silent"]:
                c.release(sid)
            for i in range(14):  # past the host tier by half a MiB: the older sessions are re-coded
                # Each written back before the next: a save that finds none of them durable yet must make its
                # room from the older sessions alone, and may evict one it has just re-coded.
                wait_for(lambda: all(s.durable for s in c.list_page(limit=100)[0]), 20, "every session durable")
                engine.save(f"fill{i}", BLOCKS, TOKENS)
                c.release(f"fill{i}")
            for sid in asked:
                wait_for(lambda: c.stat(sid).codecs.get("host") == "fp8", 20, f"{sid} re-coded fp8")
            infos = {sid: c.stat(sid) for sid in asked}
            assert "fp8" not in c.stat("silent").codecs.values() and c.stat("silent").rel_error == 0
            for sid, info in infos.items():
                assert 0 < info.rel_error <= 0.05 and info.tier_errors["host"] == info.rel_error
                # A restore says the error of what it served: the fp8 copy's, or none from the exact copy on
                # disk (the restore leases take room of the host tier, and re-coded sessions may leave it).
                result = engine.restore(sid, list(range(40, 48)))
                carries(blocks(kv, range(40, 48)), result.rel_error, info.rel_error, saved)
                held = c.begin_restore(sid)
                carries([p.tobytes() for p in arena.pages(held)], held.rel_error, info.rel_error, saved)
                c.end_restore(held)
            result = engine.restore("silent", list(range(40, 48)))
            assert result.rel_error == 0 and blocks(kv, range(40, 48)) == saved
            engine.close()
    finally:
        arena.close()
        d.close()
