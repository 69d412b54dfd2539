"""Soak: 16 client processes run mixed save, prefetch, restore, put, get and
drop against one daemon for a long time (10 minutes by default); the daemon's
RSS and open file descriptors are sampled throughout. Not part of CI.

    python -m bench --soak 600
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

from bench.common import Result
from tierd.testing import ROOT, Daemon

CLIENTS = 16


def run(seconds: float) -> list[Result]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        daemon = Daemon(root, "--writeback-idle", "1", "--host-idle", "5").start()
        proc = psutil.Process(daemon.pid())
        try:
            clients = [subprocess.Popen([sys.executable, "-m", "bench.load", daemon.socket, str(w), str(seconds)],
                                        cwd=ROOT, stdout=subprocess.PIPE, text=True) for w in range(CLIENTS)]
            samples = []  # (seconds, rss, fds)
            start = time.monotonic()
            while any(c.poll() is None for c in clients):
                samples.append((time.monotonic() - start, proc.memory_info().rss, proc.num_fds()))
                time.sleep(min(5.0, seconds / 60))
            reports = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in clients]
        finally:
            daemon.stop()
    warm = [s for s in samples if s[0] >= 0.2 * seconds] or samples
    rss0, rss1 = warm[0][1], max(s[1] for s in warm)
    fds0, fds1 = warm[0][2], max(s[2] for s in warm)
    growth = (rss1 - rss0) / rss0
    errors = sum(len(r["errors"]) for r in reports)
    mismatches = sum(r["mismatches"] for r in reports)
    calls = sum(r["ops"] for r in reports)
    return [
        Result("soak_rss_growth", round(growth, 4), "ratio", None, None, "< 0.05 after warm-up", growth < 0.05,
               {"rss_after_warmup": rss0, "rss_max": rss1, "fds_after_warmup": fds0, "fds_max": fds1,
                "errors": errors, "mismatches": mismatches, "calls": calls},
               f"{CLIENTS} clients for {seconds:.0f} s: {calls} calls, {errors} errors, {mismatches} wrong bytes",
               {"t": [s[0] for s in samples], "rss": [s[1] for s in samples], "fds": [s[2] for s in samples]}),
        Result("soak_fd_growth", fds1 - fds0, "fds", None, None, "no growth", fds1 <= fds0),
    ]
