"""Turn-2 time to first token on a real vLLM server (CPU) with the
TierdConnector: a 2,000-token conversation resumed from tierd (prefetched to
host, or straight from disk) against the same turn computed from scratch on
the same server (a request without a session id, which the connector leaves
alone); and, vllm_turn2_host_vs_prefix_cache, the turn from tierd's host
tier against a server without tierd whose own prefix cache still holds the
conversation (turn 1 just ran there: each turn 2 a conversation of its own,
so that only turn 1's blocks are cached). Needs vLLM: run it with `make
bench-vllm`."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Result, spread


def run(quick: bool) -> list[Result]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm: skipped, vLLM is not installed here (make bench-vllm)", file=sys.stderr)
        return []
    from transformers import AutoTokenizer

    from tests.vllm.server import VllmServer, text, tiny_llama
    from tierd.testing import Daemon

    repeat = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="tierd-bench-vllm-") as tmp:
        root = Path(tmp)
        # 8 layers, 4 KV heads of 64: 16 KiB of KV a token, 32 MiB for the conversation
        model = tiny_llama(root / "model", layers=8, hidden=1024, heads=16, kv_heads=4)
        tok = AutoTokenizer.from_pretrained(model)
        daemon = Daemon(root / "tierd", "--host-idle", "1", "--writeback-idle", "0.3", "--host-budget", "1GiB",
                        "--host-slab", "256MiB", "--disk-budget", "4GiB", "--disk-slab", "256MiB").start()
        server = VllmServer(model, root / "vllm.log", tierd_socket=daemon.socket)
        # A conversation of its own for each turn 2 timed (and one to warm each server up): the turn 2s of one
        # conversation would share their pages in tierd, and then each was served turn 2's blocks as well.
        tail = tok(" " + text(60, 2))["input_ids"]
        turn1 = {i: tok(text(2600, 10 + i))["input_ids"][:1900] for i in range(2 * repeat + 2)}
        try:
            server.wait()
            server.complete(turn1[0][:64], 1)  # warm-up
            sessions = {where: [f"{where}-{i}" for i in range(repeat)] for where in ("host", "disk")}
            conv = {sid: 1 + k for k, sid in enumerate(sessions["host"] + sessions["disk"])}
            p2 = {sid: turn1[i] + server.complete(turn1[i], 100, session=sid)["token_ids"] + tail
                  for sid, i in conv.items()}
            scratch = [server.complete(p2[sid], 1)["ttft"] for sid in sessions["host"]]  # no session: computed
            with daemon.client() as c:
                deadline = time.monotonic() + 120
                while any(not _on_disk(c, sid) for ids in sessions.values() for sid in ids):
                    assert time.monotonic() < deadline, "sessions never reached disk"
                    time.sleep(0.1)
                timings: dict[str, list[float]] = {}
                served: dict[str, int] = {}
                for where, ids in sessions.items():
                    timings[where] = []
                    for sid in ids:
                        if where == "host":
                            c.prefetch(sid)
                            assert c.wait_ready(sid, timeout=60)[0]
                        r = server.complete(p2[sid], 1, session=sid)
                        timings[where].append(r["ttft"])
                        served[where] = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        finally:
            server.close()
            daemon.close()
        own = VllmServer(model, root / "own.log", prefix_caching=True)
        try:
            own.wait()
            own.complete(turn1[0][:64], 1)  # warm-up
            cached, held_tokens = [], 0
            for i in [0] + [conv[sid] for sid in sessions["host"]]:  # the host turns' conversations (0: warm-up)
                r = own.complete(turn1[i] + own.complete(turn1[i], 100)["token_ids"] + tail, 1)
                if i:
                    cached.append(r["ttft"])
                    held_tokens = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        finally:
            own.close()
    base = statistics.median(scratch)
    out = []
    for where in ("host", "disk"):
        ours = statistics.median(timings[where])
        out.append(Result(
            f"vllm_turn2_ttft_from_{where}", round(ours * 1e3, 1), "ms", round(base * 1e3, 1), round(base / ours, 2),
            "faster than recompute", base / ours > 1.0,
            {"tierd_seconds": spread(timings[where]), "recompute_seconds": spread(scratch)},
            f"{len(p2[sessions[where][0]])}-token turn 2, {served[where]} tokens served from tierd "
            f"({'prefetched to host' if where == 'host' else 'read from disk at load'}); limit = the same turn "
            "computed from scratch on the same server"))
    ours, held = statistics.median(timings["host"]), statistics.median(cached)
    out.append(Result("vllm_turn2_host_vs_prefix_cache", round(ours * 1e3, 1), "ms", round(held * 1e3, 1),
                      round(ours / held, 3), "ratio (ours/limit) <= 1.05", ours / held <= 1.05,
                      {"tierd_seconds": spread(timings["host"]), "prefix_cache_seconds": spread(cached)},
                      f"turn 2 from tierd's host tier (prefetched: {served['host']} tokens served), against a vLLM "
                      f"server without tierd whose own prefix cache holds turn 1 ({held_tokens} tokens cached)"))
    return out


def _on_disk(client, session: str) -> bool:
    from tierd.client import NotFound

    try:
        return client.stat(session).tier_bytes.keys() == {"disk"}
    except NotFound:  # its save runs just after the response
        return False
