"""The calls, in the caller's process. Every unary call is written once, in
Calls, and returns whatever the client's _call returns: a value for Client,
an awaitable for AsyncClient (client/clients.py); an engine's Save and
Restore likewise, in EngineCalls. Put's messages and both byte streams are
built here for both clients."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tierd.client.channel import pb
from tierd.client.regions import as_bytes, engine_regions
from tierd.errors import InvalidArgument, shown
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
from tierd.wire.chunks import (
    GET_METHOD,
    PUT_METHOD,
    chunk_message,
)
from tierd.wire.convert import (
    info_from_pb,
    lease_from_pb,
    lookup_from_pb,
    optional_spec_to_pb,
    spec_to_pb,
)


def put_messages(session_id: str, data: Any, spec: KVSpec, num_tokens: int, chunk: int,
                  priority: int | None, start_token: int, token_ids: Any,
                  cache_salt: str = "", lossy_max_error: float | None = None) -> Iterator[pb.PutRequest | bytes]:
    """The header message, then the chunks in wire format (see tierd.wire.chunks).
    The arguments are checked and the header built before the stream starts:
    gRPC reports an error raised while it iterates the requests only as
    "Exception iterating requests!" (the async client, as a cancellation)."""
    view = as_bytes(data)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise InvalidArgument(f"chunk_bytes must be a positive integer, got {shown(chunk)}", field="chunk_bytes")
    header = pb.PutRequest(header=pb.PutHeader(session_id=session_id, spec=spec_to_pb(spec), num_tokens=num_tokens,
                                               size=len(view), priority=priority, start_token=start_token,
                                               token_ids=_ids(token_ids), cache_salt=cache_salt,
                                               lossy_max_error=lossy_max_error))
    return itertools.chain([header], (chunk_message(view[i : i + chunk]) for i in range(0, len(view), chunk)))


def _serialize(msg: pb.PutRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def byte_streams(channel: Any) -> tuple[Any, Any]:
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
    return RestoreResult(r.num_tokens, r.num_pages, r.source_tier, r.seconds, r.nbytes, r.rel_error)


def _stats(r: pb.StatsResponse) -> dict[str, Any]:
    return {
        "tiers": [TierStats(t.name, t.budget, t.used, t.capacity, t.sessions, t.backend, t.saved) for t in r.tiers],
        "bandwidth": dict(r.bandwidth), "moved_bytes": dict(r.moved_bytes), "copy_ops": r.copy_ops,
        "version": r.version, "backends": dict(r.backends), "sessions": r.sessions,
    }


def _list(r: pb.ListResponse) -> tuple[list[SessionInfo], str]:
    return [info_from_pb(i) for i in r.sessions], r.next_page_token


class Calls:
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

    def lookup(self, session_id: str, token_ids: Any, spec: KVSpec | None = None,
               cache_salt: str = "", max_error: float | None = None) -> LookupResult:
        """How many leading tokens of a prompt (its token ids, under its cache
        salt) the session's snapshot supplies; with spec, another identity is
        FAILED_PRECONDITION, and where the session does not exist (or its
        pages are a prefix of the prompt, fewer than other sessions of the
        tenant hold), their pages answer (begin_restore with the same token
        ids starts the session from them). With max_error, only the leading
        pages within that relative L2 error count (0: only exact pages: a
        page restored from a copy coded lossily carries its error)."""
        req = pb.LookupRequest(session_id=session_id, token_ids=_ids(token_ids),
                               spec=optional_spec_to_pb(spec), cache_salt=cache_salt, max_error=max_error)
        return self._call("Lookup", req, lookup_from_pb)

    def begin_save(self, session_id: str, spec: KVSpec, num_tokens: int, start_token: int = 0,
                   token_ids: Any = None, priority: int | None = None, ttl: float = 0.0,
                   cache_salt: str = "", lossy_max_error: float | None = None, size: int = 0) -> Lease:
        """Slots in the host arena for the pages of tokens [start_token,
        num_tokens): write them (Arena.runs), then commit_save or abort_save.
        token_ids, the ids of tokens [0, num_tokens), make the pages findable
        by lookup(); leading pages the tenant holds already (same tokens and
        cache salt) are not leased: the lease starts at its first_page.
        For an opaque spec, `size` bytes, its pages back to back in one run
        (lease.nbytes). lossy_max_error: as in EngineHandle.save."""
        req = pb.BeginSaveRequest(session_id=session_id, spec=spec_to_pb(spec), num_tokens=num_tokens,
                                  start_token=start_token, token_ids=_ids(token_ids), priority=priority,
                                  ttl_seconds=ttl, cache_salt=cache_salt, lossy_max_error=lossy_max_error,
                                  size=size)
        return self._call("BeginSave", req, lease_from_pb)

    def commit_save(self, lease: Lease | str) -> SessionInfo:
        """Commit the pages written into a save lease."""
        return self._call("CommitSave", _lease(lease), info_from_pb)

    def abort_save(self, lease: Lease | str) -> None:
        return self._call("AbortSave", _lease(lease), lambda r: None)

    def begin_restore(self, session_id: str, spec: KVSpec | None = None, num_pages: int = 0,
                      ttl: float = 0.0, token_ids: Any = None, cache_salt: str = "") -> Lease:
        """The first num_pages pages (0: all), brought to the host arena and
        held there: read them (Arena.runs), then end_restore. With token_ids
        (the prompt), pages holding other tokens are FAILED_PRECONDITION; with
        spec too, a session that does not exist starts from pages other
        sessions of the tenant hold, as lookup() answered."""
        req = pb.BeginRestoreRequest(session_id=session_id, spec=optional_spec_to_pb(spec),
                                     num_pages=num_pages, ttl_seconds=ttl, token_ids=_ids(token_ids),
                                     cache_salt=cache_salt)
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

    def advise(self, session_id: str, prefill_tokens_per_s: float, max_error: float | None = None) -> Advice:
        """Whether restoring beats recomputing the session's tokens (with
        max_error: those of its leading pages within that relative error)."""
        req = pb.AdviseRequest(session_id=session_id, prefill_tokens_per_s=prefill_tokens_per_s,
                               max_error=max_error)
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
        msgs, cache_layout, gpu, ticket = engine_regions(regions, self.address, self._metadata)
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


class EngineCalls:
    """Save and restore through registered engine memory (no KV bytes in messages)."""

    def __init__(self, client: Any, engine_id: str, spec: KVSpec) -> None:
        self.client = client
        self.engine_id = engine_id
        self.spec = spec

    def save(self, session_id: str, block_ids: Any, num_tokens: int, start_token: int = 0,
             tier: str = "", priority: int | None = None, token_ids: Any = None,
             cache_salt: str = "", lossy_max_error: float | None = None) -> SessionInfo:
        """Gather the blocks holding tokens [start_token, num_tokens) into the session.
        `priority` weighs eviction: each step counts as a minute of recency;
        `token_ids` (of tokens [0, num_tokens)) lets lookup() match later prompts
        (under `cache_salt`), and pages the tenant holds already are not stored again.
        `lossy_max_error` consents to a tier's lossy codec (`--codec host=fp8`,
        `remote=int8`, ...) for this session, each page within that relative
        error (at most the daemon's --lossy-max-error; 0: lossless only); None
        leaves the session's choice as it is (a new one: its tenant's)."""
        req = pb.SaveRequest(engine_id=self.engine_id, session_id=session_id, block_ids=[int(b) for b in block_ids],
                             num_tokens=num_tokens, start_token=start_token, tier=tier, priority=priority,
                             token_ids=_ids(token_ids), cache_salt=cache_salt, lossy_max_error=lossy_max_error)
        return self.client._call("Save", req, info_from_pb)

    def restore(self, session_id: str, block_ids: Any, token_ids: Any = None, cache_salt: str = "",
                whole: bool = False) -> RestoreResult:
        """Scatter the session's first len(block_ids) pages into these blocks
        (with whole, every page of it, into the first of them).
        With token_ids (the prompt, under its cache salt), pages holding other
        tokens are FAILED_PRECONDITION, and a session that does not exist
        starts from pages other sessions of the tenant hold (as lookup() says)."""
        req = pb.RestoreRequest(engine_id=self.engine_id, session_id=session_id, block_ids=[int(b) for b in block_ids],
                                token_ids=_ids(token_ids), cache_salt=cache_salt, whole=whole)
        return self.client._call("Restore", req, _restore)

    def close(self) -> Any:
        return self.client._call("UnregisterEngine", pb.EngineRequest(engine_id=self.engine_id), lambda r: None)


class Engine(EngineCalls):
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine(EngineCalls):
    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
