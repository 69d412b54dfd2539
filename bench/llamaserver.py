"""llama-server turn 2 through tierd's front (tierd llama-front) beside
llama-server's own ways, in the same run: the model of bench/llamacpp.py
(8 layers, 16 KiB of KV a token), llama-server with one slot, a
conversation of N tokens (2,000, and 8,000 without --quick) put out of the
slot by another one, then its turn 2 (the conversation plus 64 tokens, one
token generated), timed as the client sees it (the HTTP call):

- through the front from tierd's host tier after a prefetch hint, against
  a llama-server that keeps the conversation in its own --cache-ram:
  ratio ours/limit, target <= 1.10;
- through the front from tierd's disk tier, no hint, against llama-server's
  slot restore of a cold slot file (its pages dropped from the page cache)
  and the turn: target <= 1.0. Through the front, the state goes from
  tierd's disk into a restore lease, into a slot file, and then into
  llama-server: two copies of it more than llama-server's own file read.

Each of our turns is timed beside the limit's turn before it (the ratio:
the median of those pairs'); the front stores the other conversation's
turn before ours starts (it stores a turn after answering it). Needs
llama-server: `make bench-llamacpp`."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import Result, spread

NEW = 64


def run(quick: bool) -> list[Result]:
    from tests.llamacpp.servers import SERVER

    if not SERVER.exists():
        print("llamaserver: skipped, llama-server is not built here (make bench-llamacpp)", file=sys.stderr)
        return []
    from tests.llamacpp.model import tiny_llama
    from tierd.testing import Daemon

    out: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-llamaserver-") as tmp:
        root = Path(tmp)
        model = tiny_llama(root / "model.gguf", n_layer=8, n_embd=512, n_head=8, n_kv=8, n_ff=1024, ctx=16384)
        daemon = Daemon(root / "tierd", "--host-idle", "600", "--writeback-idle", "0.3", "--host-budget", "2GiB",
                        "--host-slab", "256MiB", "--disk-budget", "8GiB", "--disk-slab", "256MiB").start()
        try:
            for n in (2000,) if quick else (2000, 8000):
                print(f"llamaserver: {n} tokens ...", file=sys.stderr, flush=True)
                out += _one(daemon, model, root / str(n), n, 5 if n < 4000 else 3)
        finally:
            daemon.close()
    return out


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def _one(daemon, model: Path, root: Path, n: int, repeat: int) -> list[Result]:
    from tests.llamacpp.servers import FrontProc, LlamaServer, call, until

    root.mkdir()
    own_dir, front_dir = root / "own-slots", root / "front-slots"
    own_dir.mkdir(mode=0o700)
    front_dir.mkdir(mode=0o700)
    own = LlamaServer(root, own_dir, slots=1, ctx=n + 512, cache_ram=8192, name="own").start(model)
    behind = LlamaServer(root, front_dir, slots=1, ctx=n + 512, name="behind").start(model)
    front = FrontProc(root, daemon.socket, behind).start()
    try:
        def turn(port, tokens, session=None):
            """(seconds, the tokens generated, the prompt tokens llama-server did not decode again)."""
            body = {"prompt": tokens, "n_predict": 1, "temperature": 0.0, "top_k": 1, "return_tokens": True,
                    "cache_prompt": True, "id_slot": 0}
            t0 = time.perf_counter()
            status, got = call(port, "POST", "/completion", body, {"X-Tierd-Session": session} if session else None,
                               timeout=600)
            assert status == 200, got
            return time.perf_counter() - t0, got["tokens"], got["timings"]["cache_n"]

        a, b = _tokens(n, n), _tokens(n + 1, n)
        p2 = {}
        # The conversations' names carry their size: the daemon still holds those of the sizes run before.
        sa, sb = f"a{n}", f"b{n}"
        for port, session in ((own.port, None), (front.port, sa)):
            _, gen, _ = turn(port, a, session)
            p2[port] = a + gen + _tokens(n + 2, NEW)
            turn(port, b, session and sb)  # b takes the slot
        front.stored(2)  # (the front stores a turn after answering it)
        with daemon.client() as c:
            until(lambda: all(c.stat(f"llama-server-{s}").durable for s in (sa, sb)), 120, "written back")

        def timed(port, session=None, hint=False, cold_file=None, on_disk=False):
            turn(port, b, session and sb)  # b back in the slot (untimed)
            if session:  # ... and every turn stored: the front stores a turn after answering it, off the next's path
                until(lambda: (st := front.stats())["saves"] + st["save_failures"] >= st["turns"], 60, "stored")
            if on_disk:  # both conversations on tierd's disk tier alone, the host tier's room given back
                with daemon.client() as c:
                    c.set_budget("host", "1MiB")
                    until(lambda: all(c.stat(f"llama-server-{s}").tier_bytes.keys() == {"disk"} for s in (sa, sb)),
                          120, "the sessions on disk")
                    c.set_budget("host", "2GiB")
            if hint:
                call(port, "POST", "/tierd/prefetch", {"session": session})
                until(lambda: f"llama-server-{session}" in front.stats()["staged"], 60, "staged")
            t0 = time.perf_counter()
            if cold_file is not None:
                fd = os.open(cold_file, os.O_RDONLY)
                os.fsync(fd)  # (pages not yet written stay in the page cache whatever it is told)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: read from the device
                os.close(fd)
                status, got = call(port, "POST", "/slots/0?action=restore", {"filename": cold_file.name})
                assert status == 200, got
            seconds, _, reused = turn(port, p2[port], session)
            assert reused >= n, f"turn 2 reused {reused} of {n} tokens"
            return time.perf_counter() - t0 if cold_file is not None else seconds

        ram_s, host_s, file_s, disk_s = [], [], [], []
        for _ in range(repeat):  # in turns: this machine's speed drifts within a minute
            ram_s.append(timed(own.port))
            host_s.append(timed(front.port, sa, hint=True))
        # llama-server's own slot file of the conversation, and tierd's state of it on disk alone
        turn(own.port, p2[own.port])
        status, saved = call(own.port, "POST", "/slots/0?action=save", {"filename": "a.bin"})
        assert status == 200, saved
        restores = front.stats()["restores"]
        for _ in range(repeat):
            file_s.append(timed(own.port, cold_file=own_dir / "a.bin"))
            disk_s.append(timed(front.port, sa, on_disk=True))
        stats = front.stats()
        assert stats["misses"] == 0 and stats["restores"] == restores + 2 * repeat, stats
        mib = saved["n_written"] / (1 << 20)
    finally:
        front.stop()
        own.stop()
        behind.stop()
    med = statistics.median
    host, ram, disk, cold = med(host_s), med(ram_s), med(disk_s), med(file_s)
    host_ratio = med(h / r for h, r in zip(host_s, ram_s))  # each turn beside the limit's turn before it
    disk_ratio = med(d / f for d, f in zip(disk_s, file_s))
    note = f"{n}-token conversation + {NEW} tokens through llama-server, {mib:.0f} MiB of slot state"
    return [
        Result(f"llamacpp_server_turn2_vs_cache_ram_{n}", round(host * 1e3, 1), "ms", round(ram * 1e3, 1),
               round(host_ratio, 3), "ratio (ours/limit) <= 1.10", host_ratio <= 1.10,
               {"tierd_seconds": spread(host_s), "cache_ram_seconds": spread(ram_s)},
               note + "; tierd's host tier after a prefetch hint, through the front, against llama-server's "
                      "--cache-ram"),
        Result(f"llamacpp_server_turn2_disk_vs_slot_file_{n}", round(disk * 1e3, 1), "ms", round(cold * 1e3, 1),
               round(disk_ratio, 3), "ratio (ours/limit) <= 1.0", disk_ratio <= 1.0,
               {"tierd_seconds": spread(disk_s), "slot_file_seconds": spread(file_s)},
               note + "; tierd's disk tier, no hint, through the front, against llama-server's restore of a cold "
                      "slot file"),
    ]
