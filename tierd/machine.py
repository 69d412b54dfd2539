"""The composition root: probe the machine once and build everything that
holds KV (tiers, copy engine, disk index, the CUDA IPC cache, the store).
The daemon, the tests' harness and the benches all build through build();
nothing else constructs tiers for them.

Each choice is logged in one line and kept in `backends`, which the metrics
expose: whether there is a device tier (and on what), whether the host arena
is pinned for DMA, which disk I/O path runs, whether GPU copies run as
kernels, and whether engines may register GPU memory. Runs once, on the
main thread, before anything is served.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tierd.clock import Clock
from tierd.config import AUTO, Config, resolve_budgets
from tierd.core.cuda_ipc import CupyDriver, IpcCache
from tierd.core.events import StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.store import Store
from tierd.policy import PolicyConfig
from tierd.tiers import shm
from tierd.tiers.disk import DiskTier, FileOps
from tierd.tiers.host import HostTier
from tierd.tiers.ioqueue import PriorityExecutor
from tierd.transfer.copier import DEFAULT_WINDOW, CopyEngine

log = logging.getLogger("tierd.machine")


@dataclass
class Machine:
    store: Store
    tiers: dict
    copier: CopyEngine
    index: DiskIndex | None
    executor: PriorityExecutor
    backends: dict[str, str] = field(default_factory=dict)  # what was chosen, beside each tier's .backend
    ipc: IpcCache | None = None  # where engines may register GPU memory (CUDA IPC)
    shm_prefix: str = ""  # this run's shared-memory names: the arena's slabs and the lease segments

    def close(self, flush: bool = True) -> None:
        """Close the store (with flush, what is not durable is written first), then the I/O threads."""
        try:
            self.store.close(flush=flush)
        finally:
            self.executor.shutdown()


def policy_of(cfg: Config) -> PolicyConfig:
    quotas = tuple((tier, q) for tier, q in (("device", cfg.tenant_device_quota), ("host", cfg.tenant_host_quota),
                                              ("disk", cfg.tenant_disk_quota)) if q)
    return PolicyConfig(device_idle=cfg.device_idle, host_idle=cfg.host_idle, writeback_idle=cfg.writeback_idle,
                        disk_ttl=cfg.disk_ttl, tenant_quota=quotas, tenant_sessions=cfg.tenant_sessions,
                        tenant_leases=cfg.tenant_leases, tenant_lease_bytes=int(cfg.tenant_lease_bytes))


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


def build(cfg: Config, *, policy: PolicyConfig | None = None, clock: Clock | None = None,
          events: StoreEvents | None = None, disk: bool = True, disk_ops: FileOps | None = None,
          window_bytes: int = DEFAULT_WINDOW) -> Machine:
    """Tiers, copy engine, index and store for this machine ("auto" budgets
    resolved here), the store's sessions recovered from the index. policy: else
    the configuration's; disk=False: no disk tier (a cache in memory only);
    disk_ops: the disk tier's file operations (else probed: kvikio or POSIX)."""
    data_dir = os.path.abspath(cfg.data_dir)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    cfg = resolve_budgets(cfg)
    executor = PriorityExecutor(cfg.io_workers)
    try:
        return _build(cfg, data_dir, executor, policy or policy_of(cfg), clock, events, disk, disk_ops, window_bytes)
    except BaseException:
        executor.shutdown()
        raise


def _build(cfg: Config, data_dir: str, executor: PriorityExecutor, policy: PolicyConfig, clock: Clock | None,
           events: StoreEvents | None, disk: bool, disk_ops: FileOps | None, window_bytes: int) -> Machine:
    device, device_text = probe_device(cfg)
    log.info("device tier: %s", device_text)
    prefix = shm.claim_prefix(data_dir)  # random per run; what a killed run left is removed
    pin = device is not None and device.device.type == "cuda"
    tiers: dict = {"host": HostTier(int(cfg.host_budget), prefix, int(cfg.host_slab), pin=pin)}
    index = None
    if disk:
        slabs = os.path.join(data_dir, "slabs")
        ops, why = (disk_ops, "given") if disk_ops is not None else probe_disk_io(cfg, slabs)
        tiers["disk"] = DiskTier(int(cfg.disk_budget), slabs, executor, cfg.disk_slab, ops=ops)
        log.info("disk tier: %s I/O under %s%s", tiers["disk"].backend, slabs, f" ({why})" if ops is None else "")
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
    copier = CopyEngine(tiers, window_bytes=window_bytes, verify_tiers=verify, kernels=kernels)
    if disk:
        index = DiskIndex(os.path.join(data_dir, "index.db"))
    try:
        store = Store(tiers, copier, index, clock=clock, policy=policy, events=events, movers=cfg.movers,
                      shm_prefix=prefix)
    except BaseException:
        for tier in tiers.values():
            tier.close()
        if index is not None:
            index.close()
        raise
    return Machine(store, tiers, copier, index, executor, backends, ipc, prefix)


def open_ipc() -> IpcCache | None:
    """The cache of engine GPU memory opened through CUDA IPC, or None (logged)."""
    try:
        return IpcCache(CupyDriver())
    except Exception as exc:  # no cupy, or no driver: engines register shared memory only
        log.warning("engines cannot register GPU memory (CUDA IPC needs cupy: %s); shared memory only", exc)
        return None
