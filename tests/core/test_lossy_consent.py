"""A save's own consent to lossy codes (lossy_max_error on Save, Put and
BeginSave): a store over a small host tier re-coding fp8, with a real disk
tier and index. A save that asks is coded lossily within the error it gave
(and never past --lossy-max-error) whatever its tenant allows; a save that
says 0 is coded lossless though its tenant allows lossy; a save that says
nothing leaves it to the tenant. The consent is kept in the index, across
appends that say nothing and across a restart. A value that is no bound,
or a lossy bound for an opaque snapshot, is refused and stores nothing."""

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, MiB, kv_like
from tierd.core.store import make_key
from tierd.errors import InvalidArgument
from tierd.layout import KVSpec

BLOCKS = list(range(8))  # 8 pages of 32 KiB: a session is 256 KiB
TOKENS = 16 * len(BLOCKS)


def fill(h, store, src, n, tenant="carol", name="fill"):
    """n idle sessions of a tenant that allows nothing lossy, each later than the one before."""
    for i in range(n):
        h.clock.advance(1.0)
        key = make_key(tenant, f"{name}{i:02d}")
        store.save(key, src.memory, SPEC, BLOCKS, TOKENS)
        store.release(key)


def host_codec(store, key) -> str | None:
    return store.stat(key).codecs.get("host")


# Which saves a host tier re-coding fp8 codes lossily: (tenant, the save's lossy_max_error) -> host codec.
CASES = {
    ("bob", 0.05): "fp8",  # bob's tenant allows nothing lossy, but this save asks
    ("alice", 0.0): "lossless",  # alice's tenant allows lossy, but this save says no
    ("bob", None): "lossless",  # left to the tenant: no
    ("alice", None): "fp8",  # left to the tenant: yes
}


def test_a_save_s_own_consent_decides_over_its_tenant_s_in_either_direction(tmp_path):
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8",
                lossy_tenants=frozenset({"alice"}))
    store = h.open()
    src = kv_like(HostEngine(seed=1), seed=1)
    keys = {}
    for n, (tenant, lossy) in enumerate(CASES):  # the oldest sessions: re-coded first
        key = make_key(tenant, f"asked{n}")
        store.save(key, src.memory, SPEC, BLOCKS, TOKENS, lossy=lossy)
        store.release(key)
        h.clock.advance(1.0)
        keys[tenant, lossy] = key
    fill(h, store, src, 16)
    out = HostEngine(seed=2)
    for case, want in CASES.items():
        key = keys[case]
        assert host_codec(store, key) == want, case
        served = store.restore(key, out.memory, SPEC, BLOCKS)
        if want == "fp8":
            assert 0 < served.rel_error <= 0.05 and out.pages(BLOCKS) != src.pages(BLOCKS)
        else:
            assert served.rel_error == 0 and out.pages(BLOCKS) == src.pages(BLOCKS)
    assert store.check_accounting() == [] and store.scan() == []
    h.close()


def test_a_save_never_gets_more_error_than_lossy_max_error_allows_whatever_it_asks(tmp_path):
    # fp8 costs these pages about 2.7%: under a cap of 0.5%, every page is kept as it is (and
    # the session, which re-coding made no smaller, leaves the host tier as any other would).
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8", lossy_max_error=0.005)
    store = h.open()
    src = kv_like(HostEngine(seed=3), seed=3)
    key = make_key("bob", "greedy")
    store.save(key, src.memory, SPEC, BLOCKS, TOKENS, lossy=1.0)
    store.release(key)
    fill(h, store, src, 16)
    info = store.stat(key)
    assert info.rel_error == 0 and info.tier_errors == {}
    out = HostEngine(seed=4)
    assert store.restore(key, out.memory, SPEC, BLOCKS).rel_error == 0
    assert out.pages(BLOCKS) == src.pages(BLOCKS)
    h.close()


def test_a_save_s_consent_outlives_appends_that_say_nothing_and_a_restart_and_is_withdrawn_by_0(tmp_path):
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8")
    store = h.open()
    src = kv_like(HostEngine(seed=5), seed=5)
    asks, withdraws = make_key("bob", "asks"), make_key("bob", "withdraws")
    for key in (asks, withdraws):
        store.save(key, src.memory, SPEC, BLOCKS[:6], 16 * 6, lossy=0.05)
        store.write_back(key)
    store.drain(30)
    store = h.reopen()  # the host tier is gone; the index keeps what each save consented to
    store.save(asks, src.memory, SPEC, BLOCKS[6:], TOKENS, start_token=16 * 6)  # says nothing: as before
    store.save(withdraws, src.memory, SPEC, BLOCKS[6:], TOKENS, start_token=16 * 6, lossy=0.0)
    for key in (asks, withdraws):
        store.release(key)
        h.clock.advance(1.0)
    fill(h, store, src, 16)
    assert host_codec(store, asks).startswith("fp8") and store.stat(asks).rel_error > 0
    assert host_codec(store, withdraws) == "lossless"
    assert store.stat(withdraws).rel_error == 0
    h.close()


@pytest.mark.parametrize("bad", [-0.01, 1.5, float("nan"), float("inf"), True, "0.1"])
def test_a_lossy_max_error_that_is_no_bound_is_refused_on_every_way_in_and_stores_nothing(tmp_path, bad):
    h = Harness(str(tmp_path), host_codec="fp8")
    store = h.open()
    src = kv_like(HostEngine(seed=6), seed=6)
    key = make_key("bob", "bad")
    calls = {
        "save": lambda: store.save(key, src.memory, SPEC, BLOCKS, TOKENS, lossy=bad),
        "put": lambda: store.put(key, SPEC, TOKENS, TOKENS * SPEC.bytes_per_token,
                                 [src.page(b) for b in BLOCKS], lossy=bad),
        "begin_put": lambda: store.begin_put(key, SPEC, TOKENS, TOKENS * SPEC.bytes_per_token, lossy=bad),
        "begin_save": lambda: store.begin_save(key, SPEC, TOKENS, lossy=bad),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgument, match="lossy_max_error is a relative error in \\[0, 1\\]") as e:
            call()
        assert e.value.details["field"] == "lossy_max_error", name
    assert store.keys() == [] and store.tiers["host"].used == 0
    h.close()


def test_an_opaque_snapshot_may_not_ask_for_lossy_codes_and_may_say_0(tmp_path):
    h = Harness(str(tmp_path), host_codec="fp8")
    store = h.open()
    spec = KVSpec.opaque("llama.cpp/tiny", page_bytes=64 * 1024)
    data = np.random.default_rng(7).bytes(100_000)
    key = make_key("bob", "state")
    for call in (lambda: store.put(key, spec, 0, len(data), [data], lossy=0.05),
                 lambda: store.begin_put(key, spec, 0, len(data), lossy=0.05),
                 lambda: store.begin_save(key, spec, 0, lossy=0.05)):
        with pytest.raises(InvalidArgument, match="an opaque snapshot is never coded lossily"):
            call()
    assert store.keys() == []
    store.put(key, spec, 0, len(data), [data], lossy=0.0)
    _, reader = store.get(key)
    assert b"".join(bytes(c) for c in reader) == data
    h.close()
