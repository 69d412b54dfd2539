"""The byte streams: Put (chunks into the host tier, each checked, one copy
on the loop) and Get (served from memory on the loop; from disk, or pages
coded in memory, in batches built on the RPC threads). Each ends when its
client makes no progress for the idle deadline, and gives back every byte
and lock it held however it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tierd.api.context import CallContext, token_ids
from tierd.api.gate import CALLER, Call, parse
from tierd.core.store import PendingWrite, SnapshotReader, make_key
from tierd.errors import DataLoss, InvalidArgument
from tierd.tiers import MEMORY, kind_of
from tierd.types import SessionInfo, SessionKey
from tierd.v1 import tierd_pb2 as pb
from tierd.wire import packed
from tierd.wire.chunks import PUT_ACCEPTED, checked, chunk_message, split_chunk
from tierd.wire.convert import info_to_pb, spec_from_pb

MAX_GET_CHUNK = 4 << 20
MIN_GET_CHUNK = 4 << 10  # as small as a page may be


class StreamCalls:
    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        call = Call(self.ctx.metrics, "Put")
        write: PendingWrite | None = None
        try:
            try:
                caller = CALLER.get()
                head = _put_header(await self.ctx.read(context))
                key = make_key(caller.tenant, head.session_id)
                spec = spec_from_pb(head.spec)
                with self.ctx.limits.stream(caller.tenant), self.ctx.inflight.hold(caller.tenant, head.size):
                    write = await self.ctx.blocking(
                        caller.tenant, self.ctx.store.begin_put, key, spec, head.num_tokens, head.size,
                        head.priority if head.HasField("priority") else None, head.start_token,
                        token_ids(head.id_field("token_ids"), want=head.num_tokens, deferred=True), head.cache_salt,
                        head.lossy_max_error if head.HasField("lossy_max_error") else None,
                        undo=self.ctx.store.abort_write)
                    # the client sends its chunks now
                    await self.ctx.within(context.send_initial_metadata((PUT_ACCEPTED,)), "the Put stream took nothing")
                    n = 1
                    while (raw := await self.ctx.read(context)) is not grpc.aio.EOF:
                        data, digest = _put_chunk(raw, n)
                        if not checked(data, digest):
                            raise DataLoss(f"chunk {n - 1} of the Put stream arrived damaged (checksum mismatch)",
                                           chunk=n - 1)
                        write.write(data)  # one copy into the host tier, here on the loop
                        n += 1
                    # Every byte arrived: the commit runs to its end even if the client leaves now (else a
                    # cancel while the commit waited for a thread left its pages held by no session).
                    commit = asyncio.ensure_future(self.ctx.blocking(caller.tenant, self.ctx.store.commit_put, write))
                    commit.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen, however it ends
                    write = None
                    return info_to_pb(await asyncio.shield(commit))
            finally:
                if write is not None:  # failed or cancelled before its commit: every byte goes back, first
                    self.ctx.store.abort_write(write)
        except Exception as exc:
            await call.fail(context, exc)
        finally:
            call.count(None)

    async def _open_reader(self, tenant: str, key: SessionKey, chunk: int) -> tuple[SessionInfo, SnapshotReader]:
        """store.get on the loop; where the store has a remote tier, on an RPC
        thread (it asks the remote tier first, and may fetch). A reader opened
        for a call that left meanwhile is closed."""
        if not self.ctx.store.reaches_remote:
            return self.ctx.store.get(key, chunk)
        job = await self.ctx.limits.submit(tenant, self.ctx.executor, self.ctx.store.get, key, chunk)
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            job.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and f.result()[1].close())
            raise

    async def Get(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        call = Call(self.ctx.metrics, "Get")
        reader: SnapshotReader | None = None
        batch = None  # the RPC thread's work on the reader, while it runs
        try:
            try:
                caller = CALLER.get()
                req = parse(pb.GetRequest, raw)
                key = make_key(caller.tenant, req.session_id)
                with self.ctx.limits.stream(caller.tenant):
                    # From 4 KiB (1-byte chunks made a batch of 8 million messages) to 4 MiB (or the
                    # configured default): gRPC holds a few per open stream.
                    chunk = min(max(req.chunk_bytes or self.ctx.chunk_bytes, MIN_GET_CHUNK),
                                max(self.ctx.chunk_bytes, MAX_GET_CHUNK))
                    info, reader = await self._open_reader(caller.tenant, key, chunk)
                    with self.ctx.inflight.hold(key.tenant, info.size_bytes):
                        # Get's messages go out already serialized (see add_to_server), one copy each.
                        await self.ctx.write(context, pb.GetResponse(header=info_to_pb(info)).SerializeToString())
                        if info.tier is not None and kind_of(info.tier).medium == MEMORY and \
                                info.tier not in info.codecs:
                            # In memory as it is: ~0.1 ms per MiB on the loop itself. A thread hop per batch
                            # measured half the throughput, the two threads taking turns on the GIL. (Pages
                            # coded there are decoded on the RPC threads, as disk pages are read.)
                            for data in reader:
                                await self.ctx.write(context, chunk_message(data, reader.digest))
                        else:
                            while True:
                                batch = await self.ctx.limits.submit(caller.tenant, self.ctx.executor, _next_chunks, reader)
                                messages = await asyncio.wrap_future(batch)
                                batch = None
                                if not messages:
                                    break
                                for message in messages:
                                    await self.ctx.write(context, message)
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
