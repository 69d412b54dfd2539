"""Hostile clients against a real daemon: what it costs the daemon, and the
other tenants.

- put_flood: 200 concurrent Puts declaring 64 MiB each (quick: 50) against
  a 4 GiB host budget (quick: 1 GiB); the daemon's peak anonymous memory
  (its heap: the host arena is shared memory, counted apart) beside the
  documented bound, 256 MiB plus 4 MiB per open stream.
- lookup_flood: three concurrent Lookups of 19 million token ids (57 MiB on
  the wire; quick: 5 million, 15 MiB), once with a valid token and once
  without; peak anonymous memory above the idle daemon's, as a multiple of
  the bytes on the wire.
- stalled_neighbours: another tenant's Get p99 while 8 Puts that send their
  header and nothing more and 8 long WaitReady calls are held, beside its
  p99 with the daemon to itself (target: within 2x).
- cancelled_gets: 500 Gets of a disk-tier session cancelled mid-stream
  (quick: 100); then Drop and SIGTERM must still go through: stuck sessions.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from bench.common import Result, spread
from tierd.client import AsyncClient, KVSpec, ResourceExhausted
from tierd.testing import Daemon
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.convert import spec_to_pb
from tierd.wire.packed import encode, field

MiB = 1 << 20
OPAQUE = KVSpec.opaque("bench/flood", page_bytes=MiB)
SPEC = KVSpec("bench/flood", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = {"alice": "alice-secret", "bob": "bob-secret", "ops": "ops-secret"}


def _anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class Peak:
    """The daemon's anonymous memory, sampled every few milliseconds; its peak."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, _anon(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _anon(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _daemon(root: Path, *flags: str) -> Daemon:
    tokens = root / "tokens"
    tokens.write_text("".join(f"{t}:{hashlib.sha256(s.encode()).hexdigest()}{':admin' if t == 'ops' else ''}\n"
                              for t, s in TOKENS.items()))
    return Daemon(root, "--auth-tokens", str(tokens), "--metrics", "off", *flags).start()


def _putter(socket: str, first: int, n: int, size: int) -> None:
    """n concurrent Puts of `size` bytes (a process of the flood)."""
    import asyncio

    data = np.zeros(size, dtype=np.uint8)

    async def main() -> None:
        async with AsyncClient(socket, token=TOKENS["alice"], timeout=600) as c:
            async def one(i: int) -> None:
                try:
                    await c.put(f"flood-{i}", data, OPAQUE, 1)
                except ResourceExhausted:
                    pass  # the host tier is full: refused, as it should be

            await asyncio.gather(*(one(first + i) for i in range(n)))

    asyncio.run(main())


def put_flood(quick: bool) -> Result:
    streams, host = (50, "1GiB") if quick else (200, "4GiB")
    with tempfile.TemporaryDirectory() as tmp:
        d = _daemon(Path(tmp), "--host-budget", host, "--host-slab", "auto", "--writeback-idle", "off",
                    "--tenant-streams", "0", "--tenant-put-bytes", "0", "--max-concurrent-rpcs", "1024")
        try:
            idle = _anon(d.pid())
            peak = Peak(d.pid())
            procs = 8
            ctx = mp.get_context("spawn")
            ps = [ctx.Process(target=_putter, args=(d.socket, k * streams // procs, streams // procs, 64 * MiB))
                  for k in range(procs)]
            t0 = time.perf_counter()
            for p in ps:
                p.start()
            for p in ps:
                p.join()
            seconds = time.perf_counter() - t0
            top = peak.stop()
            if any(p.exitcode for p in ps):
                raise RuntimeError("a Put of the flood failed otherwise than refused for room")
        finally:
            d.close()
    bound = 256 * MiB + 4 * MiB * streams
    return Result("put_flood_peak_anon", top / MiB, "MiB", bound / MiB, round(top / bound, 3),
                  "<= documented bound", top <= bound, {"idle_anon_mib": idle / MiB, "seconds": seconds},
                  f"{streams} concurrent Puts of 64 MiB, host budget {host}")


def _lookup(socket: str, token: str | None, ids: bytes, out: list) -> None:
    raw = pb.LookupRequest(session_id="s").SerializeToString() + field(2, ids)
    with grpc.insecure_channel("unix:" + socket, options=[("grpc.max_send_message_length", 256 * MiB)]) as ch:
        call = ch.unary_unary("/tierd.v1.Tierd/Lookup", request_serializer=None,
                              response_deserializer=pb.LookupResponse.FromString)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            out.append(call(raw, metadata=md, timeout=120).num_tokens)
        except grpc.RpcError as err:
            out.append(err.code().name)


def lookup_flood(quick: bool) -> list[Result]:
    n = 5_000_000 if quick else 19_000_000
    ids = encode(np.random.default_rng(0).integers(0, 150_000, n))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        d = _daemon(Path(tmp), "--max-message-bytes", "96MiB", "--writeback-idle", "off")
        try:
            with d.client(token=TOKENS["alice"]) as c:
                c.put("s", np.zeros(SPEC.page_bytes * 4, dtype=np.uint8), SPEC, 64,
                      token_ids=np.arange(64))
            for who in ("alice", None):
                idle = _anon(d.pid())
                peak = Peak(d.pid())
                out: list = []
                threads = [threading.Thread(target=_lookup, args=(d.socket, TOKENS[who] if who else None, ids, out))
                           for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                growth = peak.stop() - idle
                label = "with_token" if who else "without_token"
                want = "OK" if who else "UNAUTHENTICATED"
                results.append(Result(f"lookup_flood_{label}", growth / MiB, "MiB", 3 * len(ids) / MiB,
                                      round(growth / (3 * len(ids)), 3), "growth <= 3x the wire bytes",
                                      growth <= 9 * len(ids), {"answers": out},
                                      f"3 concurrent Lookups of {n:,} ids, {len(ids) / MiB:.0f} MiB each; {want}"))
        finally:
            d.close()
    return results


def _p99(samples: list[float]) -> float:
    return float(np.percentile(samples, 99))


def stalled_neighbours(quick: bool) -> Result:
    calls = 200 if quick else 1000
    with tempfile.TemporaryDirectory() as tmp:
        d = _daemon(Path(tmp), "--writeback-idle", "off", "--stream-idle-seconds", "600")
        channel = grpc.insecure_channel("unix:" + d.socket)
        release = threading.Event()
        try:
            bob = d.client(token=TOKENS["bob"])
            data = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8).tobytes()
            bob.put("b", data, OPAQUE, 1)

            def gets() -> list[float]:
                out = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    bob.get("b")
                    out.append(time.perf_counter() - t0)
                return out

            quiet = gets()
            stub, md = pb_grpc.TierdStub(channel), (("authorization", f"Bearer {TOKENS['alice']}"),)
            d.client(token=TOKENS["alice"]).put("a", b"a", OPAQUE, 1)

            def stalled(i: int) -> None:
                def messages():
                    yield pb.PutRequest(header=pb.PutHeader(session_id=f"st{i}", spec=spec_to_pb(OPAQUE), size=MiB))
                    release.wait(600)
                try:
                    stub.Put(messages(), metadata=md, timeout=600)
                except grpc.RpcError:
                    pass

            def waiting() -> None:
                try:
                    stub.WaitReady(pb.WaitReadyRequest(session_id="a", tier="device", timeout_seconds=600),
                                   metadata=md, timeout=600)
                except grpc.RpcError:
                    pass

            threads = [threading.Thread(target=stalled, args=(i,), daemon=True) for i in range(8)]
            threads += [threading.Thread(target=waiting, daemon=True) for _ in range(8)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            ops = d.client(token=TOKENS["ops"])  # the whole daemon's figures
            while next(t.used for t in ops.stats()["tiers"] if t.name == "host") < 9 * MiB:  # 8 stalled + bob's
                if time.monotonic() > deadline:
                    raise RuntimeError("the stalled Puts never reached the daemon")
                time.sleep(0.01)
            loaded = gets()
        finally:
            release.set()
            channel.close()
            d.close()
    ratio = _p99(loaded) / _p99(quiet)
    return Result("stalled_neighbours_get_p99", _p99(loaded) * 1e3, "ms", _p99(quiet) * 1e3, round(ratio, 3),
                  "p99 <= 2x unloaded", ratio <= 2, {"loaded_ms": spread([x * 1e3 for x in loaded]),
                                                     "quiet_ms": spread([x * 1e3 for x in quiet])},
                  "1 MiB Gets of one tenant while another holds 8 stalled Puts and 8 long WaitReady calls")


def cancelled_gets(quick: bool) -> Result:
    n = 100 if quick else 500
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(Path(tmp), "--metrics", "off", "--host-idle", "0.2", "--writeback-idle", "0.1").start()
        try:
            c = d.client()
            data = np.random.default_rng(2).integers(0, 256, 24 * MiB, dtype=np.uint8).tobytes()
            c.put("s", data, OPAQUE, 1)
            c.release("s")
            deadline = time.monotonic() + 30
            while c.stat("s").tier != "disk":
                if time.monotonic() > deadline:
                    raise RuntimeError("the session never reached disk")
                time.sleep(0.02)
            t0 = time.perf_counter()
            refused = 0
            for i in range(n):
                while True:
                    try:
                        _, chunks = c.get_stream("s")
                        break
                    except ResourceExhausted:  # the last cancelled stream's bytes are still being let go
                        refused += 1
                        time.sleep(0.002)
                for k, _ in enumerate(chunks):
                    if k == i % 12:
                        break
                chunks.close()
            seconds = time.perf_counter() - t0
            intact = c.get("s") == data
            t1 = time.perf_counter()
            c.drop("s")
            stuck = int(not intact) + int(c.list() != [])
            rc = d.stop(timeout=30)
            stop_seconds = time.perf_counter() - t1
        finally:
            d.close()
    return Result("cancelled_gets_stuck_sessions", stuck, "sessions", None, None, "0, and a clean stop",
                  stuck == 0 and rc == 0, {"cancels": n, "seconds": seconds, "refused_while_letting_go": refused,
                                           "drop_and_stop_seconds": stop_seconds}, "Gets of a disk session cancelled mid-stream")


def run(quick: bool) -> list[Result]:
    return [put_flood(quick), *lookup_flood(quick), stalled_neighbours(quick), cancelled_gets(quick)]


if __name__ == "__main__":
    import sys

    from bench.common import table

    print(table(run("--quick" in sys.argv)))
