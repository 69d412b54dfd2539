"""Child process for the peak-memory test: make a large snapshot that lives
only on disk, or restore it and report memory high-water marks."""

import json
import sys

import numpy as np
import psutil
import torch  # noqa: F401  (loaded before measuring, as in the daemon, which probes the GPU with it)

from tests.helpers import Harness
from tierd.core.store import make_key
from tierd.layout import KVSpec
from tierd.transfer.copier import DEFAULT_WINDOW

MiB = 1 << 20
SPEC = KVSpec("test/big", num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=16)
K = make_key("default", "big")


def harness(root: str) -> Harness:
    return Harness(root, host_budget=1024 * MiB, host_slab=512 * MiB, disk_budget=1024 * MiB, disk_slab=512 * MiB)


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak() -> int:
    """This process's RSS high-water mark (VmHWM: unlike ru_maxrss, it does not
    inherit the parent's across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(root: str, what: str, nbytes: int) -> None:
    h = harness(root)
    report = {}
    if what == "make":
        store = h.open()
        pages = nbytes // SPEC.page_bytes
        chunk = np.random.default_rng(0).integers(0, 256, 4 * MiB, dtype=np.uint8)
        store.put(K, SPEC, pages * SPEC.block_tokens, pages * SPEC.page_bytes,
                  (chunk for _ in range(pages * SPEC.page_bytes // chunk.nbytes)))
        store.demote(K)
        h.close()
    else:
        base = rss()
        h.window_bytes = DEFAULT_WINDOW  # the daemon's staging window
        store = h.open()
        report["recovery_delta"] = peak() - base
        if what == "restore":
            from tests.helpers import HostEngine

            engine = HostEngine(SPEC, num_blocks=nbytes // SPEC.page_bytes, kind="cross_layer", seed=1)
            base = rss()
            assert peak() <= base + 16 * MiB
            store.restore(K, engine.memory, SPEC, np.arange(nbytes // SPEC.page_bytes))
        else:
            base = rss()
            total = sum(len(c) for c in store.get(K, 1 * MiB)[1])
            assert total == nbytes
        report["delta"] = peak() - base
        h.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
