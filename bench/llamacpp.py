"""llama.cpp turn 2 through tierd (tierd.adapters.llamacpp, in-process
llama-cpp-python) beside llama.cpp's own ways, in the same run: an 8-layer
random-weight Llama GGUF with 16 KiB of KV a token, a conversation of N
tokens (2,000, and 8,000 without --quick) put aside by another one, then
its turn 2 (the conversation plus 64 tokens, one token generated):

- from tierd's host tier after a prefetch, against the sequence's state kept
  in this process's RAM and set back from there (what llama-server's
  --cache-ram keeps: llama_state_seq_get_data / set_data): ratio ours/limit,
  target <= 1.05;
- from tierd's disk tier with no prefetch, against llama.cpp's own slot file
  (llama_state_seq_load_file, llama-server's slot restore) read cold (its
  pages dropped from the page cache): target <= 1.0;
- the save (the adapter's store of a completion's state) in ms, and turn 2
  computed from scratch over turn 2 from the host tier.

Needs llama-cpp-python: `make bench-llamacpp`."""

from __future__ import annotations

import ctypes
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
    try:
        import llama_cpp
    except ImportError:
        print("llamacpp: skipped, llama-cpp-python is not installed here (make bench-llamacpp)", file=sys.stderr)
        return []
    from tests.llamacpp.model import tiny_llama
    from tierd.adapters.llamacpp import attach
    from tierd.testing import Daemon

    out: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-llamacpp-") as tmp:
        root = Path(tmp)
        # 8 layers, 8 KV heads of 64, f16: 16 KiB of KV a token
        model = tiny_llama(root / "model.gguf", n_layer=8, n_embd=512, n_head=8, n_kv=8, n_ff=1024, ctx=16384)
        daemon = Daemon(root / "tierd", "--host-idle", "600", "--writeback-idle", "0.3", "--host-budget", "2GiB",
                        "--host-slab", "256MiB", "--disk-budget", "8GiB", "--disk-slab", "256MiB").start()
        try:
            with daemon.client() as c:
                for n in (2000,) if quick else (2000, 8000):
                    print(f"llamacpp: {n} tokens ...", file=sys.stderr, flush=True)
                    out += _one(llama_cpp, attach, c, model, root, n, 5 if n < 4000 else 3)
        finally:
            daemon.close()
    return out


def wait_idle(c, sid: str) -> None:
    deadline = time.monotonic() + 120
    while not c.stat(sid).durable:
        assert time.monotonic() < deadline, "the state was never written back"
        time.sleep(0.05)


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def _one(llama_cpp, attach, c, model: Path, root: Path, n: int, repeat: int) -> list[Result]:
    llm = llama_cpp.Llama(str(model), n_ctx=n + 512, n_batch=512, seed=0, verbose=False)
    ctx = llm._ctx.ctx
    mem = llama_cpp.llama_get_memory(ctx)

    def turn2(tokens, cache=None):
        llm.set_cache(cache)
        t0 = time.perf_counter()
        llm.create_completion(tokens, max_tokens=1, temperature=0.0, top_k=1)
        return time.perf_counter() - t0

    def clear():
        llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
        llm.n_tokens = 0

    a, b = _tokens(n, n), _tokens(n + 1, n)
    cache = attach(llm, c)
    saves, sids, held = [], [], []
    save = cache.save

    def timed_save():  # the completion's own store of its state
        t0 = time.perf_counter()
        sids.append(save())
        saves.append(time.perf_counter() - t0)

    cache.save = timed_save
    for conv in (a, b):  # each first turn stored in tierd; b takes the context from a
        llm.create_completion(conv, max_tokens=1, temperature=0.0, top_k=1)
        held.append([int(t) for t in llm.input_ids[: llm.n_tokens]])  # (a byte vocabulary: a few tokens generated)
        wait_idle(c, sids[-1])  # written back before the next turn, as between a user's turns
    sid_a, sid_b = sids
    cache.save = lambda: None  # the timed turns store nothing: each resumes from the same state
    p2a, p2b = held[0] + _tokens(n + 2, NEW), held[1] + _tokens(n + 3, NEW)

    # llama.cpp's own: the state in RAM (get_data / set_data), and its slot file
    llm.set_cache(None)
    clear()
    llm.create_completion(a, max_tokens=1, temperature=0.0, top_k=1)
    n_a = llm.n_tokens
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    ram = (ctypes.c_uint8 * size)()
    got = llama_cpp.llama_state_seq_get_data(ctx, ram, size, 0)
    slot = root / f"slot-{n}.bin"
    ids = (llama_cpp.llama_token * n_a)(*llm.input_ids[:n_a])
    llama_cpp.llama_state_seq_save_file(ctx, str(slot).encode(), 0, ids, n_a)

    def from_ram():
        clear()
        llama_cpp.llama_state_seq_set_data(ctx, ram, got, 0)
        llm.input_ids[:n_a] = ids
        llm.n_tokens = n_a

    def from_file():
        fd = os.open(slot, os.O_RDONLY)
        os.fsync(fd)  # (pages not yet written stay in the page cache whatever it is told)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: read from the device
        os.close(fd)
        clear()
        cap, count = n_a + 16, ctypes.c_size_t()
        toks = (llama_cpp.llama_token * cap)()
        llama_cpp.llama_state_seq_load_file(ctx, str(slot).encode(), 0, toks, cap, ctypes.byref(count))
        llm.input_ids[: count.value] = toks[: count.value]
        llm.n_tokens = count.value

    def timed_with(restore):
        clear()
        llm.create_completion(b[:64], max_tokens=1, temperature=0.0, top_k=1)  # another conversation in the context
        t0 = time.perf_counter()
        restore()
        return time.perf_counter() - t0 + turn2(p2a)

    ram_s = [timed_with(from_ram) for _ in range(repeat)]
    file_s = [timed_with(from_file) for _ in range(repeat)]
    scratch = []
    for _ in range(max(1, repeat - 1)):
        clear()
        scratch.append(turn2(p2a))

    host_s, disk_s, reused = [], [], 0
    for _ in range(repeat):
        turn2(p2b, cache)  # b takes the context (restored from tierd, untimed)
        assert cache.prefetch(p2a, wait=True)  # on a hint, ahead of the request
        before = cache.counts.restores
        host_s.append(turn2(p2a, cache))
        assert cache.counts.restores == before + 1, cache.counts
    c.set_budget("host", "1MiB")  # both sessions to disk, and no room to bring them back
    deadline = time.monotonic() + 120
    while any(c.stat(s).tier_bytes.keys() != {"disk"} for s in (sid_a, sid_b)):
        assert time.monotonic() < deadline, "the sessions never reached disk"
        time.sleep(0.1)
    for _ in range(repeat):
        turn2(p2b, cache)
        before = cache.counts.restores
        disk_s.append(turn2(p2a, cache))
        assert cache.counts.restores == before + 1, cache.counts
    c.set_budget("host", "2GiB")
    for sid in (sid_a, sid_b):
        c.drop(sid)
    cache.close()

    mib = got / (1 << 20)
    med = statistics.median
    host, ram_m, disk, cold, base = med(host_s), med(ram_s), med(disk_s), med(file_s), med(scratch)
    note = f"{n}-token conversation + {NEW} tokens, {mib:.0f} MiB of state"
    return [
        Result(f"llamacpp_turn2_vs_cache_ram_{n}", round(host * 1e3, 1), "ms", round(ram_m * 1e3, 1),
               round(host / ram_m, 3), "ratio (ours/limit) <= 1.05", host / ram_m <= 1.05,
               {"tierd_seconds": spread(host_s), "ram_seconds": spread(ram_s)},
               note + "; tierd's host tier after a prefetch against the state set back from this process's RAM"),
        Result(f"llamacpp_turn2_disk_vs_slot_file_{n}", round(disk * 1e3, 1), "ms", round(cold * 1e3, 1),
               round(disk / cold, 3), "ratio (ours/limit) <= 1.0", disk / cold <= 1.0,
               {"tierd_seconds": spread(disk_s), "slot_file_seconds": spread(file_s)},
               note + "; tierd's disk tier, no prefetch, against llama_state_seq_load_file of a cold file"),
        Result(f"llamacpp_save_ms_{n}", round(med(saves) * 1e3, 1), "ms", note=note + "; the adapter's store of a "
               "completion's state (llama.cpp writes it into a save lease, committed), each turn's first",
               spread={"seconds": spread(saves)}),
        Result(f"llamacpp_recompute_vs_restore_{n}", round(base / host, 2), "x",
               note=note + f"; turn 2 computed from scratch ({base * 1e3:.0f} ms) over turn 2 from tierd's host tier",
               spread={"recompute_seconds": spread(scratch)}),
    ]
