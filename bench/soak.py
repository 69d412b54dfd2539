"""Soak: 16 client processes run mixed save, prefetch, restore, put, get and
drop against one daemon for a long time; the daemon's private memory (RSS
less shared pages: the host arena's pages are sessions, not leaks) and open
file descriptors are sampled throughout. Not part of CI.

    python -m bench --soak 600
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
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
            samples = []  # (seconds, private bytes, fds)
            start = time.monotonic()
            while any(c.poll() is None for c in clients):
                mem = proc.memory_info()
                # Resident memory minus shared pages: the host arena's pages are sessions, not leaks.
                samples.append((time.monotonic() - start, mem.rss - mem.shared, proc.num_fds()))
                time.sleep(min(5.0, seconds / 60))
            reports = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in clients]
        finally:
            daemon.stop()
    warm = [s for s in samples if s[0] >= 0.2 * seconds] or samples
    quarter = max(1, len(warm) // 4)
    rss0 = float(np.median([s[1] for s in warm[:quarter]]))  # after warm-up
    rss1 = float(np.median([s[1] for s in warm[-quarter:]]))  # at the end
    fds0 = int(np.median([s[2] for s in warm[:quarter]]))
    fds1 = int(np.median([s[2] for s in warm[-quarter:]]))
    growth = (rss1 - rss0) / rss0
    errors = sum(len(r["errors"]) for r in reports)
    mismatches = sum(r["mismatches"] for r in reports)
    calls = sum(r["ops"] for r in reports)
    return [
        Result("soak_memory_growth", round(growth, 4), "ratio", None, None, "< 0.05 after warm-up", growth < 0.05,
               {"private_bytes_after_warmup": rss0, "private_bytes_at_end": rss1, "fds_after_warmup": fds0,
                "fds_at_end": fds1, "fds_max": max(s[2] for s in warm),
                "errors": errors, "mismatches": mismatches, "calls": calls},
               f"{CLIENTS} clients for {seconds:.0f} s: {calls} calls, {errors} errors, {mismatches} wrong bytes",
               {"t": [s[0] for s in samples], "private": [s[1] for s in samples], "fds": [s[2] for s in samples]}),
        Result("soak_fd_growth", fds1 - fds0, "fds", None, None, "no growth", fds1 <= fds0),
    ]
