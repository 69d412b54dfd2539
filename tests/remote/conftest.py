"""A real Redis Cluster (3 masters, 3 replicas) on loopback for each test
module, and stores over it (nodes) with data dirs of their own, as nodes
of a fleet would be."""

import subprocess
import time

import pytest

from tests.helpers import Harness, wait_for
from tierd.errors import Unavailable
from tierd.remote.redis import connect
from tierd.testing import RedisCluster, _free_port


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


@pytest.fixture
def single_server(tmp_path):
    """A plain redis-server on loopback (no cluster): its port, once it answers."""
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)

    def answers():
        try:
            connect(f"redis://127.0.0.1:{port}").close()
            return True
        except Unavailable:
            return False

    try:
        wait_for(answers, timeout=20, what="redis-server answering")
        yield port
    finally:
        proc.kill()
        proc.wait(10)
