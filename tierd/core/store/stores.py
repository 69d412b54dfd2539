"""The calls that store: Save (engine blocks gathered into pages, on an
RPC thread) and Put (a byte stream: begin_put, its chunks written on the
event loop with no lock held, commit_put). Each checks its arguments and
goes through the one write path (writes.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from tierd.core.roles import TierRoles
from tierd.core.store.checks import (check_blocks, check_blocks_range, check_lossy, check_opaque_size, check_priority,
                                     check_start, check_token_count, token_hashes)
from tierd.core.store.pending import PendingWrite
from tierd.core.store.writes import Writer
from tierd.errors import InvalidArgument, ResourceExhausted, shown
from tierd.layout import KVSpec
from tierd.tiers import MEMORY, tier_order
from tierd.transfer.copier import CopyEngine, EngineMemory
from tierd.transfer.runs import Geometry
from tierd.types import SessionInfo, SessionKey


class Saves:
    def __init__(self, writer: Writer, copier: CopyEngine, tiers: dict, roles: TierRoles) -> None:
        self.writer = writer
        self.copier = copier
        self.tiers = tiers
        self.roles = roles

    def landing(self, engine: EngineMemory | None) -> str:
        """Where a save's pages land by default: the engine landing tier (VRAM)
        for engines in device memory, where there is one, else the landing
        tier (the host arena)."""
        return self.roles.saves_land(engine is not None and engine.on_device)

    def save(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
             num_tokens: int, start_token: int = 0, tier: str | None = None,
             priority: int | None = None, token_ids: Iterable[int] | None = None, salt: str = "",
             lossy: float | None = None) -> SessionInfo:
        """Gather engine blocks holding tokens [start_token, num_tokens) into the
        session's snapshot, replacing what it held from start_token on. The new
        pages land in `tier` (default: device for GPU engines, else host);
        `priority` sets the session's eviction weight; `token_ids` (the ids of
        tokens [0, num_tokens)) lets lookup() match later prompts against the
        pages (under the cache `salt`), refuses an append onto pages that hold
        other tokens, and takes pages the tenant holds already from them
        instead of copying them again (sharing.py). `lossy` consents to a
        tier's lossy codec for the session, each page within that error (0:
        lossless only; None: as before, for a new session its tenant's)."""
        check_priority(priority)
        check_lossy(lossy, spec)
        if tier is not None and (tier not in self.tiers or self.tiers[tier].medium != MEMORY):
            targets = ", ".join(repr(t) for t in tier_order(self.tiers) if self.tiers[t].medium == MEMORY)
            raise InvalidArgument(f"a save lands in a memory tier of this machine ({targets}), not {shown(tier)}",
                                  field="tier")
        first_page = check_blocks_range(spec, start_token, num_tokens)
        ids = check_blocks(block_ids, engine.layout.num_blocks)
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        n_pages = spec.pages_for_tokens(num_tokens)
        if ids.size != n_pages - first_page:
            raise InvalidArgument(
                f"tokens [{start_token}, {num_tokens}) fill {n_pages - first_page} blocks of {spec.block_tokens}, "
                f"but {ids.size} block ids were given", field="block_ids", want=n_pages - first_page, got=int(ids.size))
        geom = Geometry(spec.page_bytes, n_pages, spec.page_bytes)
        w = self.writer.begin_write(key, spec, tier or self.landing(engine), first_page, num_tokens,
                              n_pages * spec.page_bytes, geom, tok, priority, lossy=lossy)
        try:
            sums = self.copier.gather(engine, ids[w.write_from - first_page :], w.spans, geom, w.write_from)
        except BaseException:
            self.writer.abort_write(w)
            raise
        return self.writer.commit_write(w, sums)

    def begin_put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
                  priority: int | None = None, start_token: int = 0,
                  token_ids: Iterable[int] | None = None, salt: str = "", lossy: float | None = None) -> PendingWrite:
        """Room for a snapshot sent as bytes: the pages from start_token on (KV
        specs; 0 replaces the whole snapshot), with their token ids (under the
        cache salt) if given. Write the stream into the result (write()), then
        commit_put, or abort_write. No lock is held meanwhile: the stream may
        take its time. Pages the tenant holds already are taken from there:
        their bytes in the stream are read past, not stored. `lossy`: as in save."""
        check_priority(priority)
        check_lossy(lossy, spec)
        first_page = check_start(spec, start_token)
        check_token_count(num_tokens)
        if spec.is_opaque:
            n_pages, last = check_opaque_size(spec, nbytes)
        else:
            if num_tokens <= start_token:
                raise InvalidArgument(f"num_tokens must be above start_token ({start_token})", field="num_tokens")
            n_pages = spec.pages_for_tokens(num_tokens)
            want = (n_pages - first_page) * spec.page_bytes
            if nbytes != want:
                raise InvalidArgument(
                    f"tokens [{start_token}, {num_tokens}) in blocks of {spec.block_tokens} take {want} bytes "
                    f"for this spec, not {nbytes}", field="size", want=want, got=nbytes)
            last = spec.page_bytes
        tok = token_hashes(spec, token_ids, num_tokens, salt)
        tier_budget = self.tiers[self.roles.landing].budget
        if nbytes > tier_budget:
            raise ResourceExhausted(f"{nbytes} bytes do not fit the host tier's budget of {tier_budget} bytes",
                                    need=nbytes, budget=tier_budget)
        geom = Geometry(spec.page_bytes, n_pages, last)
        streaming = (n_pages - first_page) * geom.stride
        self.writer.start_stream(key, streaming)
        try:
            w = self.writer.begin_write(key, spec, self.roles.landing, first_page, num_tokens,
                                  first_page * spec.page_bytes + nbytes, geom, tok, priority, lossy=lossy)
        except BaseException:
            self.writer.stream_ended(key.tenant, streaming)
            raise
        w.streaming = streaming
        w.writer = self.copier.page_writer(w.spans, geom, skip=(w.first_page, w.write_from))
        return w

    def commit_put(self, w: PendingWrite) -> SessionInfo:
        """Commit a Put whose stream has ended: nothing is visible unless
        exactly the announced bytes arrived."""
        assert w.writer is not None
        try:
            if w.writer.received != w.new_bytes:
                raise InvalidArgument(f"the stream carried {w.writer.received} bytes, the header announced "
                                      f"{w.new_bytes}", field="size", want=w.new_bytes, got=w.writer.received)
            sums = self.copier.checksums(w.spans, w.geom)
        except BaseException:
            self.writer.abort_write(w)
            raise
        self.copier.record(f"client->{self.roles.landing}", w.new_bytes, time.perf_counter() - w.started)
        try:
            return self.writer.commit_write(w, sums)
        finally:
            self.writer.end_stream(w)

    def put(self, key: SessionKey, spec: KVSpec, num_tokens: int, nbytes: int,
            chunks: Iterable[bytes | memoryview | np.ndarray], priority: int | None = None,
            start_token: int = 0, token_ids: Iterable[int] | None = None, salt: str = "",
            lossy: float | None = None) -> SessionInfo:
        """begin_put, every chunk written, commit_put: the whole Put in one call."""
        w = self.begin_put(key, spec, num_tokens, nbytes, priority, start_token, token_ids, salt, lossy)
        try:
            for chunk in chunks:
                w.write(chunk)
        except BaseException:
            self.writer.abort_write(w)
            raise
        return self.commit_put(w)
