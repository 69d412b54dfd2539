"""The operator verbs against a running daemon, and against none."""

import json
import subprocess
import sys

from tierd.testing import ROOT
from tierd.client import KVSpec


def tierd(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_operator_verbs(daemon):
    with daemon.client() as c:
        c.put("conv-1", b"a" * 5000, KVSpec.opaque("llama.cpp/qwen"), num_tokens=12)
    out = tierd("ls", "--address", daemon.socket)
    assert out.returncode == 0 and "conv-1" in out.stdout and "llama.cpp/qwen" in out.stdout
    listed = json.loads(tierd("ls", "--json", "--address", daemon.socket).stdout)
    assert [s["session_id"] for s in listed] == ["conv-1"] and listed[0]["num_tokens"] == 12
    stat = json.loads(tierd("stat", "conv-1", "--json", "--address", daemon.socket).stdout)
    assert stat["size_bytes"] == 5000 and stat["spec"]["kind"] == "opaque"
    top = tierd("top", "--once", "--address", daemon.socket)
    assert top.returncode == 0 and "host" in top.stdout and "disk" in top.stdout and "client->host" in top.stdout
    assert tierd("health", "--address", daemon.socket).stdout.strip() == "SERVING"
    out = tierd("drop", "conv-1", "--address", daemon.socket)
    assert out.returncode == 0
    missing = tierd("stat", "conv-1", "--address", daemon.socket)
    assert missing.returncode == 1 and "NotFound" in missing.stderr
    assert tierd("version").stdout.startswith("tierd ")


def test_verbs_fail_clearly_without_a_daemon(tmp_path):
    sock = str(tmp_path / "none.sock")
    health = tierd("health", "--address", sock)
    assert health.returncode == 1 and "NOT SERVING" in health.stdout
    ls = tierd("ls", "--address", sock)
    assert ls.returncode == 1 and "Unavailable" in ls.stderr
