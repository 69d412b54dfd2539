"""Leases (the engine copies pages in and out of the host arena itself) and
token lookup, on the store with a fake clock."""

import dataclasses
import os
import stat

import numpy as np
import pytest

from tests.helpers import SPEC, Harness
from tierd.client.shm import Arena
from tierd.core.store import SPARE_SECONDS, make_key
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    IdentityMismatch,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from tierd.policy import PolicyConfig

A = make_key("default", "a")
OTHER = make_key("other", "a")


@pytest.fixture
def arena():
    a = Arena()
    yield a
    a.close()


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 32000, n)


def lease_save(store, arena, key, num_tokens, start_token=0, token_ids=None, seed=1, **kw):
    """Save pages of random bytes through a lease; returns them."""
    lease = store.begin_save(key, SPEC, num_tokens, start_token, token_ids, **kw)
    rng = np.random.default_rng(seed)
    pages = arena.pages(lease)
    for page in pages:
        page[:] = rng.integers(0, 256, page.size, dtype=np.uint8)
    return lease, [p.tobytes() for p in pages]


def stored(store, key):
    _, reader = store.get(key)
    data = b"".join(bytes(c) for c in reader)
    return [data[i : i + SPEC.page_bytes] for i in range(0, len(data), SPEC.page_bytes)]


def test_save_lease_publishes_only_at_commit(store, arena):
    lease, pages = lease_save(store, arena, A, 40, token_ids=tokens(40))
    assert lease.first_page == 0 and lease.num_pages == 3 and lease.page_stride % 4096 == 0
    with pytest.raises(NotFound):
        store.stat(A)  # written, not committed: invisible
    info = store.commit_save("default", lease.lease_id)
    assert info.num_tokens == 40 and info.num_pages == 3
    assert stored(store, A) == pages
    with pytest.raises(NotFound, match="ended, expired or never was"):
        store.commit_save("default", lease.lease_id)  # a lease commits once


def test_abort_and_expiry_return_the_slots_and_publish_nothing(store, arena, harness):
    host = store.tiers["host"]
    lease, _ = lease_save(store, arena, A, 64)
    assert host.used > 0
    store.abort_save("default", lease.lease_id)
    assert host.used == 0
    with pytest.raises(NotFound):
        store.stat(A)
    lease, _ = lease_save(store, arena, A, 64, ttl=5)
    harness.clock.advance(6)
    store.tick()
    assert host.used == 0
    with pytest.raises(NotFound, match="expired"):
        store.commit_save("default", lease.lease_id)
    with pytest.raises(NotFound):
        store.stat(A)


def test_a_lease_belongs_to_its_tenant(store, arena):
    lease, _ = lease_save(store, arena, A, 16)
    with pytest.raises(NotFound):
        store.commit_save("other", lease.lease_id)
    with pytest.raises(NotFound):
        store.abort_save("other", lease.lease_id)
    store.commit_save("default", lease.lease_id)
    with pytest.raises(NotFound):
        store.begin_restore(OTHER)


def test_append_through_a_lease_and_restore_a_prefix_from_disk(store, arena, harness):
    ids = tokens(100)
    first, pages = lease_save(store, arena, A, 40, token_ids=ids[:40])
    store.commit_save("default", first.lease_id)
    # the partial third page (tokens 32-39) is replaced by the append from token 32
    more, new_pages = lease_save(store, arena, A, 100, start_token=32, token_ids=ids, seed=2)
    assert (more.first_page, more.num_pages) == (2, 5)
    store.commit_save("default", more.lease_id)
    want = pages[:2] + new_pages
    assert stored(store, A) == want
    # demote to disk only, then a restore lease for the first 4 pages reads them from there
    store.release(A)
    harness.clock.advance(10_000)
    store.tick()
    assert store.drain(30)
    assert store.stat(A).tier_bytes.keys() == {"disk"}
    lease = store.begin_restore(A, SPEC, num_pages=4, ttl=3600)
    assert lease.num_pages == 4 and lease.num_tokens == 64
    pages = arena.pages(lease)
    assert [p.tobytes() for p in pages] == want[:4]
    # the lease holds a copy of its own: the session is not held, a new save or a drop leaves the pages be
    assert store.stat(A).tier_bytes.keys() == {"disk"}
    lease_save(store, arena, A, 16, seed=3)
    store.drop(A)
    assert [p.tobytes() for p in pages] == want[:4]
    store.end_restore("default", lease.lease_id)


def test_an_expired_restore_lease_cannot_end(store, arena, harness):
    lease, _ = lease_save(store, arena, A, 16)
    store.commit_save("default", lease.lease_id)
    held = store.begin_restore(A, ttl=2)
    harness.clock.advance(3)
    store.tick()
    with pytest.raises(NotFound, match="expired"):
        store.end_restore("default", held.lease_id)
    gone_after_spare_time(store, harness, held)


def test_a_lease_expires_when_taken_past_its_time_without_a_tick(store, arena, harness):
    lease, _ = lease_save(store, arena, A, 16, ttl=2)
    harness.clock.advance(3)
    with pytest.raises(NotFound, match="expired"):
        store.commit_save("default", lease.lease_id)
    assert store.tiers["host"].used == 0
    with pytest.raises(NotFound):
        store.stat(A)
    gone_after_spare_time(store, harness, lease)


def gone_after_spare_time(store, harness, *leases):
    """An ended lease's segment is kept a while for its tenant's next lease, then goes."""
    harness.clock.advance(SPARE_SECONDS + 1)
    store.tick()
    assert not any(os.path.exists(f"/dev/shm/{lease.slots[0].shm_name}") for lease in leases)


def test_lease_segments_hold_only_the_leased_pages_under_unguessable_names(store, arena, harness):
    a, a_pages = lease_save(store, arena, A, 40)
    b, _ = lease_save(store, arena, OTHER, 40, seed=7)
    names = [a.slots[0].shm_name, b.slots[0].shm_name]
    assert len(set(names)) == 2 and all(len(n.rsplit(".", 1)[1]) == 16 for n in names)
    for lease in (a, b):  # each segment is exactly its lease's pages, nothing of another session
        (slot,) = lease.slots
        assert os.path.getsize(f"/dev/shm/{slot.shm_name}") == lease.num_pages * lease.page_bytes
        assert stat.S_IMODE(os.stat(f"/dev/shm/{slot.shm_name}").st_mode) == 0o600
    store.commit_save("default", a.lease_id)
    store.abort_save("other", b.lease_id)
    # an ended lease's segment serves its own tenant's next lease (its pages resident), never another's
    held = store.begin_restore(A)
    assert held.slots[0].shm_name == a.slots[0].shm_name
    assert [p.tobytes() for p in arena.pages(held)] == a_pages
    c, _ = lease_save(store, arena, OTHER, 40, seed=8)
    assert c.slots[0].shm_name == b.slots[0].shm_name
    d, _ = lease_save(store, arena, make_key("third", "a"), 40)
    assert d.slots[0].shm_name not in names
    store.end_restore("default", held.lease_id)
    for tenant, lease in (("other", c), ("third", d)):
        store.abort_save(tenant, lease.lease_id)
    gone_after_spare_time(store, harness, a, b, d)


def test_open_leases_are_limited_per_tenant(tmp_path, arena):
    h = Harness(str(tmp_path), policy=PolicyConfig(tenant_leases=2, tenant_lease_bytes=4 * SPEC.page_bytes))
    store = h.open()
    try:
        first = store.begin_save(A, SPEC, 16)
        second = store.begin_save(make_key("default", "b"), SPEC, 16)
        with pytest.raises(ResourceExhausted, match="may hold 2 leases open"):
            store.begin_save(make_key("default", "c"), SPEC, 16)
        store.begin_save(OTHER, SPEC, 48)  # another tenant's leases are its own
        store.abort_save("default", second.lease_id)
        with pytest.raises(ResourceExhausted, match="bytes in open leases"):
            store.begin_save(make_key("default", "c"), SPEC, 64)  # 1 + 4 pages > 4
        store.commit_save("default", first.lease_id)
        store.begin_save(make_key("default", "c"), SPEC, 64).lease_id  # room again once ended
    finally:
        h.close()


def test_bad_lease_requests_change_nothing(store, arena):
    host = store.tiers["host"]
    for kwargs, match in [
        (dict(num_tokens=0), "num_tokens"),
        (dict(num_tokens=40, start_token=8), "multiple of block_tokens"),
        (dict(num_tokens=40, token_ids=[1, 2, 3]), "40 token ids"),
        (dict(num_tokens=40, start_token=32, token_ids=list(range(8))), "40 token ids"),
        (dict(num_tokens=40, token_ids=[-1] * 40), "non-negative"),
        (dict(num_tokens=40, ttl=0), "lease lasts"),
        (dict(num_tokens=40, ttl=1e9), "lease lasts"),
        (dict(num_tokens=40, priority=10**6), "priority"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            store.begin_save(A, SPEC, **kwargs)
    with pytest.raises(NotFound, match="nothing to append"):
        store.begin_save(A, SPEC, 40, start_token=16)
    assert host.used == 0 and store.keys() == []
    lease, _ = lease_save(store, arena, A, 16)
    store.commit_save("default", lease.lease_id)
    with pytest.raises(InvalidArgument, match="ask for 1 to 1"):
        store.begin_restore(A, num_pages=2)
    with pytest.raises(IdentityMismatch):
        store.begin_restore(A, dataclasses.replace(SPEC, revision="r2"))
    with pytest.raises(IdentityMismatch):
        store.begin_save(A, dataclasses.replace(SPEC, revision="r2"), 32, start_token=16)


def test_commit_fails_cleanly_when_the_session_was_dropped_meanwhile(store, arena):
    lease, _ = lease_save(store, arena, A, 16)
    store.commit_save("default", lease.lease_id)
    append, _ = lease_save(store, arena, A, 48, start_token=16)
    store.drop(A)
    with pytest.raises(NotFound, match="nothing to append"):
        store.commit_save("default", append.lease_id)
    assert store.tiers["host"].used == 0


def test_a_damaged_session_is_not_leased(store, arena):
    lease, _ = lease_save(store, arena, A, 16)
    store.commit_save("default", lease.lease_id)
    page = store.copier.view("host", store.pieces(A, "host")[0].offset, 1)
    page[0] ^= 1  # damaged behind the store's back ...
    with pytest.raises(DataLoss):
        store.begin_restore(A)
    page[0] ^= 1  # ... and mended: the session stays damaged all the same
    with pytest.raises(DataLoss, match="damaged"):
        store.begin_restore(A)


def test_lookup_matches_whole_pages_of_the_same_tokens(store, arena, harness):
    ids = tokens(100)
    lease, _ = lease_save(store, arena, A, 100, token_ids=ids)
    store.commit_save("default", lease.lease_id)
    r = store.lookup(A, ids)
    assert (r.num_tokens, r.num_pages, r.stored_tokens, r.tier) == (100, 7, 100, "host")
    # a longer prompt with the same history: everything stored
    assert store.lookup(A, np.concatenate([ids, tokens(30, seed=9)])).num_tokens == 100
    # history edited at token 50: pages 0-2 (48 tokens) still match
    edited = ids.copy()
    edited[50] += 1
    assert store.lookup(A, edited).num_tokens == 48
    # a prompt shorter than the stored tokens: its whole pages only
    assert store.lookup(A, ids[:40]).num_tokens == 32
    assert store.lookup(A, tokens(100, seed=5)).num_tokens == 0
    assert store.lookup(A, []).num_tokens == 0
    with pytest.raises(IdentityMismatch):
        store.lookup(A, ids, dataclasses.replace(SPEC, model_id="other"))
    with pytest.raises(InvalidArgument):
        store.lookup(A, [[1, 2]])
    with pytest.raises(NotFound):
        store.lookup(OTHER, ids)
    # token hashes survive a restart through the disk index
    store.release(A)
    store = harness.reopen(flush=True)
    assert store.lookup(A, edited).num_tokens == 48


def test_pages_stored_without_token_ids_never_match(store, arena):
    ids = tokens(64)
    lease, _ = lease_save(store, arena, A, 32)
    store.commit_save("default", lease.lease_id)
    lease, _ = lease_save(store, arena, A, 64, start_token=32, token_ids=ids)
    store.commit_save("default", lease.lease_id)
    assert store.lookup(A, ids).num_tokens == 0


def test_an_append_onto_other_tokens_is_refused(store, arena):
    ids = tokens(64)
    lease, _ = lease_save(store, arena, A, 40, token_ids=ids[:40])
    store.commit_save("default", lease.lease_id)
    other = ids.copy()
    other[5] += 1  # another conversation got there first: its pages 0-1 differ
    with pytest.raises(FailedPrecondition, match="other tokens before start_token 32"):
        store.begin_save(A, SPEC, 64, start_token=32, token_ids=other)
    # the same refusal at commit, if the snapshot changed after the lease began
    lease, _ = lease_save(store, arena, A, 64, start_token=32, token_ids=ids)
    rewrite, _ = lease_save(store, arena, A, 40, token_ids=other[:40])
    store.commit_save("default", rewrite.lease_id)
    with pytest.raises(FailedPrecondition, match="other tokens"):
        store.commit_save("default", lease.lease_id)
    assert store.stat(A).num_tokens == 40 and store.lookup(A, other).num_tokens == 40


def test_a_restore_lease_checks_the_prompt(store, arena):
    ids = tokens(64)
    lease, _ = lease_save(store, arena, A, 64, token_ids=ids)
    store.commit_save("default", lease.lease_id)
    held = store.begin_restore(A, SPEC, num_pages=2, token_ids=ids)
    store.end_restore("default", held.lease_id)
    edited = ids.copy()
    edited[20] += 1
    with pytest.raises(FailedPrecondition, match="other tokens than the request"):
        store.begin_restore(A, SPEC, num_pages=2, token_ids=edited)
    held = store.begin_restore(A, SPEC, num_pages=1, token_ids=edited)  # page 0 still matches
    store.end_restore("default", held.lease_id)


def test_an_arena_lets_each_leases_segment_go(store, harness):
    """An engine that kept every segment it ever mapped would hold their
    memory for good, even after the daemon removed the files: an Arena keeps
    the segments the daemon hands out again, and lets go of those it removed."""
    arena = Arena()

    def mappings(name):  # the daemon's side maps the segment too: this test runs the store in-process
        with open("/proc/self/maps") as f:
            return sum(name in line for line in f)

    try:
        lease = store.begin_save(A, SPEC, 32)
        pages = arena.pages(lease)
        for page in pages:
            page[:] = 7
        del pages, page  # the engine is done with its views
        name = lease.slots[0].shm_name
        mapped = mappings(name)
        arena.release(lease)
        assert mappings(name) == mapped - 1
        store.commit_save("default", lease.lease_id)
        held = store.begin_restore(A, SPEC)  # the tenant's segment again: mapped once, kept
        arena.pages(held)
        store.end_restore("default", held.lease_id)
        assert list(arena._maps) == [name]
        harness.clock.advance(SPARE_SECONDS + 1)
        store.tick()  # the daemon removes the unused segment...
        other = store.begin_save(make_key("default", "b"), SPEC, 16)
        arena.pages(other)  # ...and the next lease mapped lets its mapping go
        assert name not in arena._maps and mappings(name) == 0
        store.abort_save("default", other.lease_id)
    finally:
        arena.close()
