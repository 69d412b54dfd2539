"""The Redis Cluster the remote tier's tests run against: real redis-server
processes on loopback, three masters and three replicas, that fail over when
a master is killed."""

import shutil

import pytest

from tierd.testing import RedisCluster

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path).start()
    yield c
    c.close()


def _client(cluster):
    from redis.cluster import ClusterNode, RedisCluster as Client

    live = [p for p in cluster.ports if cluster.alive(p)]
    return Client(startup_nodes=[ClusterNode("127.0.0.1", p) for p in live], socket_timeout=5)


def test_three_masters_and_three_replicas_serve_keys_in_every_slot(cluster):
    roles = [role for _, role in cluster.nodes()]
    assert roles.count("master") == 3 and roles.count("slave") == 3
    client = _client(cluster)
    values = {f"key-{i}": bytes([i]) * 1000 for i in range(200)}  # spread over the slots of all three
    for k, v in values.items():
        client.set(k, v)
    assert all(client.get(k) == v for k, v in values.items())
    client.close()


def test_a_killed_master_fails_over_to_its_replica_and_its_keys_are_served(cluster):
    import redis

    client = _client(cluster)
    client.set("{s}a", b"before")
    master = client.get_node_from_key("{s}a").port
    client.close()
    with redis.Redis(port=master, socket_timeout=5) as direct:
        assert direct.execute_command("WAIT", 1, 5000) == 1  # its replica has it
    cluster.kill(master)
    cluster.wait_ok(30)  # the replica is promoted
    client = _client(cluster)
    assert client.get("{s}a") == b"before"
    client.set("{s}a", b"after")
    assert client.get("{s}a") == b"after"
    client.close()
