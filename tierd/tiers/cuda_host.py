"""Page-lock host memory for DMA (cudaHostRegister), through cupy, else torch.

Registered memory is also mapped into the GPU's address space, so a kernel
can gather into it or scatter from it directly; is_pinned() tells the copy
engine whether a host buffer lies in such memory. Registration is tried only
when a GPU is present. register() returns None instead of raising, so the
caller can say what it fell back to.
"""

from __future__ import annotations

import bisect
import logging
import threading

import numpy as np

log = logging.getLogger("tierd.tiers.cuda_host")
_FLAGS = 1 | 2  # cudaHostRegisterPortable (every CUDA context) | cudaHostRegisterMapped (kernels reach it)

_lock = threading.Lock()
_starts: list[int] = []  # registered ranges, sorted by start
_ends: dict[int, int] = {}


def _remember(ptr: int, size: int) -> None:
    with _lock:
        bisect.insort(_starts, ptr)
        _ends[ptr] = ptr + size


def _forget(ptr: int) -> None:
    with _lock:
        if _ends.pop(ptr, None) is not None:
            _starts.remove(ptr)


def is_pinned(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies inside one registered range."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        return i >= 0 and address + nbytes <= _ends[_starts[i]]


def register(array: np.ndarray) -> int | None:
    ptr, size = array.ctypes.data, array.nbytes
    try:
        import cupy

        cupy.cuda.runtime.hostRegister(ptr, size, _FLAGS)
        _remember(ptr, size)
        return ptr
    except ImportError:
        pass
    except Exception as exc:  # cupy raises CUDARuntimeError; keep the reason in the log
        log.debug("cupy hostRegister failed: %s", exc)
        return None
    try:
        import torch

        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _FLAGS)
        if int(err) != 0:
            return None
        _remember(ptr, size)
        return ptr
    except Exception as exc:
        log.debug("torch cudaHostRegister failed: %s", exc)
        return None


def unregister(ptr: int) -> None:
    _forget(ptr)
    try:
        import cupy

        cupy.cuda.runtime.hostUnregister(ptr)
        return
    except ImportError:
        pass
    except Exception as exc:
        log.debug("cupy hostUnregister failed: %s", exc)
        return
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception as exc:
        log.debug("torch cudaHostUnregister failed: %s", exc)
