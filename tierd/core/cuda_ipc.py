"""Engine GPU memory opened through CUDA IPC handles.

An engine exports each allocation holding its KV cache as a
cudaIpcMemHandle_t; the daemon opens every allocation once (opening costs
about a millisecond, and CUDA refuses to open one handle twice in a process),
hands out byte tensors over the regions inside it, and closes it when the
last engine using it is unregistered or its process exits.

The driver does the CUDA calls; CupyDriver is the real one. The cache and
its reference counts are plain Python, so the CPU suite tests them with a
driver over shared memory.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from tierd import cuda_driver
from tierd.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("tierd.core.cuda_ipc")


@dataclass(frozen=True)
class IpcRegion:
    """A region of engine GPU memory: size bytes from offset inside the
    allocation that handle names, on the GPU with device_uuid."""

    handle: bytes
    offset: int
    size: int
    device_uuid: str


class Driver(Protocol):
    def device_index(self, device_uuid: str) -> int: ...
    def open(self, handle: bytes, device: int) -> tuple[int, int]: ...  # (address, allocation bytes)
    def close(self, address: int, device: int) -> None: ...
    def tensor(self, address: int, size: int, device: int) -> Any: ...


class CupyDriver:
    """The CUDA runtime through cupy; byte tensors through torch (zero copy)."""

    def __init__(self) -> None:
        import cupy
        import torch

        self._cp = cupy
        self._torch = torch
        self._uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}

    def device_index(self, device_uuid: str) -> int:
        try:
            return self._uuids[device_uuid]
        except KeyError:
            raise FailedPrecondition(f"GPU {device_uuid} is not visible to the daemon (visible: "
                                     f"{', '.join(sorted(self._uuids)) or 'none'})", field="regions") from None

    def open(self, handle: bytes, device: int) -> tuple[int, int]:
        cp = self._cp
        with cp.cuda.Device(device):
            address = cp.cuda.runtime.ipcOpenMemHandle(handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            base, size = cuda_driver.allocation(address)
            return address, size - (address - base)

    def close(self, address: int, device: int) -> None:
        with self._cp.cuda.Device(device):
            self._cp.cuda.runtime.ipcCloseMemHandle(address)

    def tensor(self, address: int, size: int, device: int) -> Any:
        cp = self._cp
        mem = cp.cuda.UnownedMemory(address, size, self, device)
        array = cp.ndarray((size,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return self._torch.as_tensor(array, device=f"cuda:{device}")


@dataclass
class _Opened:
    address: int
    size: int  # the allocation's bytes, 0 where the driver cannot tell
    device: int
    users: int = 0


class IpcCache:
    """Each allocation opened once, shared by every region and engine inside it."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self._open: dict[tuple[str, bytes], _Opened] = {}
        self._lock = threading.Lock()

    def acquire(self, region: IpcRegion) -> Any:
        """A byte tensor over the region; release() it when done."""
        if len(region.handle) != cuda_driver.HANDLE_BYTES:
            raise InvalidArgument(f"a CUDA IPC handle has {cuda_driver.HANDLE_BYTES} bytes, not {len(region.handle)}",
                                  field="regions")
        if region.size <= 0:
            raise InvalidArgument("a CUDA IPC region needs a positive size", field="regions")
        key = (region.device_uuid, region.handle)
        with self._lock:
            opened = self._open.get(key)
            if opened is None:
                device = self.driver.device_index(region.device_uuid)
                try:
                    address, size = self.driver.open(region.handle, device)
                except (FailedPrecondition, InvalidArgument):
                    raise
                except Exception as exc:
                    raise FailedPrecondition(f"cannot open the CUDA IPC handle of a region: {exc}",
                                             field="regions") from exc
                opened = self._open[key] = _Opened(address, size, device)
            if opened.size and region.offset + region.size > opened.size:
                self._drop_if_unused(key, opened)
                raise InvalidArgument(f"region [{region.offset}, {region.offset + region.size}) runs past its "
                                      f"{opened.size}-byte allocation", field="regions")
            opened.users += 1
        return self.driver.tensor(opened.address + region.offset, region.size, opened.device)

    def release(self, region: IpcRegion) -> None:
        key = (region.device_uuid, region.handle)
        with self._lock:
            opened = self._open.get(key)
            if opened is None:
                return
            opened.users -= 1
            self._drop_if_unused(key, opened)

    def _drop_if_unused(self, key: tuple[str, bytes], opened: _Opened) -> None:
        if opened.users > 0:
            return
        del self._open[key]
        try:
            self.driver.close(opened.address, opened.device)
        except Exception as exc:  # the engine's memory is gone either way
            log.warning("closing a CUDA IPC handle failed: %s", exc)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
