"""kernels.cu run on the CPU: the same source compiled as C++, every thread of
the grid run in turn (the kernels use no shared memory and no barriers), and
a stand-in for gpu.Kernels on top of it, so the copy engine's GPU paths run
through the real kernels' code without a GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierd.transfer import gpu, memory

HARNESS = r"""
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__ static const
struct dim { unsigned x; };
static dim blockIdx, threadIdx, blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
#include KERNELS

typedef void (*kernel)(void);
static void grid(unsigned blocks, unsigned threads, void (*body)(void*), void* arg) {
    gridDim.x = blocks; blockDim.x = threads;
    for (unsigned b = 0; b < blocks; b++)
        for (unsigned t = 0; t < threads; t++) { blockIdx.x = b; threadIdx.x = t; body(arg); }
}
struct copy_args { const u64* plan; i64 n; };
static void copy_body(void* a) { copy_args* c = (copy_args*)a; tierd_copy2d(c->plan, c->n); }
struct hash_args { const u64* pages; i64 n; u64* accs; u64* out; };
static void lanes_body(void* a) { hash_args* h = (hash_args*)a; tierd_xxh3_lanes(h->pages, h->n, h->accs); }
static void merge_body(void* a) { hash_args* h = (hash_args*)a; tierd_xxh3_merge(h->pages, h->n, h->accs, h->out); }

extern "C" void run_copy2d(const u64* plan, i64 n, unsigned blocks, unsigned threads) {
    copy_args c = {plan, n};
    grid(blocks, threads, copy_body, &c);
}
extern "C" void run_xxh3(const u64* pages, i64 n, u64* accs, u64* out, unsigned threads) {
    hash_args h = {pages, n, accs, out};
    grid((unsigned)((8 * n + threads - 1) / threads), threads, lanes_body, &h);
    grid((unsigned)((n + threads - 1) / threads), threads, merge_body, &h);
}
"""


def compile_kernels(directory: Path) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to run the kernels' source on the CPU")
    src = directory / "harness.cpp"
    src.write_text(HARNESS)
    lib = directory / "harness.so"
    subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-Wno-unknown-pragmas", f'-DKERNELS="{gpu.KERNELS_PATH}"',
                    str(src), "-o", str(lib)], check=True, capture_output=True)
    so = ctypes.CDLL(str(lib))
    so.run_copy2d.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint, ctypes.c_uint]
    so.run_xxh3.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return so


def hash_pages(so: ctypes.CDLL, pages: Sequence[tuple[int, int]]) -> np.ndarray:
    """XXH3-64 of (address, length) pages through the checksum kernels."""
    table = np.asarray(pages, dtype=np.uint64).reshape(-1)
    accs = np.zeros(8 * len(pages), dtype=np.uint64)
    out = np.zeros(len(pages), dtype=np.uint64)
    so.run_xxh3(table.ctypes.data, len(pages), accs.ctypes.data, out.ctypes.data, 64)
    return out


class EmulatedKernels:
    """gpu.Kernels' interface over the CPU-compiled kernels: host memory and
    CPU tensors stand for memory the GPU reaches."""

    host_pointers = True

    def __init__(self, so: ctypes.CDLL) -> None:
        self.so = so
        self.launches = 0
        self.priorities: list[int] = []
        self.dmas: list[int] = []

    def reaches(self, view: Any) -> bool:
        return isinstance(view, np.ndarray) or view.device.type == "cpu"

    def copy(self, copies: Sequence[gpu.Copy], priority: int) -> None:
        plan = gpu.plan_copies(copies, piece_bytes=64 << 10)
        self.so.run_copy2d(plan.ctypes.data, len(plan), 5, 32)
        self.launches += 1
        self.priorities.append(priority)

    def empty(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def dma(self, dst: Any, src: Any, priority: int) -> None:
        memory.copy(dst, src)
        self.dmas.append(priority)

    def checksums(self, pages: Sequence[tuple[int, int]], priority: int = 0) -> np.ndarray:
        assert min(n for _, n in pages) > gpu.SHORT_PAGE
        self.launches += 2
        return hash_pages(self.so, pages)
