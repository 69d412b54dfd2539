"""The tierd.v1.Tierd servicer: converts messages and calls the store.

Runs on the daemon's event loop. Every call passes a gate as it starts
(api/gate.py): its token is checked from its metadata before its message is
even read, and it counts against its tenant's open calls; its message is
parsed by the handler (not by gRPC), so a malformed one is INVALID_ARGUMENT;
long id lists are read as arrays (wire/packed.py). Calls that copy bytes
or may wait on a session run on the RPC threads, at most a few per tenant
at once (api/limits.py); the waiting itself (a tenant's turn, WaitReady, a
stream's next message) is done on the loop, so a stalled or slow client
holds no thread. Put and Get streams end when the client makes no progress
for the idle deadline, and give back every byte and lock they held however
they end. Every call is timed, and every TierdError becomes its one gRPC
status.

One method per call of the service, in the proto's order; most are a few
lines from message to store and back. Longer than this package's other
modules because the service has 23 calls, not because a method mixes
concerns: Put, Get and WaitReady, the streaming ones, are the long ones.
"""

from __future__ import annotations

import asyncio
import functools
import time
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from tierd import __version__
from tierd.api.auth import Authenticator, Caller
from tierd.api.gate import CALLER, Call, parse, unary, within
from tierd.api.inflight import InflightBytes
from tierd.api.limits import TenantLimits
from tierd.core.cuda_ipc import IpcRegion
from tierd.core.engines import EngineRegistry
from tierd.core.store import (
    DEFAULT_LEASE_SECONDS,
    PendingWrite,
    SnapshotReader,
    Store,
    make_key,
)
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    TierdError,
    WouldBlock,
)
from tierd.layout import EngineLayout, KVSpec, Segment
from tierd.metrics import Metrics
from tierd.types import SessionInfo, SessionKey
from tierd.tiers import HOST, MEMORY, kind_of
from tierd.v1 import tierd_pb2 as pb
from tierd.wire import packed
from tierd.wire.chunks import PUT_ACCEPTED, checked, chunk_message, split_chunk
from tierd.wire.convert import (
    info_to_pb,
    lease_to_pb,
    lookup_to_pb,
    optional_spec_from_pb,
    spec_from_pb,
)
from tierd.wire.fds import FdIntake

log = logging.getLogger("tierd.api")
MAX_WAIT_SECONDS = 600.0
MAX_GET_CHUNK = 4 << 20
MIN_GET_CHUNK = 4 << 10  # as small as a page may be


def _layout(req: Any, spec: Any) -> EngineLayout:
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


class _Changes:
    """Wakes WaitReady calls on the loop when the store says a session may
    have changed (from any thread, at no cost when nobody waits)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fut: asyncio.Future | None = None

    def future(self) -> asyncio.Future:
        if self._fut is None or self._fut.done():
            self._loop = asyncio.get_running_loop()
            self._fut = self._loop.create_future()
        return self._fut

    def notify(self) -> None:
        fut, loop = self._fut, self._loop
        if fut is not None and not fut.done() and loop is not None:
            try:
                loop.call_soon_threadsafe(self._fire, fut)
            except RuntimeError:
                pass  # the loop has closed: nobody waits any more

    @staticmethod
    def _fire(fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_result(None)


class TierdServicer:
    def __init__(self, store: Store, engines: EngineRegistry, executor: Executor, metrics: Metrics,
                 backends: dict[str, str], chunk_bytes: int, auth: Authenticator | None = None,
                 inflight_cap: int = 0, limits: TenantLimits | None = None, idle_seconds: float = 30.0,
                 fds: FdIntake | None = None) -> None:
        self.auth = auth or Authenticator()
        self.inflight = InflightBytes(inflight_cap)
        self.limits = limits or TenantLimits(workers=8, streams=0)
        self.idle_seconds = idle_seconds  # a stream with no progress for this long is ended
        self.store = store
        self.engines = engines
        self.executor = executor
        self.metrics = metrics
        self.backends = backends
        self.chunk_bytes = chunk_bytes
        self.fds = fds  # None: engine memory is GPU memory only (no Unix socket to hand descriptors over)
        self._changes = _Changes()
        store.subscribe(self._changes.notify)

    async def blocking(self, tenant: str, fn: Callable, *args: Any, undo: Callable[[Any], None] | None = None) -> Any:
        """fn(*args) on an RPC thread, once one of the tenant's slots is free.
        If the call is cancelled while fn runs, fn still finishes; `undo`
        then gets its result (a write nobody will commit, say)."""
        job = await self.limits.submit(tenant, self.executor, fn, *args)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if undo is not None:
                job.add_done_callback(functools.partial(_undo, undo))
            raise

    # -- engine memory ---------------------------------------------------------

    @unary(blocking=True, undo=lambda self, caller, r: self.engines.unregister(caller.tenant, r.engine_id))
    def RegisterEngine(self, req: Any, caller: Caller) -> pb.RegisterEngineResponse:
        spec = spec_from_pb(req.spec)
        layout = _layout(req, spec)
        kinds = {r.WhichOneof("memory") for r in req.regions}
        if "shm_name" in kinds:
            raise FailedPrecondition("engine memory is not taken by name (a name proves nothing about who owns the "
                                     "memory): hand over its open descriptors (tierd.client does)", field="regions")
        if None in kinds:
            raise InvalidArgument("a region names no memory (shm_fd or cuda_ipc)", field="regions")
        if kinds == {"cuda_ipc"}:
            regions: list = [IpcRegion(r.cuda_ipc.handle, r.cuda_ipc.offset, r.size, r.cuda_ipc.device_uuid)
                             for r in req.regions]
            engine = self.engines.register(caller.tenant, spec, regions, layout, req.pid)
            return pb.RegisterEngineResponse(engine_id=engine.engine_id)
        if kinds != {"shm_fd"}:
            raise InvalidArgument("an engine's regions are all shared memory or all CUDA IPC", field="regions")
        if self.fds is None:
            raise FailedPrecondition("this daemon takes no shared memory: it listens on no Unix socket",
                                     field="regions")
        ticket = self.fds.take(caller.tenant, req.fd_ticket)
        try:
            fds = ticket.fds
            for r in req.regions:
                if r.shm_fd >= len(fds):
                    raise InvalidArgument(f"region names descriptor {r.shm_fd}; the ticket holds {len(fds)}",
                                          field="regions")
            regions = [(fds[r.shm_fd], r.size) for r in req.regions]
            engine = self.engines.register(caller.tenant, spec, regions, layout, req.pid)
        finally:
            ticket.close()  # mapped now (or refused): the descriptors are not needed
        return pb.RegisterEngineResponse(engine_id=engine.engine_id)

    @unary(blocking=True)
    def UnregisterEngine(self, req: Any, caller: Caller) -> pb.Empty:
        self.engines.unregister(caller.tenant, req.engine_id)
        return pb.Empty()

    @unary(blocking=True)
    def Save(self, req: Any, caller: Caller) -> pb.SessionInfo:
        key = make_key(caller.tenant, req.session_id)
        with self.engines.use(caller.tenant, req.engine_id) as engine:
            ids = _block_ids(req.id_field("block_ids"), engine.memory.layout.num_blocks)
            with self.inflight.hold(caller.tenant, ids.size * engine.spec.page_bytes):
                info = self.store.save(key, engine.memory, engine.spec, ids, req.num_tokens, req.start_token,
                                       req.tier or None, req.priority if req.HasField("priority") else None,
                                       _token_ids(req.id_field("token_ids"), want=req.num_tokens), req.cache_salt)
        return info_to_pb(info)

    @unary(blocking=True)
    def Restore(self, req: Any, caller: Caller) -> pb.RestoreResponse:
        key = make_key(caller.tenant, req.session_id)
        with self.engines.use(caller.tenant, req.engine_id) as engine:
            ids = _block_ids(req.id_field("block_ids"), engine.memory.layout.num_blocks)
            raw = req.id_field("token_ids")  # no more of the prompt than the pages restored hold can matter
            prompt = _token_ids(raw, limit=int(ids.size) * engine.spec.block_tokens) if raw else None
            with self.inflight.hold(caller.tenant, ids.size * engine.spec.page_bytes):
                r = self.store.restore(key, engine.memory, engine.spec, ids, prompt, req.cache_salt)
        return pb.RestoreResponse(num_tokens=r.num_tokens, num_pages=r.num_pages, source_tier=r.source_tier,
                                  seconds=r.seconds)

    # -- leases and lookup ------------------------------------------------------------

    @unary(blocking=True, undo=lambda self, caller, lease: self.store.abort_save(caller.tenant, lease.lease_id))
    def BeginSave(self, req: Any, caller: Caller) -> pb.Lease:
        lease = self.store.begin_save(make_key(caller.tenant, req.session_id), spec_from_pb(req.spec), req.num_tokens,
                                      req.start_token, _token_ids(req.id_field("token_ids"), want=req.num_tokens),
                                      req.priority if req.HasField("priority") else None,
                                      req.ttl_seconds or DEFAULT_LEASE_SECONDS, req.cache_salt)
        return lease_to_pb(lease)

    @unary(blocking=True)
    def CommitSave(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.commit_save(caller.tenant, req.lease_id))

    @unary(blocking=True)
    def AbortSave(self, req: Any, caller: Caller) -> pb.Empty:
        self.store.abort_save(caller.tenant, req.lease_id)
        return pb.Empty()

    @unary(blocking=True, undo=lambda self, caller, lease: self.store.end_restore(caller.tenant, lease.lease_id))
    def BeginRestore(self, req: Any, caller: Caller) -> pb.Lease:
        key = make_key(caller.tenant, req.session_id)
        raw = req.id_field("token_ids")
        spec = optional_spec_from_pb(req)
        prompt = _token_ids(raw, limit=self._prompt_limit(key, spec)) if raw else None
        lease = self.store.begin_restore(key, spec, req.num_pages, req.ttl_seconds or DEFAULT_LEASE_SECONDS, prompt,
                                         req.cache_salt)
        return lease_to_pb(lease)

    @unary(blocking=True)
    def EndRestore(self, req: Any, caller: Caller) -> pb.Empty:
        self.store.end_restore(caller.tenant, req.lease_id)
        return pb.Empty()

    @unary(blocking=True)
    def Lookup(self, req: Any, caller: Caller) -> pb.LookupResponse:
        key = make_key(caller.tenant, req.session_id)
        spec = optional_spec_from_pb(req)
        prompt = packed.decode(req.id_field("token_ids"), limit=self._prompt_limit(key, spec))
        return lookup_to_pb(self.store.lookup(key, prompt, spec, req.cache_salt))

    def _prompt_limit(self, key: SessionKey, spec: KVSpec | None) -> int:
        """How many of a prompt's ids can match (the rest stay undecoded):
        without a spec only the snapshot's own pages answer (NOT_FOUND if
        there is none); with one, the tenant's shared pages may answer too,
        as far as the most tokens one of its sessions holds."""
        return self.store.prompt_limit(key) if spec is not None else self.store.stat(key).num_tokens

    # -- bytes ---------------------------------------------------------------------

    async def _read(self, context: grpc.aio.ServicerContext, what: str = "the Put stream") -> Any:
        """The call's next message (raw bytes, or EOF), within the idle deadline."""
        return await self._within(context.read(), f"{what} sent nothing")

    async def _write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        """Send one message, within the idle deadline (the client must keep reading)."""
        await self._within(context.write(message), "the Get stream's reader took nothing")

    async def _within(self, op: Any, stalled: str) -> Any:
        return await within(op, self.idle_seconds, stalled)

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        call = Call(self.metrics, "Put")
        write: PendingWrite | None = None
        try:
            try:
                caller = CALLER.get()
                head = _put_header(await self._read(context))
                key = make_key(caller.tenant, head.session_id)
                spec = spec_from_pb(head.spec)
                with self.limits.stream(caller.tenant), self.inflight.hold(caller.tenant, head.size):
                    write = await self.blocking(
                        caller.tenant, self.store.begin_put, key, spec, head.num_tokens, head.size,
                        head.priority if head.HasField("priority") else None, head.start_token,
                        _token_ids(head.id_field("token_ids"), want=head.num_tokens, deferred=True), head.cache_salt,
                        undo=self.store.abort_write)
                    # the client sends its chunks now
                    await self._within(context.send_initial_metadata((PUT_ACCEPTED,)), "the Put stream took nothing")
                    n = 1
                    while (raw := await self._read(context)) is not grpc.aio.EOF:
                        data, digest = _put_chunk(raw, n)
                        if not checked(data, digest):
                            raise DataLoss(f"chunk {n - 1} of the Put stream arrived damaged (checksum mismatch)",
                                           chunk=n - 1)
                        write.write(data)  # one copy into the host tier, here on the loop
                        n += 1
                    # Every byte arrived: the commit runs to its end even if the client leaves now (else a
                    # cancel while the commit waited for a thread left its pages held by no session).
                    commit = asyncio.ensure_future(self.blocking(caller.tenant, self.store.commit_put, write))
                    commit.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen, however it ends
                    write = None
                    return info_to_pb(await asyncio.shield(commit))
            finally:
                if write is not None:  # failed or cancelled before its commit: every byte goes back, first
                    self.store.abort_write(write)
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            call.count(None)

    async def _open_reader(self, tenant: str, key: SessionKey, chunk: int) -> tuple[SessionInfo, SnapshotReader]:
        """store.get on the loop; for a session only the remote tier holds, on an
        RPC thread (it is fetched first). A reader opened for a call that left
        meanwhile is closed."""
        try:
            return self.store.get(key, chunk)
        except WouldBlock:
            pass
        job = await self.limits.submit(tenant, self.executor, self.store.get, key, chunk)
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            job.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and f.result()[1].close())
            raise

    async def Get(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        call = Call(self.metrics, "Get")
        reader: SnapshotReader | None = None
        batch = None  # the RPC thread's work on the reader, while it runs
        try:
            try:
                caller = CALLER.get()
                req = parse(pb.GetRequest, raw)
                key = make_key(caller.tenant, req.session_id)
                with self.limits.stream(caller.tenant):
                    # From 4 KiB (1-byte chunks made a batch of 8 million messages) to 4 MiB (or the
                    # configured default): gRPC holds a few per open stream.
                    chunk = min(max(req.chunk_bytes or self.chunk_bytes, MIN_GET_CHUNK),
                                max(self.chunk_bytes, MAX_GET_CHUNK))
                    info, reader = await self._open_reader(caller.tenant, key, chunk)
                    with self.inflight.hold(key.tenant, info.size_bytes):
                        # Get's messages go out already serialized (see add_to_server), one copy each.
                        await self._write(context, pb.GetResponse(header=info_to_pb(info)).SerializeToString())
                        if info.tier is not None and kind_of(info.tier).medium == MEMORY:
                            # In memory: ~0.1 ms per MiB on the loop itself. A thread hop per batch
                            # measured half the throughput, the two threads taking turns on the GIL.
                            for data in reader:
                                await self._write(context, chunk_message(data, reader.digest))
                        else:
                            while True:
                                batch = await self.limits.submit(caller.tenant, self.executor, _next_chunks, reader)
                                messages = await asyncio.wrap_future(batch)
                                batch = None
                                if not messages:
                                    break
                                for message in messages:
                                    await self._write(context, message)
            finally:
                # Given back before the client is told: telling a stalled client may wait for good.
                if reader is not None:
                    if batch is not None and not batch.done():
                        batch.add_done_callback(lambda _: reader.close())  # by the thread, once it is done
                    else:
                        reader.close()
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            call.count(None)

    # -- lifecycle -------------------------------------------------------------------

    @unary()
    def Prefetch(self, req: Any, caller: Caller) -> pb.PrefetchResponse:
        key = make_key(caller.tenant, req.session_id)
        if req.deadline_seconds < 0:
            raise InvalidArgument("deadline_seconds must not be negative", field="deadline_seconds")
        deadline = self.store.clock.now() + req.deadline_seconds if req.deadline_seconds else None
        status = self.store.prefetch(key, req.tier or HOST, req.priority, deadline)
        return pb.PrefetchResponse(status=status)

    async def WaitReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.WaitReadyResponse:
        """Waits on the loop, woken by the store's changes: no thread is held."""
        call = Call(self.metrics, "WaitReady")
        try:
            caller = CALLER.get()
            req = parse(pb.WaitReadyRequest, raw)
            key = make_key(caller.tenant, req.session_id)
            if not 0 <= req.timeout_seconds <= MAX_WAIT_SECONDS:
                raise InvalidArgument(f"timeout_seconds must be 0 to {MAX_WAIT_SECONDS:.0f}", field="timeout_seconds")
            loop = asyncio.get_running_loop()
            end = loop.time() + req.timeout_seconds
            while True:
                changed = self._changes.future()  # taken before the check: a change after it wakes this call
                ready, tier = self.store.ready(key, req.tier or HOST)
                left = end - loop.time()
                if ready or left <= 0:
                    return pb.WaitReadyResponse(ready=ready, tier=tier or "")
                try:
                    await asyncio.wait_for(asyncio.shield(changed), left)
                except asyncio.TimeoutError:
                    pass
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            call.count(None)

    @unary()
    def Release(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.release(make_key(caller.tenant, req.session_id)))

    @unary()
    def Pin(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.pin(make_key(caller.tenant, req.session_id)))

    @unary()
    def Unpin(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.unpin(make_key(caller.tenant, req.session_id)))

    @unary(blocking=True)
    def Drop(self, req: Any, caller: Caller) -> pb.Empty:
        self.store.drop(make_key(caller.tenant, req.session_id))
        return pb.Empty()

    # -- inspection and control --------------------------------------------------------

    @unary()
    def Stat(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.store.stat(make_key(caller.tenant, req.session_id)))

    @unary(blocking=True)  # sorts the tenant's sessions: O(sessions log sessions), off the event loop
    def List(self, req: Any, caller: Caller) -> pb.ListResponse:
        if req.all_tenants:
            caller.require_admin("listing every tenant's sessions")
        page, token = self.store.list(None if req.all_tenants else caller.tenant, after=req.page_token,
                                      limit=req.limit or 100)
        reply = pb.ListResponse(next_page_token=token)
        for i in range(0, len(page), 256):
            reply.sessions.extend(info_to_pb(info) for info in page[i : i + 256])
            time.sleep(0)  # the event loop takes the GIL between batches: a page of 10,000 is ~0.1 s of it
        return reply

    @unary(blocking=True)  # counts sessions per tier: O(sessions), off the event loop
    def Stats(self, req: Any, caller: Caller) -> pb.StatsResponse:
        # A tenant sees its own sessions and bytes per tier, budgets and backends.
        # Traffic per route (bandwidth, bytes moved, copies) and the tiers' mapped
        # bytes are every tenant's doing: admins only.
        tenant = None if caller.admin else caller.tenant
        tiers = [pb.TierStats(name=t.name, budget=t.budget, used=t.used, capacity=t.capacity, sessions=t.sessions,
                              backend=t.backend, saved=t.saved) for t in self.store.stats(tenant)]
        reply = pb.StatsResponse(tiers=tiers, version=__version__, backends=self.backends,
                                 sessions=self.store.count(tenant))
        if tenant is None:
            copier = self.store.copier
            reply.bandwidth.update(copier.bandwidth)
            reply.moved_bytes.update(copier.moved_bytes)
            reply.copy_ops = copier.copy_ops
        return reply

    @unary(blocking=True)
    def SetBudget(self, req: Any, caller: Caller) -> pb.SetBudgetResponse:
        caller.require_admin("changing a budget")
        r = self.store.set_budget(req.tier, req.budget)
        return pb.SetBudgetResponse(tier=r.tier, old_budget=r.old_budget, new_budget=r.new_budget,
                                    released_bytes=r.released_bytes, moved_sessions=r.moved_sessions,
                                    seconds=r.seconds)

    @unary()
    def Advise(self, req: Any, caller: Caller) -> pb.AdviseResponse:
        a = self.store.advise(make_key(caller.tenant, req.session_id), req.prefill_tokens_per_s)
        return pb.AdviseResponse(restore=a.restore, restore_seconds=a.restore_seconds,
                                 recompute_seconds=a.recompute_seconds, source_tier=a.source_tier,
                                 bandwidth_bytes_per_s=a.bandwidth_bytes_per_s)


def _undo(undo: Callable[[Any], None], job: Any) -> None:
    """Take back what a cancelled call's job made, once it is done (on the job's thread)."""
    if job.cancelled() or job.exception() is not None:
        return
    try:
        undo(job.result())
    except TierdError:
        pass  # ended some other way meanwhile (expired, say)


def _token_ids(raw: memoryview, want: int | None = None, limit: int | None = None,
               deferred: bool = False) -> np.ndarray | packed.Deferred | None:
    """A packed token_ids field (None when empty: not known): exactly `want`
    ids, counted before any is decoded, or its first `limit` ids; deferred:
    decoded where the store uses it (after its own checks), not here."""
    if not raw:
        return None
    if want is not None and (got := packed.count(raw)) != want:
        raise InvalidArgument(f"{want} token ids were expected (one per stored token), got {got}",
                              field="token_ids", want=want, got=got)
    return packed.Deferred(raw) if deferred else packed.decode(raw, limit=limit)


def _block_ids(raw: memoryview, num_blocks: int) -> np.ndarray:
    """A packed block_ids field; more ids than the engine has blocks are refused before decoding."""
    if (got := packed.count(raw)) > num_blocks:
        raise InvalidArgument(f"{got} block ids for an engine of {num_blocks} blocks", field="block_ids")
    return packed.decode(raw, "block_ids")


def _next_chunks(reader: SnapshotReader, budget: int = 8 << 20, most: int = 128) -> list[bytes]:
    """The next serialized chunk messages of a Get, up to `budget` bytes and
    `most` messages: built off the event loop, one thread hop per batch."""
    out, size = [], 0
    for data in reader:
        out.append(chunk_message(data, reader.digest))
        size += len(data)
        if size >= budget or len(out) >= most:
            break
    return out


def _put_header(raw: Any) -> packed.Request:
    """The PutHeader that opens a Put stream (its token ids apart, uncopied)."""
    try:
        parts = packed.fields(raw) if isinstance(raw, bytes) else []
    except DecodeError:
        parts = []
    if len(parts) != 1 or parts[0][:2] != (pb.PutRequest.DESCRIPTOR.fields_by_name["header"].number, 2):
        raise InvalidArgument("a Put stream starts with its header", field="header")
    return parse(pb.PutHeader, parts[0][3])


def _put_chunk(raw: bytes, n: int) -> tuple[memoryview, int]:
    """Message n (the header is 0) of a Put stream as (data, xxh3), data a view of raw."""
    try:
        parts = split_chunk(raw, pb.PutRequest)
    except DecodeError:
        raise InvalidArgument(f"message {n + 1} of the Put stream is not a PutRequest") from None
    if parts is None:
        raise InvalidArgument("a Put stream has one header", field="header")
    return parts
