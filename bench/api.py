"""The daemon's API beside bare gRPC: Get stream throughput against a plain
grpc stream of the same bytes and chunk size, a local read (through shared
memory) against memcpy, and control-call latency (Stat and Prefetch) from
separate client processes under concurrency."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import Result, copy_and_hash, spread, timed
from tierd.client import Client, KVSpec
from tierd.testing import ROOT, Daemon

MiB = 1 << 20
BARE_METHOD = "/bare.Bytes/Stream"


def bare_server(socket: str, total: int, chunk: int) -> None:
    """A grpc.aio server (uvloop, like the daemon) that streams `total` bytes in
    `chunk`-byte messages, and echoes unary calls: the floor both figures sit on."""

    import grpc
    import uvloop

    payload = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(total // chunk):
            yield payload

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * MiB)])
        handler = grpc.method_handlers_generic_handler("bare.Bytes", {
            "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None,
                                                           response_serializer=None),
            "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=None, response_serializer=None)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port("unix:" + socket)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def inline_get(root: str, quick: bool) -> Result:
    import grpc

    total, chunk, repeat = (64 if quick else 256) * MiB, MiB, 3 if quick else 11
    bare_sock = os.path.join(root, "bare.sock")
    bare = subprocess.Popen([sys.executable, "-c", f"from bench.api import bare_server; "
                             f"bare_server({bare_sock!r}, {total}, {chunk})"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    daemon = Daemon(os.path.join(root, "daemon"), "--host-budget", "1GiB", "--writeback-idle", "off").start()
    try:
        assert bare.stdout.readline().strip() == "ready"
        with Client(daemon.socket) as c, grpc.insecure_channel(
                "unix:" + bare_sock, options=[("grpc.max_receive_message_length", 64 * MiB)]) as ch:
            c.put("blob", np.zeros(total, dtype=np.uint8), KVSpec.opaque("bench/blob", page_bytes=4 * MiB), 1)
            stream = ch.unary_stream(BARE_METHOD, request_serializer=None, response_deserializer=None)
            ours, limit = [], []
            for _ in range(repeat):  # in turns: the machine's speed drifts within a minute
                t0 = time.perf_counter()
                info, chunks = c.get_stream("blob", chunk_bytes=chunk)
                n = sum(len(x) for x in chunks)
                ours.append(time.perf_counter() - t0)
                assert n == total
                t0 = time.perf_counter()
                n = sum(len(m) for m in stream(b""))
                limit.append(time.perf_counter() - t0)
                assert n == total
    finally:
        bare.kill()
        daemon.stop()
    ratio = statistics.median(limit) / statistics.median(ours)
    return Result("inline_get_vs_grpc", total / statistics.median(ours) / 1e9, "GB/s",
                  total / statistics.median(limit) / 1e9, round(ratio, 3), "ratio >= 0.8", ratio >= 0.8,
                  {"ours_seconds": spread(ours), "limit_seconds": spread(limit)},
                  f"{total >> 20} MiB in {chunk >> 20} MiB chunks over the Unix socket, XXH3 per chunk both ways")


def local_read(root: str, quick: bool) -> list[Result]:
    """A client on the daemon's machine reading a session of opaque bytes
    through shared memory the daemon lends (read_local: one copy, in the
    daemon, every page checked), into a buffer of its own (get_into: a
    second copy, in the client), and into memory of its own the daemon
    reads into (LocalBuffer: one copy), beside one memcpy of the same bytes."""
    total, repeat = (64 if quick else 256) * MiB, 5 if quick else 11
    daemon = Daemon(os.path.join(root, "local"), "--host-budget", "1GiB", "--writeback-idle", "off").start()
    src, dst, out = (np.ones(total, dtype=np.uint8), np.empty(total, dtype=np.uint8),
                     np.empty(total, dtype=np.uint8))
    times: dict[str, list[float]] = {"read": [], "into": [], "buffer": [], "memcpy": [], "checked": []}
    checked_copy = copy_and_hash(src, dst)
    spec = KVSpec.opaque("bench/state", page_bytes=4 * MiB)
    try:
        with Client(daemon.socket) as c, c.local_buffer(spec, total) as buf:
            c.put("state", src, spec, 1)
            c.get_into("state", out)  # the lease segment and the buffers faulted in once
            buf.read("state")
            for _ in range(repeat):  # in turns: the machine's speed drifts within a minute
                t0 = time.perf_counter()
                with c.read_local("state") as view:
                    assert len(view) == total
                times["read"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert c.get_into("state", out) == total
                times["into"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert len(buf.read("state")) == total
                times["buffer"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.copyto(dst, src)
                times["memcpy"].append(time.perf_counter() - t0)
                times["checked"] += timed(checked_copy, 1)
    finally:
        daemon.stop()
    assert np.array_equal(out, src)
    results = []
    how = {"read": "a view of the lent memory", "into": "copied again into the client's buffer",
           "buffer": "read by the daemon into the client's registered memory (LocalBuffer)"}
    limits = {"memcpy": ("memcpy", 0.8, "memcpy"),
              "copy_and_hash": ("checked", 0.85, "a copy that XXH3-hashes what it copies, on both cores")}
    for name, what in (("local_read", "read"), ("local_get_into", "into"), ("local_buffer", "buffer")):
        ours = statistics.median(times[what])
        for against, (key, target, whose) in limits.items():
            limit = statistics.median(times[key])
            results.append(Result(f"{name}_vs_{against}", total / ours / 1e9, "GB/s", total / limit / 1e9,
                                  round(limit / ours, 3), f"ratio >= {target}", limit / ours >= target,
                                  {"ours_seconds": spread(times[what]), "limit_seconds": spread(times[key])},
                                  f"{total >> 20} MiB of opaque bytes in 4 MiB pages from the host tier, every page "
                                  f"checked; {how[what]}; limit: {whose}"))
    return results


def control_client(socket: str, seconds: float, worker: int, rate: float, bare: bool, start_at: float) -> None:
    """Stat and Prefetch (or, with bare, a gRPC echo) at `rate` calls per second
    from wall-clock time start_at (when every client has started), recording
    each latency."""
    import grpc

    lat: dict[str, list[float]] = {"Stat": [], "Prefetch": []} if not bare else {"Echo": []}
    with Client(socket) as c, grpc.insecure_channel("unix:" + socket) as ch:
        echo = ch.unary_unary("/bare.Bytes/Echo", request_serializer=None, response_deserializer=None)
        calls = [("Echo", lambda sid: echo(sid.encode()))] if bare else \
            [("Stat", lambda sid: c.stat(sid)), ("Prefetch", lambda sid: c.prefetch(sid))]
        calls[0][1]("s0")  # connect before measuring
        time.sleep(max(0.0, start_at - time.time()))
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            name, call = calls[i % len(calls)]
            t0 = time.perf_counter()
            call(f"s{(worker * 7 + i) % 64}")
            lat[name].append(time.perf_counter() - t0)
            i += 1
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
    print(json.dumps(lat))


def _clients(socket: str, seconds: float, clients: int, rate: float, bare: bool) -> dict[str, list[float]]:
    # The clients' imports and connections are done by then; each starts its
    # schedule a share of the period later, so that calls arrive evenly spread.
    start_at = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", f"from bench.api import control_client; "
                               f"control_client({socket!r}, {seconds}, {w}, {rate}, {bare}, "
                               f"{start_at + w / (clients * rate)})"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for w in range(clients)]
    lat: dict[str, list[float]] = {}
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 120)
        for k, v in json.loads(out).items():
            lat.setdefault(k, []).extend(v)
    return lat


ROUNDS = 4


def control_latency(root: str, quick: bool) -> list[Result]:
    seconds, clients, rate = (5 if quick else 20), 8, 100.0  # 800 calls/s offered in all
    bare_sock = os.path.join(root, "echo.sock")
    bare = subprocess.Popen([sys.executable, "-c", f"from bench.api import bare_server; "
                             f"bare_server({bare_sock!r}, {MiB}, {MiB})"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    # The policy loop at its default pace (the test daemon ticks five times faster).
    daemon = Daemon(os.path.join(root, "control"), "--writeback-idle", "off", "--tick-seconds", "0.5").start()
    try:
        assert bare.stdout.readline().strip() == "ready"
        with Client(daemon.socket) as c:
            for i in range(64):
                c.put(f"s{i}", b"x" * 4096, KVSpec.opaque("bench/blob"), 1)
        # In turns, so that both see the same machine: its speed drifts within a minute.
        lat: dict[str, list[float]] = {"Stat": [], "Prefetch": []}
        echo: list[float] = []
        for _ in range(ROUNDS):
            for k, v in _clients(daemon.socket, seconds / ROUNDS, clients, rate, bare=False).items():
                lat[k] += v
            echo += _clients(bare_sock, seconds / ROUNDS, clients, rate, bare=True)["Echo"]
        floor = np.array(echo) * 1e3
    finally:
        bare.kill()
        daemon.stop()
    both = np.array(lat["Stat"] + lat["Prefetch"]) * 1e3
    note = (f"{clients} client processes at {rate:.0f} calls/s each over the Unix socket, {os.cpu_count()} CPUs "
            f"shared with the daemon; limit: a bare gRPC echo under the same load, measured in {ROUNDS} turns "
            f"with tierd")
    out = []
    for q, target in ((99, 2.0), (50, 0.5)):
        ours, lim = float(np.percentile(both, q)), float(np.percentile(floor, q))
        out.append(Result(f"control_rpc_p{q}_ms", round(ours, 3), "ms", round(lim, 3), round(lim / ours, 3),
                          f"p{q} <= {target} ms", ours <= target,
                          {k: {"p50_ms": float(np.percentile(np.array(v) * 1e3, 50)),
                               "p99_ms": float(np.percentile(np.array(v) * 1e3, 99)), "n": len(v)}
                           for k, v in lat.items()} if q == 99 else {}, note if q == 99 else "",
                          {"tierd_ms": both.tolist(), "bare_grpc_ms": floor.tolist()} if q == 99 else {}))
    return out


def run(quick: bool) -> list[Result]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TIERD_BENCH_DIR")) as root:
        return [inline_get(root, quick), *local_read(root, quick), *control_latency(root, quick)]
