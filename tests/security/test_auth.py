"""Tokens decide the tenant; tenants never see each other's sessions or
engines; operator calls need the admin role."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from tierd.client import (
    KVSpec,
    NotFound,
    PermissionDenied,
    SharedKVCache,
    Unauthenticated,
)
from tierd.testing import ROOT, Daemon

TOKENS = {"alice": "alice-secret-1", "bob": "bob-secret-2", "ops": "ops-secret-3"}
OPAQUE = KVSpec.opaque("m")
SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


def sha(token):
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    tokens = root / "tokens"
    tokens.write_text(f"# tenant:sha256(token)[:admin]\nalice:{sha(TOKENS['alice'])}\n"
                      f"bob:{sha(TOKENS['bob'])}\nops:{sha(TOKENS['ops'])}:admin\n")
    d = Daemon(root, "--auth-tokens", str(tokens), "--writeback-idle", "off").start()
    yield d
    d.close()


def client(d, who):
    return d.client(token=TOKENS[who] if who else None)


def test_calls_without_a_valid_token_are_unauthenticated(secured):
    for token in ("", "wrong", TOKENS["alice"] + "x"):
        with secured.client(token=token) as c:
            with pytest.raises(Unauthenticated):
                c.stat("anything")
    assert "default" not in secured.log().split("authentication:")[1].splitlines()[0]


def test_tenants_are_isolated_for_every_call(secured):
    alice, bob = client(secured, "alice"), client(secured, "bob")
    alice.put("shared-name", b"alice's state", OPAQUE, num_tokens=1)
    # bob sees nothing of alice's, whatever he calls, and the answer is the one for a session that never was
    for call in (lambda: bob.stat("shared-name"), lambda: bob.get("shared-name"), lambda: bob.drop("shared-name"),
                 lambda: bob.prefetch("shared-name"), lambda: bob.release("shared-name"),
                 lambda: bob.pin("shared-name"), lambda: bob.advise("shared-name", 100.0),
                 lambda: bob.wait_ready("shared-name", timeout=0)):
        with pytest.raises(NotFound) as other:
            call()
        with pytest.raises(NotFound) as never:
            bob.stat("never-existed")
        assert str(other.value).replace("shared-name", "X") == str(never.value).replace("never-existed", "X")
    assert bob.list() == []
    # the same name is bob's own session, apart from alice's
    bob.put("shared-name", b"bob's state", OPAQUE, num_tokens=1)
    assert alice.get("shared-name") == b"alice's state" and bob.get("shared-name") == b"bob's state"
    assert [s.tenant for s in alice.list()] == ["alice"]
    alice.close()
    bob.close()


def test_engines_belong_to_their_tenant(secured):
    alice, bob = client(secured, "alice"), client(secured, "bob")
    with SharedKVCache(SPEC, 8) as kv:
        kv.regions[0][:] = np.arange(kv.regions[0].size, dtype=np.uint64).astype(np.uint8)
        engine = alice.register_engine(SPEC, kv)
        engine.save("kv", [0, 1], 20)
        stolen = type(engine)(bob, engine.engine_id, SPEC)  # bob guesses alice's engine id
        with pytest.raises(NotFound):
            stolen.restore("kv", [2, 3])
        with pytest.raises(NotFound):
            stolen.save("mine", [0], 16)
        engine.close()
    alice.close()
    bob.close()


def test_operator_calls_need_the_admin_role(secured):
    alice, ops = client(secured, "alice"), client(secured, "ops")
    alice.put("a1", b"x", OPAQUE, num_tokens=1)
    with pytest.raises(PermissionDenied, match="admin"):
        alice.set_budget("host", 32 << 20)
    with pytest.raises(PermissionDenied):
        alice.list(all_tenants=True)
    tenants = {s.tenant for s in ops.list(all_tenants=True)}
    assert "alice" in tenants and "ops" not in tenants
    assert ops.set_budget("host", 64 << 20).new_budget == 64 << 20
    alice.close()
    ops.close()


def test_health_needs_no_token(secured):
    out = subprocess.run([sys.executable, "-m", "tierd", "health", "--address", secured.socket], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING"


@pytest.mark.parametrize("content,words", [
    ("alice:nothex\n", "tokens:1: expected TENANT:SHA256_HEX"),
    ("# only a comment\n", "holds no tokens"),
    (f"a/b:{'0' * 64}\n", "tokens:1: tenant must be"),
    (f"alice:{'0' * 64}:root\n", "tokens:1: expected"),
])
def test_a_bad_tokens_file_is_refused_before_anything_starts(tmp_path, content, words):
    (tmp_path / "tokens").write_text(content)
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--auth-tokens", str(tmp_path / "tokens"),
                          "--data-dir", str(tmp_path / "data"), "--socket", str(tmp_path / "s.sock"),
                          "--metrics", "off"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and words in out.stderr
    assert not (tmp_path / "data").exists()  # refused before touching anything


def test_stats_show_a_tenant_its_own_activity_and_admins_the_daemon(secured):
    """Regression: Stats showed any tenant every tenant's sessions, bytes per
    tier and traffic. A tenant sees its own sessions and bytes in each tier,
    the budgets and backends; bandwidth, bytes moved and copies per route
    are every tenant's doing, shown to admins only."""
    alice, bob, ops = client(secured, "alice"), client(secured, "bob"), client(secured, "ops")

    def host(stats):
        return {t.name: t for t in stats["tiers"]}["host"]

    before = {"alice": alice.stats(), "bob": bob.stats(), "ops": ops.stats()}
    # alice stores 3 sessions of 64 KiB (in host) and reads one back; bob does nothing
    for i in range(3):
        alice.put(f"stats-{i}", b"a" * (64 << 10), KVSpec.opaque("m", page_bytes=4096), num_tokens=1)
    assert alice.get("stats-0") == b"a" * (64 << 10)
    mine, his, daemon = alice.stats(), bob.stats(), ops.stats()
    # alice sees her own sessions and bytes; bob sees nothing of hers
    assert mine["sessions"] == before["alice"]["sessions"] + 3 == len(alice.list())
    assert host(mine).used == host(before["alice"]).used + 3 * (64 << 10)
    assert host(mine).sessions == host(before["alice"]).sessions + 3
    assert his == before["bob"]
    # traffic is not a tenant's to see, nor the tiers' mapped bytes; budgets and backends are
    for stats in (mine, his):
        assert (stats["bandwidth"], stats["moved_bytes"], stats["copy_ops"]) == ({}, {}, 0)
        assert all(t.capacity == 0 for t in stats["tiers"])
        assert [t.budget for t in stats["tiers"]] == [t.budget for t in daemon["tiers"]]
        assert stats["backends"] == daemon["backends"]
    # an admin sees the whole daemon: every tenant's sessions and bytes, and alice's traffic
    assert daemon["sessions"] == len(ops.list(all_tenants=True)) >= mine["sessions"] + his["sessions"]
    assert host(daemon).used >= host(mine).used + host(his).used
    assert daemon["moved_bytes"]["client->host"] >= before["ops"]["moved_bytes"].get("client->host", 0) + 3 * (64 << 10)
    assert daemon["bandwidth"]["client->host"] > 0
    alice.close()
    bob.close()
    ops.close()
