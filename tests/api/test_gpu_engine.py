"""An engine process with its KV cache on the GPU, registered through CUDA
IPC with a daemon on the same GPU (runs only where CUDA is present)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from tierd.testing import ROOT, Daemon

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = r"""
import sys
import torch
from tierd.client import Client, KVSpec
from tierd.layout import EngineLayout

spec = KVSpec("test/gpu", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
layout = EngineLayout.layer_major(spec, 64)
sizes = [s.offset + 64 * s.stride for s in layout.segments]
# One allocation carved into K and V tensors, as a caching allocator does.
big = torch.randint(0, 256, (sum(sizes) + 4096,), dtype=torch.uint8, device="cuda")
regions, off = [], 4096
for n in sizes:
    regions.append(big[off : off + n])
    off += n

def blocks(ids):
    return [r.view(64, -1)[ids].clone() for r in regions]

with Client(sys.argv[1]) as c:
    engine = c.register_engine(spec, regions, layout)
    engine.save("s", [1, 2, 3, 10], 64)
    want = blocks([1, 2, 3, 10])
    big.zero_()
    torch.cuda.synchronize()
    result = engine.restore("s", [20, 21, 22, 23])
    got = blocks([20, 21, 22, 23])
    print("ok" if all(torch.equal(a, b) for a, b in zip(want, got)) else "WRONG", result.source_tier, flush=True)
    sys.stdin.read()
"""


def test_engine_gpu_memory_through_cuda_ipc_and_released_when_the_engine_exits(tmp_path):
    daemon = Daemon(tmp_path, "--device", "cuda", "--device-budget", "256MiB").start()
    try:
        assert "GPU copies: one kernel launch" in daemon.log()
        child = subprocess.Popen([sys.executable, "-c", ENGINE, daemon.socket], cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline().split()
        assert line == ["ok", "device"], (line, daemon.log())
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10
        while f"process {child.pid} exited" not in daemon.log():
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.1)
    finally:
        daemon.close()
