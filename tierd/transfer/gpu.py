"""Copies and checksums on the GPU, one kernel launch per call.

plan_copies() turns the 2-D copies of a gather or scatter (one per run and
segment) into the table the copy kernel reads; it is plain numpy and tested
everywhere. Kernels compiles kernels.cu with cupy and launches it on torch
streams: demand work on a high-priority stream, background moves on a
low-priority one. The daemon builds it only where CUDA and cupy are present.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tierd.tiers import cuda_host
from tierd.tiers.ioqueue import IOClass

log = logging.getLogger("tierd.transfer.gpu")

KERNELS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cu")
PIECE = 1 << 20  # bytes one thread block copies per plan entry (a multiple of 16: vectors stay aligned)
THREADS = 256
MAX_BLOCKS = 1 << 16
SHORT_PAGE = 240  # XXH3 hashes inputs up to this long another way: those pages are hashed on the CPU
_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem

Copy = tuple[int, int, int, int, int, int]  # src, dst, src_pitch, dst_pitch, width, rows


def plan_copies(copies: Sequence[Copy], piece_bytes: int = PIECE) -> np.ndarray:
    """The copy kernel's plan, (n, 6) uint64: the copies cut into pieces of at
    most piece_bytes (whole rows where a row fits, else column slices of one
    row), so every thread block gets a share of a large copy."""
    if piece_bytes <= 0 or piece_bytes % 16:
        raise ValueError(f"piece_bytes must be a positive multiple of 16, not {piece_bytes}")
    a = np.asarray(copies, dtype=np.int64).reshape(-1, 6)
    a = a[(a[:, 4] > 0) & (a[:, 5] > 0)]
    # Rows wider than a piece: one entry per column slice (same pitches, same rows).
    cols = -(-a[:, 4] // piece_bytes)
    a, j = _repeat(a, cols)
    a[:, 0] += j * piece_bytes
    a[:, 1] += j * piece_bytes
    a[:, 4] = np.minimum(piece_bytes, a[:, 4] - j * piece_bytes)
    # Then as many whole rows per entry as fit in a piece.
    per = np.maximum(1, piece_bytes // a[:, 4])
    pieces = -(-a[:, 5] // per)
    per = np.repeat(per, pieces)
    a, j = _repeat(a, pieces)
    first = j * per
    a[:, 0] += first * a[:, 2]
    a[:, 1] += first * a[:, 3]
    a[:, 5] = np.minimum(per, a[:, 5] - first)
    return np.ascontiguousarray(a).view(np.uint64)


def _repeat(a: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of a repeated counts times, and each copy's index within its row's group."""
    out = np.repeat(a, counts, axis=0)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return out, np.arange(len(out), dtype=np.int64) - starts


def rows_of(view: Any) -> tuple[int, int, int, int]:
    """(address, pitch, width, rows) of a 1-D or 2-D byte view, numpy or torch."""
    if isinstance(view, np.ndarray):
        address, shape, pitch = view.ctypes.data, view.shape, view.strides[0]
    else:
        address, shape, pitch = view.data_ptr(), tuple(view.shape), view.stride(0)
    return (address, shape[0], shape[0], 1) if len(shape) == 1 else (address, pitch, shape[1], shape[0])


def extent(view: Any) -> tuple[int, int]:
    """(first address, bytes up to the last one) a byte view touches."""
    address, pitch, width, rows = rows_of(view)
    return address, (rows - 1) * pitch + width


def copy_of(dst: Any, src: Any) -> Copy:
    """The plan entry that makes dst (a 2-D byte view) equal src."""
    s, sp, w, r = rows_of(src)
    d, dp, dw, dr = rows_of(dst)
    if (w, r) != (dw, dr):
        raise ValueError(f"copy of {r} x {w} bytes into {dr} x {dw}")
    return s, d, sp, dp, w, r


class Kernels:
    """kernels.cu compiled for the current device, with a stream per I/O class."""

    def __init__(self, device: int = 0) -> None:
        import cupy
        import torch

        self._cp = cupy
        self._torch = torch
        self.device = device
        with cupy.cuda.Device(device):
            with open(KERNELS_PATH) as f:
                module = cupy.RawModule(code=f.read(), options=("--std=c++17",))
            self._copy = module.get_function("tierd_copy2d")
            self._lanes = module.get_function("tierd_xxh3_lanes")
            self._merge = module.get_function("tierd_xxh3_merge")
            self.host_pointers = bool(cupy.cuda.runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER, device))
        low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self.demand = torch.cuda.Stream(device=device, priority=high)
        self.background = torch.cuda.Stream(device=device, priority=low)
        self.launches = 0

    def reaches(self, view: Any) -> bool:
        """Whether a kernel on this device can read and write the view: memory
        on this GPU, or host memory pinned and mapped for it."""
        if isinstance(view, np.ndarray):
            return self.host_pointers and cuda_host.is_pinned(*extent(view))
        return view.device.type == "cuda" and view.device.index in (None, self.device)

    def empty(self, nbytes: int) -> Any:
        """nbytes of GPU memory (a uint8 tensor), for staging."""
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=f"cuda:{self.device}")

    def stream(self, io_class: int) -> Any:
        return self.demand if io_class <= IOClass.PREFETCH else self.background

    def copy(self, copies: Sequence[Copy], io_class: int = IOClass.DEMAND) -> None:
        """All the copies in one launch; returns when they are done."""
        plan = plan_copies(copies)
        if not len(plan):
            return
        stream = self.stream(io_class)
        cp = self._cp
        with cp.cuda.Device(self.device), cp.cuda.ExternalStream(stream.cuda_stream):
            table = cp.asarray(plan.reshape(-1))
            self._copy((min(len(plan), MAX_BLOCKS),), (THREADS,), (table, np.int64(len(plan))))
            self.launches += 1
        stream.synchronize()

    def dma(self, dst: Any, src: Any, io_class: int = IOClass.DEMOTION) -> None:
        """dst[...] = src through the GPU's copy engines (no SM time taken from
        the inference engine) on the stream of its I/O class; returns when done."""
        torch = self._torch
        d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
        s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
        stream = self.stream(io_class)
        with torch.cuda.stream(stream):
            d.copy_(s, non_blocking=True)
        stream.synchronize()

    def checksums(self, pages: Sequence[tuple[int, int]], io_class: int = IOClass.DEMAND) -> np.ndarray:
        """XXH3-64 of each (device address, length) page, every length > SHORT_PAGE."""
        n = len(pages)
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        if min(length for _, length in pages) <= SHORT_PAGE:
            raise ValueError(f"pages of {SHORT_PAGE} bytes or fewer are hashed on the CPU")
        stream = self.stream(io_class)
        cp = self._cp
        with cp.cuda.Device(self.device), cp.cuda.ExternalStream(stream.cuda_stream):
            table = cp.asarray(np.asarray(pages, dtype=np.uint64).reshape(-1))
            accs = cp.empty(8 * n, dtype=cp.uint64)
            out = cp.empty(n, dtype=cp.uint64)
            self._lanes((-(-8 * n // THREADS),), (THREADS,), (table, np.int64(n), accs))
            self._merge((-(-n // THREADS),), (THREADS,), (table, np.int64(n), accs, out))
            self.launches += 2
            result = out.get()
        stream.synchronize()
        return result


def load(device: int = 0) -> Kernels | None:
    """The kernels, or None (with the reason logged) where they cannot run."""
    try:
        return Kernels(device)
    except Exception as exc:  # no cupy, no driver, NVRTC failure: copies fall back to one per run
        log.warning("GPU kernels unavailable (%s: %s); device copies go one per run", type(exc).__name__, exc)
        return None
