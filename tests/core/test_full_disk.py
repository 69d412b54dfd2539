"""A data dir on a file system that is really full (a small tmpfs, filled with
a plain file). Each call that needs room on it either succeeds or answers
RESOURCE_EXHAUSTED or UNAVAILABLE and changes nothing, in memory or on disk;
no byte is left held by no session; a restart on the full disk serves every
durable session; once space frees, the refused calls go through."""

import logging
import os
import re
import sqlite3
import subprocess
import time
import urllib.request

import pytest

from tests.helpers import SPEC, Harness, HostEngine, wait_for
from tierd.client import KVSpec, ResourceExhausted
from tierd.core.store import make_key
from tierd.errors import ResourceExhausted as StoreResourceExhausted
from tierd.errors import Unavailable as StoreUnavailable
from tierd.policy import PolicyConfig
from tierd.testing import Daemon, wire_accounting

MiB = 1 << 20
A, B, C = (make_key("default", n) for n in "abc")
REFUSED = (StoreResourceExhausted, StoreUnavailable)


def stored(store, key):
    info, reader = store.get(key)
    return info.num_tokens, b"".join(bytes(c) for c in reader)


def state(store):
    """Everything a client can see of every session: (durable, bytes per tier, content)."""
    return {key: (store.stat(key).durable, store.stat(key).tier_bytes, stored(store, key))
            for key in sorted(store.keys())}


def durable_content(store):
    return {key: content for key, (durable, _, content) in state(store).items() if durable}


@pytest.fixture
def full(small_fs):
    """A store on the small file system: A durable on disk only, B in host and
    on disk, C in host only; then the file system is filled."""
    h = Harness(str(small_fs.path), host_budget=16 * MiB, disk_budget=64 * MiB, disk_slab=2 * MiB)
    store = h.open()
    eng = HostEngine(seed=1)
    store.save(A, eng.memory, SPEC, [0, 1, 2, 3], 64)
    store.demote(A)
    store.save(B, eng.memory, SPEC, [4, 5], 32)
    store.write_back(B)
    store.save(C, eng.memory, SPEC, [6, 7, 8], 48)
    small_fs.fill()
    yield h, store, eng, small_fs
    h.close()


CALLS = {
    "drop a durable session": lambda s, e: s.drop(A),
    "write back a session": lambda s, e: s.write_back(C),
    "demote a session to disk": lambda s, e: s.demote(C),
    "drop a session on disk and in host": lambda s, e: s.drop(B),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_that_needs_room_on_a_full_disk_is_refused_and_changes_nothing(full, call):
    h, store, eng, fs = full
    before = state(store)
    with pytest.raises(REFUSED):
        CALLS[call](store, eng)
    # nothing changed, in memory...
    assert state(store) == before
    assert store.check_accounting() == []
    durable = durable_content(store)
    # ...or on disk: a restart on the full disk serves the same durable sessions
    store = h.reopen()
    assert durable_content(store) == durable and sorted(store.keys()) == [A, B]
    assert store.check_accounting() == [] and store.scan() == []
    # once space frees, the call goes through
    fs.free()
    store.tick()  # the disk tier notices the room
    store.save(C, eng.memory, SPEC, [6, 7, 8], 48)
    CALLS[call](store, eng)
    assert store.check_accounting() == [] and store.scan() == []


def test_calls_that_need_no_room_still_work_on_a_full_disk(full):
    h, store, eng, _ = full
    durable = durable_content(store)
    store.drop(C)  # in host only: no index entry to remove
    store.save(C, eng.memory, SPEC, [9], 16)  # lands in host
    store.save(A, eng.memory, SPEC, [9], 80, start_token=64)  # an append forgets nothing on disk
    assert stored(store, A)[0] == 80
    store.restore(B, HostEngine(seed=2).memory, SPEC, [0, 1])
    # Stored again, from token 0 by any call or from a page before its end: the state on disk stays in the
    # index until the new one is durable.
    store.save(A, eng.memory, SPEC, [9], 32, start_token=16)
    store.put(A, SPEC, 16, SPEC.page_bytes, [bytes(SPEC.page_bytes)])
    store.save(B, eng.memory, SPEC, [9], 16)
    lease = store.begin_save(B, SPEC, 32)
    store.commit_save("default", lease.lease_id)
    assert store.check_accounting() == []
    store = h.reopen()
    assert durable_content(store) == durable


def test_the_index_opens_on_a_full_file_system(small_fs):
    h = Harness(str(small_fs.path), disk_slab=2 * MiB)
    store = h.open()
    eng = HostEngine(seed=3)
    store.save(A, eng.memory, SPEC, [0, 1], 32)
    store.demote(A)
    h.close()
    assert not os.path.exists(os.path.join(h.root, "index.db-shm"))  # a clean close removes the wal-index
    small_fs.fill()  # so the next start has no room for a new one
    store = h.open()
    assert stored(store, A) == (32, b"".join(eng.pages([0, 1])))
    assert store.check_accounting() == []
    h.close()


def test_repairs_that_cannot_be_written_at_start_are_written_before_anything_new(small_fs):
    h = Harness(str(small_fs.path), disk_slab=2 * MiB)
    store = h.open()
    eng = HostEngine(seed=4)
    for key, blocks in ((A, [0, 1]), (B, [2, 3])):
        store.save(key, eng.memory, SPEC, blocks, 32)
        store.demote(key)
    h.close()
    db = sqlite3.connect(os.path.join(h.root, "index.db"))
    db.execute("UPDATE pieces SET checksums=x'00' WHERE session_id='b'")  # B's row is damaged
    db.commit()
    db.close()
    small_fs.fill()
    store = h.open()  # B is quarantined, but the index has no room to record it yet
    assert sorted(store.keys()) == [A] and store.check_accounting() == []
    small_fs.free()
    store.tick()
    # C takes the space B held; the repair commits before C's pages are recorded
    store.save(C, eng.memory, SPEC, [4, 5], 32)
    store.demote(C)
    store = h.reopen()
    assert store.recovery_problems == [] and sorted(store.keys()) == [A, C]
    assert stored(store, C) == (32, b"".join(eng.pages([4, 5])))
    assert store.scan() == []
    h.close()


def test_a_write_back_that_finds_no_room_leaves_no_file_behind(full):
    h, store, eng, _ = full
    slabs = sorted(os.listdir(store.tiers["disk"].directory))
    store.save(C, eng.memory, SPEC, list(range(64)), 64 * 16)  # a whole slab: needs a new one
    with pytest.raises(StoreUnavailable, match="full"):
        store.write_back(C)
    assert sorted(os.listdir(store.tiers["disk"].directory)) == slabs
    assert store.tiers["disk"].out_of_space and store.check_accounting() == []
    store = h.reopen(flush=True)  # a clean stop that tries to flush C, and a start on the full disk
    assert sorted(store.keys()) == [A, B] and store.scan() == [] and store.check_accounting() == []


@pytest.fixture
def full_tier(small_fs):
    """The disk tier's budget full of sessions on disk only (d0, the least
    recently used, to d3), then the file system filled: the disk tier takes a
    session only by dropping one, and its index has no room to record that.
    No watermark pressure: what moves is what idle time and room decide."""
    policy = PolicyConfig(host_idle=60, writeback_idle=None, high_watermark=1.0, low_watermark=1.0)
    h = Harness(str(small_fs.path), host_budget=8 * MiB, host_slab=8 * MiB, disk_budget=8 * MiB,
                disk_slab=2 * MiB, policy=policy)
    store = h.open()
    eng = HostEngine(seed=5)
    for i in range(4):
        store.save(make_key("default", f"d{i}"), eng.memory, SPEC, list(range(64)), 64 * 16)
        store.demote(make_key("default", f"d{i}"))
        h.clock.advance(1)
    small_fs.fill()
    yield h, store, eng, small_fs
    h.close()


ON_DISK = [make_key("default", f"d{i}") for i in range(4)]


def _idle_in_host(h, store, eng, names):
    """Save a session of 2 MiB (an engine of its own each) per name and release
    it, one second apart; let their idle time pass and the tick try to demote
    them. Returns {key: (its tokens, its bytes)}."""
    sessions = {}
    for n, name in enumerate(names):
        key, own = make_key("default", name), HostEngine(seed=10 + n)
        store.save(key, own.memory, SPEC, list(range(64)), 64 * 16)
        store.release(key)
        sessions[key] = (64 * 16, b"".join(own.pages(range(64))))
        h.clock.advance(1)
    h.clock.advance(60)
    assert sorted(m.key for m in store.tick() if m.reason == "idle") == sorted(sessions)
    assert store.drain(30)
    return sessions


def test_an_idle_session_stays_in_host_while_the_disk_tier_and_its_index_are_full(full_tier, caplog):
    h, store, eng, fs = full_tier
    caplog.set_level(logging.DEBUG, logger="tierd")
    (x, want), = _idle_in_host(h, store, eng, ["x"]).items()
    # its demotion could not be done: it stays in host (stat, unlike a read, leaves its idle clock running)
    assert store.stat(x).tier_bytes.keys() == {"host"}
    assert sorted(store.keys()) == sorted(ON_DISK + [x]) and store.check_accounting() == []
    # it is tried again later, not at every tick: 2 minutes of ticks every 0.5 s try it a few times
    tries = 0
    for _ in range(240):
        h.clock.advance(0.5)
        tries += sum(m.key == x for m in store.tick())
        assert store.drain(30)
    assert 1 <= tries <= 10
    failures = [r for r in caplog.records if "default/x to disk failed" in r.getMessage()]
    assert len(failures) == tries + 1 and [r.levelname for r in failures].count("WARNING") == 1
    # an idle demotion takes only room the disk tier has free: it never tried to drop d0 for x
    assert not [r for r in caplog.records if "evicting default/d0" in r.getMessage()]
    # served as it was stored
    assert store.stat(x).tier_bytes.keys() == {"host"} and stored(store, x) == want
    assert store.check_accounting() == []
    # the file system has room again, but the tier's budget has none: x stays in host, and nothing is dropped
    store.release(x)
    fs.free()
    for _ in range(120):
        h.clock.advance(0.5)
        store.tick()
        assert store.drain(30)
    assert store.stat(x).tier_bytes.keys() == {"host"} and sorted(store.keys()) == sorted(ON_DISK + [x])
    # once d0 is dropped, x's next idle demotion takes its room
    store.drop(ON_DISK[0])
    for _ in range(240):
        h.clock.advance(0.5)
        store.tick()
        assert store.drain(30)
        if store.stat(x).tier_bytes.keys() == {"disk"}:
            break
    assert store.stat(x).tier_bytes.keys() == {"disk"} and stored(store, x) == want
    assert sorted(store.keys()) == sorted(ON_DISK[1:] + [x]) and store.check_accounting() == []


def test_only_eviction_for_room_in_host_drops_a_session_the_least_valuable_first(full_tier):
    h, store, eng, _ = full_tier
    idle = _idle_in_host(h, store, eng, ["x0", "x1", "x2"])  # 6 MiB of the host tier's 8
    assert sorted(store.keys()) == sorted(ON_DISK + list(idle))
    # a fourth session fits: nothing is dropped
    x3, x4 = make_key("default", "x3"), make_key("default", "x4")
    store.save(x3, eng.memory, SPEC, list(range(64)), 64 * 16)
    assert sorted(store.keys()) == sorted(ON_DISK + list(idle) + [x3])
    # a fifth needs room: x0, the least recently used, has nowhere to go and is dropped, and only it
    store.save(x4, eng.memory, SPEC, list(range(64)), 64 * 16)
    x0 = make_key("default", "x0")
    assert sorted(store.keys()) == sorted(ON_DISK + [k for k in idle if k != x0] + [x3, x4])
    for key, want in idle.items():
        if key != x0:
            assert store.stat(key).tier_bytes.keys() == {"host"} and stored(store, key) == want
    assert stored(store, x4) == (64 * 16, b"".join(eng.pages(range(64))))
    assert store.check_accounting() == []


def test_a_store_takes_room_on_the_disk_tier_as_soon_as_the_file_system_has_room_again(small_fs):
    """The disk tier found the file system full while its budget had room; the
    space returns and a write-back needs more than the budget has left:
    evicting a session on disk makes the room at once, with no policy tick in
    between (it refused "the file system is full" until the tick had looked)."""
    h = Harness(str(small_fs.path), host_budget=16 * MiB, disk_budget=10 * MiB, disk_slab=2 * MiB)
    store = h.open()
    eng = HostEngine(num_blocks=128, seed=6)
    for i in range(4):
        store.save(ON_DISK[i], eng.memory, SPEC, list(range(64)), 64 * 16)
        store.demote(ON_DISK[i])
        h.clock.advance(1)
    small_fs.fill()
    c, e = make_key("default", "c"), make_key("default", "e")
    store.save(c, eng.memory, SPEC, list(range(64)), 64 * 16)
    with pytest.raises(StoreUnavailable, match="full"):
        store.write_back(c)  # 2 MiB in a new slab: the file system refuses
    assert store.tiers["disk"].out_of_space
    small_fs.free()
    store.save(e, eng.memory, SPEC, list(range(128)), 128 * 16)  # 4 MiB: 2 more than the budget has left
    store.write_back(e)
    assert store.stat(e).durable and stored(store, e) == (128 * 16, b"".join(eng.pages(range(128))))
    assert sorted(store.keys()) == sorted(ON_DISK[1:] + [c, e]) and store.check_accounting() == []
    h.close()


# -- a real daemon whose data dir is on the small file system ------------------------------

OPAQUE = KVSpec.opaque("test/full", page_bytes=64 << 10)


@pytest.fixture
def daemon_on(small_fs, tmp_path):
    """A daemon whose data dir is on the small file system (its socket and log are not)."""
    d = Daemon(tmp_path / "d", "--host-idle", "1", "--writeback-idle", "0.2", "--disk-slab", "2MiB",
               "--disk-budget", "64MiB")
    d.data_dir = str(small_fs.path / "data")
    yield d, small_fs
    d.close()


def _disk_full(d):
    text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
    return 'tierd_tier_out_of_space{tier="disk"} 1.0' in text


def _write_back_failed(d, session_id):
    """The daemon's log since its last start says a write-back of the session failed."""
    text = d.log().split(f"--- start {d.starts}\n")[-1]
    return f"of default/{session_id} to disk failed" in text


def _kept_on_disk_then_full(c, fs):
    """Put a session 'kept', wait until it is on disk only, then fill the file
    system; returns its bytes."""
    data = os.urandom(MiB)
    c.put("kept", data, OPAQUE, num_tokens=1)
    c.release("kept")
    wait_for(lambda: c.stat("kept").tier_bytes.keys() == {"disk"}, what="kept on disk only")
    fs.fill()
    return data


def test_a_daemon_stopped_on_a_full_disk_starts_and_serves(daemon_on):
    d, fs = daemon_on
    with d.start().client() as c:
        data = _kept_on_disk_then_full(c, fs)
        c.put("late", os.urandom(6 * MiB), OPAQUE, num_tokens=1)
        c.release("late")
        wait_for(lambda: _disk_full(d), what="the write-back of late finding the disk full")
        wait_for(lambda: wire_accounting(c) == [], what="accounting")
    assert d.stop() == 0  # the flush of late fails: logged, not fatal
    d.start()  # on the full disk
    with d.client() as c:
        assert [s.session_id for s in c.list()] == ["kept"] and c.get("kept") == data
        assert wire_accounting(c) == []
        c.put("new", b"x" * 100_000, OPAQUE, num_tokens=1)
        c.release("new")
        wait_for(lambda: _write_back_failed(d, "new"), what="the write-back of new refused")
        assert not c.stat("new").durable and wire_accounting(c) == []
        fs.free()
        wait_for(lambda: c.stat("new").durable, what="the write-back once space frees")
        assert wire_accounting(c) == []


def test_a_daemon_starts_on_a_full_disk_that_lacks_its_lock_file(daemon_on):
    d, fs = daemon_on
    d.start().stop()
    os.unlink(os.path.join(d.data_dir, "tierd.lock"))
    fs.fill()
    with d.start().client() as c:  # the lock file is created, its pid cannot be written
        assert c.list() == []
    assert "cannot write the pid" in d.log()


def test_a_read_only_data_dir_is_a_clear_start_up_error(daemon_on):
    """A data dir on a file system remounted read-only stopped the start with a traceback."""
    d, fs = daemon_on
    d.start().stop()
    subprocess.run(["mount", "-o", "remount,ro", str(fs.path)], check=True, capture_output=True, timeout=30)
    try:
        with pytest.raises(RuntimeError, match="cannot open the lock file .*tierd.lock of the data dir .*: Read-only"):
            d.start()
        assert d.proc.wait(10) == 1 and "Traceback" not in d.log()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(fs.path)], check=True, capture_output=True, timeout=30)


def test_on_a_full_index_a_drop_is_refused_and_an_overwrite_leaves_the_durable_state_as_it_is(daemon_on):
    d, fs = daemon_on
    with d.start().client() as c:
        data = _kept_on_disk_then_full(c, fs)
        with pytest.raises(ResourceExhausted, match="index"):
            c.drop("kept")
        assert [s.session_id for s in c.list()] == ["kept"] and c.get("kept") == data
        assert c.stat("kept").durable
        # Stored again, it needs nothing of the index: the new content is served, the durable state stays.
        c.put("kept", b"y" * 1000, OPAQUE, num_tokens=1)
        assert c.get("kept") == b"y" * 1000 and not c.stat("kept").durable
        assert wire_accounting(c) == []
    assert d.stop() == 0  # its write-back finds no room in the index: logged, not fatal
    d.start()
    with d.client() as c:
        assert [s.session_id for s in c.list()] == ["kept"] and c.get("kept") == data
        fs.free()
        c.drop("kept")
        assert c.list() == [] and wire_accounting(c) == []
    assert d.stop() == 0
    with d.start().client() as c:
        assert c.list() == []


def _tries_of(d, session_id):
    """The level of each line the daemon logged since its last start saying an
    idle demotion of the session failed."""
    text = d.log().split(f"--- start {d.starts}\n")[-1]
    return re.findall(rf"^\S+ \S+ (\w+) tierd\.core\.store: idle of default/{session_id} to disk failed", text,
                      re.MULTILINE)


def test_a_daemon_keeps_released_puts_in_host_while_its_disk_and_index_are_full(small_fs, tmp_path):
    d = Daemon(tmp_path / "d", "--host-idle", "0.2", "--writeback-idle", "off", "--disk-slab", "2MiB",
               "--disk-budget", "8MiB", "--log-level", "debug")
    d.data_dir = str(small_fs.path / "data")
    try:
        with d.start().client() as c:
            for i in range(4):
                c.put(f"d{i}", os.urandom(2 * MiB), OPAQUE, num_tokens=1)
                c.release(f"d{i}")
                wait_for(lambda i=i: c.stat(f"d{i}").tier_bytes.keys() == {"disk"}, what=f"d{i} on disk only")
            small_fs.fill()
            data = {f"x{i}": os.urandom(MiB) for i in range(3)}
            for sid, payload in data.items():
                c.put(sid, payload, OPAQUE, num_tokens=1)
                c.release(sid)
            wait_for(lambda: _tries_of(d, "x0") or "dropping default/x0" in d.log(), what="x0's idle time")
            t0 = time.monotonic()
            for sid in data:
                assert c.stat(sid).tier_bytes.keys() == {"host"}  # (a Get would restart its idle clock)
            # tried again later, not at every tick (0.1 s): a third try comes seconds after the first
            wait_for(lambda: len(_tries_of(d, "x0")) >= 3, what="a third try of x0")
            assert time.monotonic() - t0 > 2 and len(_tries_of(d, "x0")) <= 4
            assert _tries_of(d, "x0").count("WARNING") == 1
            for sid, payload in data.items():
                assert c.stat(sid).tier_bytes.keys() == {"host"} and c.get(sid) == payload
                c.release(sid)
            assert "dropping" not in d.log() and wire_accounting(c) == []
            # once space frees, the index takes a change at once, and the sessions go to disk into the
            # room d2 and d3 leave: their idle demotions drop nothing for it
            small_fs.free()
            c.drop("d3")
            c.drop("d2")
            wait_for(lambda: all(c.stat(sid).tier_bytes.keys() == {"disk"} for sid in data), what="x0..x2 on disk")
            for sid, payload in data.items():
                assert c.get(sid) == payload
            assert sorted(s.session_id for s in c.list()) == ["d0", "d1", "x0", "x1", "x2"]
            assert wire_accounting(c) == []
        assert d.stop() == 0
    finally:
        d.close()
