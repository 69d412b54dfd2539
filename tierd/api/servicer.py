"""The tierd.v1.Tierd servicer: converts messages and calls the store.

Runs on the daemon's event loop. Calls that copy bytes or may wait run on a
thread pool; the rest touch only in-memory metadata and run inline. Every
call is timed, and every TierdError becomes its one gRPC status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from tierd import __version__
from tierd.api.auth import Authenticator, Caller
from tierd.api.convert import info_to_pb, lease_to_pb, lookup_to_pb, optional_spec_from_pb, spec_from_pb
from tierd.api.inflight import InflightBytes
from tierd.api.status import ERROR_KEY, status_of
from tierd.api.wire import checked, chunk_message, split_chunk
from tierd.core.cuda_ipc import IpcRegion
from tierd.core.engines import EngineRegistry
from tierd.core.store import DEFAULT_LEASE_SECONDS, SnapshotReader, Store, make_key
from tierd.errors import DataLoss, InvalidArgument, TierdError
from tierd.layout import EngineLayout, Segment
from tierd.metrics import Metrics
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc

log = logging.getLogger("tierd.api")
MAX_WAIT_SECONDS = 600.0
_END = object()


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, TierdError):
        context.set_trailing_metadata(((ERROR_KEY, type(exc).__name__),))
        await context.abort(status_of(exc), exc.message)
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log")


class _Call:
    """Times one call and counts its outcome once. A failure is counted before
    the caller hears of it, so a scrape right after an error sees the error."""

    def __init__(self, metrics: Metrics, method: str) -> None:
        self.metrics, self.method, self.t0, self.counted = metrics, method, time.perf_counter(), False

    def count(self, code: str | None) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.rpc(self.method, time.perf_counter() - self.t0, code)

    async def fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        self.count(exc.code if isinstance(exc, TierdError) else "INTERNAL")
        await _abort(context, exc)


def _unary(blocking: bool = False) -> Callable:
    """Wrap fn(self, request, caller) -> response as a timed async handler;
    blocking ones run on the thread pool."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def handler(self: TierdServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self.metrics, fn.__name__)
            try:
                caller = self.auth.identify(context.invocation_metadata())
                if blocking:
                    return await asyncio.get_running_loop().run_in_executor(self.executor, fn, self, request, caller)
                return fn(self, request, caller)
            except Exception as exc:
                await call.fail(context, exc)
            finally:
                call.count(None)

        return handler

    return wrap


def _layout(req: pb.RegisterEngineRequest, spec: Any) -> EngineLayout:
    if req.segments:
        return EngineLayout(req.num_blocks, tuple(Segment(s.region, s.offset, s.stride, s.nbytes) for s in req.segments))
    if spec.is_opaque:
        raise InvalidArgument("an opaque spec has no block layout: use Put and Get", field="spec")
    if len(req.regions) == 1:
        return EngineLayout.cross_layer(spec, req.num_blocks)
    if len(req.regions) == 2 * spec.num_layers:
        return EngineLayout.layer_major(spec, req.num_blocks)
    raise InvalidArgument(f"give segments, or 1 region (cross-layer) or {2 * spec.num_layers} regions "
                          f"(K and V per layer); got {len(req.regions)} regions", field="segments")


class TierdServicer(pb_grpc.TierdServicer):
    def __init__(self, store: Store, engines: EngineRegistry, executor: Executor, metrics: Metrics,
                 backends: dict[str, str], chunk_bytes: int, auth: Authenticator | None = None,
                 inflight_cap: int = 0) -> None:
        self.auth = auth or Authenticator()
        self.inflight = InflightBytes(inflight_cap)
        self.store = store
        self.engines = engines
        self.executor = executor
        self.metrics = metrics
        self.backends = backends
        self.chunk_bytes = chunk_bytes

    # -- engine memory ---------------------------------------------------------

    @_unary(blocking=True)
    def RegisterEngine(self, req: pb.RegisterEngineRequest, caller: Caller) -> pb.RegisterEngineResponse:
        spec = spec_from_pb(req.spec)
        regions: list[tuple[str, int] | IpcRegion] = []
        for i, r in enumerate(req.regions):
            kind = r.WhichOneof("memory")
            if kind == "shm_name":
                regions.append((r.shm_name, r.size))
            elif kind == "cuda_ipc":
                regions.append(IpcRegion(r.cuda_ipc.handle, r.cuda_ipc.offset, r.size, r.cuda_ipc.device_uuid))
            else:
                raise InvalidArgument(f"regions[{i}] names no memory (shm_name or cuda_ipc)", field="regions")
        engine = self.engines.register(caller.tenant, spec, regions, _layout(req, spec), req.pid)
        return pb.RegisterEngineResponse(engine_id=engine.engine_id)

    @_unary(blocking=True)
    def UnregisterEngine(self, req: pb.EngineRequest, caller: Caller) -> pb.Empty:
        self.engines.unregister(caller.tenant, req.engine_id)
        return pb.Empty()

    @_unary(blocking=True)
    def Save(self, req: pb.SaveRequest, caller: Caller) -> pb.SessionInfo:
        key = make_key(caller.tenant, req.session_id)
        with self.engines.use(caller.tenant, req.engine_id) as engine, \
                self.inflight.hold(caller.tenant, len(req.block_ids) * engine.spec.page_bytes):
            info = self.store.save(key, engine.memory, engine.spec, np.asarray(req.block_ids, dtype=np.int64),
                                   req.num_tokens, req.start_token, req.tier or None,
                                   req.priority if req.HasField("priority") else None, _token_ids(req.token_ids))
        return info_to_pb(info)

    @_unary(blocking=True)
    def Restore(self, req: pb.RestoreRequest, caller: Caller) -> pb.RestoreResponse:
        key = make_key(caller.tenant, req.session_id)
        with self.engines.use(caller.tenant, req.engine_id) as engine, \
                self.inflight.hold(caller.tenant, len(req.block_ids) * engine.spec.page_bytes):
            r = self.store.restore(key, engine.memory, engine.spec, np.asarray(req.block_ids, dtype=np.int64))
        return pb.RestoreResponse(num_tokens=r.num_tokens, num_pages=r.num_pages, source_tier=r.source_tier,
                                  seconds=r.seconds)

    # -- leases and lookup ------------------------------------------------------------

    @_unary(blocking=True)
    def BeginSave(self, req: pb.BeginSaveRequest, caller: Caller) -> pb.Lease:
        lease = self.store.begin_save(make_key(caller.tenant, req.session_id), spec_from_pb(req.spec), req.num_tokens,
                                      req.start_token, _token_ids(req.token_ids),
                                      req.priority if req.HasField("priority") else None,
                                      req.ttl_seconds or DEFAULT_LEASE_SECONDS)
        return lease_to_pb(lease)

    @_unary(blocking=True)
    def CommitSave(self, req: pb.LeaseRequest, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.commit_save(caller.tenant, req.lease_id))

    @_unary(blocking=True)
    def AbortSave(self, req: pb.LeaseRequest, caller: Caller) -> pb.Empty:
        self.store.abort_save(caller.tenant, req.lease_id)
        return pb.Empty()

    @_unary(blocking=True)
    def BeginRestore(self, req: pb.BeginRestoreRequest, caller: Caller) -> pb.Lease:
        lease = self.store.begin_restore(make_key(caller.tenant, req.session_id),
                                         optional_spec_from_pb(req), req.num_pages,
                                         req.ttl_seconds or DEFAULT_LEASE_SECONDS, _token_ids(req.token_ids))
        return lease_to_pb(lease)

    @_unary()
    def EndRestore(self, req: pb.LeaseRequest, caller: Caller) -> pb.Empty:
        self.store.end_restore(caller.tenant, req.lease_id)
        return pb.Empty()

    @_unary(blocking=True)
    def Lookup(self, req: pb.LookupRequest, caller: Caller) -> pb.LookupResponse:
        return lookup_to_pb(self.store.lookup(make_key(caller.tenant, req.session_id),
                                              np.asarray(req.token_ids, dtype=np.int64), optional_spec_from_pb(req)))

    # -- bytes ---------------------------------------------------------------------

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        call = _Call(self.metrics, "Put")
        chunks: queue.Queue = queue.Queue(maxsize=16)
        try:
            caller = self.auth.identify(context.invocation_metadata())
            first = await anext(aiter(request_iterator), None)
            head = _put_header(first)
            key = make_key(caller.tenant, head.session_id)
            spec = spec_from_pb(head.spec)
            loop = asyncio.get_running_loop()
            with self.inflight.hold(caller.tenant, head.size):
                job = loop.run_in_executor(self.executor, self.store.put, key, spec, head.num_tokens, head.size,
                                           _verified(chunks), head.priority if head.HasField("priority") else None,
                                           head.start_token, _token_ids(head.token_ids))
                job.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen, even if the client left
                try:
                    n = 1
                    async for raw in request_iterator:  # wire bytes: see add_to_server
                        if job.done():
                            break
                        item = _put_chunk(raw, n)
                        await _feed(chunks, item, job)
                        if isinstance(item, InvalidArgument):
                            break
                        n += 1
                    else:
                        await _feed(chunks, _END, job)
                    return info_to_pb(await job)
                except BaseException:
                    await _feed(chunks, InvalidArgument("the Put stream was cut short"), job)
                    raise
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            call.count(None)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> Any:
        call = _Call(self.metrics, "Get")
        loop = asyncio.get_running_loop()
        reader = None
        try:
            key = make_key(self.auth.identify(context.invocation_metadata()).tenant, request.session_id)
            info, reader = await loop.run_in_executor(self.executor, self.store.get, key,
                                                      request.chunk_bytes or self.chunk_bytes)
            with self.inflight.hold(key.tenant, info.size_bytes):
                # Get's messages go out already serialized (see add_to_server), one copy each.
                yield pb.GetResponse(header=info_to_pb(info)).SerializeToString()
                if info.tier in ("host", "device"):
                    # In memory: ~0.1 ms per MiB on the loop itself. A thread hop per batch
                    # measured half the throughput, the two threads taking turns on the GIL.
                    for data in reader:
                        yield chunk_message(data, reader.digest)  # a whole page: its stored checksum
                else:
                    while batch := await loop.run_in_executor(self.executor, _next_chunks, reader):
                        for message in batch:
                            yield message
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            if reader is not None:
                reader.close()
            call.count(None)

    # -- lifecycle -------------------------------------------------------------------

    @_unary()
    def Prefetch(self, req: pb.PrefetchRequest, caller: Caller) -> pb.PrefetchResponse:
        key = make_key(caller.tenant, req.session_id)
        if req.deadline_seconds < 0:
            raise InvalidArgument("deadline_seconds must not be negative", field="deadline_seconds")
        deadline = self.store.clock.now() + req.deadline_seconds if req.deadline_seconds else None
        status = self.store.prefetch(key, req.tier or "host", req.priority, deadline)
        return pb.PrefetchResponse(status=status)

    @_unary(blocking=True)
    def WaitReady(self, req: pb.WaitReadyRequest, caller: Caller) -> pb.WaitReadyResponse:
        key = make_key(caller.tenant, req.session_id)
        if not 0 <= req.timeout_seconds <= MAX_WAIT_SECONDS:
            raise InvalidArgument(f"timeout_seconds must be 0 to {MAX_WAIT_SECONDS:.0f}", field="timeout_seconds")
        ready, tier = self.store.wait_ready(key, req.tier or "host", req.timeout_seconds)
        return pb.WaitReadyResponse(ready=ready, tier=tier or "")

    @_unary()
    def Release(self, req: pb.SessionRequest, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.release(make_key(caller.tenant, req.session_id)))

    @_unary()
    def Pin(self, req: pb.SessionRequest, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.pin(make_key(caller.tenant, req.session_id)))

    @_unary()
    def Unpin(self, req: pb.SessionRequest, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.unpin(make_key(caller.tenant, req.session_id)))

    @_unary(blocking=True)
    def Drop(self, req: pb.SessionRequest, caller: Caller) -> pb.Empty:
        self.store.drop(make_key(caller.tenant, req.session_id))
        return pb.Empty()

    # -- inspection and control --------------------------------------------------------

    @_unary()
    def Stat(self, req: pb.SessionRequest, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.stat(make_key(caller.tenant, req.session_id)))

    @_unary()
    def List(self, req: pb.ListRequest, caller: Caller) -> pb.ListResponse:
        if req.all_tenants:
            caller.require_admin("listing every tenant's sessions")
        page, token = self.store.list(None if req.all_tenants else caller.tenant, after=req.page_token,
                                      limit=req.limit or 100)
        return pb.ListResponse(sessions=[info_to_pb(i) for i in page], next_page_token=token)

    @_unary(blocking=True)  # counts sessions per tier: O(sessions), off the event loop
    def Stats(self, req: pb.StatsRequest, caller: Caller) -> pb.StatsResponse:
        # A tenant sees its own sessions and bytes per tier, budgets and backends.
        # Traffic per route (bandwidth, bytes moved, copies) and the tiers' mapped
        # bytes are every tenant's doing: admins only.
        tenant = None if caller.admin else caller.tenant
        tiers = [pb.TierStats(name=t.name, budget=t.budget, used=t.used, capacity=t.capacity, sessions=t.sessions,
                              backend=t.backend) for t in self.store.stats(tenant)]
        reply = pb.StatsResponse(tiers=tiers, version=__version__, backends=self.backends,
                                 sessions=self.store.count(tenant))
        if tenant is None:
            copier = self.store.copier
            reply.bandwidth.update(copier.bandwidth)
            reply.moved_bytes.update(copier.moved_bytes)
            reply.copy_ops = copier.copy_ops
        return reply

    @_unary(blocking=True)
    def SetBudget(self, req: pb.SetBudgetRequest, caller: Caller) -> pb.SetBudgetResponse:
        caller.require_admin("changing a budget")
        r = self.store.set_budget(req.tier, req.budget)
        return pb.SetBudgetResponse(tier=r.tier, old_budget=r.old_budget, new_budget=r.new_budget,
                                    released_bytes=r.released_bytes, moved_sessions=r.moved_sessions,
                                    seconds=r.seconds)

    @_unary()
    def Advise(self, req: pb.AdviseRequest, caller: Caller) -> pb.AdviseResponse:
        a = self.store.advise(make_key(caller.tenant, req.session_id), req.prefill_tokens_per_s)
        return pb.AdviseResponse(restore=a.restore, restore_seconds=a.restore_seconds,
                                 recompute_seconds=a.recompute_seconds, source_tier=a.source_tier,
                                 bandwidth_bytes_per_s=a.bandwidth_bytes_per_s)


def _token_ids(field: Any) -> np.ndarray | None:
    """A repeated token_ids field: None when empty (not known)."""
    return np.asarray(field, dtype=np.int64) if len(field) else None


async def _feed(chunks: queue.Queue, item: Any, job: asyncio.Future) -> None:
    """Hand one item to the thread running the store's put, without blocking
    the event loop, and without waiting on a put that has already ended."""
    while not job.done():
        try:
            chunks.put_nowait(item)
            return
        except queue.Full:
            await asyncio.sleep(0.001)


def _next_chunks(reader: SnapshotReader, budget: int = 8 << 20) -> list[bytes]:
    """The next serialized chunk messages of a Get, up to `budget` bytes: built
    off the event loop, one thread hop per batch."""
    out, size = [], 0
    for data in reader:
        out.append(chunk_message(data, reader.digest))
        size += len(data)
        if size >= budget:
            break
    return out


def add_to_server(servicer: TierdServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated add_TierdServicer_to_server,
    except that Get's responses are sent as the bytes the handler built, and
    Put's requests reach the handler as the bytes received (tierd.api.wire)."""

    class _Capture:
        handlers: dict = {}

        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            self.handlers = handlers

    capture = _Capture()
    pb_grpc.add_TierdServicer_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    handlers["Get"] = handlers["Get"]._replace(response_serializer=None)
    handlers["Put"] = handlers["Put"]._replace(request_deserializer=None)
    name = pb.DESCRIPTOR.services_by_name["Tierd"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def _put_header(raw: bytes | None) -> pb.PutHeader:
    try:
        msg = pb.PutRequest.FromString(raw) if raw is not None else None
    except DecodeError:
        msg = None
    if msg is None or msg.WhichOneof("part") != "header":
        raise InvalidArgument("a Put stream starts with its header", field="header")
    return msg.header


def _put_chunk(raw: bytes, n: int) -> tuple[memoryview, int] | InvalidArgument:
    """Message n (the header is 0) of a Put stream as (data, xxh3), data a view of raw;
    for what is not a chunk, the error that ends the stream."""
    try:
        parts = split_chunk(raw, pb.PutRequest)
    except DecodeError:
        return InvalidArgument(f"message {n + 1} of the Put stream is not a PutRequest")
    return parts if parts is not None else InvalidArgument("a Put stream has one header", field="header")


def _verified(chunks: queue.Queue) -> Iterator[memoryview]:
    """The Put stream's chunks, each checked against its XXH3 (0: unchecked)."""
    n = 0
    while True:
        item = chunks.get()
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        data, digest = item
        if not checked(data, digest):
            raise DataLoss(f"chunk {n} of the Put stream arrived damaged (checksum mismatch)", chunk=n)
        n += 1
        yield data
