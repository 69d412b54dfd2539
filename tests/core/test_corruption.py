"""Flip bytes inside a slab file: the damaged session fails with DATA_LOSS
and never returns its bytes; every other session keeps working."""

import os

import pytest

from tests.helpers import SPEC, HostEngine
from tierd.core.store import make_key
from tierd.errors import DataLoss

A = make_key("default", "a")
B = make_key("default", "b")


def _flip(store, key, page):
    piece = next(p for p in store.pieces(key, "disk") if p.first_page <= page < p.first_page + p.n_pages)
    disk = store.tiers["disk"]
    slab, off = disk.locate(piece.offset + (page - piece.first_page) * store.stat(key).spec.page_bytes)
    with open(disk.slab_path(slab), "r+b") as f:
        f.seek(off + 1234)
        byte = f.read(1)
        f.seek(off + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def two_on_disk(harness):
    store = harness.open()
    eng = HostEngine(seed=1)
    store.save(A, eng.memory, SPEC, [0, 1, 2, 3], 64)
    store.save(B, eng.memory, SPEC, [4, 5, 6, 7], 64)
    for key in (A, B):
        store.demote(key)
    _flip(store, A, 2)
    return store, eng


def test_restore_of_a_corrupted_session_is_data_loss(two_on_disk):
    store, eng = two_on_disk
    out = HostEngine(seed=2)
    with pytest.raises(DataLoss, match="page 2"):
        store.restore(A, out.memory, SPEC, [10, 11, 12, 13])
    assert out.page(12) != eng.page(2)  # the bad page never reached the engine
    assert store.stat(A).state == "damaged"
    with pytest.raises(DataLoss):
        store.restore(A, out.memory, SPEC, [10, 11, 12, 13])
    # the other session is fine
    store.restore(B, out.memory, SPEC, [20, 21, 22, 23])
    assert out.pages([20, 21, 22, 23]) == eng.pages([4, 5, 6, 7])


def test_get_and_prefetch_of_a_corrupted_session_fail_too(two_on_disk):
    store, _ = two_on_disk
    info, chunks = store.get(A, 4096)
    with pytest.raises(DataLoss):
        b"".join(chunks)
    with pytest.raises(DataLoss):
        store.prefetch(A)
    # a fresh save from token 0 replaces the damaged snapshot
    eng = HostEngine(seed=3)
    store.save(A, eng.memory, SPEC, [9], 16)
    assert store.stat(A).state == "active"


def test_corruption_found_in_the_background_marks_the_session(two_on_disk):
    store, _ = two_on_disk
    assert store.prefetch(A) == "queued"
    store.drain(10)
    assert store.stat(A).state == "damaged" and store.stat(A).tier == "disk"
    assert store.tiers["host"].used == 0  # the failed promotion gave its pages back


def test_corruption_is_found_again_after_a_restart(harness, two_on_disk):
    store = harness.reopen()
    with pytest.raises(DataLoss):
        store.restore(A, HostEngine().memory, SPEC, [0, 1, 2, 3])
    store.restore(B, HostEngine().memory, SPEC, [0, 1, 2, 3])


def test_a_disk_read_that_fails_is_unavailable_and_changes_nothing(two_on_disk):
    from tierd.errors import Unavailable

    store, eng = two_on_disk
    disk = store.tiers["disk"]
    os.truncate(disk.slab_path(0), 0)  # every read of the slab now comes up short
    with pytest.raises(Unavailable, match="try again"):
        store.restore(B, HostEngine().memory, SPEC, [0, 1, 2, 3])
    with pytest.raises(Unavailable):
        b"".join(store.get(B)[1])
    assert store.prefetch(B) == "queued"
    store.drain(10)
    assert store.stat(B).tier == "disk" and store.stat(B).state != "damaged"  # nothing moved, nothing damaged
    assert store.tiers["host"].used == 0
