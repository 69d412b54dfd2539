"""The daemon's /metrics: names, units, labels, and what they report."""

import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for
from tierd.client import KVSpec

PROMTOOL = shutil.which("promtool") or str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "promtool")


def scrape(daemon):
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
        return r.read().decode()


def samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_follow_the_naming_rules_and_report_the_work(daemon):
    spec = KVSpec.opaque("llama.cpp/test")
    with daemon.client() as c:
        c.put("secret-session-id", b"k" * 300_000, spec, num_tokens=1)
        c.release("secret-session-id")
        wait_for(lambda: c.stat("secret-session-id").tier == "disk", 20, "the demotion to disk")
        c.get("secret-session-id")
        try:
            c.stat("missing")
        except Exception:
            pass
    text = scrape(daemon)
    assert "secret-session-id" not in text and "default" not in text  # no session or tenant ids
    families = list(text_string_to_metric_families(text))
    assert families and all(f.name.startswith("tierd_") for f in families)
    s = samples(text)
    assert s[("tierd_tier_budget_bytes", (("tier", "host"),))] == 64 << 20
    assert s[("tierd_tier_sessions", (("tier", "disk"),))] == 1
    assert s[("tierd_moves_total", (("dst", "disk"), ("reason", "writeback"), ("src", "host")))] >= 1
    assert s[("tierd_moved_bytes_total", (("dst", "disk"), ("reason", "writeback"), ("src", "host")))] >= 300_000
    assert s[("tierd_rpc_seconds_count", (("method", "Put"),))] == 1
    assert s[("tierd_rpc_errors_total", (("code", "NOT_FOUND"), ("method", "Stat")))] == 1
    assert s[("tierd_tier_backend_info", (("backend", "posix-odirect"), ("tier", "disk")))] == 1 or \
        s[("tierd_tier_backend_info", (("backend", "posix-buffered"), ("tier", "disk")))] == 1
    info = [k for k in s if k[0] == "tierd_build_info"][0]
    assert dict(info[1])["device"] == "absent" and dict(info[1])["gpu_copies"] == "per-run"
    assert dict(info[1])["engine_memory"] == "shm" and dict(info[1])["malloc"].startswith("glibc ")
    assert s[("tierd_process_resident_memory_bytes", ())] > 0
    assert s[("tierd_copy_operations_total", ())] > 0


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_accepts_the_exposition(daemon):
    with daemon.client() as c:
        c.put("x", b"1" * 1000, KVSpec.opaque("m"), num_tokens=1)
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape(daemon), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
