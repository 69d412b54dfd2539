"""Typed configuration: the only place flags, environment and TOML are read.

Precedence: command-line flags > environment (TIERD_<NAME>) > the TOML file
given by --config > defaults. Defaults work on any Linux machine: a Unix
socket in a private runtime directory, data under the user's state
directory, a host budget of a quarter of RAM and a disk budget of half the
data directory's free space.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from tierd.config.values import (AUTO, _choice, _codecs, _count, _fraction, _host_port, _optional_seconds, _positive_int,
                                 _remote_url, _seconds, _size_or_auto, _tenants, _text, default_data_dir,
                                 default_runtime_dir, parse_bool)
from tierd.errors import InvalidArgument
from tierd.sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

def _opt(parse: Callable[[Any], Any], help: str, default: Any = None, factory: Callable[[], Any] | None = None,
         repeat: bool = False) -> Any:
    meta = {"parse": parse, "help": help, "repeat": repeat}  # repeat: the flag may be given more than once
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    socket: str = _opt(_text, "Unix socket path", factory=lambda: os.path.join(default_runtime_dir(), "tierd.sock"))
    listen: str = _opt(_host_port, "also listen on TCP HOST:PORT (needs --tls-cert and --tls-key)", "")
    tls_cert: str = _opt(_text, "PEM certificate for TCP", "")
    tls_key: str = _opt(_text, "PEM private key for TCP", "")
    tls_client_ca: str = _opt(_text, "PEM CA bundle: clients on TCP must present a certificate it signed", "")
    insecure_tcp: bool = _opt(parse_bool, "allow TCP without TLS (anyone who reaches the port reads every session)", False)
    auth_tokens: str = _opt(_text, "file of TENANT:SHA256_HEX_OF_TOKEN[:admin] lines; calls must bear a token", "")
    data_dir: str = _opt(_text, "directory for the disk tier and its index", factory=default_data_dir)
    device: str = _opt(_choice(AUTO, "none", "cuda", "cpu"), "device tier: auto, none, cuda[:N]", AUTO)
    device_budget: int | str = _opt(_size_or_auto, "VRAM budget (auto: a quarter of the card)", AUTO)
    host_budget: int | str = _opt(_size_or_auto, "host budget (auto: a quarter of RAM)", AUTO)
    disk_budget: int | str = _opt(_size_or_auto, "disk budget (auto: half the data dir's free space)", AUTO)
    device_idle: float = _opt(_seconds, "seconds idle before device -> host", 30.0)
    host_idle: float = _opt(_seconds, "seconds idle before host -> disk", 600.0)
    writeback_idle: float | None = _opt(_optional_seconds, "seconds idle before a disk copy is written (off: never)", 10.0)
    disk_ttl: float | None = _opt(_optional_seconds, "seconds idle before a session is dropped (off: never)", None)
    tenant_device_quota: int = _opt(parse_size, "VRAM bytes each tenant may hold (0: no limit)", 0)
    tenant_host_quota: int = _opt(parse_size, "host bytes each tenant may hold (0: no limit)", 0)
    tenant_disk_quota: int = _opt(parse_size, "disk bytes each tenant may hold (0: no limit)", 0)
    tenant_sessions: int = _opt(_count, "sessions each tenant may hold (0: no limit)", 0)
    tenant_remote_quota: int = _opt(parse_size, "remote tier bytes each tenant's sessions may take; past it, stores "
                                                "stay local (0: no limit)", 0)
    tenant_inflight_bytes: int | str = _opt(_size_or_auto, "bytes one tenant may have in flight in data calls "
                                                           "(auto: the host budget; 0: no cap)", AUTO)
    tenant_leases: int = _opt(_count, "leases each tenant may hold open (0: no limit)", 64)
    tenant_lease_bytes: int | str = _opt(_size_or_auto, "bytes each tenant may hold in open leases "
                                                        "(auto: a quarter of the host budget; 0: no limit)", AUTO)
    tenant_put_bytes: int | str = _opt(_size_or_auto, "host bytes each tenant's Puts in progress may hold "
                                                      "(auto: half the host budget; 0: no limit)", AUTO)
    tenant_streams: int = _opt(_count, "Put and Get streams each tenant may have open (0: no limit)", 32)
    tenant_workers: int = _opt(_count, "threads one tenant's data calls may use at once (0: half of rpc_workers)", 0)
    tenant_calls: int = _opt(_count, "calls each tenant may have open at once, of any method (0: no limit)", 64)
    stream_idle_seconds: float = _opt(_seconds, "a Put or Get stream that makes no progress this long is ended", 30.0)
    metrics: str = _opt(_host_port, "Prometheus HOST:PORT (off to disable)", "127.0.0.1:9464")
    log_level: str = _opt(_choice("debug", "info", "warning", "error"), "log level", "info")
    verify: str = _opt(_choice("disk", "all"), "verify checksums on moves out of: disk, or all tiers (pages leaving "
                                               "the daemon are always checked)", "disk")
    host_slab: int | str = _opt(_size_or_auto, "host arena slab size (auto: the whole budget in one)", AUTO)
    disk_slab: int = _opt(parse_size, "disk slab file size", 1 << 30)
    device_slab: int = _opt(parse_size, "VRAM slab size", 1 << 30)
    disk_io: str = _opt(_choice(AUTO, "posix", "kvikio"),
                        "disk tier I/O: auto (kvikio where it passes a self-test), posix, or kvikio (required)", AUTO)
    io_workers: int = _opt(_positive_int, "disk I/O threads", 4)
    movers: int = _opt(_positive_int, "background move threads", 2)
    rpc_workers: int = _opt(_positive_int, "threads running data calls", 8)
    max_concurrent_rpcs: int = _opt(_positive_int, "calls in flight before RESOURCE_EXHAUSTED", 256)
    # gRPC takes in a whole message before the daemon sees it: each call in flight may hold one.
    # 16 MiB carries the token ids of a prompt of about five million tokens.
    max_message_bytes: int = _opt(parse_size, "largest gRPC message", 16 << 20)
    chunk_bytes: int = _opt(parse_size, "Get stream chunk size", 1 << 20)
    tick_seconds: float = _opt(_seconds, "how often policy runs", 0.5)
    grace_seconds: float = _opt(_seconds, "time in-flight calls get to finish at shutdown", 10.0)
    flush_on_stop: bool = _opt(parse_bool, "write sessions not yet on disk at SIGTERM", True)
    remote: str = _opt(_remote_url, "remote tier: redis://[USER@]HOST:PORT[,HOST:PORT...] or rediss://... "
                                    "(a Redis Cluster or one server), or file:///PATH (a directory every node "
                                    "mounts); off: none", "")
    remote_write: str = _opt(_choice("through", "back", "off"), "what goes to the remote tier: through (every "
                             "store, in the background), back (sessions idle on disk --remote-idle seconds), "
                             "off (read only)", "through")
    remote_idle: float = _opt(_seconds, "remote_write back: seconds idle before a session is published", 60.0)
    remote_ttl: float | None = _opt(_optional_seconds, "seconds the remote tier keeps a version (off: until "
                                    "dropped or evicted)", 7 * 86400.0)
    remote_queue: int = _opt(_positive_int, "sessions waiting to be published, at most (more: not remote-durable "
                                            "until stored again)", 256)
    remote_password_file: str = _opt(_text, "file holding the remote tier's password (or TIERD_REMOTE_PASSWORD; "
                                            "never a flag)", "")
    remote_tls_ca: str = _opt(_text, "PEM CA bundle for rediss:// remote tiers", "")
    remote_timeout: float = _opt(_seconds, "seconds a remote call may take before it fails (one retry at once)", 0.5)
    remote_prefix: str = _opt(_text, "first part of every key tierd writes to the remote tier (one per deployment "
                                     "sharing a cluster)", "tierd")
    remote_recheck: float = _opt(_seconds, "seconds a copy the remote tier's change notices say nothing changed is "
                                           "served without asking the tier again (a Redis tier; 0: every read asks)",
                                 5.0)
    remote_replicas: int = _opt(_count, "replicas of a Redis primary that must acknowledge a publish before the "
                                        "session is remote-durable (fewer where the primary has fewer connected; "
                                        "0: the primary's acknowledgement alone)", 1)
    codec: dict[str, str] = _opt(_codecs, "TIER=CODEC: code pages on their way to the disk or remote tier "
                                          "(disk=lossless, remote=lossless: bit-exact, smaller; none: as they are; "
                                          "auto: lossless or none, whichever measures faster here), or re-code idle "
                                          "sessions in a full host tier (host=CODEC, their exact copy kept on disk); "
                                          "a lossy codec, fp8, int8, int4 or k16v8 (host and remote), codes the "
                                          "tenants of --lossy-tenants, lossless the others; the flag may be repeated",
                                 factory=dict, repeat=True)
    lossy_tenants: frozenset[str] = _opt(_tenants, "TENANT[,TENANT...] whose KV a lossy --codec may code (*: every "
                                                   "tenant); the others' is coded lossless", factory=frozenset)
    lossy_max_error: float = _opt(_fraction, "relative L2 error a page coded lossily may carry; a page past it is "
                                             "stored as it is", 0.05)

    def __post_init__(self) -> None:
        if not self.socket and not self.listen:
            raise InvalidArgument("configure a socket or a TCP address to listen on")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("give both --tls-cert and --tls-key, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key")
        if self.listen and not self.tls_cert and not self.insecure_tcp:
            raise InvalidArgument(f"listening on TCP {self.listen} needs TLS (--tls-cert and --tls-key); "
                                  "--insecure-tcp allows it without, for trusted networks only")
        if not self.remote_prefix or any(c in self.remote_prefix for c in "{}: \t\n"):
            raise InvalidArgument(f"remote_prefix is a word without braces, colons or spaces, not "
                                  f"{self.remote_prefix!r}")
        if self.remote_replicas > 16:
            raise InvalidArgument(f"remote_replicas is 0 to 16, not {self.remote_replicas}")
        if self.remote_recheck > 3600:
            raise InvalidArgument(f"remote_recheck is 0 to 3600 seconds, not {self.remote_recheck}")
        if not 0.01 <= self.remote_timeout <= 60:
            raise InvalidArgument(f"remote_timeout is 0.01 to 60 seconds, not {self.remote_timeout}")
        if self.codec.get("remote", "none") != "none" and not self.remote:
            raise InvalidArgument("--codec remote=... needs a remote tier (--remote)")
        if self.remote_tls_ca and not self.remote.startswith("rediss://"):
            raise InvalidArgument("--remote-tls-ca needs a rediss:// remote tier")
        if self.chunk_bytes <= 0 or self.chunk_bytes > self.max_message_bytes - 4096:
            raise InvalidArgument("chunk_bytes must be positive and fit in max_message_bytes")
        for name in ("host_slab", "disk_slab", "device_slab"):
            value = getattr(self, name)
            if value != AUTO and (value <= 0 or value % 4096):
                raise InvalidArgument(f"{name} must be a positive multiple of 4096, got {value}")

    @property
    def worker_slots(self) -> int:
        """RPC threads one tenant's calls may hold at once."""
        return self.tenant_workers or max(1, self.rpc_workers // 2)

    @property
    def metrics_endpoint(self) -> tuple[str, int] | None:
        if not self.metrics:
            return None
        host, _, port = self.metrics.rpartition(":")
        return host.strip("[]"), int(port)


FIELDS = {f.name: f for f in fields(Config)}


def env_name(name: str) -> str:
    return "TIERD_" + name.upper()


def _apply(values: dict[str, Any], source: str) -> dict[str, Any]:
    out = {}
    for name, raw in values.items():
        key = name.replace("-", "_")
        if key not in FIELDS:
            raise InvalidArgument(f"{source}: unknown setting {name!r}", setting=name)
        try:
            out[key] = FIELDS[key].metadata["parse"](raw)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}: {name}: {exc}", setting=name) from None
    return out


def load(flags: dict[str, Any] | None = None, env: dict[str, str] | None = None,
         config_file: str | None = None) -> Config:
    """Merge the sources in order of precedence into a Config."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path = config_file or env.get("TIERD_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                merged.update(_apply(tomllib.load(f), path))
        except OSError as exc:
            raise InvalidArgument(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config file {path} is not valid TOML: {exc}") from None
    merged.update(_apply({n: env[env_name(n)] for n in FIELDS if env_name(n) in env}, "environment"))
    merged.update(_apply({k: v for k, v in (flags or {}).items() if v is not None}, "flag"))
    return Config(**merged)


def resolve_budgets(cfg: Config, total_ram: int | None = None, free_disk: int | None = None) -> Config:
    """Replace "auto" host and disk budgets, and what is sized from them (the
    host slab, per-tenant bytes in flight and in leases), by numbers for this machine."""
    if cfg.host_budget == AUTO:
        ram = total_ram if total_ram is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cfg = replace(cfg, host_budget=ram // 4)
    if cfg.disk_budget == AUTO:
        if free_disk is None:
            os.makedirs(cfg.data_dir, mode=0o700, exist_ok=True)
            free_disk = shutil.disk_usage(cfg.data_dir).free
        cfg = replace(cfg, disk_budget=free_disk // 2)
    if cfg.tenant_inflight_bytes == AUTO:
        cfg = replace(cfg, tenant_inflight_bytes=int(cfg.host_budget))
    if cfg.tenant_lease_bytes == AUTO:
        cfg = replace(cfg, tenant_lease_bytes=int(cfg.host_budget) // 4)
    if cfg.tenant_put_bytes == AUTO:
        cfg = replace(cfg, tenant_put_bytes=int(cfg.host_budget) // 2)
    if cfg.host_slab == AUTO:
        # One sparse slab for the whole budget: a snapshot never has to be split
        # across slabs, so a contiguous restore stays one copy per segment.
        cfg = replace(cfg, host_slab=max(64 << 20, -(-int(cfg.host_budget) // 4096) * 4096))
    return cfg


def remote_password(cfg: Config, env: dict[str, str] | None = None) -> str | None:
    """The remote tier's password: the first line of --remote-password-file,
    else TIERD_REMOTE_PASSWORD, else none. Never a flag: a command line is
    visible to every user of the machine."""
    if cfg.remote_password_file:
        try:
            with open(cfg.remote_password_file, encoding="utf-8") as f:
                return f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "it is not UTF-8 text"
            raise InvalidArgument(f"cannot read the remote tier's password file {cfg.remote_password_file}: "
                                  f"{why}") from None
    return (os.environ if env is None else env).get("TIERD_REMOTE_PASSWORD") or None
