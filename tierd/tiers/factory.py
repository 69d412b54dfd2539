"""Probe the machine once at start and build the tiers it supports.

Each choice is logged in one line and kept in `backends`, which the metrics
expose: whether there is a device tier (and on what), whether the host arena
is pinned for DMA, which disk I/O path runs, whether GPU copies run as
kernels, and whether engines may register GPU memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tierd.config import AUTO, Config
from tierd.core.cuda_ipc import CupyDriver, IpcCache
from tierd.core.index import DiskIndex
from tierd.tiers import shm
from tierd.tiers.disk import DiskTier
from tierd.tiers.host import HostTier
from tierd.transfer.copier import CopyEngine
from tierd.transfer.ioqueue import PriorityExecutor

log = logging.getLogger("tierd.tiers")


@dataclass
class Machine:
    tiers: dict
    copier: CopyEngine
    index: DiskIndex
    executor: PriorityExecutor
    backends: dict[str, str] = field(default_factory=dict)  # what was chosen, beside each tier's .backend
    ipc: IpcCache | None = None  # where engines may register GPU memory (CUDA IPC)
    shm_prefix: str = ""  # this run's shared-memory names: the arena's slabs and the lease segments

    def close(self) -> None:
        self.executor.shutdown()


def probe_device(cfg: Config):
    """(DeviceTier or None, description)."""
    if cfg.device == "none":
        return None, "absent (disabled by configuration)"
    if cfg.device == "cpu":
        from tierd.tiers.device import DeviceTier

        budget = cfg.device_budget if cfg.device_budget != AUTO else 256 << 20
        return DeviceTier(int(budget), "cpu", cfg.device_slab), "emulated in host memory (device=cpu)"
    try:
        import torch
    except ImportError:
        return None, "absent (torch is not installed)"
    if not torch.cuda.is_available():
        return None, "absent (no CUDA device)"
    from tierd.tiers.device import DeviceTier

    name = "cuda" if cfg.device in (AUTO, "cuda") else cfg.device
    dev = torch.device(name)
    total = torch.cuda.get_device_properties(dev).total_memory
    budget = total // 4 if cfg.device_budget == AUTO else int(cfg.device_budget)
    return DeviceTier(budget, str(dev), cfg.device_slab), f"{torch.cuda.get_device_name(dev)} ({dev}) through torch"


class DiskIOUnavailable(RuntimeError):
    pass


def probe_disk_io(cfg: Config, directory: str):
    """(kvikio FileOps or None for POSIX, why kvikio is not used)."""
    if cfg.disk_io == "posix":
        return None, "posix chosen by configuration"
    from tierd.tiers import kvikio_io

    os.makedirs(directory, mode=0o700, exist_ok=True)
    ops, what = kvikio_io.probe(directory)
    if ops is None and cfg.disk_io == "kvikio":
        raise DiskIOUnavailable(f"disk_io is kvikio, but {what}")
    return ops, what


def build(cfg: Config) -> Machine:
    """Tiers, copy engine and index for this machine; budgets must be resolved."""
    data_dir = os.path.abspath(cfg.data_dir)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    executor = PriorityExecutor(cfg.io_workers)
    device, device_text = probe_device(cfg)
    log.info("device tier: %s", device_text)
    prefix = shm.claim_prefix(data_dir)  # random per run; what a killed run left is removed
    pin = device is not None and device.device.type == "cuda"
    host = HostTier(int(cfg.host_budget), prefix, int(cfg.host_slab), pin=pin)
    slabs = os.path.join(data_dir, "slabs")
    ops, why = probe_disk_io(cfg, slabs)
    disk = DiskTier(int(cfg.disk_budget), slabs, executor, cfg.disk_slab, ops=ops)
    log.info("disk tier: %s I/O under %s%s", disk.backend, disk.directory, f" ({why})" if ops is None else "")
    tiers = {"host": host, "disk": disk}
    if device is not None:
        tiers["device"] = device
    verify = ("disk",) if cfg.verify == "disk" else tuple(tiers)
    backends = {"device": str(device.device) if device is not None else "absent"}
    kernels = None
    if pin:
        from tierd.transfer import gpu

        kernels = gpu.load(device.device.index or 0)
        if kernels is not None:
            log.info("GPU copies: one kernel launch per gather or scatter; checksums on the GPU%s",
                     "" if kernels.host_pointers else " (the GPU cannot address pinned host memory: host copies go "
                                                      "one per run)")
    backends["gpu_copies"] = "kernels" if kernels is not None else "per-run"
    ipc = open_ipc() if pin else None
    backends["engine_memory"] = "shm+cuda-ipc" if ipc is not None else "shm"
    index = DiskIndex(os.path.join(data_dir, "index.db"))
    return Machine(tiers, CopyEngine(tiers, verify_tiers=verify, kernels=kernels), index, executor, backends, ipc,
                   prefix)


def open_ipc() -> IpcCache | None:
    """The cache of engine GPU memory opened through CUDA IPC, or None (logged)."""
    try:
        return IpcCache(CupyDriver())
    except Exception as exc:  # no cupy, or no driver: engines register shared memory only
        log.warning("engines cannot register GPU memory (CUDA IPC needs cupy: %s); shared memory only", exc)
        return None
