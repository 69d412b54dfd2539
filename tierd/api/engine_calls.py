"""The engine's calls: RegisterEngine (its memory, by descriptors handed
over or CUDA IPC handles), UnregisterEngine, and Save and Restore through
that memory. Their work runs on the RPC threads."""

from __future__ import annotations

from typing import Any

from tierd.api.auth import Caller
from tierd.api.context import CallContext, block_ids, token_ids
from tierd.api.gate import unary
from tierd.core.cuda_ipc import IpcRegion
from tierd.core.store import make_key
from tierd.errors import FailedPrecondition, InvalidArgument
from tierd.layout import EngineLayout, Segment
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.convert import info_to_pb, spec_from_pb


class EngineCalls:
    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx

    @unary(blocking=True, undo=lambda self, caller, r: self.ctx.engines.unregister(caller.tenant, r.engine_id))
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
            engine = self.ctx.engines.register(caller.tenant, spec, regions, layout, req.pid)
            return pb.RegisterEngineResponse(engine_id=engine.engine_id)
        if kinds != {"shm_fd"}:
            raise InvalidArgument("an engine's regions are all shared memory or all CUDA IPC", field="regions")
        if self.ctx.fds is None:
            raise FailedPrecondition("this daemon takes no shared memory: it listens on no Unix socket",
                                     field="regions")
        ticket = self.ctx.fds.take(caller.tenant, req.fd_ticket)
        try:
            fds = ticket.fds
            for r in req.regions:
                if r.shm_fd >= len(fds):
                    raise InvalidArgument(f"region names descriptor {r.shm_fd}; the ticket holds {len(fds)}",
                                          field="regions")
            regions = [(fds[r.shm_fd], r.size) for r in req.regions]
            engine = self.ctx.engines.register(caller.tenant, spec, regions, layout, req.pid)
        finally:
            ticket.close()  # mapped now (or refused): the descriptors are not needed
        return pb.RegisterEngineResponse(engine_id=engine.engine_id)

    @unary(blocking=True)
    def UnregisterEngine(self, req: Any, caller: Caller) -> pb.Empty:
        self.ctx.engines.unregister(caller.tenant, req.engine_id)
        return pb.Empty()

    @unary(blocking=True)
    def Save(self, req: Any, caller: Caller) -> pb.SessionInfo:
        key = make_key(caller.tenant, req.session_id)
        with self.ctx.engines.use(caller.tenant, req.engine_id) as engine:
            ids = block_ids(req.id_field("block_ids"), engine.memory.layout.num_blocks)
            with self.ctx.inflight.hold(caller.tenant, ids.size * engine.spec.page_bytes):
                info = self.ctx.store.save(key, engine.memory, engine.spec, ids, req.num_tokens, req.start_token,
                                           req.tier or None, req.priority if req.HasField("priority") else None,
                                           token_ids(req.id_field("token_ids"), want=req.num_tokens), req.cache_salt,
                                           req.lossy_max_error if req.HasField("lossy_max_error") else None)
        return info_to_pb(info)

    @unary(blocking=True)
    def Restore(self, req: Any, caller: Caller) -> pb.RestoreResponse:
        key = make_key(caller.tenant, req.session_id)
        with self.ctx.engines.use(caller.tenant, req.engine_id) as engine:
            ids = block_ids(req.id_field("block_ids"), engine.memory.layout.num_blocks)
            raw = req.id_field("token_ids")  # no more of the prompt than the pages restored hold can matter
            prompt = token_ids(raw, limit=int(ids.size) * engine.spec.block_tokens) if raw else None
            with self.ctx.inflight.hold(caller.tenant, ids.size * engine.spec.page_bytes):
                r = self.ctx.store.restore(key, engine.memory, engine.spec, ids, prompt, req.cache_salt, req.whole)
        return pb.RestoreResponse(num_tokens=r.num_tokens, num_pages=r.num_pages, source_tier=r.source_tier,
                                  seconds=r.seconds, nbytes=r.nbytes, rel_error=r.rel_error)


def _layout(req: Any, spec: Any) -> EngineLayout:
    if req.segments:
        return EngineLayout(req.num_blocks, tuple(Segment(s.region, s.offset, s.stride, s.nbytes) for s in req.segments))
    if len(req.regions) == 1:
        return EngineLayout.cross_layer(spec, req.num_blocks)
    if len(req.regions) == 2 * spec.num_layers and not spec.is_opaque:
        return EngineLayout.layer_major(spec, req.num_blocks)
    raise InvalidArgument(f"give segments, or 1 region (cross-layer) or {2 * spec.num_layers} regions "
                          f"(K and V per layer); got {len(req.regions)} regions", field="segments")
