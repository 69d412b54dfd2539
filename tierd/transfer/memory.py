"""Byte views over host arrays (numpy) and device tensors (torch), and the one
copy primitive every route uses.

A 2-D strided view (rows x width, rows `stride` bytes apart) lets a single
copy move one run of blocks for one segment, however the engine spaces its
blocks and however the tier packs its pages.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def rows(buf: Any, start: int, count: int, stride: int, width: int) -> Any:
    """count rows of width bytes, stride bytes apart, from byte start of a 1-D uint8 buffer."""
    if isinstance(buf, np.ndarray):
        span = (count - 1) * stride + width
        return np.lib.stride_tricks.as_strided(buf[start : start + span], shape=(count, width), strides=(stride, 1))
    return buf.as_strided((count, width), (stride, 1), buf.storage_offset() + start)


def is_device(buf: Any) -> bool:
    return not isinstance(buf, np.ndarray) and buf.device.type != "cpu"


PARALLEL_COPY = 1 << 20  # from this size, host copies go through torch, which copies on every core


def copy(dst: Any, src: Any) -> None:
    """dst[...] = src for numpy arrays and torch tensors in any combination."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray) and dst.nbytes < PARALLEL_COPY:
        np.copyto(dst, src)  # small: numpy's lower call overhead wins
        return
    import torch

    d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    d.copy_(s)


def clear(buf: Any) -> None:
    """Zero a numpy array or a torch tensor."""
    if isinstance(buf, np.ndarray):
        buf[...] = 0
    else:
        buf.zero_()


def to_host(buf: Any) -> np.ndarray:
    """A numpy view (host buffers) or copy (device tensors) of a 1-D byte buffer."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.cpu().numpy()


def synchronize(*bufs: Any) -> None:
    """Wait for queued device copies touching these buffers."""
    for b in bufs:
        if is_device(b):
            import torch

            torch.cuda.synchronize(b.device)
            return
