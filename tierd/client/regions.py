"""What a client hands the daemon, in the caller's process: data as a flat
byte view, and engine memory as region messages (shared memory handed over
as descriptors on the daemon's intake socket; GPU memory as CUDA IPC
handles)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tierd.client.channel import pb
from tierd.errors import FailedPrecondition, InvalidArgument, shown
from tierd.layout import EngineLayout
from tierd.wire.fds import hand_over, intake_path


def as_bytes(data: Any) -> memoryview:
    """bytes, bytearray, memoryview, numpy arrays and torch tensors as a flat byte view."""
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if isinstance(data, memoryview):
        return data.cast("B") if data.contiguous else memoryview(data.tobytes())
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if type(data).__module__.startswith("torch"):
        import torch

        t = data.detach().contiguous().cpu()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    raise InvalidArgument(f"data must be bytes, memoryview, a numpy array or a torch tensor, not {type(data).__name__}")


def shm_regions(pairs: list[tuple[int, int]], address: str, metadata: tuple) -> tuple[list[pb.Region], str]:
    """Hand the memory's descriptors to the daemon (it maps only memory handed
    over, never a name); the region messages and the ticket that names them."""
    if not address.startswith("unix:"):
        raise FailedPrecondition("shared-memory engine memory needs the daemon's Unix socket, on this machine",
                                 field="regions")
    for memory, _ in pairs:
        if isinstance(memory, bool) or not isinstance(memory, int):
            raise InvalidArgument(f"shared memory is handed over as an open memfd sealed against shrinking (a "
                                  f"SharedKVCache's fds), not {shown(memory)}", field="regions")
    token = next((v[len("Bearer "):] for k, v in metadata if k == "authorization"), None)
    ticket = hand_over(intake_path(address[len("unix:"):]), [fd for fd, _ in pairs], token)
    return [pb.Region(shm_fd=i, size=size) for i, (_, size) in enumerate(pairs)], ticket


def engine_regions(regions: Any, address: str, metadata: tuple) -> tuple[list[pb.Region], EngineLayout | None, bool, str]:
    """Region messages, the layout they carry if any, whether they are GPU
    memory, and the ticket of shared memory handed over."""
    if hasattr(regions, "fds") and hasattr(regions, "layout"):  # a SharedKVCache
        msgs, ticket = shm_regions(list(zip(regions.fds, regions.sizes)), address, metadata)
        return msgs, regions.layout, False, ticket
    regions = list(regions)
    cuda = [bool(getattr(r, "is_cuda", False)) for r in regions]
    if any(cuda):
        if not all(cuda):
            raise InvalidArgument("regions are all CUDA tensors or all (memfd, size) pairs", field="regions")
        return [cuda_region(t) for t in regions], None, True, ""
    msgs, ticket = shm_regions(regions, address, metadata)
    return msgs, None, False, ticket


def cuda_region(tensor: Any) -> pb.Region:
    """A contiguous CUDA tensor's bytes as a region the daemon opens through
    CUDA IPC: the handle of the allocation holding it, and where it starts."""
    import torch

    from tierd import cuda_driver

    if not tensor.is_contiguous():
        raise InvalidArgument("a GPU region must be a contiguous tensor", field="regions")
    with torch.cuda.device(tensor.device):
        torch.cuda.synchronize()  # the device's context is current on this thread, and earlier writes are done
        base, _ = cuda_driver.allocation(tensor.data_ptr())
        handle = cuda_driver.ipc_handle(base)
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return pb.Region(cuda_ipc=pb.CudaIpcMemory(handle=handle, offset=tensor.data_ptr() - base, device_uuid=uuid),
                     size=tensor.numel() * tensor.element_size())
