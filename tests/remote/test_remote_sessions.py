"""The remote tier inside the store: two stores with separate data dirs
sharing one real Redis Cluster, as two nodes would. A session stored on
one is found, read, restored and appended to on the other, byte-exact and
checked; racing nodes leave one whole history; a damaged or cut-short
remote copy is DATA_LOSS or NOT_FOUND, never served; with the remote tier
down, local sessions are served and the others are NOT_FOUND at once."""

import shutil
import threading
import time
import zlib

import pytest

from tests.helpers import SPEC, Harness, HostEngine, MiB, flip_in_arena, heard, masters_stopped, published, wait_for
from tierd.errors import DataLoss, NotFound, Unavailable
from tierd.remote.manifest import tag_of
from tierd.remote.redis.link import chunks_of
from tierd.testing import RedisCluster
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
PAGE = SPEC.page_bytes


def tokens_of(key, num_tokens):
    """A session's token ids: its own, so that no two sessions here share pages (prefix sharing)."""
    base = zlib.crc32(f"{key.tenant}/{key.session_id}".encode()) * 100_000
    return list(range(base, base + num_tokens))


def save(store, key, engine, blocks, num_tokens, start_token=0, tokens=None):
    return store.save(key, engine.memory, SPEC, blocks, num_tokens, start_token,
                      token_ids=tokens if tokens is not None else tokens_of(key, num_tokens))


def stored(store, key, engine, blocks, num_tokens, **kw):
    """save(), then until the remote tier holds it."""
    save(store, key, engine, blocks, num_tokens, **kw)
    published(store, key)


def test_a_session_stored_on_one_node_is_read_and_restored_on_another(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "chat")
    src = HostEngine(seed=1)
    stored(a, key, src, [3, 1, 4], 40)

    info = b.stat(key)  # only the remote tier holds it here
    assert (info.tier, info.state, info.tier_bytes, info.num_tokens) == ("remote", "remote", {"remote": 3 * PAGE}, 40)
    assert b.lookup(key, tokens_of(key, 40)).num_tokens == 40
    assert b.lookup(key, tokens_of(key, 20) + [7] * 20).num_tokens == 16  # the first page matches, the second not
    assert b.keys() == []  # neither fetched

    dst = HostEngine(seed=2)
    r = b.restore(key, dst.memory, SPEC, [7, 8, 9])
    assert r.num_tokens == 40 and dst.pages([7, 8, 9]) == src.pages([3, 1, 4])
    assert b.stat(key).tier == "host" and b.stat(key).remote_durable  # fetched, and still what the remote holds
    _, reader = b.get(key)
    assert b"".join(bytes(c) for c in reader) == b"".join(src.pages([3, 1, 4]))


def test_a_restore_of_a_remote_session_scatters_its_pages_as_they_arrive_each_checked(nodes, cluster):
    a = nodes("a", host_budget=96 * MiB).store
    b = nodes("b", window_bytes=4 * PAGE).store  # blocks written four pages at a time at least
    src = HostEngine(seed=11, num_blocks=640)
    key, bad, late = SessionKey("alice", "long"), SessionKey("alice", "bad"), SessionKey("alice", "late")
    stored(a, key, src, list(range(640)), 640 * 16)  # 20 MiB: two batches of chunks
    for k in (bad, late):
        stored(a, k, src, list(range(96)), 96 * 16)  # 3 MiB: three chunks
    steps = []
    scatter = b.copier.scatter

    def spy(spans, engine, ids, geom, sums, *rest):
        steps.append((min(s.first_page for s in spans), sum(s.n_pages for s in spans), len(ids)))
        return scatter(spans, engine, ids, geom, sums, *rest)

    b.copier.scatter = spy
    dst = HostEngine(seed=12, num_blocks=640)
    blocks = list(range(639, 39, -1))  # 600 blocks for the first 600 of 640 pages
    r = b.restore(key, dst.memory, SPEC, blocks)
    assert (r.source_tier, r.num_pages, r.num_tokens) == ("remote", 600, 600 * 16)
    assert dst.pages(blocks) == src.pages(range(600))
    assert len(steps) > 1 and [n for _, _, n in steps][-1] == 600  # in steps, as the chunks came
    assert [f for f, _, _ in steps][1:] == [f + c for f, c, _ in steps][:-1] and sum(c for _, c, _ in steps) == 600
    assert b.stat(key).tier == "host" and b.stat(key).remote_durable  # all 640 pages fetched
    _, reader = b.get(key)
    assert b"".join(bytes(c) for c in reader) == b"".join(src.pages(range(640)))
    assert b.remote.store.fetcher.fallbacks == 0  # every reply read straight into the pages

    client, store = a.remote.store.client, a.remote.store
    for k, chunk, blocks in ((bad, 0, list(range(40))), (late, 2, [0, 1, 2])):  # pages 31 (a block) and 95 (none)
        name = store.link.key(k, f"w{store.head(k)[0].write}", str(chunk))
        value = bytearray(client.get(name))
        value[-5] ^= 1
        client.set(name, bytes(value))
        with pytest.raises(DataLoss, match="remote tier"):
            b.restore(k, HostEngine().memory, SPEC, blocks)
        assert k not in b.keys() and b.check_accounting() == []  # nothing of it kept here


def test_the_next_turn_on_another_node_appends_and_publishes_one_history(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "turns")
    eng = HostEngine(seed=3)
    stored(a, key, eng, [0, 1], 32)
    save(b, key, eng, [2], 48, start_token=32)  # turn 2 lands on b: fetched, appended
    published(b, key)
    c = nodes("c").store
    dst = HostEngine(seed=4)
    c.restore(key, dst.memory, SPEC, [5, 6, 7])
    assert dst.pages([5, 6, 7]) == eng.pages([0, 1, 2]) and c.stat(key).num_tokens == 48

    # a holds turn 1 only: it finds b's turn 2 before it appends turn 3, and the history goes on
    assert a.stat(key).num_tokens == 48  # answered from the remote tier's manifest
    stored(a, key, eng, [3], 64, start_token=48)
    heard(c, key)
    c.restore(key, dst.memory, SPEC, [5, 6, 7, 8])
    assert dst.pages([5, 6, 7, 8]) == eng.pages([0, 1, 2, 3]) and c.stat(key).num_tokens == 64

    c.drop(key)
    c2 = nodes("c2").store
    with pytest.raises(NotFound):
        c2.stat(key)


def test_a_copy_with_stores_not_published_is_served_as_it_is(nodes):
    a, quiet = nodes("a").store, nodes("quiet", remote_write="off").store
    key = SessionKey("alice", "mine-here")
    ours, theirs = HostEngine(seed=13), HostEngine(seed=14)
    save(quiet, key, ours, [0, 1], 32)  # never published: this node's copy is the session here
    stored(a, key, theirs, [0, 1], 32)
    dst = HostEngine(seed=15)
    quiet.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == ours.pages([0, 1]) and quiet.stat(key).tier == "host"


def test_a_copy_damaged_here_gives_way_to_the_remote_one(nodes):
    a, hb = nodes("a").store, nodes("b")
    b = hb.store
    key = SessionKey("alice", "hurt-here")
    eng = HostEngine(seed=18)
    stored(a, key, eng, [0, 1], 32)
    b.restore(key, HostEngine().memory, SPEC, [0, 1])  # fetched into b's host tier
    flip_in_arena(hb.root, eng.page(1)[:64])
    with pytest.raises(DataLoss):
        b.restore(key, HostEngine().memory, SPEC, [0, 1])
    dst = HostEngine(seed=19)
    b.restore(key, dst.memory, SPEC, [0, 1])  # the damaged copy is replaced by the remote tier's
    assert dst.pages([0, 1]) == eng.pages([0, 1]) and b.stat(key).state != "damaged"


@pytest.mark.parametrize("verify", [("disk",), ("host", "disk")])
def test_host_memory_damaged_before_a_publish_is_never_served_from_the_remote_tier(nodes, verify):
    ha = nodes("a", remote_write="off", verify=verify)  # publishes when asked
    a, b = ha.store, nodes("b").store
    key = SessionKey("alice", "bitflip")
    eng = HostEngine(seed=31)
    save(a, key, eng, [0, 1, 2], 48)
    flip_in_arena(ha.root, eng.page(2)[:64])
    if verify == ("disk",):  # a move out of host memory, unchecked there: every reader checks it
        assert a.publish(key)
        with pytest.raises(DataLoss, match="remote tier"):
            b.restore(key, HostEngine().memory, SPEC, [0, 1, 2])
        assert key not in b.keys()
    else:  # host memory verified on moves: the publish finds it
        assert not a.publish(key) and a.stat(key).state == "damaged"
        with pytest.raises(NotFound):
            b.restore(key, HostEngine().memory, SPEC, [0, 1, 2])
    with pytest.raises(DataLoss):
        a.restore(key, HostEngine().memory, SPEC, [0, 1, 2])


def test_a_garbled_remote_manifest_leaves_local_copies_served_and_published_again(nodes):
    a, b = nodes("a", remote_write="off").store, nodes("b").store  # a publishes when asked
    key = SessionKey("alice", "garbled")
    eng = HostEngine(seed=20)
    save(a, key, eng, [0, 1], 32)
    assert a.publish(key)
    a.remote.store.client.set(a.remote.store.link.key(key, "m"), b"1 {not json")
    dst = HostEngine(seed=21)
    a.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == eng.pages([0, 1]) and not a.stat(key).remote_durable
    with pytest.raises(DataLoss):
        b.restore(key, dst.memory, SPEC, [0, 1])
    assert a.publish(key)  # over what is there, whatever its version
    b.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == eng.pages([0, 1])


def test_racing_fresh_histories_leave_one_whole_one(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "race")
    ea, eb = HostEngine(seed=5), HostEngine(seed=6)
    for round_ in range(3):
        save(a, key, ea, [0, 1, 2], 48)
        save(b, key, eb, [0, 1, 2], 48)
    wait_for(lambda: a.publish_queue() == b.publish_queue() == (0, 0), what="publishers idle")
    c = nodes("c").store
    dst = HostEngine(seed=7)
    c.restore(key, dst.memory, SPEC, [0, 1, 2])
    assert dst.pages([0, 1, 2]) in (ea.pages([0, 1, 2]), eb.pages([0, 1, 2]))  # one node's, never a mix


def test_a_damaged_or_cut_short_remote_copy_is_never_served(nodes, cluster):
    a, b = nodes("a").store, nodes("b").store
    eng = HostEngine(seed=8)
    for sid in ("bad", "short"):
        save(a, SessionKey("alice", sid), eng, [0, 1], 32)
        published(a, SessionKey("alice", sid))
    client = a.remote.store.client
    bad = sorted(client.keys(f"{a.remote.store.prefix}:{{{tag_of(SessionKey('alice', 'bad'))}}}:w*"))[0]
    value = bytearray(client.get(bad))
    value[100] ^= 1
    client.set(bad, bytes(value))
    with pytest.raises(DataLoss):
        b.restore(SessionKey("alice", "bad"), HostEngine().memory, SPEC, [0, 1])
    short = sorted(client.keys(f"{a.remote.store.prefix}:{{{tag_of(SessionKey('alice', 'short'))}}}:w*"))[0]
    client.delete(short)
    with pytest.raises(NotFound):
        b.get(SessionKey("alice", "short"))
    assert b.keys() == [] and b.check_accounting() == []  # nothing half-fetched is left behind


def test_a_session_dropped_on_one_node_is_gone_from_the_copies_of_the_others(nodes):
    a, b, c = nodes("a").store, nodes("b").store, nodes("c").store
    key = SessionKey("alice", "dropped")
    old, new = HostEngine(seed=30), HostEngine(seed=31)
    stored(a, key, old, [0, 1], 32)
    _, reader = b.get(key)
    assert b"".join(bytes(x) for x in reader) == b"".join(old.pages([0, 1]))  # b holds a copy now
    a.drop(key)
    heard(b, key)
    with pytest.raises(NotFound):
        b.stat(key)  # its copy is of a version dropped since: forgotten
    assert b.keys() == [] and b.check_accounting() == []
    stored(a, key, old, [0, 1], 32)
    _, reader = b.get(key)
    assert b"".join(bytes(x) for x in reader) == b"".join(old.pages([0, 1]))
    a.drop(key)
    stored(c, key, new, [2, 3, 4], 48)  # a new history of the same id, after the drop
    heard(b, key)
    _, reader = b.get(key)  # b's copy is neither version: the new one is fetched
    assert b"".join(bytes(x) for x in reader) == b"".join(new.pages([2, 3, 4]))


def test_copies_of_sessions_dropped_elsewhere_are_swept_without_a_call_naming_them(nodes):
    a, b = nodes("a").store, nodes("b").store
    eng = HostEngine(seed=34)
    keys = [SessionKey("alice", f"swept{i}") for i in range(3)]
    for i, key in enumerate(keys):
        stored(a, key, eng, [i], 16)
        _, reader = b.get(key)
        b"".join(bytes(x) for x in reader)
    a.drop(keys[0])
    a.drop(keys[1])
    client = a.remote.store.client
    client.delete(f"{a.remote.store.prefix}:{{{tag_of(keys[1])}}}:m")  # its tombstone evicted before the sweep
    assert b.sweeper.sweep() == 1 and b.sweeper.sweep() == 0
    assert sorted(b.keys()) == sorted(keys[1:]) and b.check_accounting() == []  # the bytes are back
    assert [i.session_id for i in b.list("alice")[0]] == ["swept1", "swept2"]
    # (a copy whose tombstone went first stays, as a copy whose manifest was evicted does)
    old = b.table.get(keys[2])
    seen = old.remote_version  # what a sweep read, before the drop and the new history below
    a.drop(keys[2])
    stored(a, keys[2], HostEngine(seed=35), [5], 16)
    heard(b, keys[2])
    _, reader = b.get(keys[2])  # the new history fetched into the same session meanwhile
    assert b"".join(bytes(x) for x in reader) == HostEngine(seed=35).pages([5])[0]
    assert not b.finder.dropped_elsewhere(old, seen) and keys[2] in b.keys()  # not forgotten for the old one's drop


def read(store, key):
    _, reader = store.get(key)
    return b"".join(bytes(x) for x in reader)


def marked_down(store):
    """A call that times out while every master is stopped: the node marks the remote tier down."""
    with pytest.raises(NotFound):
        store.stat(SessionKey("alice", "nobody-stored-this"))


def test_a_drop_the_remote_tier_does_not_take_fails_and_changes_nothing(nodes, cluster):
    """A drop that returned OK while the tier was down was undone once it
    answered: other nodes served the dropped version until its TTL."""
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "forget-me")
    eng = HostEngine(seed=40)
    stored(a, key, eng, [0, 1], 32)
    with masters_stopped(cluster):
        marked_down(a)
        with pytest.raises(Unavailable, match="not dropped.*nothing was changed"):
            a.drop(key)
        with pytest.raises(Unavailable, match="served once the tier answers"):
            read(a, key)  # held, but not served while no one can say another node did not drop it
    wait_for(lambda: a.stat(key).remote_durable, what="the tier answering again")
    assert read(a, key) == b"".join(eng.pages([0, 1]))  # the failed drop changed nothing

    def dropped():
        try:
            a.drop(key)
        except Unavailable:
            return False  # until the probe finds the tier answering: the engine tries again
        return True

    wait_for(dropped, what="the drop taken once the tier answers")
    for store in (a, b):
        with pytest.raises(NotFound):
            store.get(key)


def test_a_drop_is_never_undone_by_a_node_that_did_not_hear_of_it(nodes, cluster):
    """Once Drop answered OK, no node serves the dropped version again: not
    one whose remote tier stopped answering right after the drop (its copy
    is not served while it cannot ask), and not one that stored a turn onto
    it while the tier was down (that turn continued the dropped
    conversation: forgotten with it)."""
    a, b, c = nodes("a").store, nodes("b").store, nodes("c").store
    key, turned = SessionKey("alice", "dropped-then-blip"), SessionKey("alice", "turn-then-drop")
    eng = HostEngine(seed=43)
    stored(a, key, eng, [0, 1], 32)
    stored(a, turned, eng, [2, 3], 32)
    assert read(b, key) == b"".join(eng.pages([0, 1])) and read(c, turned) == b"".join(eng.pages([2, 3]))
    a.drop(key)
    with masters_stopped(cluster):
        marked_down(b)
        for call in (lambda: read(b, key), lambda: b.lookup(key, tokens_of(key, 32)),
                     lambda: b.begin_restore(key, SPEC, 2)):
            with pytest.raises(Unavailable):
                call()  # b holds the dropped version and cannot ask: not served
        assert not b.stat(key).remote_durable
        marked_down(c)
        save(c, turned, eng, [4], 48, start_token=32)  # a turn onto c's copy, published once the tier answers

    def dropped():
        try:
            a.drop(turned)  # ... and dropped on a before c could publish it
        except Unavailable:
            return False
        return True

    wait_for(dropped, what="the drop taken once the tier answers")

    def gone(store, k):
        try:
            store.stat(k)
        except NotFound:
            return True
        except Unavailable:
            return False  # until its probe finds the tier answering
        return False

    wait_for(lambda: gone(b, key), what="b forgetting the session dropped while it could not ask")
    wait_for(lambda: gone(c, turned), what="c forgetting the turn it stored onto the dropped version")
    for store, k in ((b, key), (c, turned), (a, turned)):
        with pytest.raises(NotFound):
            read(store, k)
    assert a.remote.store.head(turned)[0] is None  # c's turn was not published over the tombstone


def test_a_node_started_again_gives_its_disk_copies_way_to_a_drop_or_a_newer_turn_made_meanwhile(nodes):
    """b held copies on disk and was stopped; meanwhile a dropped one
    session and stored the next turn of another. Started again, b served
    the dropped bytes and the older turn: its copies, recovered from disk,
    were taken for its own. Now it asks the remote tier first; a copy the
    tier holds nothing of stays b's own, and is published."""
    a, hb = nodes("a").store, nodes("b")
    b = hb.store
    dropped, grown, own = (SessionKey("alice", n) for n in ("dropped-meanwhile", "grown-meanwhile", "b-own"))
    eng = HostEngine(seed=45)
    stored(a, dropped, eng, [0, 1], 32)
    stored(a, grown, eng, [2, 3], 32)
    assert read(b, dropped) == b"".join(eng.pages([0, 1])) and read(b, grown) == b"".join(eng.pages([2, 3]))
    save(b, own, eng, [4], 16)
    published(b, own)
    hb.close(flush=True)  # every copy written to b's disk
    a.drop(dropped)
    save(a, grown, eng, [5], 48, start_token=32)
    published(a, grown)
    a.remote.store.drop(own)  # ... and b's own session gone from the remote tier
    b = hb.open()
    assert set(b.keys()) == {dropped, grown, own}  # recovered, all three
    with pytest.raises(NotFound):
        read(b, dropped)
    assert read(b, grown) == b"".join(eng.pages([2, 3, 5]))
    with pytest.raises(NotFound):
        read(b, own)  # its tombstone: dropped too


def test_a_session_stored_again_after_its_drop_survives_a_crash_before_its_publish(nodes):
    """Found by the chaos campaign (seed 6, "durable session gone"): a
    session dropped, stored again from token 0 on a node and written to its
    disk, then the node stopped before its new history was published. Started
    again, the node took its disk copy for one the tombstone had dropped and
    forgot it, though the drop came first. The index records that the copy
    is the node's own history: served, and published over the tombstone."""
    a = nodes("a").store
    hb = nodes("b", remote_write="back")  # publishes only sessions idle on disk for a minute
    key = SessionKey("alice", "again")
    eng = HostEngine(seed=51)
    stored(a, key, eng, [0, 1], 32)
    a.drop(key)  # a tombstone at its key
    save(hb.store, key, eng, [2, 3], 32)
    hb.store.write_back(key)
    assert hb.store.stat(key).durable and not hb.store.stat(key).remote_durable
    hb.close()
    hb.remote_write = "through"
    b = hb.open()
    assert read(b, key) == b"".join(eng.pages([2, 3]))
    published(b, key)
    assert read(a, key) == b"".join(eng.pages([2, 3]))


def written_back(h, key, eng, blocks):
    """Store a new history on node h (remote_write back, remote_idle 1), write
    it to disk and let it go idle past remote_idle: its publish is tried."""
    save(h.store, key, eng, blocks, 32)
    h.store.write_back(key)
    h.store.release(key)
    h.clock.advance(2.0)


def test_a_newer_history_on_disk_whose_publish_failed_survives_a_crash(nodes, cluster):
    """Found by the chaos campaign (seed 8, "older than durable"): a node's
    newer history (a store from token 0) on its disk, its publish tried
    while the remote tier was down, then the node killed. Started again, it
    gave its copy way to the older version the tier held. The index records
    the version the tier held when the publish was tried: where it still
    holds that one, nothing this node published landed, and its copy is the
    session."""
    hb = nodes("b", remote_write="back", remote_idle=1)
    key = SessionKey("alice", "newer-while-down")
    eng = HostEngine(seed=53)
    written_back(hb, key, eng, [0, 1])
    published(hb.store, key)  # the remote tier holds this version
    with masters_stopped(cluster):
        written_back(hb, key, eng, [2, 3])  # a new history: its publish is tried, and fails
        wait_for(hb.store.link.down.is_set, what="the publish tried, and the remote tier marked down")
        hb.close()  # as a kill: nothing more is published or written
    b = hb.open()
    assert read(b, key) == b"".join(eng.pages([2, 3]))


def test_a_newer_history_whose_publish_call_failed_survives_a_crash_where_the_tier_holds_what_it_did(nodes,
                                                                                                     monkeypatch):
    """The same, the publish failing in its call (it may or may not have
    landed): started again, the node finds the key still at the version the
    publish was tried over, so its copy is the session, and is published."""
    hb = nodes("b", remote_write="back", remote_idle=1)
    key = SessionKey("alice", "publish-cut")
    eng = HostEngine(seed=54)
    written_back(hb, key, eng, [0, 1])
    published(hb.store, key)
    tried = []

    def cut(*args, **kw):
        tried.append(args[0])
        raise Unavailable("the connection was reset in the middle of the publish")

    monkeypatch.setattr(hb.store.remote.store, "publish", cut)
    written_back(hb, key, eng, [2, 3])
    wait_for(lambda: tried, what="the publish tried")
    hb.close()
    b = hb.open()
    assert read(b, key) == b"".join(eng.pages([2, 3]))
    b.release(key)
    hb.clock.advance(2.0)
    published(b, key)


def test_a_history_on_disk_stored_again_survives_a_crash_over_the_older_version_the_tier_holds(nodes):
    """Found by the chaos campaign (seed 6, "older than durable"): a node's
    durable history, newer than the version the remote tier held, stored
    again from token 0 and the node killed before the new content was on
    disk. Started again, the node served the tier's older version: the store
    had taken its durable history out of the index first."""
    hb = nodes("b", remote_write="back", remote_idle=1)
    key = SessionKey("alice", "again-over-the-tier")
    eng = HostEngine(seed=56)
    written_back(hb, key, eng, [0, 1])
    published(hb.store, key)  # the remote tier holds this version
    save(hb.store, key, eng, [2, 3], 32)
    hb.store.write_back(key)  # durable here, not published (not idle)
    info = hb.store.stat(key)
    assert info.durable and not info.remote_durable
    save(hb.store, key, eng, [4, 5], 32)  # stored again: in memory only
    hb.close()  # as a kill
    b = hb.open()
    assert read(b, key) == b"".join(eng.pages([2, 3]))
    b.release(key)
    hb.clock.advance(2.0)
    published(b, key)  # this node's history, published over the older version
    assert read(nodes("c").store, key) == b"".join(eng.pages([2, 3]))


def test_a_copy_whose_publish_started_gives_way_to_a_drop_made_after_it(nodes):
    """The other side: a node's own copy on disk whose publish started may be
    the version another node dropped since. Started again, the node gives it
    way to the tombstone, as a copy of a published version does."""
    a = nodes("a").store
    hb = nodes("b", remote_write="back", remote_idle=1)
    key = SessionKey("alice", "published-then-dropped")
    eng = HostEngine(seed=52)
    written_back(hb, key, eng, [0, 1])  # on disk as the node's own history, then published
    published(hb.store, key)
    a.drop(key)
    hb.close()
    b = hb.open()
    with pytest.raises(NotFound):
        read(b, key)


def test_a_node_started_again_keeps_serving_from_disk_what_the_remote_tier_holds_as_it_is(nodes):
    """A recovered copy that is the remote tier's current version (the same
    page checksums) is recorded as published, not fetched again."""
    hb = nodes("b")
    key = SessionKey("alice", "unchanged")
    eng = HostEngine(seed=48)
    stored(hb.store, key, eng, [0, 1], 32)
    hb.close(flush=True)
    b = hb.open()
    info = b.stat(key)
    assert (info.tier, info.remote_durable) == ("disk", True)
    assert read(b, key) == b"".join(eng.pages([0, 1]))


def test_a_node_started_again_serves_and_publishes_a_copy_the_remote_tier_holds_nothing_of(nodes):
    hb = nodes("b")
    b = hb.store
    key = SessionKey("alice", "only-here")
    eng = HostEngine(seed=46)
    stored(b, key, eng, [0, 1], 32)
    hb.close(flush=True)
    evict(nodes("a").store, key, "everything")  # the remote tier holds nothing of it any more
    b = hb.open()
    assert read(b, key) == b"".join(eng.pages([0, 1]))
    published(b, key)


def test_a_node_never_serves_a_version_older_than_one_it_reported(nodes, cluster):
    """b held a copy, then said the session is a's newer version (Stat from
    the manifest): while the tier is down b does not serve its older copy."""
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "newer-elsewhere")
    eng = HostEngine(seed=44)
    stored(a, key, eng, [0, 1], 32)
    assert read(b, key) == b"".join(eng.pages([0, 1]))
    save(a, key, eng, [2], 48, start_token=32)
    wait_for(lambda: b.stat(key).num_tokens == 48, what="b seeing a's newer version")
    with masters_stopped(cluster):
        marked_down(b)
        with pytest.raises(Unavailable):
            read(b, key)
        assert not b.stat(key).remote_durable and not any(i.remote_durable for i in b.list("alice")[0])
    wait_for(lambda: b.stat(key).remote_durable, what="the tier answering again")
    assert read(b, key) == b"".join(eng.pages([0, 1, 2]))


def test_stores_made_while_the_remote_tier_is_down_are_published_once_it_answers(nodes, cluster):
    a, b = nodes("a").store, nodes("b").store
    fresh, appended = SessionKey("alice", "stored-while-down"), SessionKey("alice", "appended-while-down")
    old, new = HostEngine(seed=41), HostEngine(seed=42)
    stored(a, fresh, old, [0, 1], 32)
    stored(a, appended, old, [2, 3], 32)
    assert read(b, fresh) == b"".join(old.pages([0, 1]))  # b holds the old version
    with masters_stopped(cluster):
        marked_down(a)
        save(a, fresh, new, [0, 1], 32)  # a new history, while the tier is marked down
        save(a, appended, new, [4], 48, start_token=32)
        assert read(a, fresh) == b"".join(new.pages([0, 1]))  # a serves what it stored, never the older
    published(a, fresh)
    published(a, appended)
    heard(b, fresh)
    heard(b, appended)
    assert read(b, fresh) == b"".join(new.pages([0, 1]))
    assert read(b, appended) == b"".join(old.pages([2, 3]) + new.pages([4]))
    assert read(a, fresh) == b"".join(new.pages([0, 1]))


def evict(store, key, what):
    """Delete a session's chunks, or all its keys, as Redis's eviction or TTL does."""
    remote = store.remote.store
    m = remote.head(key)[0]
    names = [remote.link.key(key, f"w{m.write}", str(i)) for i in range(chunks_of(m.nbytes))]
    names += [remote.link.key(key, "m")] if what == "everything" else []
    assert remote.client.delete(*names) == len(names)


@pytest.mark.parametrize("what", ["chunks", "everything"])
def test_a_copy_the_remote_tier_evicted_is_not_remote_durable_and_is_published_again(nodes, what):
    quiet, a, b = nodes("quiet", remote_write="off").store, nodes("a").store, nodes("b").store  # quiet: when asked
    seen, swept, through = (SessionKey("alice", f"{what}-{n}") for n in ("stat", "sweep", "through"))
    eng = HostEngine(seed=43)
    for key, blocks in ((seen, [0, 1]), (swept, [2, 3])):
        save(quiet, key, eng, blocks, 32)
        assert quiet.publish(key)
    stored(a, through, eng, [4, 5], 32)
    for key in (seen, swept, through):
        evict(quiet, key, what)
        with pytest.raises(NotFound):
            b.get(key)  # no other node can serve it
    assert not quiet.stat(seen).remote_durable  # Stat looks
    assert quiet.sweeper.sweep() == 0
    assert not {i.session_id: i for i in quiet.list("alice")[0]}[swept.session_id].remote_durable  # the sweep did
    for key, blocks in ((seen, [0, 1]), (swept, [2, 3])):
        assert read(quiet, key) == b"".join(eng.pages(blocks))  # the local copy is still good
        assert quiet.publish(key) and read(b, key) == b"".join(eng.pages(blocks))
    wait_for(lambda: a.stat(through).remote_durable and read(b, through) == b"".join(eng.pages([4, 5])),
             missing_ok=True, what="published again, on its own")


@pytest.mark.parametrize("what", ["garbage", "foreign", "cut"])
def test_a_copy_no_node_can_resume_from_the_remote_tier_is_not_remote_durable(nodes, what):
    """What the remote tier holds at the session's keys resumes it on no node:
    bytes that are no manifest, another session's manifest copied in, or a
    chunk cut short. The copy is remote-durable no more (Stat and the sweep
    see it), is still served here, and is published again over what is
    there."""
    quiet, b = nodes("quiet", remote_write="off").store, nodes("b").store  # quiet: when asked
    key, donor = SessionKey("alice", f"damaged-{what}"), SessionKey("alice", f"donor-{what}")
    eng = HostEngine(seed=44)
    for k, blocks in ((key, [0, 1]), (donor, [2, 3])):
        save(quiet, k, eng, blocks, 32)
        assert quiet.publish(k)
    remote = quiet.remote.store
    client, manifest = remote.client, remote.link.key(key, "m")
    if what == "garbage":
        client.set(manifest, b"not a manifest")
    elif what == "foreign":
        client.set(manifest, client.get(remote.link.key(donor, "m")))
    else:
        chunk = remote.link.key(key, f"w{remote.head(key)[0].write}", "0")
        client.set(chunk, client.get(chunk)[:-1000])
    assert not quiet.stat(key).remote_durable  # Stat looks
    with pytest.raises((DataLoss, NotFound)):
        b.get(key)  # no other node can serve it
    assert quiet.sweeper.sweep() == 0
    assert not quiet.stat(key).remote_durable and quiet.stat(donor).remote_durable
    assert read(quiet, key) == b"".join(eng.pages([0, 1]))  # the local copy is still good
    assert quiet.publish(key) and read(b, key) == b"".join(eng.pages([0, 1]))  # and published over what is there


@pytest.mark.parametrize("over", ["version", "tombstone"])
def test_a_publish_the_store_lost_in_a_fail_over_leaves_the_node_s_copy_served_and_published_again(nodes, over):
    """A master lost before its replica had a publish: the promoted replica
    holds what that publish replaced (the version before, or a tombstone)."""
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", f"lost-{over}")
    first, second = HostEngine(seed=36), HostEngine(seed=37)
    manifest = f"{a.remote.store.prefix}:{{{tag_of(key)}}}:m"
    client = a.remote.store.client
    stored(a, key, first, [0, 1], 32)
    if over == "tombstone":
        a.drop(key)
    before = client.get(manifest)
    stored(a, key, second, [2, 3], 32)  # a new history, published over what `before` holds
    client.set(manifest, before)  # what the promoted replica holds
    (a.sweeper.sweep if over == "tombstone" else lambda: a.stat(key))()  # the sweep, or the next call, sees it
    assert a.keys() == [key]  # a's copy is the session: kept, and published again
    wait_for(lambda: client.get(manifest) != before and a.stat(key).remote_durable, what="published again")
    _, reader = b.get(key)
    assert b"".join(bytes(x) for x in reader) == b"".join(second.pages([2, 3]))


def test_a_lost_publish_whose_number_another_node_took_gives_way_to_that_node_s_history(nodes):
    """B's append is lost in a fail-over; A appends onto the version before,
    publishing under the number B's had: B follows the store's history
    rather than serving its own as current, and cannot publish over A's."""
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "renumbered")
    eng = HostEngine(seed=38)
    manifest = f"{a.remote.store.prefix}:{{{tag_of(key)}}}:m"
    client = a.remote.store.client
    stored(a, key, eng, [0, 1], 32)
    before = client.get(manifest)
    _, reader = b.get(key)
    b"".join(bytes(x) for x in reader)
    save(b, key, eng, [4], 48, 32)  # B's turn, published
    published(b, key)
    client.set(manifest, before)  # ... and lost: the store holds the version before again
    save(a, key, eng, [5], 48, 32)  # A's turn onto that version, under the number B's had
    published(a, key)
    heard(b, key)
    _, reader = b.get(key)
    assert b"".join(bytes(x) for x in reader) == b"".join(eng.pages([0, 1, 5]))
    assert b.publish(key) and client.get(manifest) == a.remote.store.client.get(manifest)
    _, reader = a.get(key)
    assert b"".join(bytes(x) for x in reader) == b"".join(eng.pages([0, 1, 5]))  # A's turn stands


def test_a_copy_stored_onto_before_its_drop_was_known_is_forgotten_not_published_over_the_tombstone(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "raced")
    eng = HostEngine(seed=32)
    stored(a, key, eng, [0, 1], 32)
    _, reader = b.get(key)
    b"".join(bytes(x) for x in reader)
    a.drop(key)
    # b's append committed before it could learn of the drop (the store's Saves: the store without the look first)
    b.saves.save(key, eng.memory, SPEC, [2], 48, 32, token_ids=tokens_of(key, 48))
    wait_for(lambda: b.publish_queue() == (0, 0), what="the publisher idle")
    assert a.remote.store.head(key)[0] is None  # the drop stands
    for store in (a, b):  # b's turn continued the dropped conversation: gone with it
        with pytest.raises(NotFound):
            store.stat(key)


def test_wait_ready_after_a_failed_fetch_says_why(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "spoiled")
    stored(a, key, HostEngine(seed=33), [0, 1], 32)
    client = a.remote.store.client
    chunk = sorted(client.keys(f"{a.remote.store.prefix}:{{{tag_of(key)}}}:w*"))[0]
    value = bytearray(client.get(chunk))
    value[7] ^= 1
    client.set(chunk, bytes(value))
    assert b.prefetch(key) == "queued"
    with pytest.raises(DataLoss, match="failed its checksum"):
        b.wait_ready(key, timeout=30)
    client.delete(chunk)
    assert b.prefetch(key) == "queued"
    with pytest.raises(NotFound, match="incomplete"):
        b.wait_ready(key, timeout=30)


def test_a_tenant_reaches_only_its_own_remote_sessions(nodes):
    a, b = nodes("a").store, nodes("b").store
    save(a, SessionKey("alice", "mine"), HostEngine(seed=9), [0], 16)
    published(a, SessionKey("alice", "mine"))
    for verb in (lambda k: b.stat(k), lambda k: b.get(k), lambda k: b.drop(k)):
        with pytest.raises(NotFound):
            verb(SessionKey("mallory", "mine"))
    assert b.stat(SessionKey("alice", "mine")).num_tokens == 16


def test_prefetch_fetches_a_remote_session_and_wait_ready_sees_it_come(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "prefetch")
    eng = HostEngine(seed=10)
    stored(a, key, eng, [0, 1, 2, 3], 64)
    assert b.prefetch(key) == "queued"
    assert b.wait_ready(key, timeout=30) == (True, "host")
    with pytest.raises(NotFound):
        b.prefetch(SessionKey("alice", "nowhere"))


def test_with_the_remote_tier_down_local_sessions_serve_and_others_are_not_found_at_once(nodes, tmp_path):
    down = RedisCluster(tmp_path / "down", masters=3, replicas=0).start()
    try:
        h = Harness(str(tmp_path / "n"), remote=down.url)
        s = h.open()
        key = SessionKey("alice", "local")
        eng = HostEngine(seed=11)
        stored(s, key, eng, [0, 1], 32)
        for port, _ in down.nodes():
            down.kill(port)
        t0 = time.monotonic()
        with pytest.raises(NotFound):
            s.stat(SessionKey("alice", "elsewhere"))
        for _ in range(20):
            with pytest.raises(NotFound):
                s.stat(SessionKey("alice", "elsewhere"))
        assert time.monotonic() - t0 < 10  # the first call times out, the rest fail at once
        save(s, key, eng, [2, 3], 32)
        dst = HostEngine(seed=12)
        s.restore(key, dst.memory, SPEC, [0, 1])
        assert dst.pages([0, 1]) == eng.pages([2, 3])
        assert not s.stat(key).remote_durable
        h.close()
    finally:
        down.close()


def test_a_fetch_queued_then_dropped_leaves_nothing_waiting(nodes):
    a, b = nodes("a").store, nodes("b", movers=0).store  # b runs no moves: its fetch stays queued
    key = SessionKey("alice", "queued")
    stored(a, key, HostEngine(seed=16), [0], 16)
    assert b.prefetch(key) == "queued"
    assert b.ready(key) == (False, "remote")
    b.drop(key)
    for verb in (b.ready, b.stat):
        with pytest.raises(NotFound):
            verb(key)


def test_a_fetch_takes_over_a_queued_prefetch_or_demotion_and_never_gives_way():
    from tierd.core.move_queue import Job
    from tierd.core.store.lifecycle import merge_prefetch
    from tierd.tiers.ioqueue import IOClass

    key = SessionKey("alice", "jobs")
    demotion = Job(key, "disk", "idle", IOClass.DEMOTION, 0, None)
    assert merge_prefetch(demotion, Job(key, "host", "fetch", IOClass.PREFETCH, 2, 5.0))
    assert (demotion.reason, demotion.target, demotion.priority, demotion.deadline) == ("fetch", "host", 2, 5.0)
    prefetch = Job(key, "host", "prefetch", IOClass.PREFETCH, 0, None)
    assert merge_prefetch(prefetch, Job(key, "host", "fetch", IOClass.PREFETCH, 0, None))
    assert prefetch.reason == "fetch"
    assert not merge_prefetch(prefetch, Job(key, "host", "prefetch", IOClass.PREFETCH, 0, None))
    assert prefetch.reason == "fetch"  # the remote version is still what the engine will read


def test_list_merges_the_sessions_only_the_remote_tier_holds_page_by_page(nodes):
    a, b = nodes("a").store, nodes("b").store
    eng = HostEngine(seed=17)
    for i in range(7):
        save(a, SessionKey("alice", f"r{i}"), eng, [i], 16)  # on a, so remote only for b
    save(a, SessionKey("bob", "other"), eng, [0], 16)
    for i in range(7):
        published(a, SessionKey("alice", f"r{i}"))
    published(a, SessionKey("bob", "other"))
    for i in (1, 4, 8):
        save(b, SessionKey("alice", f"r{i}"), eng, [i], 16)  # b's own (r1 and r4 newer than a's)
        published(b, SessionKey("alice", f"r{i}"))
    a.drop(SessionKey("alice", "r5"))
    seen, token = [], ""
    while True:
        page, token = b.list("alice", after=token, limit=3)
        assert len(page) <= 3
        seen += [(info.session_id, info.tier) for info in page]
        if not token:
            break
    assert [sid for sid, _ in seen] == ["r0", "r1", "r2", "r3", "r4", "r6", "r8"]
    assert dict(seen)["r0"] == "remote" and dict(seen)["r8"] == "host"
    assert {i.session_id for i in b.list("bob")[0]} == {"other"}  # each tenant its own


def test_a_tenant_past_its_remote_quota_stores_locally_only(nodes):
    a = nodes("a", remote_quota=3 * PAGE).store
    eng = HostEngine(seed=22)
    save(a, SessionKey("alice", "q1"), eng, [0, 1], 32)
    published(a, SessionKey("alice", "q1"))
    save(a, SessionKey("alice", "q2"), eng, [2, 3], 32)  # 4 pages in all: past the quota of 3
    wait_for(lambda: a.publish_queue() == (0, 0), what="the publisher idle")
    assert not a.stat(SessionKey("alice", "q2")).remote_durable
    save(a, SessionKey("bob", "q3"), eng, [2, 3], 32)  # another tenant's quota is its own
    published(a, SessionKey("bob", "q3"))
    save(a, SessionKey("alice", "q1"), eng, [0], 16)  # a smaller version of q1 in place of the old one
    published(a, SessionKey("alice", "q1"))
    a.drop(SessionKey("alice", "q1"))  # its bytes are given back
    save(a, SessionKey("alice", "q2"), eng, [2, 3], 32)
    published(a, SessionKey("alice", "q2"))


def test_a_full_publish_queue_leaves_stores_local_and_not_remote_durable(nodes, cluster):
    import redis

    a = nodes("a", remote_queue=1, remote_timeout=10).store  # writes held for 4 s are slow, not down
    eng = HostEngine(seed=23)
    masters = [port for port, role in cluster.nodes() if role == "master"]
    for port in masters:  # writes wait: the publisher's first SETs hang for the pause
        redis.Redis(port=port).client_pause(4000, all=False)
    keys = [SessionKey("alice", f"full{i}") for i in range(3)]
    save(a, keys[0], eng, [0], 16)
    wait_for(lambda: a.publish_queue() == (0, 1), what="the first publish under way")
    save(a, keys[1], eng, [1], 16)  # queued
    save(a, keys[2], eng, [2], 16)  # the queue is full: stored here only
    published(a, keys[0])
    published(a, keys[1])
    wait_for(lambda: a.publish_queue() == (0, 0), what="the publisher idle")
    assert not a.stat(keys[2]).remote_durable
    dst = HostEngine(seed=24)
    a.restore(keys[2], dst.memory, SPEC, [0])
    assert dst.pages([0]) == eng.pages([2])


def keys_of(store, key):
    client = store.remote.store.client
    return sorted(client.keys(f"{store.remote.store.prefix}:{{{tag_of(key)}}}:*"))


def copy_session(store, src, dst):
    """Copy every key of one session under another's hash tag, as a faulty or hostile store might."""
    client = store.remote.store.client
    for name in keys_of(store, src):
        client.set(name.decode().replace(tag_of(src), tag_of(dst)), client.get(name))


def test_keys_copied_from_another_session_or_tenant_are_never_served(nodes):
    a, b = nodes("a").store, nodes("b").store
    bob, alice, nobody = SessionKey("bob", "evil"), SessionKey("alice", "victim"), SessionKey("alice", "never")
    save(a, bob, HostEngine(seed=25), [0, 1], 32)
    save(a, alice, HostEngine(seed=26), [0, 1], 32)
    published(a, bob)
    published(a, alice)
    copy_session(a, bob, alice)
    copy_session(a, bob, nobody)
    for key in (alice, nobody):
        for verb in (lambda k: b.stat(k), lambda k: b.get(k), lambda k: b.lookup(k, list(range(32))),
                     lambda k: b.restore(k, HostEngine().memory, SPEC, [0, 1])):
            with pytest.raises(DataLoss):
                verb(key)
    assert [i.session_id for i in b.list("alice")[0]] == []  # neither listed as alice's
    save(a, alice, HostEngine(seed=27), [0, 1], 32)  # the owner stores again: its history replaces the copy
    published(a, alice)
    dst = HostEngine(seed=28)
    b.restore(alice, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == HostEngine(seed=27).pages([0, 1])


@pytest.mark.parametrize("garbage", [b"garbage", b"1 " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
                                     b'7 {"spec": {}, "pages": -5}\n'])
def test_a_garbled_manifest_is_data_loss_there_and_replaced_by_the_next_store(nodes, garbage):
    a, b = nodes("a").store, nodes("b").store
    key, other = SessionKey("alice", "garbled-m"), SessionKey("alice", "fine")
    eng = HostEngine(seed=29)
    save(a, key, eng, [0, 1], 32)
    save(a, other, eng, [2], 16)
    published(a, key)
    published(a, other)
    a.remote.store.client.set(a.remote.store.link.key(key, "m"), garbage)
    for verb in (lambda: b.stat(key), lambda: b.lookup(key, list(range(32))), lambda: b.get(key),
                 lambda: b.prefetch(key)):
        with pytest.raises(DataLoss):
            verb()
    assert [i.session_id for i in b.list("alice")[0]] == ["fine"]  # the tenant's other sessions are listed
    stored(a, key, eng, [3, 4], 32)
    dst = HostEngine(seed=30)
    b.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == eng.pages([3, 4])


def test_a_key_of_another_type_is_that_session_s_loss_not_the_tier_s(nodes):
    a, b = nodes("a").store, nodes("b").store
    key, other = SessionKey("alice", "wrongtype"), SessionKey("alice", "neighbour")
    eng = HostEngine(seed=31)
    stored(a, other, eng, [0], 16)
    a.remote.store.client.hset(a.remote.store.link.key(key, "m"), "x", "y")
    with pytest.raises(DataLoss):
        b.stat(key)
    assert b.stat(other).tier == "remote"  # the remote tier is not marked down by it


def test_a_manifest_key_of_another_type_is_replaced_by_the_next_store_and_the_local_copy_kept(nodes):
    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "wrongtype-stored")
    eng = HostEngine(seed=45)
    save(a, key, eng, [0, 1], 32)
    publisher_idle(a)
    a.remote.store.client.delete(a.remote.store.link.key(key, "m"))
    a.remote.store.client.rpush(a.remote.store.link.key(key, "m"), b"not a manifest")
    save(a, key, eng, [2, 3], 32)  # published over it
    publisher_idle(a)
    assert a.stat(key).state != "damaged" and a.stat(key).remote_durable
    dst = HostEngine(seed=46)
    b.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == eng.pages([2, 3])


def test_a_hung_master_keeps_the_tier_down_until_it_answers_and_this_node_s_own_sessions_serve(tmp_path):
    import os
    import signal

    from tierd.core.events import NullEvents

    class Ups(NullEvents):
        def __init__(self):
            self.seen = []

        def remote_up(self, up):
            self.seen.append(up)

    hung = RedisCluster(tmp_path / "hung", masters=3, replicas=0).start()  # no replica: nothing takes over
    ups = Ups()
    h = Harness(str(tmp_path / "n"), remote=hung.url, events=ups)
    try:
        s = h.open()
        key, own = SessionKey("alice", "published-before-hung"), SessionKey("alice", "own-while-hung")
        eng = HostEngine(seed=32)
        stored(s, key, eng, [0, 1], 32)
        port = s.remote.store.client.get_node_from_key(s.remote.store.link.key(key, "m")).port
        os.kill(hung.procs[port].pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 4.0  # the probe asks every second: it would have flapped by now
            reads = 0
            with pytest.raises(NotFound):
                s.stat(SessionKey("alice", "elsewhere"))  # waits out the timeout: the tier is down
            save(s, own, eng, [2, 3], 32)  # this node's own history, stored while the tier is down
            while time.monotonic() < end:
                dst = HostEngine(seed=33)
                s.restore(own, dst.memory, SPEC, [0, 1])  # served, none waits
                assert dst.pages([0, 1]) == eng.pages([2, 3])
                with pytest.raises(Unavailable):  # one other nodes may have dropped: not served while none can say
                    s.restore(key, dst.memory, SPEC, [0, 1])
                reads += 1
            assert reads > 20 and ups.seen.count(False) == 1 and True not in ups.seen[ups.seen.index(False):]
        finally:
            os.kill(hung.procs[port].pid, signal.SIGCONT)
        wait_for(lambda: ups.seen[-1] is True, what="the probe finds every primary answering")
        assert s.stat(key).remote_durable
        dst = HostEngine(seed=34)
        s.restore(key, dst.memory, SPEC, [0, 1])
        assert dst.pages([0, 1]) == eng.pages([0, 1])
    finally:
        h.close()
        hung.close()


def test_write_back_publishes_sessions_once_idle_on_disk(nodes):
    h = nodes("a", remote_write="back", remote_idle=2)
    a, b = h.store, nodes("b").store
    key = SessionKey("alice", "backed")
    eng = HostEngine(seed=34)
    save(a, key, eng, [0, 1], 32)
    a.write_back(key)  # on disk, still in use: not published
    assert a.publish_queue() == (0, 0) and not a.stat(key).remote_durable
    a.release(key)
    h.clock.advance(1.0)  # idle, not long enough yet
    with pytest.raises(NotFound):
        b.stat(key)
    h.clock.advance(1.5)
    published(a, key)
    dst = HostEngine(seed=35)
    b.restore(key, dst.memory, SPEC, [0, 1])
    assert dst.pages([0, 1]) == eng.pages([0, 1])


def publisher_idle(store):
    wait_for(lambda: store.publish_queue() == (0, 0), what="the publisher idle")


def names_of(store, key):
    """The keys of the session's current version: its manifest and its chunks."""
    remote = store.remote.store
    m = remote.head(key)[0]
    return [remote.link.key(key, "m")] + [remote.link.key(key, f"w{m.write}", str(i))
                                          for i in range(chunks_of(m.nbytes))]


@pytest.mark.parametrize("damage", ["total a list", "total past a count", "map a string", "list a string",
                                    "map values garbled"])
def test_a_garbled_tenant_key_is_repaired_and_no_session_s_loss(nodes, damage, caplog):
    """The tenant's list, map of bytes and total are bookkeeping: one that
    holds something else is reset (one log line) or summed again, and every
    node goes on storing, publishing and listing the tenant's sessions."""
    a, b = nodes("a", remote_quota=8 * PAGE).store, nodes("b", remote_quota=8 * PAGE).store
    eng = HostEngine(seed=40)
    keys = [SessionKey("alice", f"kept{i}") for i in range(3)]
    stored(a, keys[0], eng, [0, 1], 32)
    store = a.remote.store
    client, names = store.client, {w: store.link.index("alice", w) for w in "sbu"}
    if damage == "total a list":
        client.delete(names["u"])
        client.rpush(names["u"], b"not a count")
    elif damage == "total past a count":
        client.set(names["u"], b"9" * 30)  # a tenant refused for ever, were it believed
    elif damage == "map a string":
        client.delete(names["b"])
        client.set(names["b"], b"not a map")
    elif damage == "list a string":
        client.delete(names["s"])
        client.set(names["s"], b"not a list")
    else:
        client.delete(names["u"])  # summed again from the map, where kept0's bytes are no count
        client.hset(names["b"], "kept0", b"1e999")
    for node, key, blocks in ((a, keys[1], [2, 3]), (b, keys[2], [4, 5])):
        save(node, key, eng, blocks, 32)
        publisher_idle(node)
        info = node.stat(key)
        assert info.remote_durable and info.state != "damaged", (damage, key)
    for node, key, blocks in ((b, keys[1], [2, 3]), (a, keys[2], [4, 5]), (b, keys[0], [0, 1])):
        dst = HostEngine(seed=41)
        node.restore(key, dst.memory, SPEC, [0, 1])  # each node serves the others' sessions
        assert dst.pages([0, 1]) == eng.pages(blocks)
    c = nodes("c").store
    assert [i.session_id for i in c.list("alice")[0]] == ["kept0", "kept1", "kept2"]
    kinds = {w: client.type(name) for w, name in names.items()}
    assert kinds == {"s": b"zset", "b": b"hash", "u": b"string"}
    held = 4 * PAGE if damage in ("map a string", "map values garbled") else 6 * PAGE  # kept0's bytes forgotten
    assert store.usage("alice", "kept1") == (held, 2 * PAGE)
    if damage in ("total a list", "map a string", "list a string"):
        assert len([r for r in caplog.records if "reset" in r.getMessage()]) == 1


def test_sessions_that_expired_give_their_bytes_back_to_the_tenant_s_remote_quota(nodes):
    a = nodes("a", remote_quota=6 * PAGE).store
    eng = HostEngine(seed=42)
    keys = [SessionKey("alice", f"exp{i}") for i in range(4)]
    for i, key in enumerate(keys[:3]):
        stored(a, key, eng, [2 * i, 2 * i + 1], 32)  # the quota is full
    save(a, keys[3], eng, [6, 7], 32)
    publisher_idle(a)
    assert not a.stat(keys[3]).remote_durable  # past the quota
    client = a.remote.store.client
    names = names_of(a, keys[0])
    for name in names:
        client.pexpire(name, 1)
    wait_for(lambda: client.exists(*names) == 0, what="its keys expired")
    save(a, keys[3], eng, [6, 7], 32)
    publisher_idle(a)
    assert a.stat(keys[3]).remote_durable
    assert a.remote.store.usage("alice", "exp3") == (6 * PAGE, 2 * PAGE)
    assert [i.session_id for i in nodes("b").store.list("alice")[0]] == ["exp1", "exp2", "exp3"]


@pytest.mark.parametrize("damage", ["a total of a wrong count", "a ghost in the map", "the list evicted",
                                    "the map evicted"])
def test_broken_bookkeeping_of_a_tenant_never_costs_it_its_remote_quota(nodes, damage, caplog):
    """The tenant's total reads as a count but is wrong, or its list or map of
    bytes was evicted, and then two of its sessions expire: the next publishes
    past the total recount it from what the store holds (with a log line), and
    the tenant stores up to its quota again."""
    a = nodes("a", remote_quota=8 * PAGE).store
    eng = HostEngine(seed=44)
    keys = [SessionKey("alice", f"bk{i}") for i in range(5)]
    for i, key in enumerate(keys[:3]):
        stored(a, key, eng, [2 * i, 2 * i + 1], 32)
    store, client = a.remote.store, a.remote.store.client
    names = {w: store.link.index("alice", w) for w in "sbu"}
    if damage == "a total of a wrong count":
        client.set(names["u"], b"999999999999999")
    elif damage == "a ghost in the map":
        client.hset(names["b"], "ghost", b"999999999999999")
        client.delete(names["u"])
    else:
        client.delete(names["s" if damage == "the list evicted" else "b"])
    for key in keys[:2]:
        client.delete(*names_of(a, key))  # expired
    caplog.set_level("INFO", "tierd.remote.redis")
    caplog.clear()
    for i, key in enumerate(keys[3:], 3):
        save(a, key, eng, [2 * i, 2 * i + 1], 32)
        publisher_idle(a)
        assert a.stat(key).remote_durable, key
    assert store.usage("alice", "bk4") == (6 * PAGE, 2 * PAGE)
    assert [i.session_id for i in nodes("b").store.list("alice")[0]] == ["bk2", "bk3", "bk4"]
    assert any(r.name == "tierd.remote.redis" for r in caplog.records)


def test_sessions_redis_evicted_give_their_bytes_back_to_the_tenant_s_remote_quota(tmp_path):
    """maxmemory with allkeys-lru, as the operations guide says: Redis evicts
    the least recently used keys, chunks and manifests of old sessions."""
    import redis

    lru = RedisCluster(tmp_path / "lru", masters=3, replicas=0).start()
    h = Harness(str(tmp_path / "n"), remote=lru.url, remote_quota=6 * PAGE)
    try:
        a = h.open()
        eng = HostEngine(seed=43)
        keys = [SessionKey("alice", f"lru{i}") for i in range(4)]
        for i, key in enumerate(keys[:3]):
            stored(a, key, eng, [2 * i, 2 * i + 1], 32)
        save(a, keys[3], eng, [6, 7], 32)
        publisher_idle(a)
        assert not a.stat(keys[3]).remote_durable  # past the quota
        store, client = a.remote.store, a.remote.store.client
        names = {key: names_of(a, key) for key in keys[:3]}
        tenant = [store.link.index("alice", w) for w in "sbu"]
        nodes_of = {key: client.get_node_from_key(names[key][0]).port for key in keys[:3]}
        direct = {port: redis.Redis(port=port) for port in set(nodes_of.values())}

        def idle(key):
            return min(direct[nodes_of[key]].object("idletime", n) or 0 for n in names[key])

        wait_for(lambda: all(idle(key) >= 2 for key in keys[:3]), what="the sessions' keys idle")
        for port, r in direct.items():
            r.config_set("maxmemory-policy", "allkeys-lru")
            r.config_set("maxmemory-samples", 10)

        def whole(key):
            return client.exists(*names[key]) == len(names[key])

        def evict():  # a little under what each node holds, a step at a time: the oldest keys go
            client.zrange(tenant[0], 0, -1)  # the tenant's keys in use, as each publish uses them
            client.hgetall(tenant[1])
            client.get(tenant[2])
            for port, r in direct.items():
                if any(whole(key) for key in keys[:3] if nodes_of[key] == port):
                    r.config_set("maxmemory", r.info("memory")["used_memory"] - 1024)
                    r.ping()
            return sum(not whole(key) for key in keys[:3]) >= 2

        wait_for(evict, what="two sessions evicted")
        for r in direct.values():
            r.config_set("maxmemory", 0)
        assert client.exists(*tenant) == 3  # the tenant's own keys were not evicted
        save(a, keys[3], eng, [6, 7], 32)
        publisher_idle(a)
        assert a.stat(keys[3]).remote_durable
        total, _ = store.usage("alice", "lru3")
        assert total == sum(2 * PAGE for key in keys if key == keys[3] or whole(key))
    finally:
        h.close()
        lru.close()


def test_a_call_on_a_hung_cluster_waits_the_remote_timeout_at_most(tmp_path):
    """Every master stopped (their replicas up): a Stat of a session held
    nowhere here answers NOT_FOUND within the timeout, whatever redis-py does
    to find the cluster again."""
    import os
    import signal

    hung = RedisCluster(tmp_path / "hung", masters=3, replicas=1).start()
    h = Harness(str(tmp_path / "n"), remote=hung.url, remote_timeout=0.5)
    masters = [port for port, role in hung.nodes() if role == "master"]
    try:
        s = h.open()
        stored(s, SessionKey("alice", "here"), HostEngine(seed=44), [0, 1], 32)
        for port in masters:
            os.kill(hung.procs[port].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(NotFound):
            s.stat(SessionKey("alice", "elsewhere"))
        took = time.monotonic() - t0
        assert took < 0.5 + 0.25, f"{took:.2f} s"
        t0 = time.monotonic()  # the remote store itself (the tier is down in the store now): a List's heads
        with pytest.raises(Unavailable):
            s.remote.store.heads([SessionKey("alice", f"m{i}") for i in range(24)])
        took = time.monotonic() - t0
        assert took < 0.5 + 0.25, f"{took:.2f} s"
    finally:
        for port in masters:
            os.kill(hung.procs[port].pid, signal.SIGCONT)
        h.close()
        hung.close()


def test_a_list_reads_the_first_line_of_each_manifest_alone(nodes, cluster):
    """Lists of a tenant whose sessions have large manifests read each whole,
    every time (too many to keep): four Lists over 48 manifests of 11 MiB
    raised a node's memory by 931 MiB. A listing needs a manifest's first
    line only."""
    import numpy as np
    import redis

    from tierd.remote.manifest import Manifest, owner_of

    a, b = nodes("a").store, nodes("b").store
    key = SessionKey("alice", "large")
    eng = HostEngine(seed=47)
    stored(a, key, eng, [0, 1], 32)
    m = a.remote.store.head(key)[0]
    n = 200_000  # pages: a manifest of 4.8 MiB, every part of it consistent and the session's own
    large = Manifest(m.version, m.write, m.fingerprint, {**m.spec, "page_bytes": 1}, n, n, 1,
                     np.zeros(n, dtype=np.uint64), np.zeros((n, *m.token_hashes.shape[1:]), m.token_hashes.dtype),
                     m.saved, owner_of(key))
    a.remote.store.client.set(a.remote.store.link.key(key, "m"), large.encode())
    masters = [redis.Redis(port=p) for p, role in cluster.nodes() if role == "master"]

    def sent():
        return sum(r.info("stats")["total_net_output_bytes"] for r in masters)

    before = sent()
    for _ in range(3):
        b.list("alice")
    assert sent() - before < 3 * (200 << 10)  # its first line each time, never its 4.8 MiB


def test_a_prefetch_past_the_landing_tier_is_not_ready_until_its_promotion_is_done(nodes, monkeypatch):
    """A fetch lands in the landing tier; a Prefetch that asked for a faster
    tier is not ready, on any tier, until the promotion after it is done."""
    a, b = nodes("a").store, nodes("b", device_budget=64 * MiB).store
    key = SessionKey("alice", "promoted")
    stored(a, key, HostEngine(seed=36), [0, 1], 32)
    promoting, go = threading.Event(), threading.Event()
    promote = b.placement.promote

    def held(*args, **kw):
        promoting.set()
        go.wait(30)
        return promote(*args, **kw)

    monkeypatch.setattr(b.placement, "promote", held)
    assert b.prefetch(key, "device") == "queued"
    assert promoting.wait(30)
    try:
        assert b.ready(key, "device") == (False, "remote") and b.ready(key) == (False, "remote")
    finally:
        go.set()
    assert b.wait_ready(key, "device", timeout=30) == (True, "device")


def test_a_store_with_a_remote_tier_whose_recovery_fails_starts_no_thread(cluster, tmp_path, monkeypatch):
    """Recovery comes before the movers, the publisher and the sweep start."""
    from tests.core.test_recovery import assert_no_thread_left

    assert_no_thread_left(str(tmp_path / "n"), cluster.url, monkeypatch, remote_prefix=f"t{time.monotonic_ns()}")
