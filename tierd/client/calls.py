"""The clients, run in the caller's process (engines, adapters, the CLI).
Every unary call is written once, in _Calls, and returns whatever the
client's _call returns: a value for Client, an awaitable for AsyncClient.
Put and Get stream, so each client has its own. Requests are built through
`pb`, which refuses a caller's bad value as InvalidArgument; both clients'
channels take _OPTIONS (message sizes, reconnecting)."""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from tierd.config import default_runtime_dir
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument, shown
from tierd.layout import EngineLayout, KVSpec
from tierd.types import (
    Advice,
    BudgetResult,
    Lease,
    LookupResult,
    RestoreResult,
    SessionInfo,
    TierStats,
)
from tierd.v1 import tierd_pb2
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.chunks import (
    GET_METHOD,
    PUT_METHOD,
    chunk_message,
    put_accepted,
    read_chunk,
    read_header,
)
from tierd.wire.convert import (
    info_from_pb,
    lease_from_pb,
    lookup_from_pb,
    optional_spec_to_pb,
    spec_to_pb,
)
from tierd.wire.fds import hand_over, intake_path
from tierd.wire.status import from_rpc_error

DEFAULT_CHUNK = 1 << 20
MAX_MESSAGE = 64 << 20
RECONNECT_MS = 500
# Both clients' channels. gRPC waits 1 s after a failed connection attempt and
# 1.6 times longer after each next one, up to 120 s: after a 30 s outage a
# client found the restarted daemon ~10 s late. The daemon is local, or one
# hop away, so a client tries every RECONNECT_MS (+-20% jitter) while it is
# down, whatever the outage lasted. (grpc.min_reconnect_backoff_ms is not a
# backoff but how long one attempt may take; its 20 s stays.) Calls do not
# wait_for_ready: while the daemon is down they fail at once with
# UNAVAILABLE, and the caller (the vLLM connector: recompute) decides.
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS), ("grpc.max_reconnect_backoff_ms", RECONNECT_MS)]
_HOLDS = {FieldDescriptor.TYPE_UINT32: "integers from 0 to 2**32-1",
          FieldDescriptor.TYPE_UINT64: "integers from 0 to 2**64-1",
          FieldDescriptor.TYPE_INT32: "integers from -2**31 to 2**31-1",
          FieldDescriptor.TYPE_INT64: "integers from -2**63 to 2**63-1",
          FieldDescriptor.TYPE_DOUBLE: "numbers", FieldDescriptor.TYPE_STRING: "text",
          FieldDescriptor.TYPE_BOOL: "true or false", FieldDescriptor.TYPE_BYTES: "bytes"}


class _Checked:
    """A message class whose constructor turns protobuf's refusal of a value
    (a negative count, an integer past its field's range, text where a number
    goes: a bare ValueError or TypeError) into the InvalidArgument the daemon
    gives for a bad value, naming the field."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def __call__(self, **fields: Any) -> Any:
        try:
            return self._cls(**fields)
        except (TypeError, ValueError) as exc:
            name, value = next(((k, v) for k, v in fields.items() if not self._takes(k, v)), (None, None))
            if name is None:
                raise InvalidArgument(f"{self._cls.__name__}: {exc}") from None
            holds = _HOLDS.get(self._cls.DESCRIPTOR.fields_by_name[name].type, "values of another type")
            raise InvalidArgument(f"{name} cannot be {shown(value)}: it holds {holds}", field=name,
                                  value=value) from None

    def _takes(self, name: str, value: Any) -> bool:
        try:
            self._cls(**{name: value})
        except (TypeError, ValueError):
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)


class _Messages:
    """tierd_pb2 with every message class _Checked: the clients build each
    request from a caller's values through it."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(tierd_pb2, name)
        if isinstance(attr, type) and issubclass(attr, Message):
            attr = _Checked(attr)
        setattr(self, name, attr)  # looked up once
        return attr


pb: Any = _Messages()


def default_address() -> str:
    """TIERD_SOCKET if set, else the daemon's default socket. A client given no
    address connects here only through a directory of its own user."""
    path = os.environ.get("TIERD_SOCKET") or os.path.join(default_runtime_dir(), "tierd.sock")
    return "unix:" + os.path.abspath(path)


def _private_socket_dir(directory: str) -> None:
    """Refuse to connect through a socket directory that another user owns or
    can write to: they could stand in for the daemon and receive this client's
    token and KV (a local user can create /tmp/tierd-UID before the daemon
    first starts). Where it is missing, claim it (0700) as the daemon would:
    nobody else can make it later, and this user's daemon accepts it."""
    try:
        os.mkdir(directory, 0o700)
    except (FileExistsError, FileNotFoundError, PermissionError):
        pass  # there already, or a parent is missing or not ours to write: no one else's either
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    raise FailedPrecondition(f"the socket directory {directory} {problem}: whoever else controls it could stand in "
                             "for the daemon and receive your calls. Remove it if you do not know why it is there, "
                             "or give the daemon's address explicitly", directory=directory)


def _target(address: str | None) -> str:
    if address is None:
        target = default_address()
        _private_socket_dir(os.path.dirname(target[len("unix:"):]))
        return target
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) or (":" in address and not address.startswith("/")):
        return address
    return "unix:" + os.path.abspath(address)


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


def _shm_regions(pairs: list[tuple[int, int]], address: str, metadata: tuple) -> tuple[list[pb.Region], str]:
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


def _regions(regions: Any, address: str, metadata: tuple) -> tuple[list[pb.Region], EngineLayout | None, bool, str]:
    """Region messages, the layout they carry if any, whether they are GPU
    memory, and the ticket of shared memory handed over."""
    if hasattr(regions, "fds") and hasattr(regions, "layout"):  # a SharedKVCache
        msgs, ticket = _shm_regions(list(zip(regions.fds, regions.sizes)), address, metadata)
        return msgs, regions.layout, False, ticket
    regions = list(regions)
    cuda = [bool(getattr(r, "is_cuda", False)) for r in regions]
    if any(cuda):
        if not all(cuda):
            raise InvalidArgument("regions are all CUDA tensors or all (memfd, size) pairs", field="regions")
        return [cuda_region(t) for t in regions], None, True, ""
    msgs, ticket = _shm_regions(regions, address, metadata)
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


def _put_messages(session_id: str, data: Any, spec: KVSpec, num_tokens: int, chunk: int,
                  priority: int | None, start_token: int, token_ids: Any) -> Iterator[pb.PutRequest | bytes]:
    """The header message, then the chunks in wire format (see tierd.wire.chunks).
    The arguments are checked and the header built before the stream starts:
    gRPC reports an error raised while it iterates the requests only as
    "Exception iterating requests!" (the async client, as a cancellation)."""
    view = as_bytes(data)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise InvalidArgument(f"chunk_bytes must be a positive integer, got {shown(chunk)}", field="chunk_bytes")
    header = pb.PutRequest(header=pb.PutHeader(session_id=session_id, spec=spec_to_pb(spec), num_tokens=num_tokens,
                                               size=len(view), priority=priority, start_token=start_token,
                                               token_ids=_ids(token_ids)))
    return itertools.chain([header], (chunk_message(view[i : i + chunk]) for i in range(0, len(view), chunk)))


def _serialize(msg: pb.PutRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _byte_streams(channel: Any) -> tuple[Any, Any]:
    """Get and Put on a channel (sync or asyncio), their chunk messages in
    wire format both ways (see tierd.wire.chunks)."""
    return (channel.unary_stream(GET_METHOD, request_serializer=pb.GetRequest.SerializeToString,
                                 response_deserializer=None),
            channel.stream_unary(PUT_METHOD, request_serializer=_serialize,
                                 response_deserializer=pb.SessionInfo.FromString))


def _ids(token_ids: Any) -> list[int] | None:
    if token_ids is None:
        return None
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]


def _lease(lease: Lease | str) -> pb.LeaseRequest:
    return pb.LeaseRequest(lease_id=lease if isinstance(lease, str) else lease.lease_id)


def _restore(r: pb.RestoreResponse) -> RestoreResult:
    return RestoreResult(r.num_tokens, r.num_pages, r.source_tier, r.seconds)


def _stats(r: pb.StatsResponse) -> dict[str, Any]:
    return {
        "tiers": [TierStats(t.name, t.budget, t.used, t.capacity, t.sessions, t.backend) for t in r.tiers],
        "bandwidth": dict(r.bandwidth), "moved_bytes": dict(r.moved_bytes), "copy_ops": r.copy_ops,
        "version": r.version, "backends": dict(r.backends), "sessions": r.sessions,
    }


def _list(r: pb.ListResponse) -> tuple[list[SessionInfo], str]:
    return [info_from_pb(i) for i in r.sessions], r.next_page_token


class _Calls:
    """The unary calls, shared by both clients."""

    _call: Callable[..., Any]

    def stat(self, session_id: str) -> SessionInfo:
        """Where the session is and what it holds."""
        return self._call("Stat", pb.SessionRequest(session_id=session_id), info_from_pb)

    def list_page(self, limit: int = 100, page_token: str = "",
                  all_tenants: bool = False) -> tuple[list[SessionInfo], str]:
        """One page of this tenant's sessions (every tenant's, for admin tokens)
        and the token of the next page ("" at the end)."""
        return self._call("List", pb.ListRequest(limit=limit, page_token=page_token, all_tenants=all_tenants), _list)

    def prefetch(self, session_id: str, tier: str = "host", priority: int = 0,
                 deadline_seconds: float = 0.0) -> str:
        """Start moving the session up to `tier`; returns "ready" or "queued" at once."""
        req = pb.PrefetchRequest(session_id=session_id, tier=tier, priority=priority, deadline_seconds=deadline_seconds)
        return self._call("Prefetch", req, lambda r: r.status)

    def wait_ready(self, session_id: str, timeout: float = 30.0, tier: str = "host") -> tuple[bool, str | None]:
        """Wait until the whole session is in `tier` or faster: (ready, tier it is in)."""
        req = pb.WaitReadyRequest(session_id=session_id, tier=tier, timeout_seconds=timeout)
        return self._call("WaitReady", req, lambda r: (r.ready, r.tier or None), timeout=timeout + 10)

    def lookup(self, session_id: str, token_ids: Any, spec: KVSpec | None = None) -> LookupResult:
        """How many leading tokens of a prompt (its token ids) the session's
        snapshot supplies; with spec, another identity is FAILED_PRECONDITION."""
        req = pb.LookupRequest(session_id=session_id, token_ids=_ids(token_ids),
                               spec=optional_spec_to_pb(spec))
        return self._call("Lookup", req, lookup_from_pb)

    def begin_save(self, session_id: str, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Any = None, priority: int | None = None, ttl: float = 0.0) -> Lease:
        """Slots in the host arena for the pages of tokens [start_token,
        num_tokens): write them (Arena.runs), then commit_save or abort_save.
        token_ids, the ids of tokens [0, num_tokens), make the pages findable
        by lookup()."""
        req = pb.BeginSaveRequest(session_id=session_id, spec=spec_to_pb(spec), num_tokens=num_tokens,
                                  start_token=start_token, token_ids=_ids(token_ids), priority=priority,
                                  ttl_seconds=ttl)
        return self._call("BeginSave", req, lease_from_pb)

    def commit_save(self, lease: Lease | str) -> SessionInfo:
        """Publish the pages written into a save lease."""
        return self._call("CommitSave", _lease(lease), info_from_pb)

    def abort_save(self, lease: Lease | str) -> None:
        return self._call("AbortSave", _lease(lease), lambda r: None)

    def begin_restore(self, session_id: str, spec: KVSpec | None = None, num_pages: int = 0,
                      ttl: float = 0.0, token_ids: Any = None) -> Lease:
        """The first num_pages pages (0: all), brought to the host arena and
        held there: read them (Arena.runs), then end_restore. With token_ids
        (the prompt), pages holding other tokens are FAILED_PRECONDITION."""
        req = pb.BeginRestoreRequest(session_id=session_id, spec=optional_spec_to_pb(spec),
                                     num_pages=num_pages, ttl_seconds=ttl, token_ids=_ids(token_ids))
        return self._call("BeginRestore", req, lease_from_pb)

    def end_restore(self, lease: Lease | str) -> None:
        """Let the pages move again. NotFound if the lease expired before: what
        was read may be wrong, recompute it."""
        return self._call("EndRestore", _lease(lease), lambda r: None)

    def release(self, session_id: str) -> SessionInfo:
        """The engine is done with the session for now: its idle clock starts."""
        return self._call("Release", pb.SessionRequest(session_id=session_id), info_from_pb)

    def pin(self, session_id: str) -> SessionInfo:
        """Keep the session where it is: it is never demoted or evicted while pinned."""
        return self._call("Pin", pb.SessionRequest(session_id=session_id), info_from_pb)

    def unpin(self, session_id: str) -> SessionInfo:
        return self._call("Unpin", pb.SessionRequest(session_id=session_id), info_from_pb)

    def drop(self, session_id: str) -> None:
        """Forget the session in every tier."""
        return self._call("Drop", pb.SessionRequest(session_id=session_id), lambda r: None)

    def stats(self) -> dict[str, Any]:
        """Tiers (budget, bytes used, sessions), backends and version; for an
        admin token (or none needed), the whole daemon's with bandwidth and
        bytes moved per route, else this tenant's own, without the routes."""
        return self._call("Stats", pb.StatsRequest(), _stats)

    def set_budget(self, tier: str, size: int | str) -> BudgetResult:
        """Change a tier's budget now; shrinking the device tier demotes at once."""
        from tierd.sizes import parse_size

        req = pb.SetBudgetRequest(tier=tier, budget=parse_size(size))
        return self._call("SetBudget", req, lambda r: BudgetResult(r.tier, r.old_budget, r.new_budget,
                                                                   r.released_bytes, r.moved_sessions, r.seconds))

    def advise(self, session_id: str, prefill_tokens_per_s: float) -> Advice:
        """Whether restoring beats recomputing the session's tokens."""
        req = pb.AdviseRequest(session_id=session_id, prefill_tokens_per_s=prefill_tokens_per_s)
        return self._call("Advise", req, lambda r: Advice(r.restore_seconds, r.recompute_seconds, r.source_tier,
                                                          r.bandwidth_bytes_per_s))

    def register_engine(self, spec: KVSpec, regions: Any, layout: EngineLayout | None = None,
                        pid: int | None = None) -> Any:
        """Register engine KV memory: a SharedKVCache; (memfd, size) pairs, each
        memfd sealed against shrinking (SharedKVCache's are); or contiguous
        CUDA tensors (the daemon opens them through CUDA IPC), the last two
        with a layout. Shared memory's descriptors are handed to the daemon
        over its Unix socket (a blocking local exchange, also for
        AsyncClient): the daemon maps nothing by name.
        The daemon unregisters the engine when process pid exits: by default
        this process for GPU memory, no process for shared memory (pass
        os.getpid() to have it watched; 0 for none). With GPU memory, save
        blocks once the kernels writing them are done
        (torch.cuda.current_stream().synchronize()); restore returns with the
        blocks written. Returns an Engine with save and restore."""
        msgs, cache_layout, gpu, ticket = _regions(regions, self.address, self._metadata)
        layout = layout or cache_layout
        req = pb.RegisterEngineRequest(spec=spec_to_pb(spec), regions=msgs, fd_ticket=ticket,
                                       pid=(os.getpid() if gpu else 0) if pid is None else pid)
        if layout is not None:
            req.num_blocks = layout.num_blocks
            req.segments.extend(pb.Segment(region=s.region, offset=s.offset, stride=s.stride, nbytes=s.nbytes)
                                for s in layout.segments)
        elif hasattr(regions, "num_blocks"):
            req.num_blocks = regions.num_blocks
        else:
            raise InvalidArgument("give a layout (EngineLayout) with plain regions", field="layout")
        return self._call("RegisterEngine", req, lambda r: self._engine(r.engine_id, spec))

    def _engine(self, engine_id: str, spec: KVSpec) -> Any:
        raise NotImplementedError


class _EngineCalls:
    """Save and restore through registered engine memory (no KV bytes in messages)."""

    def __init__(self, client: Any, engine_id: str, spec: KVSpec) -> None:
        self.client = client
        self.engine_id = engine_id
        self.spec = spec

    def save(self, session_id: str, block_ids: Any, num_tokens: int, start_token: int = 0,
             tier: str = "", priority: int | None = None, token_ids: Any = None) -> SessionInfo:
        """Gather the blocks holding tokens [start_token, num_tokens) into the session.
        `priority` weighs eviction: each step counts as a minute of recency;
        `token_ids` (of tokens [0, num_tokens)) lets lookup() match later prompts."""
        req = pb.SaveRequest(engine_id=self.engine_id, session_id=session_id, block_ids=[int(b) for b in block_ids],
                             num_tokens=num_tokens, start_token=start_token, tier=tier, priority=priority,
                             token_ids=_ids(token_ids))
        return self.client._call("Save", req, info_from_pb)

    def restore(self, session_id: str, block_ids: Any) -> RestoreResult:
        """Scatter the session's first len(block_ids) pages into these blocks."""
        req = pb.RestoreRequest(engine_id=self.engine_id, session_id=session_id, block_ids=[int(b) for b in block_ids])
        return self.client._call("Restore", req, _restore)

    def close(self) -> Any:
        return self.client._call("UnregisterEngine", pb.EngineRequest(engine_id=self.engine_id), lambda r: None)


class Engine(_EngineCalls):
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine(_EngineCalls):
    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _read(path_or_pem: str | bytes | None) -> bytes | None:
    if path_or_pem is None or isinstance(path_or_pem, bytes):
        return path_or_pem
    with open(path_or_pem, "rb") as f:
        return f.read()


def _channel_args(address: str | None, token: str | None, tls_ca: Any, tls_cert: Any,
                  tls_key: Any) -> tuple[str, tuple, grpc.ChannelCredentials | None]:
    target = _target(address)
    token = token if token is not None else os.environ.get("TIERD_TOKEN") or None
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    creds = None
    if tls_ca is not None or tls_cert is not None:
        creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
    return target, metadata, creds


class Client(_Calls):
    """A blocking client. `address`: a socket path, "unix:PATH" or "HOST:PORT"
    (default: TIERD_SOCKET or the daemon's default socket). `token` (default:
    TIERD_TOKEN) authenticates; `tls_ca` (and `tls_cert`, `tls_key` for mutual
    TLS), as paths or PEM bytes, secure a TCP connection."""

    def __init__(self, address: str | None = None, token: str | None = None, timeout: float | None = 60.0, *,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address, self._metadata, creds = _channel_args(address, token, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._channel = (grpc.secure_channel(self.address, creds, options=_OPTIONS) if creds else
                         grpc.insecure_channel(self.address, options=_OPTIONS))
        self._stub = pb_grpc.TierdStub(self._channel)
        self._get, self._put = _byte_streams(self._channel)

    def _call(self, rpc: str, request: Any, parse: Callable[[Any], Any], timeout: float | None = None) -> Any:
        try:
            reply = getattr(self._stub, rpc)(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return parse(reply)

    def _engine(self, engine_id: str, spec: KVSpec) -> Engine:
        return Engine(self, engine_id, spec)

    def health(self, timeout: float = 5.0) -> str:
        """The daemon's grpc.health.v1 status ("SERVING" when all is well)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                    timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def list(self, all_tenants: bool = False) -> list[SessionInfo]:
        """Every session of this tenant (of every tenant, for admin tokens)."""
        out, token = [], ""
        while True:
            page, token = self.list_page(500, token, all_tenants)
            out += page
            if not token:
                return out

    def put(self, session_id: str, data: Any, spec: KVSpec, num_tokens: int, chunk_bytes: int = DEFAULT_CHUNK,
            priority: int | None = None, start_token: int = 0, token_ids: Any = None) -> SessionInfo:
        """Store bytes (bytes, memoryview, numpy array or torch tensor) as the session's snapshot;
        with start_token (KV specs), the bytes are the pages from there on, appended."""
        messages = _put_messages(session_id, data, spec, num_tokens, chunk_bytes, priority, start_token, token_ids)
        started = threading.Event()
        call: list = []

        def requests() -> Iterator[pb.PutRequest | bytes]:
            yield next(messages)  # the header; the chunks only once the daemon has taken it
            started.wait()
            if put_accepted(call[0].initial_metadata()):
                yield from messages

        try:
            call.append(self._put.future(requests(), timeout=self.timeout, metadata=self._metadata))
            started.set()
            reply = call[0].result()
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return info_from_pb(reply)

    def get(self, session_id: str, chunk_bytes: int = 0) -> bytes:
        """The session's snapshot as bytes."""
        return b"".join(self.get_stream(session_id, chunk_bytes)[1])

    def get_stream(self, session_id: str, chunk_bytes: int = 0) -> tuple[SessionInfo, Iterator[memoryview]]:
        """The session's info and an iterator over its bytes, chunk by chunk:
        each a read-only memoryview of the message it came in (no copy)."""
        stream = self._get(pb.GetRequest(session_id=session_id, chunk_bytes=chunk_bytes), timeout=self.timeout,
                           metadata=self._metadata)
        try:
            head = read_header(next(stream))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

        def chunks() -> Iterator[memoryview]:
            try:
                for n, raw in enumerate(stream):
                    yield read_chunk(raw, n)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None

        return info_from_pb(head), chunks()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Calls):
    """The asyncio client: the same methods as Client, awaited."""

    def __init__(self, address: str | None = None, token: str | None = None, timeout: float | None = 60.0, *,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address, self._metadata, creds = _channel_args(address, token, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._channel = (grpc.aio.secure_channel(self.address, creds, options=_OPTIONS) if creds else
                         grpc.aio.insecure_channel(self.address, options=_OPTIONS))
        self._stub = pb_grpc.TierdStub(self._channel)
        self._get, self._put = _byte_streams(self._channel)

    async def _call(self, rpc: str, request: Any, parse: Callable[[Any], Any], timeout: float | None = None) -> Any:
        try:
            reply = await getattr(self._stub, rpc)(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return parse(reply)

    def _engine(self, engine_id: str, spec: KVSpec) -> AsyncEngine:
        return AsyncEngine(self, engine_id, spec)

    async def list(self, all_tenants: bool = False) -> list[SessionInfo]:
        out, token = [], ""
        while True:
            page, token = await self.list_page(500, token, all_tenants)
            out += page
            if not token:
                return out

    async def put(self, session_id: str, data: Any, spec: KVSpec, num_tokens: int, chunk_bytes: int = DEFAULT_CHUNK,
                  priority: int | None = None, start_token: int = 0, token_ids: Any = None) -> SessionInfo:
        messages = _put_messages(session_id, data, spec, num_tokens, chunk_bytes, priority, start_token, token_ids)
        call = self._put(timeout=self.timeout, metadata=self._metadata)
        try:
            try:
                await call.write(next(messages))
                # The chunks go only once the daemon has taken the header: a refusal then comes with its own
                # status (grpc.aio reports a write that fails as the call ends as INTERNAL, not the status).
                if put_accepted(await call.initial_metadata()):
                    for message in messages:
                        await call.write(message)
                    await call.done_writing()
            except asyncio.InvalidStateError:
                pass  # the call ended while writing: its status says why
            return info_from_pb(await call)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def get(self, session_id: str, chunk_bytes: int = 0) -> bytes:
        info, chunks = await self.get_stream(session_id, chunk_bytes)
        return b"".join([c async for c in chunks])

    async def get_stream(self, session_id: str,
                         chunk_bytes: int = 0) -> tuple[SessionInfo, AsyncIterator[memoryview]]:
        stream = self._get(pb.GetRequest(session_id=session_id, chunk_bytes=chunk_bytes), timeout=self.timeout,
                           metadata=self._metadata)
        try:
            head = await stream.read()
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        if head is grpc.aio.EOF:
            raise DataLoss("the Get stream ended before its header")
        header = read_header(head)

        async def chunks() -> AsyncIterator[memoryview]:
            n = 0
            try:
                while (raw := await stream.read()) is not grpc.aio.EOF:
                    yield read_chunk(raw, n)
                    n += 1
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None

        return info_from_pb(header), chunks()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
