"""Two engine replicas, each a real vLLM server (CPU) beside its own tierd
daemon, the daemons sharing one real Redis Cluster: turn 1 on the first,
turn 2 on the second, served from tierd with the same greedy outputs as a
server without the connector; the first codes its pages lossless on their
way to the remote tier. The servers run one after the other (two
cores). Runs with the other vLLM tests (`make test-vllm`)."""

import shutil

import pytest

pytest.importorskip("vllm")

from tests.vllm.server import OUT, VllmServer, conversation, expected_served, served, wait_for
from tierd.testing import Daemon, RedisCluster

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")


def test_turn_two_on_another_replica_is_served_from_the_remote_tier(model, tmp_path):
    path, tok = model
    p1, more = conversation(tok, 7)
    plain = VllmServer(path, tmp_path / "plain.log").wait()
    try:
        out1 = plain.complete(p1, OUT)["token_ids"]
        p2 = p1 + out1 + more
        out2 = plain.complete(p2, OUT)["token_ids"]
    finally:
        plain.close()

    cluster = RedisCluster(tmp_path / "redis").start()
    a = b = None
    try:
        a = Daemon(tmp_path / "a", "--remote", cluster.url, "--codec", "remote=lossless").start()
        first = VllmServer(path, tmp_path / "first.log", tierd_socket=a.socket).wait()
        try:
            r1 = first.complete(p1, OUT, session="chat")
            assert r1["token_ids"] == out1 and served(r1) == 0
            with a.client() as c:
                wait_for(lambda: c.stat("chat").remote_durable, timeout=60)
                assert c.stat("chat").codecs == {"remote": "lossless"}
        finally:
            first.close()
        a.kill()  # the first replica's node is gone; its disk with it
        shutil.rmtree(a.data_dir)

        b = Daemon(tmp_path / "b", "--remote", cluster.url).start()
        second = VllmServer(path, tmp_path / "second.log", tierd_socket=b.socket).wait()
        try:
            r2 = second.complete(p2, OUT, session="chat")
            assert served(r2) == expected_served(p1, out1, p2) > 0
            assert r2["token_ids"] == out2
        finally:
            second.close()
    finally:
        for d in (a, b):
            if d is not None:
                d.close()
        cluster.close()
