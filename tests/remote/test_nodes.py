"""Three real daemons with separate data dirs sharing one real Redis
Cluster (3 masters, 3 replicas): a session stored on A resumes on B after A
is killed and its data dir deleted; C answers Lookup from the remote copy;
a master killed fails over and the sessions it held are served again while
the local tiers serve throughout; a wrong or missing password is a clear
start-up error."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import masters_stopped, metric, wait_for
from tierd.errors import NotFound, Unavailable
from tierd.layout import KVSpec
from tierd.testing import Daemon, RedisCluster

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
SPEC = KVSpec("test/llama-tiny", "r1", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


@pytest.fixture
def daemons(cluster, tmp_path):
    prefix = f"t{time.monotonic_ns()}"
    made = []

    def node(name, *flags):
        d = Daemon(tmp_path / name, "--remote", cluster.url, "--remote-prefix", prefix, *flags).start()
        made.append(d)
        return d

    yield node
    for d in made:
        d.close()


def test_a_session_stored_on_a_node_that_dies_resumes_on_another(daemons):
    a, b, c = daemons("a"), daemons("b"), daemons("c")
    tokens = list(range(1000, 1000 + 80))
    data = os.urandom(5 * SPEC.page_bytes)
    with a.client() as ca:
        ca.put("chat", data, SPEC, 80, token_ids=tokens)
        wait_for(lambda: ca.stat("chat").remote_durable, what="the session published")
    a.kill()
    shutil.rmtree(a.data_dir)

    with c.client() as cc:
        info = cc.stat("chat")
        assert (info.tier, info.tier_bytes, info.num_tokens) == ("remote", {"remote": len(data)}, 80)
        assert cc.lookup("chat", tokens[:40] + [1] * 40, SPEC).num_tokens == 32  # two whole pages match
        assert cc.lookup("chat", tokens, SPEC).num_tokens == 80
        assert [(s.session_id, s.tier) for s in cc.list()] == [("chat", "remote")]  # listed, not fetched
    with b.client() as cb:
        assert cb.get("chat") == data
        assert cb.stat("chat").tier == "host"
        with pytest.raises(NotFound):
            cb.stat("nobody-saved-this")
    with b.client() as cb:
        assert "chat" in {s.session_id for s in cb.list()}  # fetched here, so listed


def test_prefetch_and_wait_ready_bring_a_remote_session_in(daemons):
    a, b = daemons("a"), daemons("b")
    data = os.urandom(3 * SPEC.page_bytes)
    with a.client() as ca:
        ca.put("next-turn", data, SPEC, 48)
        wait_for(lambda: ca.stat("next-turn").remote_durable, what="the session published")
    with b.client() as cb:
        assert cb.prefetch("next-turn") == "queued"
        assert cb.wait_ready("next-turn", timeout=30) == (True, "host")
        assert cb.get("next-turn") == data


def test_a_master_killed_fails_over_and_the_sessions_serve_again_once_the_tier_answers(daemons, cluster):
    a, b = daemons("a"), daemons("b")
    blobs = {f"s{i}": os.urandom(2 * SPEC.page_bytes) for i in range(12)}
    with a.client() as ca:
        for sid, blob in blobs.items():
            ca.put(sid, blob, SPEC, 32)
        for sid in blobs:
            wait_for(lambda: ca.stat(sid).remote_durable, what=f"{sid} published")
    assert metric(a, "tierd_remote_up") == 1
    cluster.wait_replicated()  # a fail-over keeps what the replicas have (a session not yet there: NOT_FOUND)
    masters = [port for port, role in cluster.nodes() if role == "master"]
    cluster.kill(masters[0])
    with a.client() as ca:
        def unavailable(sid):
            try:
                ca.get(sid)
            except Unavailable:
                return True  # a holds it, but serves a copy other nodes hold only once the tier says it stands
            return False

        wait_for(lambda: unavailable("s0"), what="a marking the remote tier down")
        assert all(unavailable(sid) for sid in blobs)
    assert metric(a, "tierd_remote_ops_total", 'op="manifest",outcome="unavailable"') >= 1
    cluster.wait_ok(timeout=60)
    with a.client() as ca:
        def served_here():
            try:
                return all(ca.get(sid) == blob for sid, blob in blobs.items())
            except Unavailable:
                return False

        wait_for(served_here, timeout=60, what="a serving its copies again")
    with b.client() as cb:
        def served():
            try:
                return all(cb.get(sid) == blob for sid, blob in blobs.items())
            except Exception:
                return False

        wait_for(served, timeout=60, what="every session served from the promoted replicas")
    wait_for(lambda: metric(a, "tierd_remote_up") == 1, what="a's probe finds the remote tier again")


def test_a_drop_while_the_remote_tier_hangs_is_unavailable_and_never_undone(daemons, cluster):
    """Every master stopped: a Drop answered OK was undone once they answered
    (another node served the dropped bytes). It is UNAVAILABLE, the session
    held where it was (not served while the tier cannot say it stands), and
    the drop tried again once the tier answers is taken everywhere."""
    a, b = daemons("a"), daemons("b")
    data = os.urandom(2 * SPEC.page_bytes)
    with a.client() as ca:
        ca.put("forget-me", data, SPEC, 32)
        wait_for(lambda: ca.stat("forget-me").remote_durable, what="the session published")
        with masters_stopped(cluster):
            with pytest.raises(NotFound):
                ca.stat("nobody-stored-this")  # times out: the node marks the tier down
            with pytest.raises(Unavailable, match="not dropped"):
                ca.drop("forget-me")
            with pytest.raises(Unavailable, match="served once the tier answers"):
                ca.get("forget-me")

        def dropped():
            try:
                ca.drop("forget-me")
            except Unavailable:
                return False
            return True

        wait_for(dropped, what="the drop taken once the tier answers")
    with b.client() as cb, pytest.raises(NotFound):
        cb.get("forget-me")


def test_a_wrong_or_missing_password_is_a_clear_start_up_error(tmp_path):
    locked = RedisCluster(tmp_path / "redis", masters=3, replicas=0, password="s3cret-pw").start()
    try:
        wrong = {"TIERD_REMOTE_PASSWORD": "not-the-pw-9f3"}
        for env, said in ((wrong, "refused the password"), ({}, "needs a password")):
            d = Daemon(tmp_path / f"d{len(env)}", "--remote", locked.url, env=env)
            with pytest.raises(RuntimeError) as err:
                d.start()
            assert said in str(err.value) and "s3cret-pw" not in str(err.value) and "not-the-pw-9f3" not in d.log()
        pw = tmp_path / "pw"
        pw.write_text("s3cret-pw\n")
        d = Daemon(tmp_path / "ok", "--remote", locked.url, "--remote-password-file", str(pw)).start()
        try:
            with d.client() as c:
                c.put("x", b"y" * 4096, KVSpec.opaque("test/blob"), 1)
                wait_for(lambda: c.stat("x").remote_durable, what="published with the password")
            assert "s3cret-pw" not in d.log()
        finally:
            d.close()
    finally:
        locked.close()


def test_a_cluster_that_hangs_at_start_is_a_clear_start_up_error(cluster, tmp_path):
    """Every master stopped as a daemon starts: it exited with a traceback
    (RedisClusterException, from reading the slots); it says what failed."""
    with masters_stopped(cluster):
        d = Daemon(tmp_path / "d", "--remote", cluster.url)
        with pytest.raises(RuntimeError) as err:
            d.start()
    assert "cannot use the remote tier" in str(err.value) and "Traceback" not in d.log()


def test_a_huge_value_at_a_manifest_key_costs_the_node_little_and_fails_that_session_alone(daemons, cluster):
    """120 MiB of garbage at a session's manifest key: Stats of it, eight at
    once, each answer DATA_LOSS without the node taking the value in."""
    import threading

    from redis.cluster import ClusterNode, RedisCluster as Client

    from tests.security.test_memory import peak_growth
    from tierd.client import DataLoss
    from tierd.remote.manifest import tag_of
    from tierd.types import SessionKey

    a, b = daemons("a"), daemons("b")
    data = os.urandom(2 * SPEC.page_bytes)
    with a.client() as ca:
        ca.put("fine", data, SPEC, 32)
        wait_for(lambda: ca.stat("fine").remote_durable, what="the session published")
    prefix = b.flags[b.flags.index("--remote-prefix") + 1]
    client = Client(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports], socket_timeout=30)
    client.set(f"{prefix}:{{{tag_of(SessionKey('default', 'huge'))}}}:m", b"7 " + os.urandom(120 << 20))
    client.close()
    errors = []

    def stat():
        with b.client(timeout=60) as cb:
            try:
                cb.stat("huge")
            except Exception as exc:  # noqa: BLE001 - each answer is checked below
                errors.append(exc)

    def eight_at_once():
        threads = [threading.Thread(target=stat) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with b.client() as cb:
        assert cb.stat("fine").tier == "remote"  # the node has its connections and threads up
    growth = peak_growth(b, eight_at_once)
    assert len(errors) == 8 and all(isinstance(e, DataLoss) for e in errors), errors
    assert growth < 32 << 20, f"{growth / (1 << 20):.0f} MiB for eight Stats"
    with b.client() as cb:
        assert cb.stat("fine").tier == "remote" and cb.get("fine") == data  # the others are served


@pytest.mark.parametrize("recheck", ["5", "0"])
def test_each_call_reads_a_local_published_session_s_manifest_once_at_most_and_not_at_all_while_notices_live(
        daemons, cluster, recheck):
    """Lookup, BeginRestore and Prefetch read the remote manifest twice, even
    for a session this node holds and published (the prompt's limit, then
    the call): once now with --remote-recheck 0, and not at all while the
    tier's change notices are live (nothing changed the session), counted
    by the cluster itself."""
    a = daemons("a", "--remote-recheck", recheck)
    if recheck != "0":
        wait_for(lambda: metric(a, "tierd_remote_notices") == 1, what="the notices live")
    tokens = list(range(5000, 5000 + 48))
    with a.client() as ca:
        ca.put("here", os.urandom(3 * SPEC.page_bytes), SPEC, 48, token_ids=tokens)
        wait_for(lambda: ca.stat("here").remote_durable, what="the session published")
        calls = {
            "Lookup": lambda: ca.lookup("here", tokens, SPEC),
            "Lookup without a spec": lambda: ca.lookup("here", tokens),
            "BeginRestore": lambda: ca.end_restore(ca.begin_restore("here", SPEC, 3, token_ids=tokens).lease_id),
            "Prefetch": lambda: ca.prefetch("here"),
        }
        counted, known = {}, metric(a, "tierd_remote_ops_total", 'op="manifest",outcome="known"')
        for name, call in calls.items():
            before = cluster.scripts_run()
            call()
            counted[name] = cluster.scripts_run() - before
    assert counted == dict.fromkeys(calls, 1 if recheck == "0" else 0)
    # (each call spares one read: the prompt's limit and the call share what the notices keep)
    assert metric(a, "tierd_remote_ops_total", 'op="manifest",outcome="known"') - known == (recheck != "0") * 4
    assert metric(a, "tierd_remote_notices") == (recheck != "0")


def test_a_daemon_coding_its_remote_pages_says_so_in_stat_and_metrics(daemons):
    a, b = daemons("a", "--codec", "remote=lossless"), daemons("b")
    data = b"a conversation's state " * 40_000  # repetitive: codes far smaller
    with a.client() as ca:
        ca.put("coded", data, KVSpec.opaque("llama.cpp/tiny", page_bytes=1 << 18), 0)
        wait_for(lambda: ca.stat("coded").remote_durable, what="the session published")
        info = ca.stat("coded")
    assert info.codecs == {"remote": "lossless"} and 0 < info.coded_bytes["remote"] < len(data) // 20
    assert metric(a, "tierd_codec_bytes_total", 'codec="lossless",form="logical",op="encode"') == len(data)
    with b.client() as cb:
        assert cb.stat("coded").codecs == {"remote": "lossless"}  # from the manifest
        assert cb.get("coded") == data
    assert metric(b, "tierd_codec_bytes_total", 'codec="lossless",form="coded",op="decode"') == \
        info.coded_bytes["remote"]
    stat = subprocess.run([sys.executable, "-m", "tierd", "stat", "coded", "--json", "--address", b.socket],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(stat.stdout)["codecs"] == {"remote": "lossless"}


def test_a_daemon_killed_while_it_codes_a_publish_leaves_one_whole_version_and_loses_nothing_durable(daemons):
    a = daemons("a", "--codec", "remote=lossless", "--host-budget", "256MiB")
    b = daemons("b", "--host-budget", "256MiB")
    spec = KVSpec.opaque("llama.cpp/tiny", page_bytes=1 << 20)
    rng = np.random.default_rng(3)
    first, second = (rng.integers(0, 16, 48 << 20, dtype=np.uint8).tobytes() for _ in range(2))  # codes slowly
    with a.client() as ca:
        ca.put("s", first, spec, 0)
        wait_for(lambda: ca.stat("s").remote_durable, what="the first version remote-durable")
        ca.put("s", second, spec, 0)  # its publish is coding as the daemon dies
    a.kill()
    with b.client() as cb:
        seen = cb.get("s")
        assert seen in (first, second)  # the durable version or the next, whole: never a mix, never none
    a.start()
    with a.client() as ca:
        assert ca.get("s") == seen  # (its own copy died with it: the remote tier's version)


def test_a_tenant_that_consents_gets_its_kv_coded_lossy_and_sees_what_it_cost(daemons):
    a = daemons("a", "--codec", "remote=fp8", "--lossy-tenants", "default", "--lossy-max-error", "0.04")
    b = daemons("b")
    rng = np.random.default_rng(4)
    values = rng.standard_normal(5 * SPEC.page_bytes // 2).reshape(-1, SPEC.head_dim) * rng.choice([0.1, 4.0], 64)
    data = values.astype(np.float16).tobytes()
    tokens = list(range(5000, 5000 + 80))
    with a.client() as ca:
        ca.put("kv", data, SPEC, 80, token_ids=tokens)
        wait_for(lambda: ca.stat("kv").remote_durable, what="the session published")
        info = ca.stat("kv")
    assert info.codecs == {"remote": "fp8"} and 0 < info.tier_errors["remote"] <= 0.04 and info.rel_error == 0
    assert info.coded_bytes["remote"] < 0.55 * len(data)
    assert metric(a, "tierd_codec_page_rel_error_count", 'codec="fp8"') == 5
    with b.client() as cb:
        assert cb.lookup("kv", tokens, SPEC, max_error=0.0).num_tokens == 0  # no page of it exact
        assert cb.lookup("kv", tokens, SPEC).num_tokens == 80
        got = cb.get("kv")
        assert got != data and len(got) == len(data)
        assert cb.stat("kv").rel_error == pytest.approx(info.tier_errors["remote"])
