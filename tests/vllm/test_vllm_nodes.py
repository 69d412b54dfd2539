"""Three engine replicas, each a real vLLM server (CPU) beside its own tierd
daemon, the daemons sharing one real Redis Cluster: turn 1 on the first,
turn 2 on the second, served from tierd with the same greedy outputs as a
server without the connector (the first codes its pages lossless on their
way to the remote tier); the second codes its version fp8, and turn 3 on
the third is served from those lossy pages: how many of its greedy tokens
agree with the server without the connector is measured and reported (a
line on the terminal, and the test's `fp8_agreement` property), not
assumed. The servers run one after the other (two cores). Runs with the
other vLLM tests (`make test-vllm`)."""

import shutil

import pytest

pytest.importorskip("vllm")

from tests.vllm.server import OUT, VllmServer, conversation, expected_served, served, wait_for
from tierd.testing import Daemon, RedisCluster

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")


def test_turn_two_on_another_replica_is_served_from_the_remote_tier(model, tmp_path, capsys, record_property):
    path, tok = model
    p1, more = conversation(tok, 7)
    _, more3 = conversation(tok, 8)
    plain = VllmServer(path, tmp_path / "plain.log").wait()
    try:
        out1 = plain.complete(p1, OUT)["token_ids"]
        p2 = p1 + out1 + more
        out2 = plain.complete(p2, OUT)["token_ids"]
        p3 = p2 + out2 + more3
        out3 = plain.complete(p3, OUT)["token_ids"]
    finally:
        plain.close()

    cluster = RedisCluster(tmp_path / "redis").start()
    a = b = c3 = None
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

        b = Daemon(tmp_path / "b", "--remote", cluster.url, "--codec", "remote=fp8", "--lossy-tenants", "*").start()
        second = VllmServer(path, tmp_path / "second.log", tierd_socket=b.socket).wait()
        try:
            r2 = second.complete(p2, OUT, session="chat")
            assert served(r2) == expected_served(p1, out1, p2) > 0
            assert r2["token_ids"] == out2
            with b.client() as c:  # turn 2 appended, and published again: coded fp8 now
                def published_turn_2():  # (one stat: remote_durable of the version that holds turn 2)
                    nonlocal info
                    info = c.stat("chat")
                    return info.remote_durable and info.num_tokens == len(p2) + OUT - 1

                info = None
                wait_for(published_turn_2, timeout=60)
                assert info.codecs == {"remote": "fp8"} and 0 < info.tier_errors["remote"] <= 0.05
        finally:
            second.close()
        b.kill()
        shutil.rmtree(b.data_dir)

        c3 = Daemon(tmp_path / "c", "--remote", cluster.url).start()
        third = VllmServer(path, tmp_path / "third.log", tierd_socket=c3.socket).wait()
        try:
            r3 = third.complete(p3, OUT, session="chat")
            assert served(r3) == expected_served(p2, out2, p3) > 0
            with c3.client() as c:  # it carries the error of the fp8 pages it holds (turn 3's save, just after
                # the answer, may have put an exact page in place of the last of them: at most their worst)
                assert 0 < c.stat("chat").rel_error <= info.tier_errors["remote"] * (1 + 1e-6)
        finally:
            third.close()
        same = sum(x == y for x, y in zip(r3["token_ids"], out3))
        prefix = next((i for i, (x, y) in enumerate(zip(r3["token_ids"], out3)) if x != y), len(out3))
        record_property("fp8_agreement", same / len(out3))
        with capsys.disabled():
            print(f"\nfp8 turn 3 ({served(r3)} of {len(p3)} prompt tokens from fp8 pages, worst page relative "
                  f"error {info.tier_errors['remote']:.4f}): {same} of {len(out3)} greedy tokens agree with the "
                  f"server without the connector, the first {prefix} in a row")
    finally:
        for d in (a, b, c3):
            if d is not None:
                d.close()
        cluster.close()
