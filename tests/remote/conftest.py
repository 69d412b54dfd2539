"""A real Redis Cluster (3 masters, 3 replicas) on loopback for each test module."""

import pytest

from tierd.testing import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("redis")).start()
    yield c
    c.close()
