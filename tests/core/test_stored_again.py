"""A durable state the index holds, while the session's content that
replaces it (a store from token 0, an append from a page before its end, the
pages a restore takes from other sessions) is not durable yet: the cases a
review of that mechanism found (core/index_edits.py). Each kill is a close
without flush: nothing more is written."""

import os

import pytest

from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key
from tierd.errors import DataLoss, NotFound, ResourceExhausted

MiB = 1 << 20
BT = SPEC.block_tokens
PREFIX = list(range(5000, 5000 + 4 * BT))  # 4 pages of a shared prompt


def read(store, key):
    try:
        return read_all(store.get(key)[1])
    except NotFound:
        return None


def test_a_write_back_that_needs_the_room_of_the_state_it_replaces_moves_no_other_session_out(tmp_path):
    """The write-back made room by evicting another durable session, then let
    go of the state it replaced: the room that state held goes first."""
    h = Harness(str(tmp_path), disk_budget=MiB, disk_slab=MiB, movers=0)
    store = h.open()
    a, b = make_key("default", "a"), make_key("default", "b")
    eng = HostEngine(seed=12)
    store.save(a, eng.memory, SPEC, list(range(12)), 12 * BT)
    store.demote(a)
    store.save(b, eng.memory, SPEC, list(range(12, 28)), 16 * BT)
    store.demote(b)
    store.save(a, eng.memory, SPEC, list(range(30, 42)), 12 * BT)
    store.write_back(a)
    assert store.stat(a).durable and b in store.keys() and store.check_accounting() == []


def test_a_get_stream_open_on_the_session_keeps_its_state_where_the_write_back_lacks_room(tmp_path):
    """A Get stream still reading defers the freeing of what the session lets
    go: giving the state up then made no room, the write-back failed, and a
    kill lost the session."""
    h = Harness(str(tmp_path), disk_budget=MiB, disk_slab=MiB, movers=0)
    store = h.open()
    key = make_key("default", "big")
    eng = HostEngine(seed=12)
    store.save(key, eng.memory, SPEC, list(range(20)), 20 * BT)
    store.demote(key)
    store.save(key, eng.memory, SPEC, list(range(20, 40)), 20 * BT)
    _, reader = store.get(key)
    with pytest.raises(ResourceExhausted):
        store.write_back(key)
    assert read_all(reader) == b"".join(eng.pages(range(20, 40)))
    assert store.check_accounting() == []
    h.close()
    store = h.open()
    assert read(store, key) == b"".join(eng.pages(range(20)))


def test_a_full_index_at_the_write_back_keeps_the_state(tmp_path):
    """A write-back the index refuses (full) gave up the state for room it did not lack."""
    h = Harness(str(tmp_path), movers=0)
    store = h.open()
    key = make_key("default", "a")
    eng = HostEngine(seed=1)
    store.save(key, eng.memory, SPEC, [0, 1, 2], 3 * BT)
    store.demote(key)
    store.save(key, eng.memory, SPEC, [4, 5], 2 * BT)

    def full(*args, **kw):
        raise ResourceExhausted("the disk index has no room to record the change (database or disk is full)")

    store.index.add_pieces = full
    with pytest.raises(ResourceExhausted):
        store.write_back(key)
    h.close()
    store = h.open()
    assert read(store, key) == b"".join(eng.pages([0, 1, 2]))


def test_stat_and_stats_count_an_allocation_the_state_and_the_content_both_hold_once(tmp_path):
    h = Harness(str(tmp_path), movers=0)
    store = h.open()
    key = make_key("default", "turns")
    eng = HostEngine(seed=13)
    store.save(key, eng.memory, SPEC, [0, 1, 2], 2 * BT + 8)
    store.demote(key)
    used = store.tiers["disk"].used
    store.save(key, eng.memory, SPEC, [3, 4], 4 * BT - 4, start_token=2 * BT)
    assert store.stat(key).tier_bytes["disk"] == used and store.stat(key).shared_bytes == 0
    for stats in (store.stats(), store.stats("default")):
        assert [t.saved for t in stats if t.name == "disk"] == [0]


def test_a_state_found_damaged_is_given_up_when_the_session_is_stored_again(tmp_path):
    h = Harness(str(tmp_path), movers=0)
    store = h.open()
    key = make_key("default", "d")
    eng = HostEngine(seed=13)
    store.save(key, eng.memory, SPEC, [0, 1, 2, 3], 4 * BT)
    store.demote(key)
    store.save(key, eng.memory, SPEC, [5, 6], 4 * BT, start_token=2 * BT)  # the 4-page state is kept
    piece = next(p for p in store.pieces(key, "disk") if p.first_page <= 1 < p.first_page + p.n_pages)
    disk = store.tiers["disk"]
    slab, off = disk.locate(piece.offset + (1 - piece.first_page) * SPEC.page_bytes)
    with open(disk.slab_path(slab), "r+b") as f:  # page 1, which both hold
        f.seek(off + 1234)
        byte = f.read(1)
        f.seek(off + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
        os.fsync(f.fileno())
    with pytest.raises(DataLoss):
        read_all(store.get(key)[1])
    store.save(key, eng.memory, SPEC, [7, 8], 2 * BT)
    h.close()
    assert h.open().keys() == []


def test_a_restore_that_takes_pages_from_other_sessions_keeps_the_state_on_disk(tmp_path):
    """A restore with token ids that extends a session from another session's
    pages replaced its content from page 0, and took its durable state (or the
    one kept for a store) out of the index: a kill after a read lost it."""
    h = Harness(str(tmp_path), movers=0)
    store = h.open()
    a, b, c = make_key("t", "a"), make_key("t", "b"), make_key("t", "c")
    eng = HostEngine(seed=3)
    store.save(b, eng.memory, SPEC, [0, 1, 2, 3, 4], 5 * BT, token_ids=PREFIX + [1] * BT)
    store.save(a, eng.memory, SPEC, [0, 1], 2 * BT, token_ids=PREFIX[: 2 * BT])
    store.demote(a)
    store.save(c, eng.memory, SPEC, [10, 11, 12], 3 * BT, token_ids=[7] * (3 * BT))
    store.demote(c)
    store.save(c, eng.memory, SPEC, [0, 1], 2 * BT, token_ids=PREFIX[: 2 * BT])  # c's 3 pages are kept
    for key in (a, c):
        store.restore(key, HostEngine(seed=99).memory, SPEC, [0, 1, 2, 3], token_ids=PREFIX)
    assert store.check_accounting() == [] and store.scan() == []
    h.close()
    store = h.open()
    assert read(store, a) == b"".join(eng.pages([0, 1])) and read(store, c) == b"".join(eng.pages([10, 11, 12]))
