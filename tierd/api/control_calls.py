"""Lifecycle, inspection and control: Prefetch, WaitReady (it waits on the
loop, woken by the store's changes), Release, Pin, Unpin, Drop, Stat, List,
Stats, SetBudget, Advise."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from tierd import __version__
from tierd.api.auth import Caller
from tierd.api.context import CallContext
from tierd.api.gate import CALLER, Call, parse, unary
from tierd.core.store import make_key
from tierd.errors import InvalidArgument
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.convert import info_to_pb

MAX_WAIT_SECONDS = 600.0


class ControlCalls:
    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx

    @unary(remote=True)
    def Prefetch(self, req: Any, caller: Caller) -> pb.PrefetchResponse:
        key = make_key(caller.tenant, req.session_id)
        if req.deadline_seconds < 0:
            raise InvalidArgument("deadline_seconds must not be negative", field="deadline_seconds")
        deadline = self.ctx.store.clock.now() + req.deadline_seconds if req.deadline_seconds else None
        status = self.ctx.store.prefetch(key, req.tier or None, req.priority, deadline)
        return pb.PrefetchResponse(status=status)

    async def WaitReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.WaitReadyResponse:
        """Waits on the loop, woken by the store's changes: no thread is held."""
        call = Call(self.ctx.metrics, "WaitReady")
        try:
            caller = CALLER.get()
            req = parse(pb.WaitReadyRequest, raw)
            key = make_key(caller.tenant, req.session_id)
            if not 0 <= req.timeout_seconds <= MAX_WAIT_SECONDS:
                raise InvalidArgument(f"timeout_seconds must be 0 to {MAX_WAIT_SECONDS:.0f}", field="timeout_seconds")
            loop = asyncio.get_running_loop()
            end = loop.time() + req.timeout_seconds
            while True:
                changed = self.ctx.changes.future()  # taken before the check: a change after it wakes this call
                ready, tier = self.ctx.store.ready(key, req.tier or None)
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
        return info_to_pb(self.ctx.store.release(make_key(caller.tenant, req.session_id)))

    @unary()
    def Pin(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.ctx.store.pin(make_key(caller.tenant, req.session_id)))

    @unary()
    def Unpin(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.ctx.store.unpin(make_key(caller.tenant, req.session_id)))

    @unary(blocking=True)
    def Drop(self, req: Any, caller: Caller) -> pb.Empty:
        self.ctx.store.drop(make_key(caller.tenant, req.session_id))
        return pb.Empty()

    @unary(remote=True)
    def Stat(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.ctx.store.stat(make_key(caller.tenant, req.session_id)))

    @unary(blocking=True)  # sorts the tenant's sessions: O(sessions log sessions), off the event loop
    def List(self, req: Any, caller: Caller) -> pb.ListResponse:
        if req.all_tenants:
            caller.require_admin("listing every tenant's sessions")
        page, token = self.ctx.store.list(None if req.all_tenants else caller.tenant, after=req.page_token,
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
                              backend=t.backend, saved=t.saved) for t in self.ctx.store.stats(tenant)]
        reply = pb.StatsResponse(tiers=tiers, version=__version__, backends=self.ctx.backends,
                                 sessions=self.ctx.store.count(tenant))
        if tenant is None:
            copier = self.ctx.store.copier
            reply.bandwidth.update(copier.bandwidth)
            reply.moved_bytes.update(copier.moved_bytes)
            reply.copy_ops = copier.copy_ops
        return reply

    @unary(blocking=True)
    def SetBudget(self, req: Any, caller: Caller) -> pb.SetBudgetResponse:
        caller.require_admin("changing a budget")
        r = self.ctx.store.set_budget(req.tier, req.budget)
        return pb.SetBudgetResponse(tier=r.tier, old_budget=r.old_budget, new_budget=r.new_budget,
                                    released_bytes=r.released_bytes, moved_sessions=r.moved_sessions,
                                    seconds=r.seconds)

    @unary()
    def Advise(self, req: Any, caller: Caller) -> pb.AdviseResponse:
        a = self.ctx.store.advise(make_key(caller.tenant, req.session_id), req.prefill_tokens_per_s,
                                  req.max_error if req.HasField("max_error") else None)
        return pb.AdviseResponse(restore=a.restore, restore_seconds=a.restore_seconds,
                                 recompute_seconds=a.recompute_seconds, source_tier=a.source_tier,
                                 bandwidth_bytes_per_s=a.bandwidth_bytes_per_s)
