"""Prefix sharing in the store: pages of the same tokens under the same
identity, salt and tenant are stored once, on every tier and every save path;
a new session starts from them; dropping, damage and restarts keep every
session's bytes and every allocation's holders exact."""

import sys
import threading

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key
from tierd.client.shm import Arena
from tierd.errors import DataLoss, FailedPrecondition, IdentityMismatch, InvalidArgument, NotFound
from tierd.layout import KVSpec
from tierd.transfer.runs import page_stride

PREFIX = list(range(5000, 5000 + 8 * SPEC.block_tokens))  # 8 pages of shared prompt
N = 50


def key(i, tenant="t"):
    return make_key(tenant, f"s{i}")


def own_tokens(i):
    return PREFIX + [i + 1] * SPEC.block_tokens  # a 9th page of the session's own


def save_all(store, eng, n=N, tenant="t", salt=""):
    for i in range(n):
        toks = own_tokens(i)
        store.save(key(i, tenant), eng.memory, SPEC, list(range(8)) + [8 + i], len(toks), token_ids=toks, salt=salt)


STRIDE = page_stride(SPEC.page_bytes)


def rounded(store, tier, pages):
    """What an allocation of this many pages takes in the tier."""
    return store.tiers[tier].allocator.round(pages * STRIDE)


def restored(store, k, n_pages=9):
    out = HostEngine(seed=99)
    store.restore(k, out.memory, SPEC, list(range(n_pages)))
    return out.pages(range(n_pages))


@pytest.fixture
def world(tmp_path):
    h = Harness(str(tmp_path), movers=0)
    store = h.open()
    yield h, store
    h.close()


def test_fifty_sessions_hold_a_shared_prefix_once(world):
    h, store = world
    eng = HostEngine(seed=1)
    save_all(store, eng)
    host = store.tiers["host"]
    # the first save took 9 pages in one allocation, every other only its own page
    assert host.used == rounded(store, "host", 9) + (N - 1) * rounded(store, "host", 1)
    for i in range(N):
        assert restored(store, key(i)) == eng.pages(list(range(8)) + [8 + i])
        info = store.stat(key(i))
        assert info.shared_bytes == 8 * SPEC.page_bytes and info.own_bytes == SPEC.page_bytes
    (host_stats,) = [t for t in store.stats() if t.name == "host"]
    assert host_stats.saved == (N - 1) * rounded(store, "host", 9)
    assert store.check_accounting() == []


def test_dropping_all_but_one_leaves_the_last_intact(world):
    h, store = world
    eng = HostEngine(seed=2)
    save_all(store, eng)
    for i in range(N - 1):
        store.drop(key(i))
        assert store.check_accounting() == []
    last = key(N - 1)
    assert restored(store, last) == eng.pages(list(range(8)) + [8 + N - 1])
    # the first session's allocation lives on, held by the last one alone
    assert store.tiers["host"].used == rounded(store, "host", 9) + rounded(store, "host", 1)
    assert store.stat(last).shared_bytes == 0
    store.drop(last)
    assert store.tiers["host"].used == 0 and store.check_accounting() == []


def test_demotion_stores_shared_pages_once_on_disk_and_a_restart_counts_holders_again(world):
    h, store = world
    eng = HostEngine(seed=3)
    save_all(store, eng, n=10)
    for i in range(10):
        store.demote(key(i), "disk")
    assert store.tiers["disk"].used == rounded(store, "disk", 9) + 9 * rounded(store, "disk", 1)
    assert store.tiers["host"].used == 0
    assert store.scan() == []
    store = h.reopen()  # what the index and slab files hold, nothing flushed at close
    assert len(store.keys()) == 10 and store.recovery_problems == []
    assert store.tiers["disk"].used == rounded(store, "disk", 9) + 9 * rounded(store, "disk", 1)
    assert store.check_accounting() == [] and store.scan() == []
    for i in range(10):
        assert store.stat(key(i)).shared_bytes == 8 * SPEC.page_bytes
    for i in range(9):
        store.drop(key(i))
    assert restored(store, key(9)) == eng.pages(list(range(8)) + [17])
    store.drop(key(9))
    assert store.tiers["disk"].used == 0 and store.check_accounting() == []


def test_a_damaged_shared_page_fails_every_holder_and_the_next_save_heals(world, tmp_path, caplog):
    h, store = world
    eng = HostEngine(seed=4)
    save_all(store, eng, n=5)
    for i in range(5):
        store.demote(key(i), "disk")
    (piece,) = [p for p in store.pieces(key(0), "disk") if p.first_page == 0]
    slab, at = divmod(piece.offset + 3 * STRIDE + 100, h.disk_slab)  # page 3, shared by all five
    with open(tmp_path / "slabs" / f"slab-{slab:06d}.bin", "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))
    with pytest.raises(DataLoss):
        restored(store, key(2))
    assert "4 other sessions of t hold that copy of page 3 and are damaged too" in caplog.text
    for i in range(5):  # every session holding that allocation is damaged, none serves it
        assert store.stat(key(i)).state == "damaged"
        with pytest.raises(DataLoss):
            restored(store, key(i))
    # a new session with the same tokens finds nothing to share: it stores a good copy of its own
    with pytest.raises(NotFound):
        store.lookup(make_key("t", "fresh"), own_tokens(0), SPEC)
    disk_before = store.tiers["disk"].used
    store.save(make_key("t", "fresh"), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens,
               token_ids=own_tokens(0))
    assert store.stat(make_key("t", "fresh")).shared_bytes == 0
    assert restored(store, make_key("t", "fresh")) == eng.pages(range(9))
    # and a damaged session stored again from token 0 shares the good copy
    store.save(key(1), eng.memory, SPEC, list(range(8)) + [9], 9 * SPEC.block_tokens, token_ids=own_tokens(1))
    assert store.stat(key(1)).state != "damaged" and store.stat(key(1)).shared_bytes == 8 * SPEC.page_bytes
    assert restored(store, key(1)) == eng.pages(list(range(8)) + [9])
    # (its old pages went: the damaged allocation stays while the other damaged sessions hold it)
    assert store.tiers["disk"].used == disk_before - rounded(store, "disk", 1)
    assert store.check_accounting() == []


def test_no_sharing_across_tenants_or_salts(world):
    h, store = world
    eng = HostEngine(seed=5)
    save_all(store, eng, n=2)
    used = store.tiers["host"].used
    # another tenant with the same prompt: no hit, and its save stores every page
    with pytest.raises(NotFound):
        store.lookup(make_key("u", "x"), PREFIX, SPEC)
    store.save(make_key("u", "x"), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens, token_ids=own_tokens(0))
    assert store.tiers["host"].used == used + rounded(store, "host", 9)
    assert store.stat(make_key("u", "x")).shared_bytes == 0
    # the same tenant under a cache salt: no hit either; the salted pages share among themselves
    with pytest.raises(NotFound):
        store.lookup(make_key("t", "salted"), PREFIX, SPEC, salt="user-7")
    for i in range(2):
        store.save(make_key("t", f"salted{i}"), eng.memory, SPEC, list(range(8)) + [8 + i], 9 * SPEC.block_tokens,
                   token_ids=own_tokens(i), salt="user-7")
    assert store.stat(make_key("t", "salted1")).shared_bytes == 8 * SPEC.page_bytes
    assert store.lookup(make_key("t", "salted-new"), PREFIX, SPEC, salt="user-7").num_pages == 8
    with pytest.raises(NotFound):
        store.lookup(make_key("t", "salted-new"), PREFIX, SPEC, salt="user-8")
    # a salted session does not match its own prompt without the salt
    # (nor do the unsalted sessions' pages answer: its own pages, of other tokens, are never replaced)
    assert store.lookup(make_key("t", "salted0"), PREFIX, SPEC).num_pages == 0
    assert store.lookup(make_key("t", "salted0"), PREFIX).num_pages == 0
    with pytest.raises(InvalidArgument):
        store.lookup(make_key("t", "x"), PREFIX, SPEC, salt="s" * 257)


def test_a_new_session_starts_from_the_shared_pages(world):
    h, store = world
    eng = HostEngine(seed=6)
    save_all(store, eng, n=3)
    prompt = PREFIX + [77] * 20
    new = make_key("t", "new")
    found = store.lookup(new, prompt, SPEC)
    assert (found.num_tokens, found.num_pages) == (len(PREFIX), 8)
    used = store.tiers["host"].used
    with pytest.raises(InvalidArgument, match="hold 8 pages"):
        store.begin_restore(new, SPEC, 9, token_ids=prompt)
    lease = store.begin_restore(new, SPEC, found.num_pages, token_ids=prompt)
    try:
        arena = Arena()
        got = [bytes(row) for row in arena.pages(lease)]
        arena.close()
    finally:
        store.end_restore("t", lease.lease_id)
    assert got == eng.pages(range(8))
    info = store.stat(new)
    assert (info.num_tokens, info.num_pages, info.shared_bytes) == (len(PREFIX), 8, 8 * SPEC.page_bytes)
    assert store.tiers["host"].used == used  # nothing stored
    # the next turn appends its own pages after the shared ones
    toks = prompt[:9 * SPEC.block_tokens]
    store.save(new, eng.memory, SPEC, [40], len(toks), start_token=len(PREFIX), token_ids=toks)
    assert restored(store, new) == eng.pages(list(range(8)) + [40])
    # a session that exists and holds a prefix of the request is extended from the shared pages the
    # request matches (all 9 pages of "new", which holds the request's 9th page too)
    short = make_key("t", "short")
    store.save(short, eng.memory, SPEC, [50, 51], 2 * SPEC.block_tokens, token_ids=PREFIX[: 2 * SPEC.block_tokens])
    lease = store.begin_restore(short, SPEC, 8, token_ids=prompt)
    store.end_restore("t", lease.lease_id)
    assert store.stat(short).num_pages == 9 and restored(store, short) == eng.pages(list(range(8)) + [40])
    assert store.check_accounting() == []


def test_put_and_save_leases_store_only_pages_not_held(world):
    h, store = world
    eng = HostEngine(seed=7)
    save_all(store, eng, n=1)
    used = store.tiers["host"].used
    prefix_bytes = b"".join(eng.pages(range(8)))
    own = np.random.default_rng(8).integers(0, 256, SPEC.page_bytes, dtype=np.uint8).tobytes()
    # Put: the stream carries every page, the held ones are read past
    toks = own_tokens(1)
    store.put(make_key("t", "put"), SPEC, len(toks), 9 * SPEC.page_bytes, [prefix_bytes, own], token_ids=toks)
    assert store.tiers["host"].used == used + rounded(store, "host", 1)
    info, reader = store.get(make_key("t", "put"))
    assert read_all(reader) == prefix_bytes + own and info.shared_bytes == 8 * SPEC.page_bytes
    # a save lease starts past the pages held already
    toks = own_tokens(2)
    lease = store.begin_save(make_key("t", "lease"), SPEC, len(toks), token_ids=toks)
    assert (lease.first_page, lease.num_pages) == (8, 1)
    arena = Arena()
    (row,) = arena.pages(lease)
    row[:] = np.frombuffer(own, dtype=np.uint8)
    arena.close()
    store.commit_save("t", lease.lease_id)
    info, reader = store.get(make_key("t", "lease"))
    assert read_all(reader) == prefix_bytes + own
    # an aborted lease gives its held pages back
    lease = store.begin_save(make_key("t", "aborted"), SPEC, len(toks), token_ids=toks)
    store.abort_save("t", lease.lease_id)
    assert store.check_accounting() == []
    for k in ("s0", "put", "lease"):
        store.drop(make_key("t", k))
    assert store.tiers["host"].used == 0 and store.check_accounting() == []


def test_a_prompt_is_read_only_as_far_as_the_tenant_holds_tokens(world):
    h, store = world
    eng = HostEngine(seed=9)
    assert store.prompt_limit(key(0)) == 0
    save_all(store, eng, n=2)
    store.save(make_key("t", "short"), eng.memory, SPEC, [30], 16, token_ids=list(range(16)))
    # the deepest session holds 9 pages: no prompt matches more than 144 tokens, of any session
    assert store.prompt_limit(make_key("t", "new")) == 9 * SPEC.block_tokens
    assert store.prompt_limit(make_key("u", "new")) == 0  # another tenant's count
    for i in range(2):
        store.drop(key(i))
    assert store.prompt_limit(make_key("t", "new")) == 16
    store.drop(make_key("t", "short"))
    assert store.prompt_limit(make_key("t", "new")) == 0


def test_a_session_stored_again_lends_only_what_it_holds_now(world):
    """A session stored again with other tokens (from token 0, or appended
    past its first pages), or dropped and its id reused, lends nothing of
    what it held before: a new session of the old tokens stores its own."""
    h, store = world
    eng = HostEngine(seed=10)
    old = list(range(4 * SPEC.block_tokens))
    other = list(range(90_000, 90_000 + 4 * SPEC.block_tokens))
    x, y = make_key("t", "x"), make_key("t", "y")

    def fresh_y(blocks):
        store.save(y, eng.memory, SPEC, blocks, len(old), token_ids=old)
        assert restored(store, y, 4) == eng.pages(blocks)
        store.drop(y)

    store.save(x, eng.memory, SPEC, [0, 1, 2, 3], len(old), token_ids=old)
    store.save(x, eng.memory, SPEC, [4, 5, 6, 7], len(other), token_ids=other)  # from token 0, other tokens
    with pytest.raises(NotFound):
        store.lookup(make_key("t", "z"), old, SPEC)
    fresh_y([10, 11, 12, 13])
    # an append past x's first two pages, with other tokens there
    store.save(x, eng.memory, SPEC, [0, 1, 2, 3], len(old), token_ids=old)
    store.save(x, eng.memory, SPEC, [20, 21], len(old), start_token=32, token_ids=old[:32] + other[32:])
    store.save(y, eng.memory, SPEC, [10, 11, 12, 13], len(old), token_ids=old)
    assert restored(store, y, 4) == eng.pages([0, 1, 12, 13])  # two pages x still holds, two of its own
    store.drop(y)
    # dropped, and the id reused for other tokens
    store.drop(x)
    store.save(x, eng.memory, SPEC, [4, 5, 6, 7], len(other), token_ids=other)
    fresh_y([30, 31, 32, 33])
    # and a session stored again from token 0 with the same tokens keeps the new bytes
    store.save(x, eng.memory, SPEC, [40, 41, 42, 43], len(other), token_ids=other)
    assert restored(store, x, 4) == eng.pages([40, 41, 42, 43])
    assert store.check_accounting() == []


def test_a_store_that_took_pages_found_damaged_meanwhile_is_refused(world):
    h, store = world
    eng = HostEngine(seed=11)
    store.save(key(0), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens, token_ids=own_tokens(0))
    lease = store.begin_save(key(1), SPEC, 9 * SPEC.block_tokens, token_ids=own_tokens(1))
    assert lease.first_page == 8  # its first 8 pages are key(0)'s
    (piece,) = store.pieces(key(0), "host")
    store.tiers["host"].view(piece.offset + 5 * STRIDE + 10, 1)[0] ^= 0xFF  # behind the daemon's back
    with pytest.raises(DataLoss):
        restored(store, key(0))
    with pytest.raises(DataLoss, match="failed its checksum meanwhile"):
        store.commit_save("t", lease.lease_id)
    with pytest.raises(NotFound):
        store.stat(key(1))
    # the next store of those tokens keeps a good copy of its own
    store.save(key(2), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens, token_ids=own_tokens(2))
    assert store.stat(key(2)).shared_bytes == 0 and restored(store, key(2)) == eng.pages(range(9))
    store.drop(key(0))
    assert store.check_accounting() == []


def test_stores_racing_a_session_stored_again_with_other_tokens(world):
    """One thread stores x again and again, with prompt T and with V; others
    store new sessions of T and start new sessions from T (x is the only
    other holder of T at first): each reads some session's bytes of T, none
    is refused for an empty session, nothing hangs."""
    h, store = world
    eng = HostEngine(seed=12, num_blocks=64)
    t_toks = list(range(4 * SPEC.block_tokens))
    v_toks = list(range(70_000, 70_000 + 4 * SPEC.block_tokens))
    stored_t = [eng.pages([0, 1, 2, 3])] + [eng.pages([20 + n, 21 + n, 22 + n, 23 + n]) for n in (0, 10)]
    stop, errors = threading.Event(), []

    def resaver():
        i = 0
        while not stop.is_set():
            toks, blocks = (t_toks, [0, 1, 2, 3]) if i % 2 else (v_toks, [8, 9, 10, 11])
            store.save(make_key("t", "x"), eng.memory, SPEC, blocks, len(toks), token_ids=toks)
            i += 1

    def user(n):
        for i in range(400):
            k = make_key("t", f"u{n}-{i}")
            try:
                if i % 2:
                    store.save(k, eng.memory, SPEC, [20 + n, 21 + n, 22 + n, 23 + n], len(t_toks), token_ids=t_toks)
                else:
                    try:
                        lease = store.begin_restore(k, SPEC, 4, token_ids=t_toks)
                    except NotFound:
                        continue  # x held V then, and no one else T
                    store.end_restore("t", lease.lease_id)
                out = HostEngine(seed=13)
                store.restore(k, out.memory, SPEC, [0, 1, 2, 3])
                if out.pages([0, 1, 2, 3]) not in stored_t:  # some session's bytes of T
                    errors.append(f"{k.session_id}: other bytes")
                store.drop(k)
            except Exception as exc:  # noqa: BLE001 - every failure is one to report
                errors.append(f"{k.session_id}: {exc!r}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the window between truncation and the table opens wide
    try:
        threads = [threading.Thread(target=resaver)] + [threading.Thread(target=user, args=(n,)) for n in (0, 10)]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(60)
        stop.set()
        threads[0].join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    assert store.check_accounting() == []


def test_a_session_being_stored_again_lends_nothing_midway(world):
    """Between the cut of a session's old pages and its new ones, other calls
    may run (the store lock is let go): they must not find its old prompt."""
    h, store = world
    eng = HostEngine(seed=14)
    t_toks, v_toks = list(range(64)), list(range(80_000, 80_064))
    x, new = make_key("t", "x"), make_key("t", "new")
    store.save(x, eng.memory, SPEC, [0, 1, 2, 3], 64, token_ids=t_toks)
    seen = []
    truncate = store.placement.edits.truncate

    def midway(session, n_pages, add=None, keep=False):
        freed = truncate(session, n_pages, add, keep)
        with pytest.raises(NotFound):  # (a 4-page answer, and then a session of 0 pages, before)
            store.lookup(new, t_toks, SPEC)
        with pytest.raises(NotFound):
            store.begin_restore(new, SPEC, 4, token_ids=t_toks)
        seen.append(n_pages)
        return freed

    store.placement.edits.truncate = midway
    store.save(x, eng.memory, SPEC, [8, 9, 10, 11], 64, token_ids=v_toks)
    store.placement.edits.truncate = truncate
    assert seen == [0]
    assert store.lookup(new, v_toks, SPEC).num_pages == 4 and restored(store, x, 4) == eng.pages([8, 9, 10, 11])
    assert store.check_accounting() == []


def test_a_session_of_another_identity_is_refused_not_replaced(world):
    h, store = world
    eng = HostEngine(seed=15)
    other_spec = KVSpec("test/other-model", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                        block_tokens=16)
    other = HostEngine(spec=other_spec, seed=16)
    store.save(key(0), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens, token_ids=own_tokens(0))
    x = make_key("t", "x")
    store.save(x, other.memory, other_spec, [0, 1], 32, token_ids=PREFIX[:32])
    with pytest.raises(IdentityMismatch):  # though key(0) holds the request's pages under SPEC
        store.begin_restore(x, SPEC, 8, token_ids=PREFIX)
    assert store.stat(x).spec == other_spec and store.stat(x).num_pages == 2


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("held", ["other tokens", "a prefix, then other tokens", "unknown tokens"])
@pytest.mark.parametrize("call", ["restore", "begin_restore", "begin_restore of all"])
def test_a_read_never_replaces_a_session_holding_other_tokens(world, tier, held, call):
    """A read of a session that exists, with the token ids of a prompt its
    pages do not begin (another session of the tenant holds all of it), is
    FAILED_PRECONDITION and changes nothing: starting from the shared pages
    is for a session that does not exist or holds a prefix of the prompt."""
    h, store = world
    eng = HostEngine(seed=17)
    store.save(key(0), eng.memory, SPEC, list(range(9)), 9 * SPEC.block_tokens, token_ids=own_tokens(0))
    x = make_key("t", "x")
    toks = {"other tokens": list(range(90_000, 90_000 + 6 * SPEC.block_tokens)),
            "a prefix, then other tokens": PREFIX[: 4 * SPEC.block_tokens] + [3] * (2 * SPEC.block_tokens),
            "unknown tokens": None}[held]
    store.save(x, eng.memory, SPEC, list(range(20, 26)), 6 * SPEC.block_tokens, token_ids=toks)
    if tier == "disk":
        store.demote(x, "disk")
    data = read_all(store.get(x)[1])
    before = store.stat(x)  # (after the read: its last access)
    used = {t: store.tiers[t].used for t in store.tiers}
    with pytest.raises(FailedPrecondition, match="other tokens"):
        if call == "restore":
            store.restore(x, HostEngine(seed=99).memory, SPEC, list(range(9)), token_ids=own_tokens(0))
        else:
            store.begin_restore(x, SPEC, 9 if call == "begin_restore" else 0, token_ids=own_tokens(0))
    assert store.stat(x) == before and set(before.tier_bytes) == {tier}
    assert read_all(store.get(x)[1]) == data and {t: store.tiers[t].used for t in store.tiers} == used
    assert store.lookup(x, own_tokens(0), SPEC).num_pages == (4 if held.startswith("a prefix") else 0)
    assert store.check_accounting() == []


def test_a_session_stored_again_over_shared_pages_on_disk_keeps_them_until_its_new_content_is_durable(world):
    """A session whose durable state shares prefix pages on disk, stored
    again from token 0: the index keeps that state (a crash finds it), its
    allocations keep their holders, and the accounting holds, per tenant
    too; written back, or dropped, it lets them go, and the other sessions
    read as before."""
    h, store = world
    eng = HostEngine(seed=5)
    save_all(store, eng, n=3)
    for i in range(3):
        store.demote(key(i))
    disk = store.tiers["disk"]
    used = disk.used
    store.save(key(0), eng.memory, SPEC, [20, 21], 2 * SPEC.block_tokens)  # other tokens: nothing shared
    assert disk.used == used and store.check_accounting() == [] and store.scan() == []
    (tenant_disk,) = [t for t in store.stats("t") if t.name == "disk"]
    assert tenant_disk.used == sum(store.stat(key(i)).tier_bytes.get("disk", 0) for i in range(3)) - tenant_disk.saved
    store = h.reopen()
    assert restored(store, key(0)) == eng.pages(list(range(8)) + [8])  # as it was: the new content was not durable
    store.save(key(0), eng.memory, SPEC, [20, 21], 2 * SPEC.block_tokens)
    # s1 stored again over the same prefix: its new content takes the prefix pages on disk from s2, recorded
    # in the index with it (the index holds the state kept until then)
    store.save(key(1), eng.memory, SPEC, list(range(8)) + [22], 9 * SPEC.block_tokens, token_ids=own_tokens(7))
    assert store.stat(key(1)).shared_bytes == 8 * SPEC.page_bytes
    assert store.check_accounting() == [] and store.scan() == []
    store.demote(key(0))  # the new content durable: the state kept for it goes
    store.demote(key(1))
    assert store.check_accounting() == [] and store.scan() == []
    store = h.reopen()
    assert restored(store, key(1)) == eng.pages(list(range(8)) + [22])
    store.drop(key(1))
    assert store.check_accounting() == [] and store.scan() == []
    # s0's pages lie in the allocation s2 still holds; s1's own pages go, s0's new pages come
    assert store.tiers["disk"].used == used - rounded(store, "disk", 1) + rounded(store, "disk", 2)
    assert restored(store, key(2)) == eng.pages(list(range(8)) + [10])
    assert restored(store, key(0), 2) == eng.pages([20, 21])
    store = h.reopen()
    assert sorted(store.keys()) == [key(0), key(2)] and store.scan() == [] and store.check_accounting() == []
    assert restored(store, key(2)) == eng.pages(list(range(8)) + [10])
