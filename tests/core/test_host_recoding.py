"""Re-coding as capacity (--codec host=fp8): a store over a small host tier,
a real disk tier and index. When the host tier is full, idle sessions of
tenants that allow lossy coding are re-coded in place, fp8, before any
session leaves it; the others lossless. A re-coded copy is served decoded,
within the bound, with the error it carries reported by Stat, Lookup and
Advise; the exact copy stays on disk, and moves, publishes and other
sessions' stores never read the lossy one. Damaged coded bytes are
DATA_LOSS."""

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, MiB, kv_like, read_all
from tierd.checksum import page_checksum
from tierd.core.store import make_key
from tierd.errors import DataLoss, InvalidArgument

BLOCKS = list(range(8))  # 8 pages of 32 KiB: a session is 256 KiB
SESSIONS = 24  # 6 MiB of sessions against a 4 MiB host tier


def ids_of(i: int) -> list[int]:
    """Session i's token ids: its own (no pages shared between sessions)."""
    return list(range(10_000 * i, 10_000 * i + 16 * len(BLOCKS)))


def values(pages: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(pages), dtype=np.float16).astype(np.float64)


def page_error(got: bytes, want: bytes) -> float:
    a, b = values([got]), values([want])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def full(tmp_path):
    """24 sessions of KV-like pages, each released after its save, over a 4 MiB host tier re-coding fp8 for alice."""
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8",
                lossy_tenants=frozenset({"alice"}))
    store = h.open()
    src = kv_like(HostEngine(seed=1), seed=1)
    keys = []
    for i in range(SESSIONS):
        key = make_key("alice" if i % 4 else "bob", f"s{i:02d}")
        store.save(key, src.memory, SPEC, BLOCKS, 16 * len(BLOCKS), token_ids=ids_of(i))
        store.release(key)
        h.clock.advance(1.0)  # each later than the one before: least recently used first
        keys.append(key)
    yield h, store, src, keys
    h.close()


def test_a_full_host_tier_recodes_idle_sessions_before_any_leaves_it_and_holds_them_all(full):
    _, store, src, keys = full
    infos = [store.stat(k) for k in keys]
    assert all("host" in i.tier_bytes for i in infos)  # nobody left the host tier: 24 sessions where 16 fit
    recoded = [i for i in infos if "host" in i.codecs]
    assert len(recoded) >= SESSIONS - 16
    for i in recoded:
        assert i.durable and i.tier_bytes["disk"] == len(BLOCKS) * SPEC.page_bytes  # the exact copy, on disk
        if i.tenant == "alice":
            assert i.codecs["host"] == "fp8" and 0 < i.tier_errors["host"] <= 0.05 and i.rel_error > 0
            assert i.tier_bytes["host"] < 0.6 * len(BLOCKS) * SPEC.page_bytes
        else:  # bob allows no lossy coding: lossless
            assert i.codecs["host"] == "lossless" and i.rel_error == 0 and "host" not in i.tier_errors
    assert {i.tenant for i in recoded} == {"alice", "bob"}
    assert store.check_accounting() == [] and store.scan() == []


def test_a_recoded_session_is_served_within_its_bound_with_the_error_stat_reports(full):
    _, store, src, keys = full
    alice = next(k for k in keys if store.stat(k).codecs.get("host") == "fp8")
    bob = next(k for k in keys if store.stat(k).codecs.get("host") == "lossless")
    out = HostEngine(seed=2)
    served = store.restore(alice, out.memory, SPEC, BLOCKS)
    errors = [page_error(out.page(b), src.page(b)) for b in BLOCKS]
    assert 0 < max(errors) <= 0.05
    assert store.stat(alice).rel_error == pytest.approx(max(errors), rel=1e-3)  # what it reports is what it served
    assert served.rel_error == pytest.approx(max(errors), rel=1e-3)  # and the restore says what it carried
    part = store.restore(alice, out.memory, SPEC, BLOCKS[:2])  # of the pages it restores, not the whole session's
    assert part.rel_error == pytest.approx(max(page_error(out.page(b), src.page(b)) for b in BLOCKS[:2]), rel=1e-3)
    lease = store.begin_restore(alice)
    assert lease.rel_error == pytest.approx(max(errors), rel=1e-3)
    store.end_restore(alice.tenant, lease.lease_id)
    assert store.restore(bob, out.memory, SPEC, BLOCKS).rel_error == 0
    assert out.pages(BLOCKS) == src.pages(BLOCKS)  # lossless: bit-exact
    _, chunks = store.get(alice, SPEC.page_bytes)  # a Get of whole pages: each chunk's checksum is its own
    got = []
    for chunk in chunks:
        got.append(bytes(chunk))
        assert chunks.digest == page_checksum(chunk)
    assert [page_error(g, src.page(b)) for g, b in zip(got, BLOCKS)] == pytest.approx(errors)


def test_lookup_and_advise_count_only_pages_within_the_bound_of_the_copy_served(full):
    _, store, _, keys = full
    alice = next(k for k in keys if store.stat(k).codecs.get("host") == "fp8")
    worst, ids, n = store.stat(alice).rel_error, ids_of(keys.index(alice)), 16 * len(BLOCKS)
    assert store.lookup(alice, ids + [1]).num_tokens == n
    assert store.lookup(alice, ids + [1], max_error=0.0).num_tokens == 0  # no page served exact
    assert store.lookup(alice, ids + [1], max_error=worst).num_tokens == n
    assert store.advise(alice, 1000.0, max_error=0.0).recompute_seconds == 0  # nothing to restore
    assert store.advise(alice, 1000.0, max_error=worst).recompute_seconds == pytest.approx(n / 1000.0)
    store.demote(alice)  # the host copy goes: the exact disk copy is served
    assert store.stat(alice).rel_error == 0 and store.lookup(alice, ids + [1], max_error=0.0).num_tokens == n


def test_the_exact_copy_stays_on_disk_and_moves_read_it_never_the_lossy_one(full):
    h, store, src, keys = full
    alice = next(k for k in keys if store.stat(k).codecs.get("host") == "fp8")
    out = HostEngine(seed=3)
    store.demote(alice)
    store.restore(alice, out.memory, SPEC, BLOCKS)
    assert out.pages(BLOCKS) == src.pages(BLOCKS)
    store = h.reopen()  # the host tier does not outlive the daemon; the disk copy does, exact
    store.restore(alice, out.memory, SPEC, BLOCKS)
    assert out.pages(BLOCKS) == src.pages(BLOCKS)


def test_an_append_to_a_recoded_session_stores_its_new_pages_exact_beside_the_coded_ones(full):
    _, store, src, keys = full
    alice = next(k for k in keys if store.stat(k).codecs.get("host") == "fp8")
    store.save(alice, src.memory, SPEC, [20, 21], 16 * 10, start_token=16 * 8)
    assert store.stat(alice).codecs["host"] == "fp8+none"
    out = HostEngine(seed=4)
    store.restore(alice, out.memory, SPEC, list(range(30, 40)))
    assert out.pages([38, 39]) == src.pages([20, 21])  # the new pages as they were stored
    assert all(0 < page_error(out.page(30 + i), src.page(i)) <= 0.05 for i in range(8))
    store.write_back(alice)
    store.demote(alice)
    store.restore(alice, out.memory, SPEC, list(range(30, 40)))
    assert out.pages(range(30, 40)) == src.pages(BLOCKS + [20, 21])  # from disk: every page exact


def test_damaged_coded_bytes_in_the_host_tier_are_data_loss_never_noise(full):
    _, store, src, keys = full
    alice, other = [k for k in keys if store.stat(k).codecs.get("host") == "fp8"][:2]
    piece = store.pieces(alice, "host")[0]
    view = store.copier.view("host", piece.offset, piece.codes.stored)
    view[int(piece.codes.sizes[0]) + 40] ^= 0x20  # inside page 1's coded bytes
    out = HostEngine(seed=5)
    with pytest.raises(DataLoss, match="page 1 failed its checksum in the host tier \\(its coded bytes\\)"):
        store.restore(alice, out.memory, SPEC, BLOCKS)
    assert store.stat(alice).state == "damaged"
    store.restore(other, out.memory, SPEC, BLOCKS)
    assert all(page_error(out.page(b), src.page(b)) <= 0.05 for b in BLOCKS)


def test_recoded_pages_are_never_lent_to_another_sessions_store(tmp_path):
    h = Harness(str(tmp_path), host_budget=2 * MiB, host_slab=2 * MiB, host_codec="fp8",
                lossy_tenants=frozenset({"*"}))
    store = h.open()
    src = kv_like(HostEngine(seed=6), seed=6)
    prompt = list(range(1000, 1000 + 16 * len(BLOCKS)))
    first = make_key("default", "first")
    store.save(first, src.memory, SPEC, BLOCKS, len(prompt), token_ids=prompt)
    store.release(first)
    for i in range(8):  # fill the host tier: the first session, least recently used, is re-coded
        h.clock.advance(1.0)
        key = make_key("default", f"fill{i}")
        store.save(key, src.memory, SPEC, BLOCKS, 16 * len(BLOCKS))
        store.release(key)
    assert store.stat(first).codecs.get("host") == "fp8"
    again = make_key("default", "again")
    store.save(again, src.memory, SPEC, BLOCKS, len(prompt), token_ids=prompt)
    assert store.stat(again).rel_error == 0 and "host" not in store.stat(again).codecs
    out = HostEngine(seed=7)
    store.restore(again, out.memory, SPEC, BLOCKS)
    assert out.pages(BLOCKS) == src.pages(BLOCKS)
    h.close()


def test_the_policy_tick_recodes_over_the_high_watermark_on_the_movers(tmp_path):
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8",
                lossy_tenants=frozenset({"*"}))
    store = h.open()
    src = kv_like(HostEngine(seed=8), seed=8)
    for i in range(16):  # exactly full: 16 sessions of 256 KiB, over the 0.95 watermark
        key = make_key("default", f"t{i:02d}")
        store.save(key, src.memory, SPEC, BLOCKS, 16 * len(BLOCKS))
        store.release(key)
        h.clock.advance(1.0)
    moves = store.tick()
    assert {mv.reason for mv in moves} - {"writeback"} == {"recode"}  # no session leaves the host tier
    store.drain(30)
    assert store.tiers["host"].used <= 0.85 * store.tiers["host"].budget
    assert all("host" in store.stat(k).tier_bytes for k in store.keys())
    assert store.check_accounting() == []


@pytest.mark.parametrize("codec, error", [("auto", "not auto"), ("zstd9", "unknown codec 'zstd9'")])
def test_a_host_codec_that_cannot_be_is_refused_at_start(tmp_path, codec, error):
    with pytest.raises(InvalidArgument, match=error):
        Harness(str(tmp_path), host_codec=codec).open()


@pytest.mark.parametrize("kw", [{"disk": False}, {"disk_budget": 0}])
def test_a_host_codec_needs_a_disk_tier_with_room_for_the_exact_copy(tmp_path, kw):
    with pytest.raises(InvalidArgument, match="needs a host tier and a disk tier with a budget"):
        Harness(str(tmp_path), host_codec="fp8", **kw).open()


def test_stores_find_room_where_re_codes_free_less_than_planned(tmp_path):
    """Idle sessions that code barely smaller (random bytes, lossless for a
    tenant that allows no lossy coding): each store still finds its room,
    the re-coded sessions leaving the tier once re-coding them freed too
    little, as sessions leave a tier that re-codes nothing."""
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, host_codec="fp8",
                lossy_tenants=frozenset({"alice"}))
    store = h.open()
    noise = HostEngine(seed=11)  # random bytes: lossless keeps them about as they are
    for i in range(12):
        key = make_key("bob", f"idle{i}")
        store.save(key, noise.memory, SPEC, BLOCKS, 16 * len(BLOCKS))
        store.release(key)
        h.clock.advance(1.0)
    for i in range(16):  # active sessions, each needing room the idle ones hold
        store.save(make_key("bob", f"busy{i}"), noise.memory, SPEC, BLOCKS, 16 * len(BLOCKS))
        h.clock.advance(1.0)
    assert sum("host" in store.stat(make_key("bob", f"busy{i}")).tier_bytes for i in range(16)) == 16
    assert store.check_accounting() == []
    h.close()


def test_the_error_a_page_is_held_to_is_measured_in_float64_and_never_reported_below_it(tmp_path):
    """1 MiB pages of bfloat16 (where float32 norms came out low): a bound
    set a hair under a page's true error keeps that page as it is."""
    from tierd import codecs
    from tierd.layout import KVSpec

    spec = KVSpec("test/big", num_layers=4, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_tokens=128)
    shape = codecs.page_shape(spec)
    rng = np.random.default_rng(12)
    pages = (rng.standard_normal((2, spec.page_bytes // 2)).astype(np.float32).view(np.uint32) >> 16) \
        .astype(np.uint16).view(np.uint8).reshape(2, -1)
    coded = codecs.code(codecs.get("fp8"), pages, shape, keep=True)

    def true_error(i):
        a = (pages[i].view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        b = (coded.decoded[i].view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return np.linalg.norm(b - a) / np.linalg.norm(a)

    for i in range(2):
        assert coded.rel_error[i] >= true_error(i) and coded.rel_error[i] == pytest.approx(true_error(i), rel=1e-6)
    from tierd.transfer.coded import encode_windows
    from tierd.transfer.runs import Geometry
    from tierd.transfer.windows import Window

    geom = Geometry(spec.page_bytes, 2, spec.page_bytes)
    bound = np.array([true_error(0) * (1 - 1e-6), 1.0])  # page 0 just past its bound: kept as it is
    (batch,) = encode_windows(iter([Window(0, 2, "host", pages.reshape(-1), True)]), geom, "fp8", shape, bound)
    assert batch.codes.rel_error[0] == 0 and batch.codes.rel_error[1] > 0


def test_one_session_holds_its_pages_fp8_in_the_host_tier_and_lossless_on_disk(tmp_path):
    h = Harness(str(tmp_path), host_budget=2 * MiB, host_slab=2 * MiB, host_codec="fp8", disk_codec="lossless",
                lossy_tenants=frozenset({"*"}))
    store = h.open()
    src = kv_like(HostEngine(seed=9), seed=9)
    keys = []
    for i in range(10):
        key = make_key("default", f"m{i}")
        store.save(key, src.memory, SPEC, BLOCKS, 16 * len(BLOCKS))
        store.release(key)
        h.clock.advance(1.0)
        keys.append(key)
    info = store.stat(keys[0])
    assert info.codecs == {"host": "fp8", "disk": "lossless"} and info.coded_bytes["disk"] < info.size_bytes
    out = HostEngine(seed=10)
    store.restore(keys[0], out.memory, SPEC, BLOCKS)  # from the host tier: fp8, decoded
    assert all(0 < page_error(out.page(b), src.page(b)) <= 0.05 for b in BLOCKS)
    store.demote(keys[0])
    store.restore(keys[0], out.memory, SPEC, BLOCKS)  # from disk: lossless, bit-exact
    assert out.pages(BLOCKS) == src.pages(BLOCKS) and store.stat(keys[0]).rel_error == 0
    assert store.check_accounting() == [] and store.scan() == []
    h.close()
