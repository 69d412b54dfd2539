"""`tierd serve`: the daemon's life from start to a graceful stop.

Start: set the umask to 077 (what the daemon creates is its user's alone),
take the socket's and the data dir's lock files (a second daemon on either
fails with a clear message), probe the machine and build the tiers,
recover the disk index, serve gRPC (with health and reflection) and metrics,
and run policy every tick. Stop (SIGTERM or SIGINT): refuse new calls, let
in-flight ones finish within the grace period, flush to disk what must
survive, release everything, exit 0.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import logging
import os
import signal
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from tierd import __version__
from tierd.api.auth import Authenticator
from tierd.api.gate import OpenServices, add_to_server
from tierd.api.limits import TenantLimits
from tierd.api.servicer import TierdServicer
from tierd.config import Config, resolve_budgets
from tierd.core.engines import EngineRegistry
from tierd.core.index import IndexFormatError, IndexUnavailable
from tierd.core.store import Store
from tierd.errors import InvalidArgument, TierdError
from tierd.machine import DiskIOUnavailable, RemoteUnavailable, build, check_codecs
from tierd.metrics import Metrics
from tierd.process import TRIM_SECONDS, raise_fd_limit, tune_malloc
from tierd.tiers import shm
from tierd.v1 import tierd_pb2
from tierd.api.intake import FdIntake
from tierd.wire.fds import intake_path

log = logging.getLogger("tierd")
SERVICE = tierd_pb2.DESCRIPTOR.services_by_name["Tierd"].full_name
OPEN_CALLS = 16  # health and reflection calls at once: they answer without a token


HANDSHAKE_SECONDS = 10


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


def _lock(path: str, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # a read-only file system, a directory not ours, a link planted there
        raise StartupError(f"cannot open the lock file {path} of the {what}: {exc.strerror or exc}; tierd needs "
                           "to write there (its lock, its index, its slab files)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartupError(f"{what} is in use by another tierd (pid {holder}); stop it or choose another") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        # The pid only makes a second daemon's message clearer; the lock is the
        # flock. A full disk must not stop the start.
        log.warning("cannot write the pid into %s: %s", path, exc)
    return fd


def _check_data_dir(path: str) -> None:
    """Create the data dir 0700; refuse one anyone can write to, and symlinks
    where the index and slabs live (nothing is followed out of the data dir)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & stat.S_IWOTH:
        raise StartupError(f"the data dir {path} is writable by anyone: chmod o-w it, or choose another")
    for name in ("index.db", "slabs", "tierd.lock"):
        if os.path.islink(os.path.join(path, name)):
            raise StartupError(f"{os.path.join(path, name)} is a symbolic link; tierd follows none in its data dir")
    slabs = os.path.join(path, "slabs")
    if os.path.isdir(slabs):
        for entry in os.scandir(slabs):
            if entry.is_symlink():
                raise StartupError(f"{entry.path} is a symbolic link; tierd follows none in its data dir")


def _private_dir(path: str) -> None:
    """Create the socket's directory 0700 where it is missing; refuse one that
    is not a directory of the daemon's own user with mode 0700 (a symbolic
    link is refused, not followed). Whoever else owns or can write to it can
    swap the socket for their own and receive every client's token and KV: a
    local user can create /tmp/tierd-UID before the daemon first starts."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    advice = "remove it, or choose another --socket"
    if not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise StartupError(f"the socket directory {path} is {what}; {advice}")
    if st.st_uid != os.geteuid():
        raise StartupError(f"the socket directory {path} belongs to uid {st.st_uid}, not to this daemon's user "
                           f"(uid {os.geteuid()}), who could replace the socket; {advice}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise StartupError(f"the socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700: "
                           f"others could replace the socket; chmod 700 it, or choose another --socket")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise StartupError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _tls(cfg: Config) -> grpc.ServerCredentials:
    ca = _read(cfg.tls_client_ca, "client CA") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(_read(cfg.tls_key, "TLS key"), _read(cfg.tls_cert, "TLS certificate"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


async def _serve(cfg: Config, store: Store, servicer: TierdServicer, stop: asyncio.Event,
                 trim: Callable[[], object] | None = None) -> None:
    server = grpc.aio.server(
        # A fixed 1 MiB receive window per stream: gRPC's bandwidth probing grew it to several MiB
        # each, so 24 streams of Put chunks held 230 MiB of heap (99 MiB now), for Puts as fast.
        options=[("grpc.max_receive_message_length", cfg.max_message_bytes),
                 ("grpc.max_send_message_length", cfg.max_message_bytes),
                 ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20),
                 # A connection holds a descriptor: one that never says a word goes after 10 s, not 120.
                 ("grpc.server_handshake_timeout_ms", HANDSHAKE_SECONDS * 1000)],
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        interceptors=[OpenServices(OPEN_CALLS, cfg.stream_idle_seconds)],
    )
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    endpoints = []
    if cfg.socket:
        if server.add_insecure_port(f"unix:{cfg.socket}") == 0:  # 0600, by the umask serve() set
            raise StartupError(f"cannot listen on {cfg.socket}")
        endpoints.append(f"unix:{cfg.socket}")
    if cfg.listen:
        if cfg.tls_cert:
            bound = server.add_secure_port(cfg.listen, _tls(cfg))
            endpoints.append(f"{cfg.listen} (TLS{', client certificates required' if cfg.tls_client_ca else ''})")
        else:
            bound = server.add_insecure_port(cfg.listen)
            log.warning("listening on TCP %s without TLS (--insecure-tcp): anyone who reaches it can read "
                        "every session", cfg.listen)
            endpoints.append(f"{cfg.listen} (no TLS)")
        if bound == 0:
            raise StartupError(f"cannot listen on {cfg.listen}")
    await server.start()
    loop = asyncio.get_running_loop()
    if servicer.ctx.fds is not None:
        servicer.ctx.fds.start(loop)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tierd %s serving on %s", __version__, " and ".join(endpoints))
    # What start-up built (modules, gRPC, the index) lives as long as the
    # daemon: leave it out of every later collection. A full collection over
    # it stalled the loop for ~10 ms, in which every call in flight waited.
    gc.collect()
    gc.freeze()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    trimmed = time.monotonic()
    # Policy runs on a thread of its own: it never waits behind client calls for an RPC thread.
    policy = ThreadPoolExecutor(1, thread_name_prefix="tierd-policy")

    def tick() -> None:
        nonlocal trimmed
        store.tick()
        servicer.ctx.engines.reap()
        if trim is not None and time.monotonic() - trimmed >= TRIM_SECONDS:
            trim()
            trimmed = time.monotonic()

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), cfg.tick_seconds)
        except asyncio.TimeoutError:
            try:
                await loop.run_in_executor(policy, tick)
            except Exception:
                log.exception("policy tick failed")
    log.info("stopping: in-flight calls get %.0f s", cfg.grace_seconds)
    if servicer.ctx.fds is not None:
        servicer.ctx.fds.close()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(cfg.grace_seconds)
    policy.shutdown()


def serve(cfg: Config) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    # Before anything is created: every file and directory the daemon makes (the
    # socket, the index and its -wal and -shm, which SQLite creates 0644 less the
    # umask, lock and slab files, shared memory) is its user's alone.
    os.umask(0o077)
    trim = tune_malloc()  # before the daemon's threads start: they take their heaps from the first malloc on
    raise_fd_limit()
    if trim is None:
        log.info("malloc: not glibc; freed memory goes back to the system by the C library's own policy")
    try:
        auth = Authenticator.from_file(cfg.auth_tokens) if cfg.auth_tokens else Authenticator()
    except InvalidArgument as exc:
        raise StartupError(str(exc)) from None
    log.info("authentication: %s", f"bearer tokens from {cfg.auth_tokens}" if auth.enabled else
             "none (the socket's permissions are the gate; every caller is tenant 'default')")
    try:
        check_codecs(cfg)  # before the data dir, the socket or shared memory is touched
    except InvalidArgument as exc:
        raise StartupError(str(exc)) from None
    cfg = resolve_budgets(cfg)
    with ExitStack() as stack:
        _check_data_dir(cfg.data_dir)
        data_lock = _lock(os.path.join(cfg.data_dir, "tierd.lock"), f"data dir {cfg.data_dir}")
        stack.callback(os.close, data_lock)
        if cfg.socket:
            _private_dir(os.path.dirname(os.path.abspath(cfg.socket)))
            sock_lock = _lock(cfg.socket + ".lock", f"socket {cfg.socket}")
            stack.callback(os.close, sock_lock)
            if os.path.exists(cfg.socket):
                os.unlink(cfg.socket)  # left by a daemon that died: the lock says none is running
            stack.callback(lambda: os.path.exists(cfg.socket) and os.unlink(cfg.socket))

        registry = CollectorRegistry()
        metrics = Metrics(registry)
        try:
            machine = build(cfg, events=metrics)
        except (IndexFormatError, IndexUnavailable) as exc:
            raise StartupError(f"{exc}; nothing was changed") from None
        except (DiskIOUnavailable, RemoteUnavailable) as exc:
            raise StartupError(str(exc)) from None
        except (OSError, TierdError) as exc:
            raise StartupError(f"cannot open the tiers under {cfg.data_dir}: {exc}") from None
        stack.callback(lambda: machine.close(flush=cfg.flush_on_stop))
        store = machine.store
        backends = machine.backends  # each tier's live backend is in its stats and tierd_tier_backend_info
        metrics.set_backends(backends)
        metrics.watch(store)
        if store.recovery_problems:
            log.warning("recovery repaired %d problems (see above)", len(store.recovery_problems))
        if cfg.metrics_endpoint:
            host, port = cfg.metrics_endpoint
            try:
                httpd, thread = start_http_server(port, host, registry=registry)
            except OSError as exc:  # taken (by another daemon, or another local user first)
                raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another "
                                   "--metrics address, or --metrics off") from None
            stack.callback(httpd.shutdown)
            log.info("metrics on http://%s:%d/metrics", host, httpd.server_port)
        engines = EngineRegistry(ipc=machine.ipc)
        stack.callback(engines.close)
        executor = ThreadPoolExecutor(cfg.rpc_workers, thread_name_prefix="tierd-rpc")
        stack.callback(executor.shutdown)
        fds = FdIntake(intake_path(cfg.socket), lambda token: auth.identify(
            [("authorization", f"Bearer {token}")] if token else []).tenant, shm.is_own) if cfg.socket else None
        servicer = TierdServicer(store, engines, executor, metrics, backends, cfg.chunk_bytes, auth,
                                 int(cfg.tenant_inflight_bytes), TenantLimits(cfg.worker_slots, cfg.tenant_streams, cfg.tenant_calls),
                                 cfg.stream_idle_seconds, fds)
        _run(_serve(cfg, store, servicer, asyncio.Event(), trim))
        log.info("flushing and closing")
    log.info("stopped")
    return 0


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:  # not on this platform: the default loop does
        asyncio.run(coro)
        return
    uvloop.run(coro)
