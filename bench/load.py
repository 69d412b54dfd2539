"""One of many client processes hammering a daemon: save, restore, put, get,
prefetch and drop on sessions of its own, checking every byte. Prints a JSON
report. Used by the concurrency test and by the soak run.

    python -m bench.load SOCKET WORKER SECONDS"""

import json
import sys
import time

import numpy as np

from tierd.client import Client, KVSpec, SharedKVCache

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("llama.cpp/test", page_bytes=64 * 1024)


def main(socket: str, worker: int, seconds: float) -> None:
    rng = np.random.default_rng(worker)
    report = {"ops": 0, "errors": [], "mismatches": 0}
    with Client(socket) as c, SharedKVCache(SPEC, 32) as kv:
        engine = c.register_engine(SPEC, kv)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            i += 1
            sid = f"w{worker}-{i % 4}"
            try:
                n = int(rng.integers(1, 8))
                src = rng.choice(16, size=n, replace=False)
                for b in src:
                    for seg in range(len(kv.layout.segments)):
                        kv.block(seg, b)[:] = rng.integers(0, 256, kv.layout.segments[seg].nbytes, dtype=np.uint8)
                want = [kv.block(seg, b).tobytes() for b in src for seg in range(len(kv.layout.segments))]
                engine.save(sid, src, n * 16)
                dst = np.arange(16, 16 + n)
                engine.restore(sid, dst)
                got = [kv.block(seg, b).tobytes() for b in dst for seg in range(len(kv.layout.segments))]
                report["mismatches"] += got != want
                blob = rng.integers(0, 256, int(rng.integers(1, 300_000)), dtype=np.uint8).tobytes()
                c.put(sid + "-blob", blob, OPAQUE, num_tokens=1, chunk_bytes=65536)
                report["mismatches"] += c.get(sid + "-blob") != blob
                c.release(sid)
                c.prefetch(sid)
                if i % 5 == 0:
                    c.drop(sid + "-blob")
                report["ops"] += 7
            except Exception as exc:  # every error is a failure of the test: report it
                report["errors"].append(f"{type(exc).__name__}: {exc}")
        for s in c.list():
            if s.session_id.startswith(f"w{worker}-"):
                c.drop(s.session_id)
        engine.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
