"""Page-lock host memory for DMA (cudaHostRegister), through cupy, else torch.

Imported only when a GPU is present. Every function returns None or False
instead of raising, so the caller can say what it fell back to.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("tierd.tiers.cuda_host")
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def register(array: np.ndarray) -> int | None:
    ptr, size = array.ctypes.data, array.nbytes
    try:
        import cupy

        cupy.cuda.runtime.hostRegister(ptr, size, _PORTABLE)
        return ptr
    except ImportError:
        pass
    except Exception as exc:  # cupy raises CUDARuntimeError; keep the reason in the log
        log.debug("cupy hostRegister failed: %s", exc)
        return None
    try:
        import torch

        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _PORTABLE)
        return ptr if int(err) == 0 else None
    except Exception as exc:
        log.debug("torch cudaHostRegister failed: %s", exc)
        return None


def unregister(ptr: int) -> None:
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
