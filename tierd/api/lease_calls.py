"""Leases and lookup: BeginSave, CommitSave, AbortSave, BeginRestore,
EndRestore, Lookup. Their work runs on the RPC threads."""

from __future__ import annotations

from typing import Any

from tierd.api.auth import Caller
from tierd.api.context import CallContext, token_ids
from tierd.api.gate import unary
from tierd.core.store import DEFAULT_LEASE_SECONDS, make_key
from tierd.layout import KVSpec
from tierd.types import SessionKey
from tierd.v1 import tierd_pb2 as pb
from tierd.wire import packed
from tierd.wire.convert import info_to_pb, lease_to_pb, lookup_to_pb, optional_spec_from_pb, spec_from_pb


class LeaseCalls:
    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx

    @unary(blocking=True, undo=lambda self, caller, lease: self.ctx.store.abort_save(caller.tenant, lease.lease_id))
    def BeginSave(self, req: Any, caller: Caller) -> pb.Lease:
        lease = self.ctx.store.begin_save(make_key(caller.tenant, req.session_id), spec_from_pb(req.spec), req.num_tokens,
                                      req.start_token, token_ids(req.id_field("token_ids"), want=req.num_tokens),
                                      req.priority if req.HasField("priority") else None,
                                      req.ttl_seconds or DEFAULT_LEASE_SECONDS, req.cache_salt,
                                      req.lossy_max_error if req.HasField("lossy_max_error") else None, req.size)
        return lease_to_pb(lease)

    @unary(blocking=True)
    def CommitSave(self, req: Any, caller: Caller) -> pb.SessionInfo:
        return info_to_pb(self.ctx.store.commit_save(caller.tenant, req.lease_id))

    @unary(blocking=True)
    def AbortSave(self, req: Any, caller: Caller) -> pb.Empty:
        self.ctx.store.abort_save(caller.tenant, req.lease_id)
        return pb.Empty()

    @unary(blocking=True, undo=lambda self, caller, lease: self.ctx.store.end_restore(caller.tenant, lease.lease_id))
    def BeginRestore(self, req: Any, caller: Caller) -> pb.Lease:
        key = make_key(caller.tenant, req.session_id)
        raw = req.id_field("token_ids")
        spec = optional_spec_from_pb(req)
        prompt = token_ids(raw, limit=self._prompt_limit(key, spec)) if raw else None
        lease = self.ctx.store.begin_restore(key, spec, req.num_pages, req.ttl_seconds or DEFAULT_LEASE_SECONDS, prompt,
                                             req.cache_salt)
        return lease_to_pb(lease)

    @unary(blocking=True)
    def EndRestore(self, req: Any, caller: Caller) -> pb.Empty:
        self.ctx.store.end_restore(caller.tenant, req.lease_id)
        return pb.Empty()

    @unary(blocking=True)
    def Lookup(self, req: Any, caller: Caller) -> pb.LookupResponse:
        key = make_key(caller.tenant, req.session_id)
        spec = optional_spec_from_pb(req)
        prompt = packed.decode(req.id_field("token_ids"), limit=self._prompt_limit(key, spec))
        return lookup_to_pb(self.ctx.store.lookup(key, prompt, spec, req.cache_salt,
                                                  req.max_error if req.HasField("max_error") else None))

    def _prompt_limit(self, key: SessionKey, spec: KVSpec | None) -> int:
        """How many of a prompt's ids can match (the rest stay undecoded):
        without a spec only the snapshot's own pages answer (NOT_FOUND if
        there is none); with one, the tenant's shared pages may answer too,
        as far as the most tokens one of its sessions holds."""
        return self.ctx.store.prompt_limit(key) if spec is not None else self.ctx.store.own_tokens(key)
