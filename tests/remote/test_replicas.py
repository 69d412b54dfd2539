"""Remote-durable means on a replica (--remote-replicas, WAIT), against a
real Redis Cluster: a publish whose master's replica is stopped is taken
(the session's version, served) but not remote-durable until the replica
has it; then the master is killed right after the publish was acknowledged,
a replica takes over, and another node resumes the session byte-exact."""

import os
import shutil
import signal

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, wait_for
from tierd.checksum import page_checksum
from tierd.remote.backend import Unreplicated
from tierd.remote.manifest import tag_of
from tierd.remote.redis import RemoteStore, connect
from tierd.testing import RedisCluster
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
KEY = SessionKey("alice", "chat")


def master_and_replica(cluster, name):
    """The ports of the primary that holds key `name` and of its replica."""
    client = connect(cluster.url)
    node = client.get_node_from_key(name)
    nodes = client.cluster_nodes()
    master_id = nodes[f"{node.host}:{node.port}"]["node_id"]
    replica = next(int(addr.rsplit(":", 1)[1]) for addr, n in nodes.items()
                   if n["master_id"] == master_id and "slave" in n["flags"])
    client.close()
    return node.port, replica


def publish(store, nbytes, expect=0):
    data = np.random.default_rng(nbytes).bytes(nbytes)
    return store.publish(KEY, expect, {"model_id": "m"}, "fp", 16, nbytes, np.array([page_checksum(data)],
                         dtype=np.uint64), np.arange(1, dtype=np.uint64), [(data, True)])


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path / "redis").start()
    c.wait_replicated()  # (each replica through its first sync)
    yield c
    c.close()


def test_a_version_no_replica_acknowledged_is_taken_and_replicated_once_the_replica_has_it(cluster):
    store = RemoteStore(connect(cluster.url), prefix="w", replicas=1)
    alone = RemoteStore(connect(cluster.url), prefix="w", replicas=0)
    try:
        _, replica = master_and_replica(cluster, f"w:{{{tag_of(KEY)}}}:m")
        m1 = publish(store, 1000)  # acknowledged: returns
        os.kill(cluster.procs[replica].pid, signal.SIGSTOP)
        try:
            with pytest.raises(Unreplicated, match="too few replicas") as raised:
                publish(store, 2000, expect=m1.version)
            m2 = raised.value.manifest
            assert store.head(KEY)[0].version == m2.version  # taken: the session's version, served
            assert store.replicated([KEY]) == [False]
            m3 = publish(alone, 3000, expect=m2.version)  # --remote-replicas 0: the primary's word alone
        finally:
            os.kill(cluster.procs[replica].pid, signal.SIGCONT)
        wait_for(lambda: store.replicated([KEY]) == [True], what="the replica has it")
        assert store.head(KEY)[0].version == m3.version
    finally:
        store.close()
        alone.close()


def test_a_session_is_remote_durable_once_on_a_replica_and_survives_its_master_killed_right_after(cluster, tmp_path):
    a = Harness(str(tmp_path / "a"), remote=cluster.url, remote_prefix="d")
    b = Harness(str(tmp_path / "b"), remote=cluster.url, remote_prefix="d")
    sa, sb = a.open(), b.open()
    try:
        master, replica = master_and_replica(cluster, sa.remote.store.link.key(KEY, "m"))
        eng = HostEngine(seed=5)
        os.kill(cluster.procs[replica].pid, signal.SIGSTOP)
        try:
            sa.save(KEY, eng.memory, SPEC, [0, 1, 2], 48, token_ids=list(range(48)))
            # published (the remote tier took it), but no replica acknowledged it: not remote-durable
            wait_for(lambda: sa.remote.store.head(KEY)[0] is not None, what="the version taken")
            assert not sa.stat(KEY).remote_durable
        finally:
            os.kill(cluster.procs[replica].pid, signal.SIGCONT)
        wait_for(lambda: sa.stat(KEY).remote_durable, what="remote-durable once the replica has it")
        cluster.kill(master)  # right after: nothing waited for but the acknowledgement
        cluster.wait_ok(30)
        dst = HostEngine(seed=6)
        wait_for(lambda: sb.restore(KEY, dst.memory, SPEC, [3, 4, 5]).num_tokens == 48, timeout=60,
                 what="the session resumed on the other node after the fail-over", missing_ok=True)
        assert dst.pages([3, 4, 5]) == eng.pages([0, 1, 2])
    finally:
        a.close()
        b.close()


def test_a_primary_with_no_replica_acknowledges_on_its_own_word(single_server):
    """A single server (or a primary whose replicas are all gone): nothing to
    wait for; a publish is remote-durable as the primary took it."""
    store = RemoteStore(connect(f"redis://127.0.0.1:{single_server}"), prefix="one", replicas=1)
    try:
        m = publish(store, 1000)  # no Unreplicated
        assert store.head(KEY)[0].version == m.version and store.replicated([KEY]) == [True]
    finally:
        store.close()


def test_a_drop_no_replica_acknowledged_is_taken_and_said_so_and_the_next_drop_finds_it_gone(cluster):
    store = RemoteStore(connect(cluster.url), prefix="x", replicas=1)
    try:
        _, replica = master_and_replica(cluster, f"x:{{{tag_of(KEY)}}}:m")
        publish(store, 1000)
        os.kill(cluster.procs[replica].pid, signal.SIGSTOP)
        try:
            with pytest.raises(Unreplicated, match="drop is taken"):
                store.drop(KEY)
            assert store.head(KEY)[0] is None  # taken: a tombstone in its place
        finally:
            os.kill(cluster.procs[replica].pid, signal.SIGCONT)
        wait_for(lambda: store.replicated([KEY]) == [True], what="the replica has the tombstone")
        assert store.drop(KEY) is False  # nothing there; acknowledged, so no Unreplicated
    finally:
        store.close()


def test_a_daemon_drop_no_replica_acknowledged_is_unavailable_and_dropped_here(cluster, tmp_path):
    from tierd.errors import NotFound, Unavailable

    a = Harness(str(tmp_path / "a"), remote=cluster.url, remote_prefix="y")
    sa = a.open()
    try:
        _, replica = master_and_replica(cluster, sa.remote.store.link.key(KEY, "m"))
        eng = HostEngine(seed=7)
        sa.save(KEY, eng.memory, SPEC, [0, 1, 2], 48, token_ids=list(range(48)))
        wait_for(lambda: sa.stat(KEY).remote_durable, what="published and on a replica")
        os.kill(cluster.procs[replica].pid, signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable, match="is dropped, but .*drop it again"):
                sa.drop(KEY)
            with pytest.raises(NotFound):
                sa.stat(KEY)  # gone here as well: nothing of it is served
        finally:
            os.kill(cluster.procs[replica].pid, signal.SIGCONT)
        wait_for(lambda: _drop_not_found(sa), what="the next drop finds it gone")
    finally:
        a.close()


def _drop_not_found(store):
    from tierd.errors import NotFound, Unavailable

    try:
        store.drop(KEY)
    except NotFound:
        return True
    except Unavailable:
        return False
    raise AssertionError("a drop of a dropped session answered OK")
