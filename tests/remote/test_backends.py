"""Every remote backend against the contracts of tierd/remote/backend.py,
on the real thing: a Redis Cluster with replicas, and a shared directory
(two backends opened on one directory are two nodes; racing publishers are
processes of their own, as nodes are). Versions whole or not at all, racing
writers that never splice, a drop that leaves nothing to resume, damage found
and never served."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tierd.checksum import page_checksum
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from tierd.remote import registry
from tierd.remote.files import FileBackend
from tierd.remote.manifest import FIRST_VERSIONS, tag_of
from tierd.remote.redis import RemoteStore, connect
from tierd.types import SessionKey
from tests.remote.test_remote_store import KEY, PAGE, publish, snapshot  # 1.5 MiB pages: chunks do not line up

HAVE_REDIS = shutil.which("redis-server") is not None


class Redis:
    """Two nodes' backends on one cluster, and how to damage what they wrote."""

    def __init__(self, cluster):
        prefix = f"t{time.monotonic_ns()}"
        self.a, self.b = (RemoteStore(connect(cluster.url), prefix=prefix) for _ in range(2))

    def _chunks(self, key):
        return sorted((k.decode() for k in self.a.client.keys(f"{self.a.prefix}:{{{tag_of(key)}}}:w*")),
                      key=lambda k: int(k.rpartition(":")[2]))

    def flip(self, key, at):
        name = self._chunks(key)[at // self.a.chunk_bytes]
        value = bytearray(self.a.client.get(name))
        value[at % self.a.chunk_bytes] ^= 0x10
        self.a.client.set(name, bytes(value))

    def cut(self, key):
        """Lose the end of the version (evicted, say): NotFound."""
        self.a.client.delete(self._chunks(key)[-1])
        return NotFound

    def lose(self, key):
        self.a.client.delete(self._chunks(key)[0])

    def shorten(self, key):
        """A chunk of the version of another length than the version needs."""
        name = self._chunks(key)[0]
        self.a.client.set(name, self.a.client.get(name)[:-1000])

    def garble(self, key, raw):
        self.a.client.set(f"{self.a.prefix}:{{{tag_of(key)}}}:m", raw)

    def close(self):
        self.a.close()
        self.b.close()


class Files:
    def __init__(self, root):
        self.root = root
        self.a, self.b = FileBackend(str(root)), FileBackend(str(root))

    def _data(self, key):
        where = self.a.dir_of(key)
        return next(os.path.join(where, n) for n in os.listdir(where) if n.startswith("w"))

    def flip(self, key, at):
        with open(self._data(key), "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x10]))

    def cut(self, key):
        """A torn file: cut short of what its manifest says is DataLoss."""
        path = self._data(key)
        os.truncate(path, os.path.getsize(path) - 1000)
        return DataLoss

    def lose(self, key):
        os.unlink(self._data(key))

    def shorten(self, key):
        """The version's file of another length than the version needs."""
        self.cut(key)

    def garble(self, key, raw):
        os.makedirs(self.a.dir_of(key), exist_ok=True)
        with open(os.path.join(self.a.dir_of(key), "m"), "wb") as f:
            f.write(raw)

    def close(self):
        pass


@pytest.fixture(params=["redis", "file"])
def nodes(request, tmp_path):
    if request.param == "redis":
        if not HAVE_REDIS:
            pytest.skip("redis-server is not installed (make install installs it)")
        n = Redis(request.getfixturevalue("cluster"))
    else:
        n = Files(tmp_path / "kv")
    yield n
    n.close()


def read(backend, m, key=KEY):
    """The version's pages as the core reads them: into memory of its own,
    in the backend's claims, each page checked against its checksum."""
    buf = memoryview(bytearray(m.nbytes))
    at = 0

    def claim(n):
        nonlocal at
        at += n
        return [buf[at - n : at]]

    for _ in backend.read_into(key, m, claim):
        pass
    pages = [bytes(buf[i * m.page_bytes : i * m.page_bytes + m.size_of(i)]) for i in range(m.n_pages)]
    for i, page in enumerate(pages):
        if page_checksum(page) != int(m.checksums[i]):
            raise DataLoss(f"page {i} failed its checksum in the remote tier", page=i, tier="remote")
    return pages


def test_a_version_published_on_one_node_reads_back_byte_exact_on_another(nodes):
    pages, sums = snapshot(4, seed=1)
    m = publish(nodes.a, pages, sums)
    assert FIRST_VERSIONS <= m.version < 2 * FIRST_VERSIONS  # a history starts at a number of its own
    got, version = nodes.b.head(KEY)
    assert version == m.version and got.fingerprint == "fp" and list(got.checksums) == list(sums)
    assert list(got.token_hashes) == [0, 1, 2, 3] and got.num_tokens == 64
    assert read(nodes.b, got) == pages
    assert nodes.b.heads([KEY, SessionKey("alice", "none")])[0].version == m.version
    assert nodes.b.heads([SessionKey("alice", "none")]) == [None]


def test_a_new_version_replaces_the_old_whole_and_a_reader_of_the_old_finds_it_gone(nodes):
    pages, sums = snapshot(3, seed=2)
    first = publish(nodes.a, pages, sums)
    newer, new_sums = snapshot(4, seed=3)
    m = publish(nodes.b, newer, new_sums, expect=first.version)
    assert m.version == first.version + 1 and read(nodes.a, nodes.a.head(KEY)[0]) == newer
    with pytest.raises(NotFound):
        read(nodes.a, first)  # its bytes were reclaimed: never a mix of two versions


def test_a_stale_writer_is_refused_and_changes_nothing(nodes):
    pages, sums = snapshot(2, seed=6)
    first = publish(nodes.a, pages, sums)
    second = publish(nodes.a, pages, sums, expect=first.version)
    with pytest.raises(FailedPrecondition, match=f"version {second.version}"):
        publish(nodes.b, *snapshot(2, seed=7), expect=first.version)
    assert nodes.b.head(KEY)[0].write == second.write and read(nodes.b, second) == pages


def test_changed_bytes_are_data_loss_and_a_version_cut_short_is_never_served(nodes):
    pages, sums = snapshot(3, seed=8)
    m = publish(nodes.a, pages, sums)
    nodes.flip(KEY, PAGE + 12345)
    with pytest.raises(DataLoss, match="page 1 failed its checksum"):
        read(nodes.b, nodes.b.head(KEY)[0])
    error = nodes.cut(KEY)
    with pytest.raises(error):
        read(nodes.b, m)


@pytest.mark.parametrize("garbage", [b"not a manifest", b"12 {\"write\": 1}\n", b"[" * 100_000])
def test_a_garbled_manifest_is_data_loss_and_the_next_history_replaces_it(nodes, garbage):
    publish(nodes.a, *snapshot(2, seed=10))
    nodes.garble(KEY, garbage)
    with pytest.raises(DataLoss, match="does not parse"):
        nodes.b.head(KEY)
    assert nodes.b.heads([KEY]) == [None] and nodes.b.tombstones([KEY]) == [0]
    pages, sums = snapshot(2, seed=11)
    m = publish(nodes.b, pages, sums, expect=nodes.b.version_of(KEY))  # what the core's next store expects
    assert read(nodes.a, nodes.a.head(KEY)[0]) == pages and nodes.a.head(KEY)[1] == m.version


def test_a_manifest_copied_from_another_session_is_refused(nodes):
    other = SessionKey("alice", "chat-2")
    publish(nodes.a, *snapshot(2, seed=12), key=other)
    raw = nodes.a.head(other)[0].encode()
    nodes.garble(KEY, raw)
    with pytest.raises(DataLoss, match="another session's"):
        nodes.b.head(KEY)


def test_a_drop_leaves_a_tombstone_and_nothing_another_node_can_resume(nodes):
    pages, sums = snapshot(2, seed=9)
    m = publish(nodes.a, pages, sums)
    assert nodes.a.drop(KEY)
    assert nodes.b.head(KEY) == (None, m.version + 1)
    assert nodes.b.tombstones([KEY, SessionKey("alice", "x")]) == [m.version + 1, 0]
    with pytest.raises(NotFound):
        read(nodes.b, m)  # a node that read the manifest before the drop finds nothing to resume
    assert nodes.b.listed("alice") == [] and not nodes.b.drop(KEY)  # nothing there to drop
    with pytest.raises(FailedPrecondition):
        publish(nodes.b, pages, sums, expect=m.version)  # a node still holding the dropped version
    again = publish(nodes.b, pages, sums, expect=m.version + 1)  # a new history after the drop
    assert again.version == m.version + 2 and read(nodes.a, again) == pages


def test_a_node_learns_which_of_its_versions_the_store_lost_and_no_other_change_is_a_loss(nodes):
    pages, sums = snapshot(2, seed=11)
    first = publish(nodes.a, pages, sums)
    other = SessionKey("alice", "other")
    m = publish(nodes.a, pages, sums, key=other)
    asked = [(KEY, first.version, first.write, first.nbytes), (other, m.version, m.write, m.nbytes),
             (SessionKey("alice", "never"), 7, "0" * 16, 1)]
    assert nodes.b.missing(asked) == [False, False, True]
    publish(nodes.b, pages, sums, expect=first.version)  # another node's newer version: no loss
    nodes.b.drop(other)  # a drop: no loss either
    assert nodes.a.missing(asked[:2]) == [False, False]
    third = SessionKey("alice", "third")
    m = publish(nodes.a, pages, sums, key=third)
    nodes.lose(third)  # the store evicted part of the version
    assert nodes.b.missing([(third, m.version, m.write, m.nbytes), asked[0]]) == [True, False]


@pytest.mark.parametrize("damage", ["garbage", "a manifest cut short", "another session's manifest",
                                    "the version's bytes cut short"])
def test_a_version_no_node_can_resume_is_missing_whatever_damaged_it(nodes, damage):
    """missing() is true exactly where a node that holds no copy cannot
    resume the version from the store: the manifest's key holds bytes that
    are no manifest (nor a tombstone), a manifest whose first line is there
    but not the rest, another session's manifest, or the version's bytes are
    of another length than it needs."""
    pages, sums = snapshot(3, seed=15)
    m = publish(nodes.a, pages, sums)
    asked = [(KEY, m.version, m.write, m.nbytes)]
    assert nodes.b.missing(asked) == [False]
    if damage == "garbage":
        nodes.garble(KEY, b"not a manifest")
    elif damage == "a manifest cut short":
        raw = m.encode()
        nodes.garble(KEY, raw[: raw.index(b"\n") + 9])  # its version and write id still at its head
    elif damage == "another session's manifest":
        other = SessionKey("alice", "chat-2")
        nodes.garble(KEY, publish(nodes.a, pages, sums, key=other).encode())
    else:
        nodes.shorten(KEY)
    with pytest.raises((DataLoss, NotFound)):
        read(nodes.b, nodes.b.head(KEY)[0])  # no node resumes it
    assert nodes.b.missing(asked) == [True]


def test_a_tenant_s_sessions_are_listed_and_counted_for_it_alone(nodes):
    a, a_sums = snapshot(2, seed=13)
    b, b_sums = snapshot(3, seed=14)
    publish(nodes.a, a, a_sums, key=SessionKey("alice", "s1"))
    publish(nodes.b, b, b_sums, key=SessionKey("alice", "s2"))
    publish(nodes.b, a, a_sums, key=SessionKey("bob", "s1"))
    size_a, size_b = sum(map(len, a)), sum(map(len, b))
    assert nodes.a.listed("alice") == ["s1", "s2"] and nodes.a.listed("alice", after="s1") == ["s2"]
    assert nodes.a.listed("alice", count=1) == ["s1"] and nodes.a.listed("carol") == []
    assert nodes.b.usage("alice", "s2") == (size_a + size_b, size_b)
    assert nodes.b.usage("bob", "s2") == (size_a, 0)
    nodes.a.drop(SessionKey("alice", "s1"))
    assert nodes.b.listed("alice") == ["s2"] and nodes.b.usage("alice", "s1") == (size_b, 0)
    nodes.a.ping()


RACER = textwrap.dedent("""
    import sys, numpy as np
    from tierd.errors import FailedPrecondition
    from tierd.remote.files import FileBackend
    from tierd.types import SessionKey
    from tierd.checksum import page_checksum
    backend, me, rounds = FileBackend(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    wins = 0
    for r in range(rounds):
        page = bytes([me]) * 65536 + r.to_bytes(4, "little")
        _, version = backend.head(SessionKey("alice", "race"))
        try:
            backend.publish(SessionKey("alice", "race"), version, {}, "fp", 16, len(page),
                            np.array([page_checksum(page)] * 3, dtype=np.uint64), np.zeros(0, np.uint64),
                            [(page, True)] * 3)
            wins += 1
        except FailedPrecondition:
            pass
    print(wins)
""")


def test_publishers_racing_from_several_processes_keep_one_whole_history(tmp_path):
    """Nodes are processes: the manifest's switch is a compare-and-set across
    them (record locks), so every version builds on the one before, and the
    one read is one writer's, whole."""
    root = tmp_path / "kv"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(root), str(me), "40"], stdout=subprocess.PIPE,
                               env=env, text=True) for me in (1, 2, 3)]
    wins = [int(p.communicate(timeout=120)[0]) for p in racers]
    assert all(p.returncode == 0 for p in racers)
    backend = FileBackend(str(root))
    m, version = backend.head(SessionKey("alice", "race"))
    first = version - sum(wins) + 1  # every win added one to the history, none was lost or doubled
    assert FIRST_VERSIONS <= first < 2 * FIRST_VERSIONS
    pages = read(backend, m, SessionKey("alice", "race"))
    assert len({p for p in pages}) == 1 and pages[0][0] in (1, 2, 3)  # one writer's pages, none spliced
    where = backend.dir_of(SessionKey("alice", "race"))
    assert [n for n in os.listdir(where) if n.startswith("w")] == [f"w{m.write}"]  # losers left nothing


def test_a_huge_file_at_a_manifest_s_place_is_refused_by_its_size_unread(tmp_path):
    from tierd.remote.manifest import MAX_MANIFEST_BYTES

    backend = FileBackend(str(tmp_path))
    publish(backend, *snapshot(1, seed=15))
    path = os.path.join(backend.dir_of(KEY), "m")
    os.truncate(path, MAX_MANIFEST_BYTES + 1)  # sparse: reading it would cost its size
    with pytest.raises(DataLoss, match="does not parse"):
        backend.head(KEY)


def test_a_version_older_than_the_ttl_is_gone_as_an_expired_key_is(tmp_path):
    backend = FileBackend(str(tmp_path), ttl=60)
    m = publish(backend, *snapshot(1, seed=16))
    assert backend.head(KEY)[0].version == m.version
    for name in os.listdir(backend.dir_of(KEY)):  # the manifest and its bytes, written 61 s ago
        os.utime(os.path.join(backend.dir_of(KEY), name), (time.time() - 61, time.time() - 61))
    assert backend.head(KEY) == (None, 0)
    assert backend.usage("alice", KEY.session_id) == (m.nbytes, m.nbytes)  # as listed, until a recount
    assert backend.usage("alice", KEY.session_id, recount=True) == (0, 0) and backend.listed("alice") == []
    assert backend.missing([(KEY, m.version, m.write, m.nbytes)]) == [True]
    again = publish(backend, *snapshot(1, seed=17))  # a new history, as after a Redis key expired
    assert backend.head(KEY)[0].version == again.version
    assert [n for n in os.listdir(backend.dir_of(KEY)) if n.startswith("w")] == [f"w{again.write}"]


def test_a_directory_not_mounted_is_unavailable_not_an_empty_store(tmp_path):
    """The share unmounted under a node: a drop answered OK (nothing there),
    and publishes went into the mount point, reported remote-durable."""
    backend = FileBackend(str(tmp_path / "mnt"))
    m = publish(backend, *snapshot(1, seed=18))
    os.rename(tmp_path / "mnt", tmp_path / "elsewhere")  # as an unmount leaves the empty mount point
    os.makedirs(tmp_path / "mnt")
    for call in (backend.ping, lambda: backend.drop(KEY), lambda: backend.head(KEY),
                 lambda: publish(backend, *snapshot(1, seed=19), expect=m.version)):
        with pytest.raises(Unavailable, match="not mounted"):
            call()
    assert os.listdir(tmp_path / "mnt") == []  # nothing written into the mount point
    os.rmdir(tmp_path / "mnt")
    os.rename(tmp_path / "elsewhere", tmp_path / "mnt")  # mounted again: as it was
    assert backend.head(KEY)[0].version == m.version and backend.drop(KEY)


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_anything_but_a_file_at_a_session_s_place_is_that_session_s_loss_and_never_blocks(tmp_path, what):
    """A pipe in place of a manifest or a version's bytes blocked every call
    naming the session (past any deadline); a directory took the whole tier
    down."""
    backend = FileBackend(str(tmp_path))
    other = SessionKey("alice", "other")
    publish(backend, *snapshot(1, seed=20), key=other)
    m = publish(backend, *snapshot(1, seed=21))
    for name in ("m", f"w{m.write}"):
        path = os.path.join(backend.dir_of(KEY), name)
        os.replace(path, path + ".kept")
        os.mkfifo(path) if what == "fifo" else os.mkdir(path)
        t0 = time.monotonic()
        with pytest.raises(DataLoss):
            backend.head(KEY) if name == "m" else read(backend, m)
        assert time.monotonic() - t0 < 5
        assert backend.missing([(KEY, m.version, m.write, m.nbytes)]) == [True]
        assert backend.head(other)[0] is not None  # the others' sessions as they were
        os.remove(path) if what == "fifo" else os.rmdir(path)
        os.replace(path + ".kept", path)


def test_the_registry_opens_a_backend_by_scheme_and_names_the_schemes_it_knows(tmp_path):
    opened = registry.open_backend(f"file://{tmp_path}", registry.Options(prefix="p"))
    assert isinstance(opened, FileBackend) and opened.root == str(tmp_path / "p")
    with pytest.raises(InvalidArgument, match=r"no remote backend serves 'nfs' URLs \(known: .*file, redis, rediss"):
        registry.open_backend("nfs://server/kv", registry.Options())


def test_a_session_saved_on_a_node_resumes_on_another_through_a_shared_directory_after_it_is_killed(tmp_path):
    from tests.helpers import wait_for
    from tierd.layout import KVSpec
    from tierd.testing import Daemon

    spec = KVSpec("test/llama-tiny", "r1", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                  block_tokens=16)
    kv = tmp_path / "kv"
    kv.mkdir()
    a, b, c = (Daemon(tmp_path / name, "--remote", f"file://{kv}") for name in "abc")
    try:
        a.start()
        b.start()
        assert "remote tier: directory" in a.log()
        tokens = list(range(1000, 1080))
        data = os.urandom(5 * spec.page_bytes)
        with a.client() as ca:
            ca.put("chat", data, spec, 80, token_ids=tokens)
            wait_for(lambda: ca.stat("chat").remote_durable, what="the session published")
        a.kill()
        with b.client() as cb:
            info = cb.stat("chat")
            assert (info.tier, info.num_tokens) == ("remote", 80)
            assert cb.lookup("chat", tokens[:40] + [1] * 40, spec).num_tokens == 32
            assert cb.get("chat") == data  # byte-exact, fetched through the directory
            cb.drop("chat")
        c.start()
        with c.client() as cc:
            with pytest.raises(NotFound):
                cc.get("chat")  # dropped on b: no node resumes it
    finally:
        for d in (a, b, c):
            d.close()


def test_a_session_past_what_a_manifest_holds_is_refused_before_a_byte_is_written(nodes):
    """Readers take a manifest of MAX_PAGES pages at most (sessions of millions
    of tokens): a longer session is never published, nothing of it written."""
    from tierd.remote.backend import Refused
    from tierd.remote.manifest import MAX_PAGES

    def data():
        raise AssertionError("a byte of it was asked for")
        yield

    n = MAX_PAGES + 1
    with pytest.raises(Refused, match=f"{MAX_PAGES} pages"):
        nodes.a.publish(KEY, 0, {"model_id": "m"}, "fp", 16 * n, 1, np.zeros(n, np.uint64),
                        np.zeros((n, 16), np.uint8), data())
    assert nodes.a.head(KEY) == (None, 0) and nodes.a.listed("alice") == []
