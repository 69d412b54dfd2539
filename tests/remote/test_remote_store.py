"""The remote store against a real Redis Cluster (and a single server):
versions published whole or not at all, racing writers that never splice,
reclaimed old versions, every page checked as it is read back, a session
cut short answering NotFound, and clear errors for a wrong password or a
store that is down."""

import re
import shutil
import threading
import time

import numpy as np
import pytest

from tests.remote.proxies import CuttingProxy
from tierd.checksum import page_checksum
from tierd.errors import DataLoss, FailedPrecondition, NotFound, Unauthenticated, Unavailable
from tierd.testing import RedisCluster
from tierd.remote.backend import Refused
from tierd.remote.manifest import FIRST_VERSIONS, tag_of
from tierd.remote.redis import RemoteStore, connect
from tierd.remote.redis.link import CHUNK_BYTES, chunks_of
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
KEY = SessionKey("alice", "chat-1")
PAGE = 3 * (1 << 20) // 2  # 1.5 MiB: pages and chunks do not line up


@pytest.fixture
def store(cluster):
    s = RemoteStore(connect(cluster.url), prefix=f"t{time.monotonic_ns()}")
    yield s
    s.close()


def snapshot(n_pages, seed, last=PAGE // 3):
    rng = np.random.default_rng(seed)
    pages = [rng.integers(0, 256, PAGE if i < n_pages - 1 else last, dtype=np.uint8).tobytes() for i in range(n_pages)]
    return pages, np.array([page_checksum(p) for p in pages], dtype=np.uint64)


def publish(store, pages, sums, expect=0, key=KEY):
    return store.publish(key, expect, {"model_id": "m"}, "fp", len(pages) * 16, PAGE, sums,
                         np.arange(len(pages), dtype=np.uint64), ((p, True) for p in pages))


def keys_of(store, key=KEY):
    return sorted(k.decode() for k in store.client.keys(f"{store.prefix}:{{{tag_of(key)}}}:*"))


def test_a_version_round_trips_byte_exact_under_keys_that_name_no_one(store):
    pages, sums = snapshot(3, seed=1)
    m = publish(store, pages, sums)
    assert FIRST_VERSIONS <= m.version < 2 * FIRST_VERSIONS  # a history starts at a number of its own
    assert (m.n_pages, m.nbytes) == (3, sum(map(len, pages)))
    got = store.head(KEY)[0]
    assert got.version == m.version and got.fingerprint == "fp" and list(got.checksums) == list(sums)
    assert list(got.token_hashes) == [0, 1, 2] and got.num_tokens == 48
    assert list(store.read(KEY, got)) == pages
    names = keys_of(store)
    assert len(names) == 1 + chunks_of(m.nbytes) and not any("alice" in n or "chat-1" in n for n in names)
    sizes = [store.client.strlen(n) for n in names if not n.endswith(":m")]
    assert max(sizes) == CHUNK_BYTES < 1 << 20  # below the power of two the allocator would round up to


def test_pieces_valid_until_the_next_are_copied_and_held_ones_sent_as_they_are(store):
    """A file tier hands out pages in staging buffers that it fills again; a
    memory tier's views stay put. Cut at random, the two mixed, more chunks
    than the buffers a publish keeps: what is read back is what was given."""
    pages, sums = snapshot(28, seed=11)  # 40 MiB: 41 chunks
    data = memoryview(b"".join(pages))
    rng = np.random.default_rng(12)
    staging = bytearray(3 << 20)

    def pieces():
        at = 0
        while at < len(data):
            size = min(int(rng.integers(1, 3 << 20)), len(data) - at)
            if rng.random() < 0.3:
                yield data[at : at + size], True
            else:
                staging[:size] = data[at : at + size]
                yield memoryview(staging)[:size], False
                staging[:size] = b"\xee" * size  # filled again: a piece that was not copied would show it
            at += size

    m = store.publish(KEY, 0, {"model_id": "m"}, "fp", len(pages) * 16, PAGE, sums,
                      np.arange(len(pages), dtype=np.uint64), pieces())
    assert chunks_of(m.nbytes) > 32 and list(store.read(KEY, m)) == pages


def test_a_new_version_replaces_the_old_whole_and_reclaims_it(store):
    pages, sums = snapshot(3, seed=2)
    first = publish(store, pages, sums)
    newer, new_sums = snapshot(4, seed=3)
    m = publish(store, newer, new_sums, expect=first.version)
    assert m.version == first.version + 1 and list(store.read(KEY, store.head(KEY)[0])) == newer
    assert len(keys_of(store)) == 1 + chunks_of(m.nbytes)  # version 1's chunks are gone


def test_racing_writers_leave_one_whole_history(store):
    """Two nodes saving the same session from the same version: one wins, the
    other is told so and leaves nothing behind; what is read is one of them, whole."""
    a, a_sums = snapshot(6, seed=4)
    b, b_sums = snapshot(6, seed=5)
    outcomes = {}

    def write(name, pages, sums):
        try:
            outcomes[name] = publish(store, pages, sums)
        except FailedPrecondition as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=write, args=args) for args in (("a", a, a_sums), ("b", b, b_sums))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [n for n, o in outcomes.items() if not isinstance(o, Exception)]
    assert len(won) == 1 and isinstance(outcomes[{"a": "b", "b": "a"}[won[0]]], FailedPrecondition)
    assert list(store.read(KEY, store.head(KEY)[0])) == (a if won == ["a"] else b)
    assert len(keys_of(store)) == 1 + chunks_of(outcomes[won[0]].nbytes)


def test_a_stale_writer_is_refused_and_changes_nothing(store):
    pages, sums = snapshot(2, seed=6)
    first = publish(store, pages, sums)
    second = publish(store, pages, sums, expect=first.version)
    before = keys_of(store)
    with pytest.raises(FailedPrecondition, match=f"version {second.version}"):
        publish(store, *snapshot(2, seed=7), expect=first.version)
    assert keys_of(store) == before and list(store.read(KEY, store.head(KEY)[0])) == pages


def test_a_changed_byte_is_data_loss_and_a_lost_chunk_not_found(store):
    pages, sums = snapshot(3, seed=8)
    m = publish(store, pages, sums)
    chunk = next(n for n in keys_of(store) if n.endswith(":1"))
    value = bytearray(store.client.get(chunk))
    value[12345] ^= 0x10
    store.client.set(chunk, bytes(value))
    page = (CHUNK_BYTES + 12345) // PAGE  # the changed byte's page
    with pytest.raises(DataLoss, match=f"page {page} failed its checksum in the remote tier"):
        list(store.read(KEY, store.head(KEY)[0]))
    store.client.delete(chunk)  # evicted, say
    with pytest.raises(NotFound, match="incomplete"):
        list(store.read(KEY, m))


def test_a_chunk_of_another_size_or_type_is_read_again_through_redis_py_and_is_data_loss(store):
    pages, sums = snapshot(3, seed=12)
    publish(store, pages, sums)
    assert list(store.read(KEY, store.head(KEY)[0])) == pages and store.fetcher.fallbacks == 0  # straight into memory
    chunk = next(n for n in keys_of(store) if n.endswith(":1"))
    value = store.client.get(chunk)
    store.client.set(chunk, value + b"x")  # a byte longer than its manifest says
    with pytest.raises(DataLoss, match="bytes, not what its manifest says"):
        list(store.read(KEY, store.head(KEY)[0]))
    assert store.fetcher.fallbacks == 1
    store.client.delete(chunk)
    store.client.rpush(chunk, b"not a value")  # a list where a chunk was
    with pytest.raises(DataLoss, match="WRONGTYPE"):
        list(store.read(KEY, store.head(KEY)[0]))
    store.client.delete(chunk)
    store.client.set(chunk, value)
    assert list(store.read(KEY, store.head(KEY)[0])) == pages  # the connections closed on the way work again
    assert store.fetcher.fallbacks == 2


def test_drop_leaves_only_a_tombstone_that_the_next_history_numbers_on_from(store):
    pages, sums = snapshot(2, seed=9)
    m = publish(store, pages, sums)
    assert store.drop(KEY)
    assert store.head(KEY)[0] is None and store.head(KEY) == (None, m.version + 1)
    assert keys_of(store) == [f"{store.prefix}:{{{tag_of(KEY)}}}:m"]  # the chunks are gone, the tombstone stays
    assert store.listed("alice") == [] and not store.drop(KEY)  # nothing there to drop
    assert store.head(KEY) == (None, m.version + 1) and store.tombstones([KEY, SessionKey("alice", "x")]) == \
        [m.version + 1, 0]
    with pytest.raises(FailedPrecondition):
        publish(store, pages, sums, expect=m.version)  # a node still holding the dropped version
    again = publish(store, pages, sums, expect=m.version + 1)  # a store from token 0, after the drop
    assert again.version == m.version + 2 and list(store.read(KEY, again)) == pages


@pytest.mark.parametrize("junk", [b"99999999999999999 {}", b"999999999999999999999 dropped", b"0 dropped"])
def test_a_version_number_past_what_the_scripts_hold_exactly_is_garbage_and_replaced(store, junk):
    """The scripts compare versions as Lua numbers (doubles): past 10**14 two
    versions could compare equal, and two writers both win."""
    manifest = f"{store.prefix}:{{{tag_of(KEY)}}}:m"
    store.client.set(manifest, junk)
    with pytest.raises(DataLoss, match="does not parse"):
        store.head(KEY)
    assert store.version_of(KEY) == 0 and store.tombstones([KEY]) == [0]
    pages, sums = snapshot(2, seed=18)
    m = publish(store, pages, sums)  # the next store replaces it
    assert FIRST_VERSIONS <= m.version < 2 * FIRST_VERSIONS and list(store.read(KEY, store.head(KEY)[0])) == pages
    store.client.set(manifest, junk)
    store.drop(KEY)
    assert store.head(KEY) == (None, 1) and store.tombstones([KEY]) == [1]  # a tombstone of its own in its place


def test_a_history_at_the_top_of_the_numbers_starts_again_below(store):
    from tierd.remote.manifest import MAX_VERSION

    manifest = f"{store.prefix}:{{{tag_of(KEY)}}}:m"
    store.client.set(manifest, f"{MAX_VERSION} dropped".encode())
    assert store.head(KEY) == (None, MAX_VERSION)
    pages, sums = snapshot(2, seed=19)
    m = publish(store, pages, sums, expect=MAX_VERSION)
    assert FIRST_VERSIONS <= m.version < 2 * FIRST_VERSIONS and store.head(KEY)[0].version == m.version
    raw = store.client.get(manifest)
    store.client.set(manifest, str(MAX_VERSION).encode() + raw[raw.index(b" "):])  # the same, numbered at the top
    assert store.head(KEY)[0].version == MAX_VERSION
    store.drop(KEY)
    assert store.head(KEY) == (None, 1)  # a tombstone, not a number the scripts print as 1e+14


def test_missing_tells_the_versions_the_store_lost_from_another_version_or_a_drop(store, monkeypatch):
    import tierd.remote.redis.manifests as manifests

    monkeypatch.setattr(manifests, "LOOK_BATCH", 5)  # a round trip for every session or two
    pages, sums = snapshot(3, seed=21)  # three chunks
    keys = [SessionKey("alice", f"look{i}") for i in range(5)]
    made = [publish(store, pages, sums, key=k) for k in keys]

    def ask():
        return store.missing([(k, m.version, m.write, m.nbytes) for k, m in zip(keys, made)])

    assert ask() == [False] * 5
    store.client.delete(store.link.key(keys[0], f"w{made[0].write}", "1"))  # a chunk evicted
    store.client.delete(store.link.key(keys[1], "m"))  # the manifest expired
    publish(store, pages, sums, expect=made[2].version, key=keys[2])  # another version: no loss
    store.drop(keys[3])  # a tombstone: no loss
    assert ask() == [True, True, False, False, False]


def test_a_version_whose_chunks_are_not_all_there_is_not_published(store):
    """A fail-over between the chunks' writes and the manifest's switch loses
    the chunks the old master had not passed on: the switch sees it."""
    pages, sums = snapshot(3, seed=16)
    m = publish(store, pages, sums)
    put = store._put

    def lose_one(key, write, first, chunks):
        put(key, write, first, chunks)
        store.client.delete(store.link.key(key, f"w{write}", str(first)))

    store._put = lose_one
    with pytest.raises(Refused, match="chunks written"):
        publish(store, *snapshot(3, seed=17), expect=m.version)
    store._put = put
    assert store.head(KEY)[0].write == m.write and list(store.read(KEY, m)) == pages  # the version before is served
    assert len(keys_of(store)) == 1 + chunks_of(m.nbytes)  # the new version's chunks are gone


def test_values_go_out_as_they_lie_and_replies_are_parsed_in_c(store):
    """hiredis's packer would copy each chunk into one buffer before sending it."""
    from redis.connection import PythonRespSerializer

    node = store.client.get_node_from_key(f"{store.prefix}:{{{tag_of(KEY)}}}:m")
    conn = node.redis_connection.connection_pool.get_connection()
    try:
        assert isinstance(conn._command_packer, PythonRespSerializer)
        view = memoryview(bytearray(CHUNK_BYTES))
        assert any(piece is view for piece in conn.pack_commands([("SET", "k", view)]))
        assert type(conn._parser).__name__ == "_HiredisParser"
    finally:
        node.redis_connection.connection_pool.release(conn)


def test_a_replica_serves_the_session_after_its_master_is_killed(tmp_path):
    cluster = RedisCluster(tmp_path).start()
    try:
        store = RemoteStore(connect(cluster.url), prefix="fo")
        pages, sums = snapshot(2, seed=10)
        publish(store, pages, sums)
        master = store.client.get_node_from_key(f"fo:{{{tag_of(KEY)}}}:m").port
        cluster.wait_replicated()  # (WAIT on a connection of its own would wait for none of the store's writes)
        store.close()
        cluster.kill(master)
        cluster.wait_ok(30)
        store = RemoteStore(connect(f"redis://127.0.0.1:{next(p for p in cluster.ports if cluster.alive(p))}"),
                            prefix="fo")
        assert list(store.read(KEY, store.head(KEY)[0])) == pages
        store.close()
    finally:
        cluster.close()


def test_a_single_server_is_found_for_what_it_is(single_server):
    client = connect(f"redis://127.0.0.1:{single_server}")
    assert type(client).__name__ == "Redis"
    store = RemoteStore(client, prefix="one")
    pages, sums = snapshot(2, seed=11)
    publish(store, pages, sums)
    assert list(store.read(KEY, store.head(KEY)[0])) == pages
    client.close()


def test_a_wrong_password_and_a_store_that_is_down_are_clear_errors(tmp_path):
    cluster = RedisCluster(tmp_path, password="s3cret").start()
    try:
        with pytest.raises(Unauthenticated, match="refused the password|needs a password"):
            connect(cluster.url, password="wrong")
        with pytest.raises(Unauthenticated, match="needs a password"):
            connect(cluster.url)
        store = RemoteStore(connect(cluster.url, password="s3cret"), prefix="pw")
        publish(store, *snapshot(1, seed=12))
        store.close()
    finally:
        cluster.close()
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="no node of the remote store answered"):
        connect(cluster.url, timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_calls_to_a_store_that_went_down_fail_fast(tmp_path):
    cluster = RedisCluster(tmp_path).start()
    try:
        store = RemoteStore(connect(cluster.url, timeout=0.5), prefix="down")
        publish(store, *snapshot(1, seed=13))
    finally:
        cluster.close()
    for call in (lambda: store.head(KEY)[0], lambda: publish(store, *snapshot(1, seed=14), expect=1)):
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="the remote store did not answer"):
            call()
        assert time.monotonic() - t0 < 5


def test_a_fetch_cut_in_the_middle_reads_the_rest_through_redis_py_from_where_it_stopped(single_server):
    proxy = CuttingProxy(single_server)
    try:
        store = RemoteStore(connect(f"redis://127.0.0.1:{proxy.port}"), prefix="cut")
        pages, sums = snapshot(12, seed=15)  # 17 chunks: several batches in flight at once
        publish(store, pages, sums)
        m = store.head(KEY)[0]
        proxy.cut = 6 * CHUNK_BYTES + CHUNK_BYTES // 3  # in the middle of chunk 6 (the manifest's reply is small)
        buf = bytearray(m.nbytes)
        at = 0

        def claim(n):
            nonlocal at
            at += n
            return [memoryview(buf)[at - n : at]]

        told = list(store.read_into(KEY, m, claim))
        assert told == sorted(set(told)) and told[-1] == m.nbytes  # more each time, to the end
        assert bytes(buf) == b"".join(pages) and store.fetcher.fallbacks == 1
        # The chunks before the cut were told to the reader (it may be placing them): not read again.
        wanted = [int(name.rsplit(b":", 1)[1]) for name in re.findall(rb"cut:\{[^}]+\}:w[^:\r]+:\d+", proxy.after)]
        assert proxy.was_cut and wanted == list(range(6, chunks_of(m.nbytes)))
        store.close()
    finally:
        proxy.close()


def test_a_tenant_s_bytes_are_a_running_total_kept_with_its_list(store):
    sizes = {}
    for i, n in enumerate((3, 1, 2)):
        pages, sums = snapshot(n, seed=20 + i)
        publish(store, pages, sums, key=SessionKey("alice", f"u{i}"))
        sizes[f"u{i}"] = sum(map(len, pages))
    publish(store, *snapshot(2, seed=30), key=SessionKey("bob", "u0"))  # another tenant's are its own
    assert store.usage("alice", "u1") == (sum(sizes.values()), sizes["u1"])
    pages, sums = snapshot(1, seed=31)
    publish(store, pages, sums, expect=store.head(SessionKey("alice", "u0"))[0].version, key=SessionKey("alice", "u0"))  # a new version in place of the old
    sizes["u0"] = len(pages[0])
    assert store.usage("alice", "u0") == (sum(sizes.values()), sizes["u0"])
    store.drop(SessionKey("alice", "u2"))
    del sizes["u2"]
    assert store.usage("alice", "nobody") == (sum(sizes.values()), 0)
    total = store.link.index("alice", "u")
    for damage in (lambda: store.client.delete(total), lambda: store.client.set(total, b"many")):
        damage()  # a store written before there was a total, or one garbled: summed again
        assert store.usage("alice", "u1") == (sum(sizes.values()), sizes["u1"])
        assert int(store.client.get(total)) == sum(sizes.values())


def test_a_large_manifest_is_read_whole_once_and_one_longer_than_its_head_says_not_at_all(store):
    """A manifest past what one reply carries (20,000 pages here): its head says
    how long it is, it is read whole once per version, and a value of another
    length at its key is DataLoss before any more of it is read."""
    import redis

    n, page = 20_000, 64
    data = np.random.default_rng(21).integers(0, 256, n * page, dtype=np.uint8).tobytes()
    sums = np.array([page_checksum(data[i * page : (i + 1) * page]) for i in range(n)], dtype=np.uint64)

    def publish_big(expect=0):
        return store.publish(KEY, expect, {"model_id": "m"}, "fp", n, page, sums, np.arange(n, dtype=np.uint64),
                             [(data, True)])

    m = publish_big()
    name = f"{store.prefix}:{{{tag_of(KEY)}}}:m"
    assert store.client.strlen(name) > 300_000
    node = redis.Redis(port=store.client.get_node_from_key(name).port)

    def sent():
        return node.info("stats")["total_net_output_bytes"]

    assert store.head(KEY)[0].version == m.version
    before = sent()
    again = store.head(KEY)[0]
    assert sent() - before < 100_000  # its head, not its 300 KB again
    assert again.version == m.version and list(again.checksums) == list(sums) and b"".join(store.read(KEY, again)) \
        == data
    newer = publish_big(expect=m.version)
    assert store.head(KEY)[0].version == newer.version  # a new version is read anew
    raw = store.client.get(name)
    for wrong in (raw + b"x", raw[:-1], raw[:70_000]):
        store.client.set(name, wrong)
        before = sent()
        with pytest.raises(DataLoss, match="bytes"):
            store.head(KEY)[0]
        assert sent() - before < 100_000


@pytest.mark.parametrize("damage", ["a wrong count", "a ghost in the map"])
def test_a_tenant_s_total_that_is_wrong_is_summed_again_at_its_first_recount(store, damage):
    """A total that reads as a count but is not the sum of the tenant's
    sessions (set so, or summed with an entry no session has) would refuse
    the tenant for ever: a recount sums it again from what the store holds."""
    sizes = {}
    for i, n in enumerate((2, 1)):
        pages, sums = snapshot(n, seed=40 + i)
        publish(store, pages, sums, key=SessionKey("alice", f"u{i}"))
        sizes[f"u{i}"] = sum(map(len, pages))
    names = {w: store.link.index("alice", w) for w in "sbu"}
    if damage == "a wrong count":
        store.client.set(names["u"], b"999999999999999")
    else:
        store.client.hset(names["b"], "ghost", b"999999999999999")
        store.client.delete(names["u"])
    assert store.usage("alice", "u1", recount=True) == (sum(sizes.values()), sizes["u1"])
    assert int(store.client.get(names["u"])) == sum(sizes.values())
    assert sorted(k.decode() for k in store.client.hkeys(names["b"])) == ["u0", "u1"]


@pytest.mark.parametrize("lost", ["list", "map"])
def test_sessions_gone_after_their_tenant_s_list_or_map_was_evicted_no_longer_count(store, lost):
    """allkeys-lru may evict any key, a tenant's list or map of bytes too; the
    sessions that expire afterwards give their bytes back at the next recount,
    and the list names the sessions the store holds."""
    sizes = {}
    for i in range(4):
        if i == 3:  # evicted before the last publish, then two sessions expire
            store.client.delete(store.link.index("alice", "s" if lost == "list" else "b"))
            for gone in (SessionKey("alice", "u0"), SessionKey("alice", "u1")):
                m = store.head(gone)[0]
                store.client.delete(store.link.key(gone, "m"), *[store.link.key(gone, f"w{m.write}", str(i))
                                                                for i in range(chunks_of(m.nbytes))])
        pages, sums = snapshot(1, seed=50 + i)
        publish(store, pages, sums, key=SessionKey("alice", f"u{i}"))
        sizes[f"u{i}"] = len(pages[0])
    assert store.usage("alice", "u3", recount=True) == (sizes["u2"] + sizes["u3"], sizes["u3"])
    assert store.listed("alice") == ["u2", "u3"]
    assert store.usage("alice", "u2") == (sizes["u2"] + sizes["u3"], sizes["u2"])


def test_a_manifest_longer_than_a_session_needs_is_refused_by_its_head_unread(store):
    """A value at a manifest's key that agrees with itself but is past what a
    manifest may be (one page and 72 MiB of token hashes: more than the kept
    manifests hold) is DataLoss from its head alone, however often asked for."""
    import redis

    from tierd.remote.manifest import Manifest, owner_of

    raw = Manifest(FIRST_VERSIONS, "ab12", "fp", {"model_id": "m"}, 16, 1, 1, np.zeros(1, np.uint64),
                   np.zeros((1, 1024, 72 << 10), np.uint8), 0.0, owner_of(KEY)).encode()
    name = f"{store.prefix}:{{{tag_of(KEY)}}}:m"
    store.client.set(name, raw)
    del raw
    node = redis.Redis(port=store.client.get_node_from_key(name).port)

    def sent():  # to clients (its replica is sent the value meanwhile)
        stats = node.info("stats")
        return stats["total_net_output_bytes"] - stats["total_net_repl_output_bytes"]

    for _ in range(3):
        before = sent()
        with pytest.raises(DataLoss, match="does not parse"):
            store.head(KEY)
        assert store.heads([KEY]) == [None]
        assert sent() - before < 1 << 20
    store.client.delete(name)
