"""What every call group of the servicer shares (api/servicer.py): the
store and the engines, the RPC threads and the tenants' limits on them, the
bytes in flight, the caller's identity, and the stream helpers that end a
call whose client makes no progress. Runs on the daemon's event loop; the
calls' blocking work goes to the RPC threads through blocking()."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import grpc
import numpy as np

from tierd.api.auth import Authenticator
from tierd.api.gate import within
from tierd.api.inflight import InflightBytes
from tierd.api.intake import FdIntake
from tierd.api.limits import TenantLimits
from tierd.core.engines import EngineRegistry
from tierd.core.store import Store
from tierd.errors import InvalidArgument, TierdError
from tierd.metrics import Metrics
from tierd.wire import packed


class Changes:
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


class CallContext:
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
        self.changes = Changes()
        store.subscribe(self.changes.notify)

    async def blocking(self, tenant: str, fn: Callable, *args: Any, undo: Callable[[Any], None] | None = None) -> Any:
        """fn(*args) on an RPC thread, once one of the tenant's slots is free.
        If the call is cancelled while fn runs, fn still finishes; `undo`
        then gets its result (a write nobody will commit, say)."""
        job = await self.limits.submit(tenant, self.executor, self._one_read, fn, *args)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if undo is not None:
                job.add_done_callback(functools.partial(_undo, undo))
            raise

    def _one_read(self, fn: Callable, *args: Any) -> Any:
        """fn(*args), reading each session's remote manifest once at most."""
        with self.store.one_read():
            return fn(*args)

    async def read(self, context: grpc.aio.ServicerContext, what: str = "the Put stream") -> Any:
        """The call's next message (raw bytes, or EOF), within the idle deadline."""
        return await self.within(context.read(), f"{what} sent nothing")

    async def write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        """Send one message, within the idle deadline (the client must keep reading)."""
        await self.within(context.write(message), "the Get stream's reader took nothing")

    async def within(self, op: Any, stalled: str) -> Any:
        return await within(op, self.idle_seconds, stalled)


def _undo(undo: Callable[[Any], None], job: Any) -> None:
    """Take back what a cancelled call's job made, once it is done (on the job's thread)."""
    if job.cancelled() or job.exception() is not None:
        return
    try:
        undo(job.result())
    except TierdError:
        pass  # ended some other way meanwhile (expired, say)


def token_ids(raw: memoryview, want: int | None = None, limit: int | None = None,
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


def block_ids(raw: memoryview, num_blocks: int) -> np.ndarray:
    """A packed block_ids field; more ids than the engine has blocks are refused before decoding."""
    if (got := packed.count(raw)) > num_blocks:
        raise InvalidArgument(f"{got} block ids for an engine of {num_blocks} blocks", field="block_ids")
    return packed.decode(raw, "block_ids")


