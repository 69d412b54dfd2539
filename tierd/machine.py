"""The composition root: probe the machine once and build everything that
holds KV (tiers, copy engine, disk index, the CUDA IPC cache, the store).
The daemon, the tests' harness and the benches all build through build();
nothing else constructs tiers for them.

Each choice is logged in one line and kept in `backends`, which the metrics
expose: whether there is a device tier (and on what), whether the host arena
is pinned for DMA, which disk I/O path runs, whether GPU copies run as
kernels, whether engines may register GPU memory, and how malloc keeps
freed buffers (glibc's is told to keep them for the next). Runs once, on the
main thread, before anything is served.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tierd.clock import Clock
from tierd.config import AUTO, Config, remote_password, resolve_budgets
from tierd.core.cuda_ipc import CupyDriver, IpcCache
from tierd.core.events import NullEvents, StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.store import Store
from tierd.core.store import build as build_store
from tierd.codecs.auto import check_codec
from tierd.core.store.coding import Consent
from tierd.core.store.recoding import Recoding
from tierd.core.store.remote import Remote
from tierd.policy import PolicyConfig
from tierd.sizes import format_size
from tierd.tiers import DEVICE, DISK, FILE, HOST, durable_tier, shm, tier_order
from tierd.tiers.disk import DiskTier
from tierd.tiers.fileops import FileOps
from tierd.tiers.host import HostTier
from tierd.tiers.ioqueue import IOExecutor
from tierd.transfer.coded import TierCoding
from tierd.transfer.copier import DEFAULT_WINDOW, CopyEngine

log = logging.getLogger("tierd.machine")


@dataclass
class Machine:
    store: Store
    tiers: dict
    copier: CopyEngine
    index: DiskIndex | None
    executor: IOExecutor
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
    quotas = tuple((tier, q) for tier, q in ((DEVICE, cfg.tenant_device_quota), (HOST, cfg.tenant_host_quota),
                                              (DISK, cfg.tenant_disk_quota)) if q)
    return PolicyConfig(device_idle=cfg.device_idle, host_idle=cfg.host_idle, writeback_idle=cfg.writeback_idle,
                        disk_ttl=cfg.disk_ttl, tenant_quota=quotas, tenant_sessions=cfg.tenant_sessions,
                        tenant_leases=cfg.tenant_leases, tenant_lease_bytes=int(cfg.tenant_lease_bytes),
                        tenant_put_bytes=int(cfg.tenant_put_bytes))


@dataclass
class Site:
    """What the tier builders are handed: the configuration, this run's
    shared-memory prefix and I/O threads, and the tiers built so far."""

    cfg: Config
    data_dir: str
    shm_prefix: str
    executor: IOExecutor
    disk_ops: FileOps | None = None  # the disk tier's file operations, if given (else probed)
    tiers: dict = field(default_factory=dict)


def device_tier(site: Site):
    """VRAM through torch where CUDA is present (or emulated: device=cpu)."""
    cfg = site.cfg
    if cfg.device == "none":
        return None, "absent (disabled by configuration)"
    if cfg.device == "cpu":
        from tierd.tiers.device import DeviceTier

        budget = int(cfg.device_budget) if cfg.device_budget != AUTO else 256 << 20
        return (DeviceTier(budget, "cpu", cfg.device_slab),
                f"emulated in host memory (device=cpu); budget {format_size(budget)}")
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
    return DeviceTier(budget, str(dev), cfg.device_slab), (f"{torch.cuda.get_device_name(dev)} ({dev}) through torch; "
                                                           f"budget {format_size(budget)}")


def host_tier(site: Site):
    """The shared-memory arena, pinned for DMA where a CUDA device tier is."""
    tier = HostTier(int(site.cfg.host_budget), site.shm_prefix, int(site.cfg.host_slab), pin=_on_cuda(site))
    return tier, f"{tier.backend}; budget {format_size(tier.budget)}"


def disk_tier(site: Site):
    """Sparse slab files under the data dir, through kvikio where it passes its self-test, else POSIX."""
    slabs = os.path.join(site.data_dir, "slabs")
    ops, why = (site.disk_ops, "given") if site.disk_ops is not None else probe_disk_io(site.cfg, slabs)
    tier = DiskTier(int(site.cfg.disk_budget), slabs, site.executor, site.cfg.disk_slab, ops=ops)
    return tier, (f"{tier.backend} I/O under {slabs}{f' ({why})' if ops is None else ''}; "
                  f"budget {format_size(tier.budget)}")


# The tiers a machine may have, each built by its function in this order
# (the host arena is pinned where the device tier runs on CUDA). A new tier
# is one more builder here.
TIERS = (device_tier, host_tier, disk_tier)


def _on_cuda(site: Site) -> bool:
    device = site.tiers.get(DEVICE)
    return device is not None and device.device.type == "cuda"


class DiskIOUnavailable(RuntimeError):
    pass


class RemoteUnavailable(RuntimeError):
    """The remote tier configured cannot be used: unreachable, or the password is refused."""


def remote_tier(cfg: Config) -> tuple[Remote | None, str]:
    """The remote tier where --remote is given (the backend its URL's scheme
    names: tierd/remote/registry.py), and what it is, for the log."""
    if not cfg.remote:
        return None, "absent"
    from tierd.errors import TierdError
    from tierd.remote import registry

    options = registry.Options(cfg.remote_prefix, cfg.remote_ttl, cfg.remote_timeout, remote_password(cfg),
                               cfg.remote_tls_ca or None, cfg.remote_recheck, cfg.remote_replicas)
    codec = cfg.codec.get("remote", "none")
    try:
        check_codec(codec)
        store = registry.open_backend(cfg.remote, options)
    except TierdError as exc:
        raise RemoteUnavailable(f"cannot use the remote tier: {exc}") from None
    sweep = min(60.0, cfg.remote_ttl / 10) if cfg.remote_ttl else 60.0  # well within a tombstone's life
    lossy = Consent(cfg.lossy_tenants, cfg.lossy_max_error).describe(codec)
    return (Remote(store, cfg.remote_write, cfg.remote_idle, cfg.remote_queue, int(cfg.tenant_remote_quota), sweep,
                   codec, cfg.lossy_tenants, cfg.lossy_max_error),
            f"{store.describe()}; write {cfg.remote_write}; codec {codec}{lossy}")


# glibc's malloc gives freed memory at the top of a heap back to the kernel once more than
# about two of the largest recent buffers lie free there; the next ones then cost a page fault
# per 4 KiB when first written. The daemon allocates buffers of about a MiB by the dozen (a
# Get's chunks that span pages, a Put's messages, replies read through redis-py): kept, they
# are written at memory speed.
KEEP_FREED_BYTES = 64 << 20  # per heap: a few batches of buffers
MMAP_ABOVE_BYTES = 4 << 20  # buffers up to this come from a heap (and are kept); larger ones are mapped


def keep_freed_buffers() -> str:
    """Tell glibc's malloc to keep freed buffers for the next (what was done, for the log)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        version, mallopt = libc.gnu_get_libc_version, libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, say): its malloc as it is
        return "not glibc: as it is"
    version.restype = ctypes.c_char_p
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not (mallopt(m_mmap_threshold, MMAP_ABOVE_BYTES) and mallopt(m_trim_threshold, KEEP_FREED_BYTES)):
        return f"glibc {version().decode()}: refused the settings, as it is"
    return f"glibc {version().decode()}: buffers up to {format_size(MMAP_ABOVE_BYTES)} from heaps, " \
           f"up to {format_size(KEEP_FREED_BYTES)} freed kept per heap"


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
          window_bytes: int = DEFAULT_WINDOW, tiers: tuple = TIERS) -> Machine:
    """Tiers, copy engine, index and store for this machine ("auto" budgets
    resolved here), the store's sessions recovered from the index. policy: else
    the configuration's; disk=False: no disk tier (a cache in memory only);
    disk_ops: the disk tier's file operations (else probed: kvikio or POSIX);
    tiers: the builders of the tiers this machine may have."""
    data_dir = os.path.abspath(cfg.data_dir)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    cfg = resolve_budgets(cfg)
    executor = IOExecutor(cfg.io_workers)
    builders = tuple(b for b in tiers if disk or b is not disk_tier)
    site = Site(cfg, data_dir, "", executor, disk_ops)
    try:
        return _build(site, builders, policy or policy_of(cfg), clock, events, window_bytes)
    except BaseException:
        for tier in site.tiers.values():
            tier.close()
        executor.shutdown()
        raise


def _build(site: Site, builders: tuple, policy: PolicyConfig, clock: Clock | None, events: StoreEvents | None,
           window_bytes: int) -> Machine:
    cfg = site.cfg
    site.shm_prefix = shm.claim_prefix(site.data_dir)  # random per run; what a killed run left is removed
    for builder in builders:
        tier, text = builder(site)
        if tier is not None:
            site.tiers[tier.name] = tier
            log.info("%s tier: %s", tier.name, text)
        else:
            log.info("%s tier: %s", builder.__name__.removesuffix("_tier"), text)
    tiers = {name: site.tiers[name] for name in tier_order(site.tiers)}
    # Pages read from a file tier are always checked; verify=all checks moves out of memory tiers too.
    verify = () if cfg.verify == "disk" else tuple(n for n, t in tiers.items() if t.medium != FILE)
    device = tiers.get(DEVICE)
    backends = {"device": str(device.device) if device is not None else "absent"}
    kernels = None
    pin = _on_cuda(site)
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
    backends["malloc"] = keep_freed_buffers()
    log.info("malloc: %s", backends["malloc"])
    durable = durable_tier(tiers)
    codings = {durable: TierCoding(durable, cfg.codec.get(durable, "none"), events or NullEvents())} if durable else {}
    backends.update({f"{name}_codec": coding.codec for name, coding in codings.items()})
    copier = CopyEngine(tiers, window_bytes=window_bytes, verify_tiers=verify, kernels=kernels, codings=codings,
                        events=events)
    recoding = Recoding.of(cfg.codec.get(HOST, "none"), HOST, tiers, durable, cfg.lossy_tenants, cfg.lossy_max_error)
    remote, text = remote_tier(cfg)
    log.info("remote tier: %s", text)
    backends["remote"] = text
    index = DiskIndex(os.path.join(site.data_dir, "index.db")) if durable is not None else None
    try:
        store = build_store(tiers, copier, index, clock=clock, policy=policy, events=events, movers=cfg.movers,
                            shm_prefix=site.shm_prefix, remote=remote, recoding=recoding)
    except BaseException:
        if index is not None:
            index.close()
        if remote is not None:
            remote.store.close()
        raise
    return Machine(store, tiers, copier, index, site.executor, backends, ipc, site.shm_prefix)


def check_codecs(cfg: Config) -> None:
    """--codec checked before anything is made or changed (data dir, shared memory, tiers): InvalidArgument."""
    for name in cfg.codec.values():
        check_codec(name)
    TierCoding.check(DISK, cfg.codec.get(DISK, "none"))
    Recoding.check(cfg.codec.get(HOST, "none"), HOST, cfg.host_budget != 0, cfg.disk_budget != 0)  # (or auto)


def open_ipc() -> IpcCache | None:
    """The cache of engine GPU memory opened through CUDA IPC, or None (logged)."""
    try:
        return IpcCache(CupyDriver())
    except Exception as exc:  # no cupy, or no driver: engines register shared memory only
        log.warning("engines cannot register GPU memory (CUDA IPC needs cupy: %s); shared memory only", exc)
        return None
