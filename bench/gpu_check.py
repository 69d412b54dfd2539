"""The GPU check: one script for a machine with a CUDA device.

    PYTHONPATH=. python3 bench/gpu_check.py [--json PATH]

It runs the GPU tests, measures raw device-to-device, pinned host-to-device
and device-to-host bandwidth through torch and a raw disk read (kvikio where
it works, else O_DIRECT), then saves a 42,603-token snapshot of a Qwen-like
layout (28 layers, 4 KV heads, head dim 128, bf16: about 57 KB a token) from
engine tensors on the GPU and restores it from each tier, into a contiguous
block table and into one of 4 runs, checking the bytes every time. The last
thing it prints is one table: times, bandwidths, and ratios to the raw
figures. On a GPU it also times the page checksum kernels and checks them
against the CPU's. `--device cpu --tokens 4096` runs the same steps on the
CPU (the test suite does, so the script cannot rot unseen).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierd.config import Config
from tierd.core.store import Store, make_key
from tierd.layout import EngineLayout, KVSpec
from tierd.machine import build
from tierd.tiers.fileops import aligned_buffer
from tierd.tiers.ioqueue import IOClass
from tierd.transfer.copier import EngineMemory

KEY = make_key("default", "gpu-check")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best(fn, device: str, repeat: int) -> float:
    """Best of `repeat` timed runs, seconds (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def raw_bandwidths(nbytes: int, device: str, repeat: int) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    return {
        "d2d": nbytes / best(lambda: dst.copy_(src), device, repeat),
        "h2d": nbytes / best(lambda: dst.copy_(pinned, non_blocking=True), device, repeat),
        "d2h": nbytes / best(lambda: pinned.copy_(src, non_blocking=True), device, repeat),
    }


def raw_disk_read(store: Store, nbytes: int, repeat: int) -> float:
    """Bandwidth of reading nbytes of the disk tier's slab file with its own backend."""
    disk = store.tiers["disk"]
    pieces = disk.alloc_pages(1, -(-nbytes // 4096) * 4096)
    if pieces is None:
        raise RuntimeError("no disk room for the raw read")
    buf = aligned_buffer(-(-nbytes // 4096) * 4096)
    disk.write(pieces[0].offset, buf)
    disk.sync()
    seconds = best(lambda: disk.read(pieces[0].offset, buf, IOClass.DEMAND), "cpu", repeat)
    disk.free(pieces[0])
    return nbytes / seconds


def engine(spec: KVSpec, num_blocks: int, device: str) -> EngineMemory:
    """Per-layer K and V tensors, as vLLM and SGLang keep them, full of random bytes."""
    layout = EngineLayout.layer_major(spec, num_blocks)
    g = torch.Generator(device=device).manual_seed(0)
    regions = [torch.randint(0, 256, (num_blocks * s.stride,), dtype=torch.uint8, device=device, generator=g)
               for s in layout.segments]
    return EngineMemory(layout, regions)


def pages_equal(a: EngineMemory, a_blocks: np.ndarray, b: EngineMemory, b_blocks: np.ndarray) -> bool:
    ia, ib = torch.as_tensor(a_blocks, device=a.regions[0].device), torch.as_tensor(b_blocks, device=b.regions[0].device)
    for seg, ra, rb in zip(a.layout.segments, a.regions, b.regions):
        va = ra.view(-1, seg.stride)[ia, : seg.nbytes]
        vb = rb.view(-1, seg.stride)[ib, : seg.nbytes]
        if not torch.equal(va, vb):
            return False
    return True


def device_checksums(kernels, spec: KVSpec, pages: int, repeat: int) -> tuple[str, str, str, str]:
    """The checksum kernels over every page of a snapshot-sized buffer on the
    GPU, 64 of the pages compared with the CPU's xxhash."""
    import xxhash

    stride = -(-spec.page_bytes // 4096) * 4096
    buf = torch.randint(0, 256, (pages * stride,), dtype=torch.uint8, device="cuda")
    table = [(buf.data_ptr() + i * stride, spec.page_bytes) for i in range(pages)]
    sums = kernels.checksums(table)
    seconds = best(lambda: kernels.checksums(table), "cuda", repeat)
    sample = np.random.default_rng(0).choice(pages, min(64, pages), replace=False)
    agree = all(int(sums[i]) == xxhash.xxh3_64_intdigest(buf[i * stride : i * stride + spec.page_bytes].cpu().numpy())
                for i in sample)
    if not agree:
        raise AssertionError("GPU and CPU checksums differ")
    nbytes = pages * spec.page_bytes
    return ("checksums on the GPU", f"{seconds * 1e3:.1f} ms", f"{nbytes / seconds / 1e9:.1f} GB/s",
            f"{len(sample)} sampled pages agree with the CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=42_603)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", str(ROOT / "bench" / "out")),
                                                       "gpu_check.json"))
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (use --device cpu for the logic)")
        return 2
    rows: list[tuple[str, str, str, str]] = []
    if cuda and not args.skip_tests:
        t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], cwd=ROOT,
                           capture_output=True, text=True)
        print(t.stdout[-3000:], t.stderr[-2000:])
        rows.append(("GPU tests (pytest -m gpu)", t.stdout.strip().splitlines()[-1] if t.stdout else "?", "", ""))
    spec = KVSpec("gpu-check/qwen-shape", num_layers=28, num_kv_heads=args.heads, head_dim=args.head_dim,
                  dtype="bfloat16", block_tokens=16)
    pages = spec.pages_for_tokens(args.tokens)
    nbytes = pages * spec.page_bytes
    num_blocks = pages + 3 * 300
    bounds = np.linspace(0, pages, 5).astype(int)
    four_runs = np.concatenate([np.arange(a, b) + 300 * i for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    contiguous = np.arange(pages)
    raw = raw_bandwidths(nbytes, args.device, args.repeat)
    with tempfile.TemporaryDirectory(prefix="tierd-gpu-check-") as tmp:
        budget = 2 * nbytes + (256 << 20)
        cfg = Config(data_dir=tmp, device=args.device if cuda else "cpu", device_budget=budget, host_budget=budget,
                     disk_budget=2 * budget, host_slab=budget, device_slab=budget, disk_slab=budget)
        machine = build(cfg)
        store = machine.store
        try:
            raw["disk"] = raw_disk_read(store, nbytes, args.repeat)
            src = engine(spec, num_blocks, args.device)
            dst = engine(spec, num_blocks, args.device)
            t0 = time.perf_counter()
            store.save(KEY, src, spec, contiguous, args.tokens, tier="device")
            sync(args.device)
            save_s = time.perf_counter() - t0
            rows.append(("save into the device tier", f"{save_s * 1e3:.1f} ms", f"{nbytes / save_s / 1e9:.1f} GB/s",
                         f"{nbytes / save_s / raw['d2d']:.2f} x d2d"))
            for tier, limit in (("device", "d2d"), ("host", "h2d"), ("disk", "disk")):
                if tier != "device":
                    store.demote(KEY, tier, reason="gpu-check")
                assert store.stat(KEY).tier == tier, store.stat(KEY)
                for name, table in (("contiguous", contiguous), ("4 runs", four_runs)):
                    ops = store.copier.copy_ops
                    seconds = best(lambda table=table: store.restore(KEY, dst, spec, table), args.device, args.repeat)
                    copies = store.copier.copy_ops - ops
                    ok = pages_equal(src, contiguous, dst, table)
                    rows.append((f"restore from {tier}, {name}", f"{seconds * 1e3:.1f} ms",
                                 f"{nbytes / seconds / 1e9:.1f} GB/s",
                                 f"{nbytes / seconds / raw[limit]:.2f} x {limit}; "
                                 f"{copies // (args.repeat + 1)} copies; bytes {'ok' if ok else 'WRONG'}"))
                    if not ok:
                        raise AssertionError(f"restore from {tier} into {name} gave other bytes")
            if machine.copier.kernels is not None:
                rows.append(device_checksums(machine.copier.kernels, spec, pages, args.repeat))
        finally:
            machine.close(flush=False)
    rows = [(f"raw {k}" + (f" ({store.tiers['disk'].backend})" if k == "disk" else ""), "",
             f"{raw[k] / 1e9:.1f} GB/s", "") for k in ("d2d", "h2d", "d2h", "disk")] + rows
    header = f"{args.tokens} tokens, {nbytes / 1e9:.2f} GB, {args.device}"
    print(f"\n## gpu_check: {header}\n\n| step | time | bandwidth | ratio |\n| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"header": header, "rows": rows, "raw": raw}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
