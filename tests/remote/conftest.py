"""A real Redis Cluster (3 masters, 3 replicas) on loopback for each test
module, and stores over it (nodes) with data dirs of their own, as nodes
of a fleet would be."""

import time

import pytest

from tests.helpers import Harness

from tierd.testing import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("redis")).start()
    yield c
    c.close()


@pytest.fixture
def nodes(cluster, tmp_path):
    """node(name, remote=URL or None (the cluster), **Harness settings): an open Harness, closed after the test."""
    prefix = f"t{time.monotonic_ns()}"
    made = []

    def node(name, remote=None, **kw):
        h = Harness(str(tmp_path / name), remote=remote or cluster.url, remote_prefix=prefix, **kw)
        h.open()
        made.append(h)
        return h

    yield node
    for h in made:
        h.close()
