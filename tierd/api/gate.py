"""The gate every call passes, and the plumbing of a call, for the servicer.

Runs on the daemon's event loop. gated() wraps each tierd.v1.Tierd method:
as the call starts, before any message is read, its token is checked from
its metadata (a call without a valid one is refused at once, holding
nothing) and the call counts against its tenant's open calls; a call of one
message must send it within the idle deadline. unary() turns a method of
the servicer into a timed handler that parses its own request (parse(): a
malformed one is INVALID_ARGUMENT, never INTERNAL) and runs it on the RPC
threads when it blocks. Call times a call and counts its outcome once;
abort() turns a TierdError into its one gRPC status. OpenServices bounds
health and reflection, which answer without a token.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc._cython import cygrpc

from tierd.api.auth import Caller
from tierd.errors import DeadlineExceeded, InvalidArgument, TierdError
from tierd.metrics import Metrics
from tierd.v1 import tierd_pb2 as pb
from tierd.wire import packed
from tierd.wire.status import ERROR_KEY, status_of

log = logging.getLogger("tierd.api")

CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("caller")  # set by the gate, for the handler

SERVICE = pb.DESCRIPTOR.services_by_name["Tierd"]
# Requests without long id lists (packed.FIELDS) are small: a RegisterEngine of
# 4,096 regions and segments is about 150 KiB. Past this, one is refused before
# protobuf parses it on the loop (60 MB of empty segments: 4 s, 1.7 GB).
SMALL_REQUEST = 1 << 20
LATE_SECONDS = 0.01  # a call that made something (a lease, an engine) with less time left takes it back


class ClientGone(Exception):
    """A message could not be sent or read: the client has left the call."""


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, TierdError):
        context.set_trailing_metadata(((ERROR_KEY, type(exc).__name__),))
        await context.abort(status_of(exc), exc.message)
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log")


class Call:
    """Times one call and counts its outcome once. A failure is counted before
    the caller hears of it, so a scrape right after an error sees the error."""

    def __init__(self, metrics: Metrics, method: str) -> None:
        self.metrics, self.method, self.t0, self.counted = metrics, method, time.perf_counter(), False
        metrics.rpc_started(method)

    def count(self, code: str | None) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.rpc(self.method, time.perf_counter() - self.t0, code)

    async def fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, ClientGone) or context.cancelled() or context.done():
            # The client left (or the call is over): nobody to tell, nothing the daemon did wrong.
            # Ended as a cancelled call: gRPC then sends nothing (a response would be serialized).
            self.count("CANCELLED")
            log.debug("%s: the client went away (%s)", self.method, type(exc).__name__)
            raise asyncio.CancelledError()
        self.count(exc.code if isinstance(exc, TierdError) else "INTERNAL")
        await abort(context, exc)


def parse(cls: type, raw: bytes | memoryview) -> packed.Request:
    """A request message from its bytes, its long id fields apart
    (wire/packed.py); InvalidArgument (logged in one line) when it is not one."""
    try:
        return packed.parse(cls, raw)
    except DecodeError as exc:
        log.info("%s: a malformed request was refused (%s)", cls.DESCRIPTOR.name, exc)
        raise InvalidArgument(f"the request is not a valid {cls.DESCRIPTOR.name} message "
                              "(malformed protobuf, or a string that is not UTF-8)") from None


def unary(blocking: bool = False, remote: bool = False,
          undo: Callable[[Any, Caller, Any], None] | None = None) -> Callable:
    """Wrap fn(self, request, caller) -> response as a timed async handler that
    parses the request (the gate has checked the caller); blocking ones run on
    the RPC threads, and so do those that ask the remote tier (remote) where
    the store has one (known when it is built). If the call is cancelled while fn runs, or ends without
    its answer reaching the client (its deadline passed as the answer went
    out), undo(self, caller, response) takes back what fn made for a client
    that will never hear of it (on an RPC thread)."""

    def wrap(fn: Callable) -> Callable:
        cls = getattr(pb, SERVICE.methods_by_name[fn.__name__].input_type.name)

        @functools.wraps(fn)
        async def handler(self: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            call = Call(self.ctx.metrics, fn.__name__)
            try:
                caller = CALLER.get()
                req = parse(cls, raw)
                if blocking or remote and self.ctx.store.reaches_remote:
                    take_back = undo and functools.partial(undo, self, caller)
                    response = await self.ctx.blocking(caller.tenant, fn, self, req, caller, undo=take_back)
                    if take_back is not None:
                        left = context.time_remaining()
                        if left is not None and left < LATE_SECONDS:
                            # The client gives up before (or as) the answer reaches it, yet the
                            # call would end well on this side: nobody would end what it made.
                            self.ctx.executor.submit(_take_back, take_back, response)
                            raise DeadlineExceeded(f"the {fn.__name__} call's deadline passed as it was answered; "
                                                   "what it made is taken back")
                        context.add_done_callback(
                            lambda done: done.cancelled() and self.ctx.executor.submit(_take_back, take_back, response))
                    return response
                return fn(self, req, caller)
            except Exception as exc:
                await call.fail(context, exc)
            finally:
                call.count(None)

        return handler

    return wrap


def _take_back(undo: Callable[[Any], None], response: Any) -> None:
    try:
        undo(response)
    except TierdError:
        pass  # ended some other way meanwhile (expired, say)


async def within(op: Any, seconds: float, stalled: str) -> Any:
    """A call's read or write, ended when the client makes no progress for
    `seconds`. Not wait_for: that waits for the cancelled operation to
    finish, which a stalled client never lets happen."""
    task = asyncio.ensure_future(op)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen, however the call ends
    done, _ = await asyncio.wait((task,), timeout=seconds)
    if not done:
        task.cancel()
        raise DeadlineExceeded(f"{stalled} for {seconds:g} s")
    try:
        return task.result()
    except cygrpc.BaseError as exc:  # the call is over on gRPC's side
        raise ClientGone() from exc


def request_limit(method: Any) -> int | None:
    """The most bytes a request of this method may have (None: the server's message limit)."""
    return None if method.input_type.name in packed.FIELDS or method.client_streaming else SMALL_REQUEST


def gated(ctx: Any, fn: Callable, read: bool, limit: int | None = None) -> Callable:
    """fn as the call's behavior, behind a gate that runs as the call starts,
    before any message is read: the caller's token is checked (a call
    without a valid one is refused at once, holding nothing) and the call is
    counted against its tenant's open calls; then the request message (for
    calls of one message) must arrive within the idle deadline. Unary calls
    are served as request streams for this: gRPC would otherwise hold the
    call, and one of its --max-concurrent-rpcs, until the message came."""

    async def behavior(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            caller = ctx.auth.identify(context.invocation_metadata())
            CALLER.set(caller)
            with ctx.limits.call(caller.tenant):
                if not read:
                    return await fn(request_iterator, context)
                raw = await ctx.read(context, f"the {fn.__name__} call")
                if raw is grpc.aio.EOF:
                    raise InvalidArgument(f"the {fn.__name__} call carried no request")
                if limit is not None and len(raw) > limit:
                    raise InvalidArgument(f"a {fn.__name__} request is at most {limit} bytes, not {len(raw)}")
                return await fn(raw, context)
        except grpc.aio.AbortError:
            raise  # fn has told the client already
        except Exception as exc:
            await Call(ctx.metrics, fn.__name__).fail(context, exc)

    return behavior


class OpenServices(grpc.aio.ServerInterceptor):
    """Health and reflection answer anyone, token or not: at most `limit` of
    their calls run at once, whoever makes them, and a call of one request
    must send it within the idle deadline. (Unbounded, calls that sent
    nothing held every one of --max-concurrent-rpcs.) The Tierd service's
    calls pass through: its own gate bounds them (gated)."""

    def __init__(self, limit: int, idle_seconds: float) -> None:
        self.limit, self.idle_seconds, self.open = limit, idle_seconds, 0

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{SERVICE.full_name}/"):
            return handler
        inner = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary

        async def behavior(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.open >= self.limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health and reflection calls")
            self.open += 1
            try:
                request = request_iterator
                if not handler.request_streaming:
                    raw = await within(context.read(), self.idle_seconds, f"the {details.method} call sent nothing")
                    if raw is grpc.aio.EOF:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
                    request = handler.request_deserializer(raw)
                result = inner(request, context)
                if inspect.isasyncgen(result):  # responses yielded: sent one by one
                    async for response in result:
                        await context.write(response)
                    return None
                return await result
            except DeadlineExceeded as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, exc.message)
            finally:
                self.open -= 1

        # A request stream keeps its deserializer; a single request is read raw, then deserialized above.
        deserializer = handler.request_deserializer if handler.request_streaming else None
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(behavior, deserializer, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(behavior, deserializer, handler.response_serializer)


class _ClientLeft(logging.Filter):
    """gRPC logs a call whose status it could not send, after the handler
    returned, at ERROR with a traceback: the client had gone (its deadline
    passed, or it hung up). Nothing the daemon did wrong: one line at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("ExecuteBatchError raised in core"):
            log.debug("%s: the client went away", record.getMessage())
            return False
        return True


_CLIENT_LEFT = _ClientLeft()


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register the servicer's handlers, each behind its gate (gated). Every
    request reaches its handler as the bytes received (parsed there), and
    Get's responses are sent as the bytes the handler built (tierd.wire.chunks)."""
    logging.getLogger("grpc._cython.cygrpc").addFilter(_CLIENT_LEFT)  # (once: filters are a set)
    handlers = {}
    for method in SERVICE.methods:
        fn = getattr(servicer, method.name)
        behavior = gated(servicer.ctx, fn, read=not method.client_streaming, limit=request_limit(method))
        if method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behavior, None, None)
        else:
            out = getattr(pb, method.output_type.name).SerializeToString
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(behavior, None, out)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
