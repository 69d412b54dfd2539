"""Idle demotions and write-backs are voluntary: they take only the room the
lower tier has free, and never drop a session to make more; a session they
cannot move stays where it is. Only eviction drops (a tier over its high
watermark, a store that needs room), least valuable first, and never while
the tier has room. A real store and a real disk tier whose budget is small."""

from tests.helpers import SPEC, Harness, HostEngine
from tierd.core.store import make_key
from tierd.policy import PolicyConfig

MiB = 1 << 20
PAGES = 32  # 1 MiB of SPEC's pages


def _stored(store, key):
    info, reader = store.get(key)
    return info.num_tokens, b"".join(bytes(c) for c in reader)


def _save(h, store, name, seed, release=True):
    """Save a session of 1 MiB (an engine of its own), release it and let a
    tenth of a second pass; returns its key and (tokens, bytes)."""
    key, eng = make_key("default", name), HostEngine(seed=seed)
    store.save(key, eng.memory, SPEC, list(range(PAGES)), PAGES * SPEC.block_tokens)
    if release:
        store.release(key)
    h.clock.advance(0.1)
    return key, (PAGES * SPEC.block_tokens, b"".join(eng.pages(range(PAGES))))


def _ticks(h, store, seconds):
    """Policy ticks every 0.5 s for `seconds`, each one's moves done before the next."""
    for _ in range(int(seconds * 2)):
        h.clock.advance(0.5)
        store.tick()
        assert store.drain(30)


def _where(store, keys):
    return {key: set(store.stat(key).tier_bytes) for key in keys}


def _served_as_stored(store, sessions):
    for key, want in sessions.items():
        assert _stored(store, key) == want, key


def test_idle_demotion_onto_a_full_disk_budget_drops_nothing(tmp_path):
    """20 sessions of 1 MiB idle in a host tier of 48 MiB, a disk tier of 8:
    those the disk tier has room for go down, the others stay in host."""
    h = Harness(str(tmp_path), host_budget=48 * MiB, disk_budget=8 * MiB, disk_slab=2 * MiB,
                policy=PolicyConfig(host_idle=0.5, writeback_idle=None))
    store = h.open()
    try:
        sessions = dict(_save(h, store, f"b{i}", i) for i in range(20))
        _ticks(h, store, 90)  # long enough for the held sessions' retries to come up several times
        assert sorted(store.keys()) == sorted(sessions)
        disk = store.tiers["disk"]
        where = _where(store, sessions)
        on_disk = [k for k, tiers in where.items() if tiers == {"disk"}]
        # the disk tier is filled, and its being full drops nothing: no session needs its room
        assert len(on_disk) == 8 and disk.used == disk.budget
        assert all(tiers == {"host"} for k, tiers in where.items() if k not in on_disk)
        _served_as_stored(store, sessions)
        assert store.check_accounting() == []
    finally:
        h.close()


def test_write_backs_onto_a_full_disk_budget_drop_nothing(tmp_path):
    """A write-back's disk copy takes free room only: it does not drop other
    sessions (their copy on disk, or on disk and in host) to make more."""
    h = Harness(str(tmp_path), host_budget=48 * MiB, disk_budget=8 * MiB, disk_slab=2 * MiB,
                policy=PolicyConfig(host_idle=600, writeback_idle=0.5))
    store = h.open()
    try:
        sessions = dict(_save(h, store, f"w{i}", 100 + i) for i in range(20))
        _ticks(h, store, 90)
        assert sorted(store.keys()) == sorted(sessions)
        assert all(tiers >= {"host"} for tiers in _where(store, sessions).values())
        assert sum(store.stat(k).durable for k in sessions) == 8 and store.tiers["disk"].used == 8 * MiB
        _served_as_stored(store, sessions)
        assert store.check_accounting() == []
    finally:
        h.close()


def test_pressure_on_host_still_evicts_the_least_valuable_first(tmp_path):
    """The host tier over its high watermark demotes its least valuable
    sessions to a disk tier with no room left: the least valuable there are
    dropped for them, and only they."""
    h = Harness(str(tmp_path), host_budget=8 * MiB, host_slab=8 * MiB, disk_budget=4 * MiB, disk_slab=2 * MiB,
                policy=PolicyConfig(host_idle=600, writeback_idle=None))
    store = h.open()
    try:
        sessions = {}
        for i in range(14):  # each one a second older than the next: least valuable first
            key, want = _save(h, store, f"p{i:02}", 200 + i)
            sessions[key] = want
            h.clock.advance(0.9)
            store.tick()
            assert store.drain(30)
        order = sorted(sessions)
        kept = sorted(store.keys())
        gone = [k for k in order if k not in kept]
        assert gone and gone == order[: len(gone)]  # the oldest, and only they
        assert store.tiers["host"].used <= 8 * MiB and store.tiers["disk"].used <= 4 * MiB
        _served_as_stored(store, {k: sessions[k] for k in kept})
        assert store.check_accounting() == []
    finally:
        h.close()
