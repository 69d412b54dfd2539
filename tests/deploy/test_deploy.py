"""The deployment files parse, pass Prometheus's own checks, name only metrics
the daemon exports, and ask the daemon's health service for health."""

import configparser
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tierd.core.index_schema import FORMAT_VERSION
from tierd.testing import ROOT, Daemon

DEPLOY = ROOT / "deploy"
PROMTOOL = shutil.which("promtool") or str(ROOT / ".venv" / "bin" / "promtool")
needs_promtool = pytest.mark.skipif(not Path(PROMTOOL).exists(),
                                    reason="promtool (Debian's prometheus package) is not installed")
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself
REMOTE_ONLY = {"tierd_remote_up"}  # exported where there is a remote tier (tests/remote/test_nodes.py reads it)


def exported_families(daemon) -> set[str]:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    out = set()
    for name, kind in names:
        out.add(name)
        if kind == "histogram":
            out |= {name + "_bucket", name + "_count", name + "_sum"}
        if kind == "counter" and not name.endswith("_total"):
            out.add(name + "_total")
        if kind == "info":
            out.add(name + "_info")
    return out | set(re.findall(r"^(tierd_\w+)", text, re.M))


def metric_names(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b([a-z_][a-z0-9_]*)\b(?=\s*[{\[(]|\s*[/)>=<]|\s*$)", expr)
            if m.startswith("tierd_") or m in PROMETHEUS_OWN}


def rules():
    return yaml.safe_load((DEPLOY / "prometheus" / "tierd-rules.yml").read_text())["groups"][0]["rules"]


def dashboard():
    return json.loads((DEPLOY / "grafana" / "tierd.json").read_text())


def test_every_metric_named_in_rules_and_dashboard_is_exported(daemon):
    exported = exported_families(daemon) | PROMETHEUS_OWN
    named = set()
    for rule in rules():
        named |= metric_names(rule["expr"])
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            named |= metric_names(target["expr"])
    assert len(named) >= 15
    assert named - REMOTE_ONLY <= exported, sorted(named - exported - REMOTE_ONLY)
    assert REMOTE_ONLY <= named


def test_alerts_cover_what_operators_need():
    names = {r["alert"] for r in rules()}
    assert {"TierdDown", "TierdTierNearBudget", "TierdPrefetchLate", "TierdChecksumFailures",
            "TierdDiskErrors", "TierdLeasesExpiring", "TierdRemoteUnreachable"} <= names
    assert all(r["annotations"]["summary"] for r in rules())


@needs_promtool
def test_promtool_accepts_the_rules_and_the_config():
    for args in (["check", "rules", "tierd-rules.yml"], ["check", "config", "prometheus.yml"]):
        out = subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_has_the_panels_operators_look_at():
    titles = {p["title"] for p in dashboard()["panels"]}
    assert {"Tier occupancy", "Moves by route", "Restore latency (p50, p99)", "RPC latency p99",
            "Prefetch outcomes", "Errors", "Remote tier"} <= titles
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_the_pod_shares_socket_and_shared_memory_and_probes_health():
    (deployment,) = list(yaml.safe_load_all((DEPLOY / "k8s" / "engine-with-tierd.yaml").read_text()))
    pod = deployment["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    tierd = containers["tierd"]
    engine = containers["engine"]
    mounts = {c: {m["name"]: m["mountPath"] for m in containers[c]["volumeMounts"]} for c in containers}
    # the socket directory and /dev/shm are the same volumes in both containers
    assert mounts["tierd"]["tierd-socket"] == mounts["engine"]["tierd-socket"] == "/run/tierd"
    assert mounts["tierd"]["shm"] == mounts["engine"]["shm"] == "/dev/shm"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and volumes["shm"]["emptyDir"]["sizeLimit"]
    assert "nvme" in mounts["tierd"] and mounts["tierd"]["nvme"] == "/var/lib/tierd"
    env = {e["name"]: e["value"] for e in tierd["env"]}
    # in a directory tierd makes inside the shared volume (an emptyDir is world-writable: refused as the socket's)
    engine_env = {e["name"]: e["value"] for e in engine["env"]}
    assert env["TIERD_SOCKET"] == "/run/tierd/sock/tierd.sock" == engine_env["TIERD_SOCKET"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert tierd[probe]["exec"]["command"] == ["tierd", "health"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(tierd["ports"][0]["containerPort"]) == "9464"
    assert tierd["resources"]["requests"] and engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["securityContext"]["runAsUser"] != 0


def test_podmonitor_selects_the_pod_and_its_metrics_port():
    monitor = yaml.safe_load((DEPLOY / "k8s" / "podmonitor.yaml").read_text())
    (deployment,) = list(yaml.safe_load_all((DEPLOY / "k8s" / "engine-with-tierd.yaml").read_text()))
    pod = deployment["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports


def test_dockerfile_is_multi_stage_non_root_and_checks_health():
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2
    assert re.search(r"^ARG BASE=nvidia/cuda:\S+-runtime", text, re.M)
    assert re.search(r"^ARG EXTRAS=gpu$", text, re.M)
    user = re.search(r"^USER (\S+)", text, re.M).group(1)
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(r'^HEALTHCHECK .*CMD \["tierd", "health"\]', text, re.M)
    assert re.search(r"^EXPOSE 9464$", text, re.M)


def test_systemd_unit_is_hardened():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "tierd.service")
    service = unit["Service"]
    assert service["User"] == "tierd" and service["RuntimeDirectory"] == "tierd"
    assert service["ProtectSystem"] == "strict" and service["LimitMEMLOCK"] == "infinity"
    assert service["NoNewPrivileges"] == "yes" and service["KillSignal"] == "SIGTERM"
    assert service["ExecStart"].endswith("tierd serve")


def test_health_reports_serving_then_fails_once_stopped(tmp_path):
    d = Daemon(tmp_path).start()
    health = [sys.executable, "-m", "tierd", "health", "--address", d.socket]
    try:
        out = subprocess.run(health, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "SERVING"
    finally:
        assert d.stop() == 0
    out = subprocess.run(health, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "NOT SERVING" in out.stdout


def test_an_index_of_another_format_is_refused_at_start(tmp_path):
    d = Daemon(tmp_path).start()
    d.stop()
    db = sqlite3.connect(str(tmp_path / "data" / "index.db"))
    db.execute("UPDATE meta SET value='99' WHERE key='format'")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match=f"this tierd reads format {FORMAT_VERSION}; nothing was changed"):
        d.start()
    assert d.proc.returncode == 1
