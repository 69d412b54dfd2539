"""Scenario tests for the store, each step commented, on a fake clock."""


import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, read_all, wait_for
from tierd.core.store import upkeep as store_module
from tierd.core.store import make_key
from tierd.errors import FailedPrecondition, IdentityMismatch, InvalidArgument, NotFound, ResourceExhausted
from tierd.layout import KVSpec
from tierd.policy import PolicyConfig

MiB = 1 << 20
OPAQUE = KVSpec.opaque("test/blob", page_bytes=4096)
A = make_key("default", "a")
B = make_key("default", "b")


def tick(store):
    moves = store.tick()
    assert store.drain(30)
    return [(m.key.session_id, m.target, m.reason) for m in moves]


def fill_released(store, clock, eng):
    """Sessions a, b, c of 40 pages each (1.25 MiB), saved a second apart and released."""
    for i, name in enumerate("abc"):
        clock.advance(1)
        store.save(make_key("default", name), eng.memory, SPEC, list(range(i * 40, i * 40 + 40)), 640)
        store.release(make_key("default", name))


@pytest.fixture
def three_tiers(tmp_path):
    h = Harness(str(tmp_path), device_budget=16 * MiB)
    yield h
    h.close()


def test_idle_session_walks_down_the_tiers_and_comes_back(three_tiers):
    store, clock = three_tiers.open(), three_tiers.clock
    eng = HostEngine(seed=1)
    blocks = [3, 4, 5, 9]
    # save 60 tokens into the device tier, then release
    store.save(A, eng.memory, SPEC, blocks, 60, tier="device")
    store.release(A)
    assert store.stat(A).tier == "device" and store.stat(A).state == "idle"
    # idle 11 s -> a disk copy is written, the device copy stays authoritative
    clock.advance(11)
    assert tick(store) == [("a", "disk", "writeback")]
    info = store.stat(A)
    assert info.tier == "device" and info.durable and set(info.tier_bytes) == {"device", "disk"}
    # idle 31 s -> host
    clock.advance(20)
    assert tick(store) == [("a", "host", "idle")]
    assert set(store.stat(A).tier_bytes) == {"host", "disk"}
    # idle 601 s -> disk only; the disk copy was clean, so nothing is written again
    written = store.copier.moved_bytes.get("host->disk", 0)
    clock.advance(570)
    assert tick(store) == [("a", "disk", "idle")]
    assert store.stat(A).tier_bytes.keys() == {"disk"}
    assert store.copier.moved_bytes.get("host->disk", 0) == written
    # prefetch -> host, then restore byte-exact
    assert store.prefetch(A, "host") == "queued"
    assert store.wait_ready(A, "host", timeout=10) == (True, "host")
    out = HostEngine(seed=2)
    result = store.restore(A, out.memory, SPEC, [10, 11, 12, 13])
    assert result.num_tokens == 60 and result.source_tier == "host"
    assert out.pages([10, 11, 12, 13]) == eng.pages(blocks)
    assert store.stat(A).state == "active"


def test_append_saves_only_the_new_pages(store):
    eng = HostEngine(seed=3)
    # turn 1: 40 tokens = 3 pages (the last one partial)
    store.save(A, eng.memory, SPEC, [0, 1, 2], 40)
    first_pieces = list(store.pieces(A, "host"))
    ops = store.copier.copy_ops
    # turn 2: the engine rewrites the partial block and adds one: tokens 32..60
    store.save(A, eng.memory, SPEC, [2, 7], 60, start_token=32)
    assert store.copier.copy_ops - ops == 2 * len(eng.layout.segments)  # blocks 2 and 7: two runs
    assert store.pieces(A, "host")[0].offset == first_pieces[0].offset  # pages 0-1 untouched
    info = store.stat(A)
    assert (info.num_tokens, info.num_pages) == (60, 4)
    out = HostEngine(seed=4)
    store.restore(A, out.memory, SPEC, [20, 21, 22, 23])
    assert out.pages([20, 21, 22, 23]) == eng.pages([0, 1, 2, 7])


def test_rewrite_from_token_zero_replaces_even_the_identity(store):
    eng = HostEngine(seed=5)
    store.save(A, eng.memory, SPEC, [0, 1, 2], 48)
    other = KVSpec("test/other", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    eng2 = HostEngine(other, seed=6)
    store.save(A, eng2.memory, other, [4], 10)
    info = store.stat(A)
    assert info.model_id == "test/other" and info.num_pages == 1
    assert store.tiers["host"].used == store.stat(A).tier_bytes["host"]  # old pages freed


def test_appending_needs_the_same_identity_and_no_gap(store):
    eng = HostEngine(seed=7)
    store.save(A, eng.memory, SPEC, [0, 1], 32)
    other = KVSpec("test/llama-tiny", "r2", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                   block_tokens=16)
    with pytest.raises(IdentityMismatch, match="revision"):
        store.save(A, HostEngine(other).memory, other, [2], 48, start_token=32)
    with pytest.raises(FailedPrecondition, match="past the 32 tokens"):
        store.save(A, eng.memory, SPEC, [3], 64, start_token=48)
    with pytest.raises(NotFound):
        store.save(B, eng.memory, SPEC, [3], 64, start_token=48)
    with pytest.raises(IdentityMismatch):
        store.restore(A, HostEngine(other).memory, other, [0, 1])
    assert store.stat(A).num_tokens == 32


def test_full_host_evicts_the_least_recently_used_to_disk(tmp_path):
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB)
    store, clock = h.open(), h.clock
    eng = HostEngine(num_blocks=200, seed=8)
    per = SPEC.page_bytes * 40  # 40 pages each: 1.25 MiB, three fit in 4 MiB
    for i, name in enumerate("abc"):
        clock.advance(1)
        store.save(make_key("default", name), eng.memory, SPEC, list(range(i * 40, i * 40 + 40)), 640)
    assert store.tiers["host"].used == 3 * per
    store.pin(make_key("default", "a"))
    # d needs room: a is older but pinned, so b (next least recent) goes to disk
    clock.advance(1)
    store.save(make_key("default", "d"), eng.memory, SPEC, list(range(120, 160)), 640)
    assert store.stat(make_key("default", "a")).tier == "host"
    assert store.stat(make_key("default", "b")).tier == "disk"
    assert store.stat(make_key("default", "c")).tier == "host"
    assert store.tiers["host"].used == 3 * per
    out = HostEngine(num_blocks=200, seed=9)
    store.restore(make_key("default", "b"), out.memory, SPEC, list(range(40)))
    assert out.pages(range(40)) == eng.pages(range(40, 80))
    h.close()


def test_room_is_made_now_from_sessions_whose_write_back_is_still_queued(tmp_path):
    # Many sessions released at once queue their write-backs faster than they run;
    # a save that needs their room must not wait for the queue, nor be refused.
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB, movers=0,
                policy=PolicyConfig(writeback_idle=1, host_idle=60))
    store, clock = h.open(), h.clock
    eng = HostEngine(num_blocks=200, seed=11)
    fill_released(store, clock, eng)
    clock.advance(2)
    assert {m.reason for m in store.tick()} == {"writeback"}
    assert {k.session_id for k in store.moves.busy_keys()} == {"a", "b", "c"}  # queued, none running
    clock.advance(1)
    store.save(make_key("default", "d"), eng.memory, SPEC, list(range(120, 160)), 640)
    assert [store.stat(make_key("default", n)).tier for n in "abcd"] == ["disk", "host", "host", "host"]
    out = HostEngine(num_blocks=200, seed=12)
    store.restore(make_key("default", "a"), out.memory, SPEC, list(range(40)))
    assert out.pages(range(40)) == eng.pages(range(40))
    h.close()


def test_without_a_disk_tier_the_least_recent_session_is_dropped(tmp_path):
    h = Harness(str(tmp_path), host_budget=2 * MiB, host_slab=2 * MiB, disk=False)
    store = h.open()
    eng = HostEngine(num_blocks=100, seed=10)
    store.save(A, eng.memory, SPEC, list(range(40)), 640)
    h.clock.advance(1)
    store.save(B, eng.memory, SPEC, list(range(40, 80)), 640)
    with pytest.raises(NotFound):
        store.stat(A)
    assert store.stat(B).tier == "host"
    h.close()


def test_shrinking_the_device_budget_demotes_at_once(three_tiers):
    store, clock = three_tiers.open(), three_tiers.clock
    eng = HostEngine(num_blocks=64, seed=11)
    store.save(A, eng.memory, SPEC, list(range(20)), 320, tier="device")
    clock.advance(1)
    store.save(B, eng.memory, SPEC, list(range(20, 40)), 320, tier="device")
    used = store.tiers["device"].used
    # shrink to one session's worth: a (least recent) moves to host now
    result = store.set_budget("device", used // 2)
    assert result.released_bytes == used // 2 and result.moved_sessions == 1
    assert store.stat(A).tier == "host" and store.stat(B).tier == "device"
    # pinned sessions cannot be squeezed out: refused, nothing changes
    store.pin(B)
    with pytest.raises(FailedPrecondition, match="unpin"):
        store.set_budget("device", 0)
    assert store.tiers["device"].budget == used // 2 and store.stat(B).tier == "device"


def test_two_prefetches_make_one_move(store):
    eng = HostEngine(seed=12)
    store.save(A, eng.memory, SPEC, list(range(6)), 96)
    store.demote(A)
    before = store.copier.moved_bytes.get("disk->host", 0)
    assert store.prefetch(A) == "queued"
    store.prefetch(A, priority=5)
    assert store.drain(10)
    assert store.copier.moved_bytes["disk->host"] - before == 6 * SPEC.page_bytes
    assert store.prefetch(A) == "ready"


def test_drop_mid_prefetch_leaves_nothing(store):
    eng = HostEngine(seed=12)
    store.save(A, eng.memory, SPEC, list(range(6)), 96)
    store.demote(A)
    store.prefetch(A)
    store.drop(A)
    assert store.drain(10)
    with pytest.raises(NotFound):
        store.stat(A)
    assert store.tiers["host"].used == 0 and store.tiers["disk"].used == 0
    assert store.index.count() == (0, 0)


def test_restore_mid_prefetch_waits_for_that_move(store):
    eng = HostEngine(seed=13)
    store.save(A, eng.memory, SPEC, list(range(8)), 128)
    store.demote(A)
    moved = store.copier.moved_bytes.get("disk->host", 0)
    store.prefetch(A)
    # Until a mover starts it, the prefetch is only queued and a restore reads from disk
    # itself (through a staging window, counted disk->host too): wait until it runs.
    wait_for(lambda: A not in store.moves.busy_keys() or A in store.moves.busy_keys(queued=False), 10,
             "the prefetch to run")
    out = HostEngine(seed=14)
    store.restore(A, out.memory, SPEC, list(range(8)))
    assert out.pages(range(8)) == eng.pages(range(8))
    store.drain(10)
    # one promotion's worth of bytes came off disk, not two
    assert store.copier.moved_bytes.get("disk->host", 0) - moved <= 8 * SPEC.page_bytes


def test_wait_ready_times_out_with_where_the_session_is(store):
    eng = HostEngine(seed=15)
    store.save(A, eng.memory, SPEC, [0], 16)
    store.demote(A)
    assert store.wait_ready(A, "host", timeout=0.05) == (False, "disk")
    with pytest.raises(InvalidArgument):
        store.wait_ready(A, "nowhere", 1)


def test_pins_never_go_negative(store):
    store.save(A, HostEngine().memory, SPEC, [0], 16)
    store.pin(A)
    store.unpin(A)
    with pytest.raises(FailedPrecondition, match="not pinned"):
        store.unpin(A)
    assert store.stat(A).pins == 0


def test_put_get_roundtrip_and_failed_put_leaves_nothing(store):
    spec = KVSpec.opaque("llama.cpp/test", page_bytes=64 * 1024)
    data = np.random.default_rng(16).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    store.put(A, spec, 123, len(data), [data[i : i + 50_000] for i in range(0, len(data), 50_000)])
    info, chunks = store.get(A, 70_000)
    assert read_all(chunks) == data and info.num_tokens == 123
    used = store.tiers["host"].used
    with pytest.raises(InvalidArgument, match="carried 1000 bytes"):
        store.put(B, spec, 1, 5000, [b"x" * 1000])
    with pytest.raises(NotFound):
        store.stat(B)
    assert store.tiers["host"].used == used


def test_list_pages_through_every_session(store):
    eng = HostEngine()
    names = [f"s{i:02d}" for i in range(7)]
    for n in names:
        store.save(make_key("default", n), eng.memory, SPEC, [0], 16)
    store.save(make_key("other", "x"), eng.memory, SPEC, [0], 16)
    seen, token = [], ""
    while True:
        page, token = store.list("default", after=token, limit=3)
        seen += [i.session_id for i in page]
        if not token:
            break
    assert seen == names


def test_advise_uses_the_measured_route(store):
    eng = HostEngine()
    store.save(A, eng.memory, SPEC, list(range(4)), 64)
    store.restore(A, HostEngine(seed=1).memory, SPEC, list(range(4)))
    advice = store.advise(A, prefill_tokens_per_s=1.0)
    assert advice.source_tier == "host" and advice.restore
    assert advice.bandwidth_bytes_per_s == store.copier.bandwidth["host->engine"]


def test_graceful_close_flushes_and_restart_recovers(harness):
    store = harness.open()
    eng = HostEngine(seed=17)
    store.save(A, eng.memory, SPEC, [5, 6, 7], 40)
    assert not store.stat(A).durable
    store = harness.reopen(flush=True)
    info = store.stat(A)
    assert info.durable and info.tier == "disk" and info.num_tokens == 40
    out = HostEngine(seed=18)
    store.restore(A, out.memory, SPEC, [0, 1, 2])
    assert out.pages([0, 1, 2]) == eng.pages([5, 6, 7])


def test_crash_keeps_the_last_durable_prefix(harness):
    store = harness.open()
    eng = HostEngine(seed=19)
    store.save(A, eng.memory, SPEC, [0, 1], 32)
    store.write_back(A)
    store.save(A, eng.memory, SPEC, [2, 3], 64, start_token=32)  # not on disk yet
    store = harness.reopen(flush=False)  # a crash: nothing flushed
    info = store.stat(A)
    assert (info.num_tokens, info.durable) == (32, True)
    out = HostEngine(seed=20)
    store.restore(A, out.memory, SPEC, [8, 9])
    assert out.pages([8, 9]) == eng.pages([0, 1])


def test_too_big_for_every_tier_is_resource_exhausted(tmp_path):
    h = Harness(str(tmp_path), host_budget=1 * MiB, host_slab=1 * MiB)
    store = h.open()
    with pytest.raises(ResourceExhausted, match="host tier"):
        store.save(A, HostEngine(num_blocks=40).memory, SPEC, list(range(40)), 640)
    assert store.keys() == []
    h.close()


def test_ttl_drops_idle_sessions(tmp_path):
    h = Harness(str(tmp_path), policy=PolicyConfig(disk_ttl=100))
    store = h.open()
    store.save(A, HostEngine().memory, SPEC, [0], 16)
    store.release(A)
    h.clock.advance(101)
    assert tick(store) == [("a", "drop", "ttl")]
    assert store.keys() == []
    h.close()


class Recorder:
    """StoreEvents that remembers prefetch outcomes."""

    def __init__(self):
        self.outcomes = []

    def __getattr__(self, name):
        return lambda *args: None

    def prefetch_outcome(self, outcome):
        self.outcomes.append(outcome)


def test_prefetch_outcomes_ready_in_time_late_and_missed(harness):
    harness.events = recorder = Recorder()
    store = harness.open()
    eng = HostEngine(seed=21)
    store.save(A, eng.memory, SPEC, [0, 1], 32)
    assert store.prefetch(A) == "ready"
    store.demote(A)
    # a deadline already past when the move would start: missed, nothing moves
    store.prefetch(A, deadline=harness.clock.now() - 1)
    store.drain(10)
    assert store.stat(A).tier == "disk"
    # one in time
    store.prefetch(A, deadline=harness.clock.now() + 60)
    store.drain(10)
    assert store.stat(A).tier == "host"
    assert recorder.outcomes == ["ready", "missed", "in_time"]


def test_put_appends_pages_from_start_token(store):
    rng = np.random.default_rng(22)
    first = rng.integers(0, 256, 2 * SPEC.page_bytes, dtype=np.uint8).tobytes()
    store.put(A, SPEC, 20, len(first), [first])
    # tokens 16..40: the partial page 1 again, and page 2
    more = rng.integers(0, 256, 2 * SPEC.page_bytes, dtype=np.uint8).tobytes()
    info = store.put(A, SPEC, 40, len(more), [more], start_token=16)
    assert (info.num_tokens, info.num_pages, info.size_bytes) == (40, 3, 3 * SPEC.page_bytes)
    assert b"".join(store.get(A)[1]) == first[: SPEC.page_bytes] + more
    with pytest.raises(InvalidArgument, match="take"):
        store.put(A, SPEC, 48, SPEC.page_bytes, [b"x" * SPEC.page_bytes], start_token=16)  # needs two pages
    with pytest.raises(FailedPrecondition, match="past the 40 tokens"):
        store.put(A, SPEC, 80, 2 * SPEC.page_bytes, [b"x" * 2 * SPEC.page_bytes], start_token=48)
    with pytest.raises(InvalidArgument, match="replaced whole"):
        store.put(B, KVSpec.opaque("m"), 1, 10, [b"x" * 10], start_token=16)
    assert b"".join(store.get(A)[1]) == first[: SPEC.page_bytes] + more


def test_a_prefetched_session_waits_in_host_while_others_make_room(tmp_path):
    h = Harness(str(tmp_path), host_budget=4 * MiB, host_slab=4 * MiB)
    store, clock = h.open(), h.clock
    eng = HostEngine(num_blocks=200, seed=23)
    fill_released(store, clock, eng)
    # a is the least recently used, but the engine just asked for it: it is "ready" in host and awaited
    assert store.prefetch(make_key("default", "a")) == "ready"
    clock.advance(1)
    store.save(make_key("default", "d"), eng.memory, SPEC, list(range(120, 160)), 640)  # needs room
    assert store.stat(make_key("default", "a")).tier == "host"
    assert store.stat(make_key("default", "b")).tier == "disk"
    # once restored, a is an ordinary session again
    store.restore(make_key("default", "a"), HostEngine(num_blocks=200).memory, SPEC, list(range(40)))
    assert not store.policy_view(make_key("default", "a")).awaited
    h.close()


def test_a_tick_looks_only_at_sessions_whose_move_may_be_due(store, harness, monkeypatch):
    """Regression: every tick built a view of every released session under the
    store lock; at 20,000 sessions that held the lock (and the GIL) ~100 ms
    every 0.5 s, and Stat's p99 went from 0.5 to 16 ms."""
    looked = []
    real = store_module.idle_moves
    monkeypatch.setattr(store_module, "idle_moves", lambda views, *a: looked.append(len(views)) or real(views, *a))
    keys = [make_key("default", f"s{i}") for i in range(200)]
    for k in keys:
        store.put(k, OPAQUE, 1, 4096, [b"x" * 4096])
        store.release(k)
    # idle 11 s: each gets its disk copy; the next tick looks at each once more, to see what is due next
    harness.clock.advance(11)
    assert {m.reason for m in store.tick()} == {"writeback"} and store.drain(30)
    store.tick()
    assert all(store.stat(k).durable and store.stat(k).tier == "host" for k in keys)
    # nothing is due before the host idle time (600 s): ticks look at no session
    looked.clear()
    for _ in range(5):
        harness.clock.advance(100)
        assert store.tick() == []
    assert sum(looked) == 0
    # idle 611 s: each is due to leave host, and is moved; a pinned one only once unpinned
    store.pin(keys[0])
    harness.clock.advance(100)
    assert sorted((m.key, m.reason) for m in store.tick()) == [(k, "idle") for k in sorted(keys[1:])]
    assert store.drain(30) and all(store.stat(k).tier == "disk" for k in keys[1:])
    store.unpin(keys[0])
    assert [(m.key, m.reason) for m in store.tick()] == [(keys[0], "idle")]
    assert store.drain(30) and store.stat(keys[0]).tier == "disk"


def test_a_tick_looks_at_no_session_of_the_lowest_tier_between_its_high_watermark_and_its_budget(tmp_path,
                                                                                                monkeypatch):
    """Regression: the tick built a view of every session of a tier past the
    high watermark, though out of the lowest tier only what passes its budget
    goes; with 100,000 sessions on a disk tier 98% full, that held the store
    lock ~0.5 s every tick, and Stat's p99 was 31 ms."""
    h = Harness(str(tmp_path), disk_budget=8 * MiB, disk_slab=8 * MiB)
    store = h.open()
    try:
        looked = []
        real = store_module.pressure_moves
        monkeypatch.setattr(store_module, "pressure_moves", lambda views, *a: looked.append(len(views)) or
                            real(views, *a))
        keys = [make_key("default", f"s{i}") for i in range(31)]  # 31 of 256 KiB: 97% of the disk budget
        for k in keys:
            store.put(k, SPEC, 128, 8 * SPEC.page_bytes, [bytes(8 * SPEC.page_bytes)])
            store.demote(k, "disk")
        disk = store.tiers["disk"]
        assert store.policy.high_watermark * disk.budget < disk.used <= disk.budget
        assert store.tick() == [] and looked == []  # nothing to say, and nothing looked at
        assert all(store.stat(k).tier == "disk" for k in keys)
    finally:
        h.close()
