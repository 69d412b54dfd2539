"""The few CUDA driver calls tierd makes directly (through ctypes, so an
engine needs neither cupy nor a compiler to export its memory).

Used where a GPU is present: by the client to export the allocations under
an engine's KV tensors as IPC handles, by the daemon to check a region
against the allocation it opened.
"""

from __future__ import annotations

import ctypes

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_lib: ctypes.CDLL | None = None


class CudaDriverError(RuntimeError):
    pass


def _libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaDriverError(f"{what} failed: {(name.value or b'CUDA error %d' % rc).decode()}")


def allocation(address: int) -> tuple[int, int]:
    """(base, bytes) of the device allocation holding address; the calling
    thread needs the device's context current (any torch or cupy call on
    that device makes it so)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
           "cuMemGetAddressRange")
    return int(base.value), int(size.value)


def ipc_handle(base: int) -> bytes:
    """The IPC handle of the allocation starting at base (cudaMalloc memory;
    not virtual-memory allocations such as torch's expandable segments)."""
    handle = (ctypes.c_char * HANDLE_BYTES)()
    _check(_libcuda().cuIpcGetMemHandle(handle, ctypes.c_uint64(base)), "cuIpcGetMemHandle")
    return bytes(handle)
