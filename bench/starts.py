"""Start times of a real daemon over a data dir of durable sessions (quick:
500; else 2,000), as it is, on a full file system, with one damaged index
row, and with a garbled index (moved aside and rebuilt from the session
records), each beside the sessions it then serves (all of them but the
damaged row's). The data dir is a tmpfs mounted for the run (a
file system that fills up for real): that needs root; without it the full
file system case is left out."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from bench.common import Result
from tierd.client import KVSpec
from tierd.testing import Daemon

MiB = 1 << 20
SPEC = KVSpec.opaque("bench/starts", page_bytes=4096)


def _start(d: Daemon) -> tuple[float, int]:
    t0 = time.perf_counter()
    d.start()
    seconds = time.perf_counter() - t0
    with d.client() as c:
        served = len(c.list_page(limit=10_000)[0])
    d.stop()
    return seconds, served


def run(quick: bool) -> list[Result]:
    from tests.helpers import SmallFS, wait_for

    sessions = 500 if quick else 2000
    root = Path(tempfile.mkdtemp(prefix="tierd-starts-"))
    fs = SmallFS(root / "fs", 512 * MiB)
    mounted = fs.mount() is None
    try:
        d = Daemon(root / "d", "--writeback-idle", "0", "--disk-slab", "16MiB", "--disk-budget", "400MiB",
                   "--host-budget", "256MiB")
        d.data_dir = str((fs.path if mounted else root) / "data")
        with d.start().client() as c:
            for i in range(sessions):
                c.put(f"s{i:05d}", os.urandom(16384), SPEC, 1)
                c.release(f"s{i:05d}")
            wait_for(lambda: all(s.durable for s in c.list_page(limit=10_000)[0]), 300, "every session durable")
        d.stop()
        out = []

        def row(name: str, case: str) -> None:
            seconds, served = _start(d)
            out.append(Result(name, seconds, "s", target="<= 10 s", ok=seconds <= 10,
                              spread={"sessions_served": served}, note=f"{sessions} sessions, {case}: {served} served"))

        row("start_seconds", "as they are")
        if mounted:
            fs.fill()
            row("start_full_disk_seconds", "the file system full")
            fs.free()
        db = sqlite3.connect(os.path.join(d.data_dir, "index.db"))
        db.execute("UPDATE pieces SET checksums = x'00' WHERE session_id = 's00007'")  # one damaged row
        db.commit()
        db.close()
        row("start_damaged_row_seconds", "one index row damaged")
        with open(os.path.join(d.data_dir, "index.db"), "r+b") as f:
            f.seek(100)
            f.write(os.urandom(8192))
        for suffix in ("-wal", "-shm"):
            if os.path.exists(os.path.join(d.data_dir, "index.db" + suffix)):
                os.unlink(os.path.join(d.data_dir, "index.db" + suffix))
        row("start_garbled_index_seconds", "the index garbled (moved aside, rebuilt from the session records)")
        d.close()
        return out
    finally:
        if mounted:
            fs.unmount()
        shutil.rmtree(root, ignore_errors=True)
