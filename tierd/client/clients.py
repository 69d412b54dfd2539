"""Client (blocking) and AsyncClient (asyncio), run in the caller's process
(engines, adapters, the CLI): each opens the channel (client/channel.py),
answers the calls of client/calls.py through its own _call, and streams Put
and Get its own way."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import grpc

from tierd.client.calls import AsyncEngine, Calls, Engine, byte_streams, put_messages
from tierd.client.channel import DEFAULT_CHUNK, OPTIONS, channel_args, pb
from tierd.client import local
from tierd.client.shm import Arena
from tierd.errors import DataLoss
from tierd.layout import KVSpec
from tierd.types import (
    SessionInfo,
)
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.chunks import (
    put_accepted,
    read_chunk,
    read_header,
)
from tierd.wire.convert import (
    info_from_pb,
)
from tierd.wire.status import from_rpc_error


class Client(Calls):
    """A blocking client. `address`: a socket path, "unix:PATH" or "HOST:PORT"
    (default: TIERD_SOCKET or the daemon's default socket). `token` (default:
    TIERD_TOKEN) authenticates; `tls_ca` (and `tls_cert`, `tls_key` for mutual
    TLS), as paths or PEM bytes, secure a TCP connection."""

    def __init__(self, address: str | None = None, token: str | None = None, timeout: float | None = 60.0, *,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address, self._metadata, creds = channel_args(address, token, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._channel = (grpc.secure_channel(self.address, creds, options=OPTIONS) if creds else
                         grpc.insecure_channel(self.address, options=OPTIONS))
        self._stub = pb_grpc.TierdStub(self._channel)
        self._get, self._put = byte_streams(self._channel)
        self._arena: Arena | None = None  # the lease segments read_local maps
        self._arena_lock = threading.Lock()

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
            priority: int | None = None, start_token: int = 0, token_ids: Any = None,
            cache_salt: str = "", lossy_max_error: float | None = None) -> SessionInfo:
        """Store bytes (bytes, memoryview, numpy array or torch tensor) as the session's snapshot;
        with start_token (KV specs), the bytes are the pages from there on, appended. With token_ids
        (under cache_salt), pages the tenant holds already are not stored again. lossy_max_error: as in
        EngineHandle.save (opaque bytes are never coded lossily)."""
        messages = put_messages(session_id, data, spec, num_tokens, chunk_bytes, priority, start_token, token_ids,
                                cache_salt, lossy_max_error)
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

    def read_local(self, session_id: str, ttl: float = 60.0,
                   spec: KVSpec | None = None) -> AbstractContextManager[memoryview]:
        """The session's bytes, read on the daemon's machine through shared
        memory it lends for the read: a read-only view, valid inside the
        block (client/local.py). With spec, another identity's snapshot is
        IdentityMismatch."""
        return local.read_local(self, session_id, ttl, spec)

    def get_into(self, session_id: str, out: Any, ttl: float = 60.0, spec: KVSpec | None = None) -> int:
        """Copy the session's bytes into `out` (a writable buffer: bytearray,
        numpy array, ...), read as read_local reads them; returns how many."""
        return local.get_into(self, session_id, out, ttl, spec)

    def local_buffer(self, spec: KVSpec, nbytes: int) -> local.LocalBuffer:
        """Memory of this process, registered with the daemon, that it reads
        sessions of `spec` (up to nbytes) into: LocalBuffer.read."""
        return local.LocalBuffer(self, spec, nbytes)

    def close(self) -> None:
        self._channel.close()
        if self._arena is not None:
            self._arena.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(Calls):
    """The asyncio client: the same methods as Client, awaited."""

    def __init__(self, address: str | None = None, token: str | None = None, timeout: float | None = 60.0, *,
                 tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None) -> None:
        self.address, self._metadata, creds = channel_args(address, token, tls_ca, tls_cert, tls_key)
        self.timeout = timeout
        self._channel = (grpc.aio.secure_channel(self.address, creds, options=OPTIONS) if creds else
                         grpc.aio.insecure_channel(self.address, options=OPTIONS))
        self._stub = pb_grpc.TierdStub(self._channel)
        self._get, self._put = byte_streams(self._channel)
        self._arena: Arena | None = None  # the lease segments read_local maps
        self._arena_lock = threading.Lock()

    async def _call(self, rpc: str, request: Any, parse: Callable[[Any], Any], timeout: float | None = None) -> Any:
        try:
            reply = await getattr(self._stub, rpc)(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return parse(reply)

    def _engine(self, engine_id: str, spec: KVSpec) -> AsyncEngine:
        return AsyncEngine(self, engine_id, spec)

    def read_local(self, session_id: str, ttl: float = 60.0,
                   spec: KVSpec | None = None) -> AbstractAsyncContextManager[memoryview]:
        """Client.read_local, as an async context manager."""
        return local.read_local_async(self, session_id, ttl, spec)

    async def get_into(self, session_id: str, out: Any, ttl: float = 60.0, spec: KVSpec | None = None) -> int:
        """Client.get_into, awaited."""
        return await local.get_into_async(self, session_id, out, ttl, spec)

    async def list(self, all_tenants: bool = False) -> list[SessionInfo]:
        out, token = [], ""
        while True:
            page, token = await self.list_page(500, token, all_tenants)
            out += page
            if not token:
                return out

    async def put(self, session_id: str, data: Any, spec: KVSpec, num_tokens: int, chunk_bytes: int = DEFAULT_CHUNK,
                  priority: int | None = None, start_token: int = 0, token_ids: Any = None,
                  cache_salt: str = "", lossy_max_error: float | None = None) -> SessionInfo:
        messages = put_messages(session_id, data, spec, num_tokens, chunk_bytes, priority, start_token, token_ids,
                                cache_salt, lossy_max_error)
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
        if self._arena is not None:
            self._arena.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
