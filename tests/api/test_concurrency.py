"""16 client processes save and restore their own sessions for 30 s against
one daemon: no errors, no wrong byte, and the daemon's memory comes back."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from tierd.testing import ROOT, Daemon

CLIENTS = 16
SECONDS = float(os.environ.get("TIERD_LOAD_SECONDS", "15"))
# After every session is dropped, the daemon may keep at most this much more
# memory than it had warmed up: allocator caches and thread stacks, not data.
RSS_SLACK = 64 << 20


def _rss(pid):
    return psutil.Process(pid).memory_info().rss


@pytest.mark.slow
def test_sixteen_clients_for_fifteen_seconds(tmp_path):
    d = Daemon(tmp_path, "--writeback-idle", "0.5", "--host-idle", "2").start()
    try:
        # warm up: one short round, so imports and pools are counted in the baseline
        warm = subprocess.run([sys.executable, "-m", "bench.load", d.socket, "99", "1"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert warm.returncode == 0, warm.stderr
        baseline = _rss(d.pid())
        procs = [subprocess.Popen([sys.executable, "-m", "bench.load", d.socket, str(w), str(SECONDS)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for w in range(CLIENTS)]
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=SECONDS + 180)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
        assert all(r["errors"] == [] for r in reports), [r["errors"][:3] for r in reports if r["errors"]]
        assert sum(r["mismatches"] for r in reports) == 0
        assert all(r["ops"] > 0 for r in reports)
        with d.client() as c:
            assert c.list() == []
            assert all(t.used == 0 for t in c.stats()["tiers"])
        # free arena memory goes back once the host tier has been quiet for a second
        deadline = time.monotonic() + 10
        while _rss(d.pid()) > baseline + RSS_SLACK and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _rss(d.pid()) <= baseline + RSS_SLACK, (baseline, _rss(d.pid()))
        print(f"{CLIENTS} clients, {sum(r['ops'] for r in reports)} calls in {SECONDS:.0f} s; "
              f"daemon RSS {baseline >> 20} MiB before, {_rss(d.pid()) >> 20} MiB after")
        assert "Traceback" not in d.log()
    finally:
        d.close()
