"""A vLLM KV connector: conversations saved to tierd when a turn ends and
resumed from tierd at the next turn.

Load it out of tree::

    --kv-transfer-config '{"kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd.adapters.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:/run/tierd/tierd.sock"}}'

Requests that carry a session id (the X-Session-ID header, a `session_id`
body field or `vllm_xargs`) are served from the session's snapshot as far as
its pages hold the same tokens as the prompt (a `Lookup`), and append their
new blocks to it when they finish, then `Release` it so idle demotion starts.
Requests without one pass through untouched. A request's `cache_salt`
is folded into its session (adapters/sessions.py) and passed with its token
ids: every user of the server is one tierd tenant, and the salt keeps users
who send the same session id apart, and keeps tierd sharing pages only among
requests with the same salt, as vLLM's own prefix cache does. A new
conversation whose prompt starts with pages other sessions hold (a system
prompt) loads them on its first turn. Session ids must be unguessable all
the same.

Pages move through leases, each a shared-memory segment of its own: the worker copies
blocks in and out itself (vLLM on a CPU keeps its KV cache in private
memory; on a GPU the same copies run device <-> host). Loads run in a thread,
layer by layer, while the forward pass computes: each attention layer waits
for its own layer only. Saves run in another thread, off the engine's steps;
vLLM keeps a finished request's blocks until its save is done. Whatever fails (the daemon unreachable, a page
damaged, a lease expired) is reported to vLLM as blocks that failed to load,
and vLLM recomputes them: a failure costs time, never correctness.

extra config: address (default: TIERD_SOCKET or the daemon's default socket),
token (default: TIERD_TOKEN), timeout_seconds (per call, default 30),
lease_seconds (default 60).

Runs in vLLM's processes: the scheduler-side methods in the scheduler, the
worker-side ones and the load and save threads in each worker. What the
scheduler hands the workers, and the engine's identity, are in
vllm_jobs.py; the load thread, vllm_load.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tierd.adapters.paged import LayerBlocks
from tierd.adapters.vllm_jobs import (
    LoadJob,
    SaveJob,
    TierdConnectorMetadata,
    salt_of,
    session_of,
    spec_for,
    unsupported,
)
from tierd.adapters.vllm_load import Load
from tierd.client import Arena, Client, NotFound, TierdError
from tierd.errors import FailedPrecondition

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.tierd")  # under vLLM's logger, so its handlers print it


class TierdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._lease_seconds = float(extra.get("lease_seconds", 60.0))
        self._client = Client(extra.get("address") or None, token=extra.get("token") or None,
                              timeout=float(extra.get("timeout_seconds", 30.0)))
        why = unsupported(vllm_config, kv_cache_config)
        self._spec = None if why else spec_for(vllm_config, kv_cache_config)  # type: ignore[arg-type]
        if why:
            log.warning("tierd connector: %s are not supported; every request passes through", why)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("tierd connector: set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config, "
                        "so that a failed load is recomputed instead of failing its request")
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}  # req id -> (tokens tierd supplies, tokens vLLM has)
        self._to_load: dict[str, Request] = {}
        self._to_save: list[SaveJob] = []
        # worker side
        self._blocks: LayerBlocks | None = None
        self._layer_of: dict[str, int] = {}
        self._arena = Arena()
        self._load: Load | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tierd-save")  # turns are saved in order
        self._saved: set[str] = set()  # requests whose save ended (added by the saver thread)
        self._saved_lock = threading.Lock()
        self._load_errors: set[int] = set()

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        session = session_of(request)
        if session is None or self._spec is None:
            return 0, False
        if request.request_id in self._matched:  # asked again (the request waited): same answer
            supplied = self._matched[request.request_id][0]
        else:
            prompt = list(request.prompt_token_ids or [])
            supplied = 0
            if prompt:
                try:
                    supplied = self._client.lookup(session, prompt, self._spec, salt_of(request)).num_tokens
                except NotFound:
                    pass
                except TierdError as exc:
                    log.warning("tierd connector: lookup of session %r failed (%s); computing it", session, exc)
            # whole blocks, and at least the last prompt token is computed (its logits are needed)
            bs = self._spec.block_tokens
            supplied = max(0, min(supplied, len(prompt) - 1)) // bs * bs
        self._matched[request.request_id] = (supplied, num_computed_tokens)
        return max(0, supplied - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._to_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierdConnectorMetadata(saves=self._to_save)
        self._to_save = []
        scheduled = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [(rid, cached.new_block_ids[i]) for i, rid in enumerate(cached.req_ids)
                      if rid in cached.resumed_req_ids]
        bs = self._spec.block_tokens if self._spec is not None else 1
        for req_id, block_ids in scheduled:
            request = self._to_load.pop(req_id, None)
            if request is None or block_ids is None:
                continue
            supplied, local = self._matched[req_id]
            n, first = supplied // bs, -(-local // bs)
            meta.loads.append(LoadJob(req_id, session_of(request) or "", salt_of(request),
                                      list(request.prompt_token_ids)[:supplied], n, first, list(block_ids[0][first:n])))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # the snapshot already holds the prompt's first `same` tokens (whoever supplied their KV this turn)
        same = self._matched.pop(request.request_id, (0, 0))[0]
        self._to_load.pop(request.request_id, None)
        session = session_of(request)
        # KV exists for the computed tokens; the last sampled token has none yet
        num_tokens = min(request.num_computed_tokens, len(request.all_token_ids))
        if session is None or self._spec is None or num_tokens <= 0:
            return False, None
        bs = self._spec.block_tokens
        self._to_save.append(SaveJob(request.request_id, session, salt_of(request),
                                     list(request.all_token_ids)[:num_tokens],
                                     min(same, num_tokens) // bs * bs, list(block_ids[: -(-num_tokens // bs)])))
        return True, None  # vLLM keeps the blocks until the worker reports the save done

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if self._spec is None:
            return
        names = sorted(kv_caches, key=extract_layer_index)
        blocks = LayerBlocks(kv_caches[n] for n in names)
        if blocks.page_bytes != self._spec.page_bytes:
            log.error("tierd connector: a block of all layers takes %d bytes here, the spec says %d; disabled",
                      blocks.page_bytes, self._spec.page_bytes)
            self._spec = None
            return
        self._blocks = blocks
        self._layer_of = {n: i for i, n in enumerate(names)}
        log.info("tierd connector: %d layers, %d blocks of %d tokens, %d bytes a page (%s)", len(names),
                 blocks.num_blocks, self._spec.block_tokens, blocks.page_bytes, self._spec.arrangement)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, TierdConnectorMetadata) or not meta.loads or self._blocks is None:
            return
        self._finish_load()
        self._load = Load(meta.loads, self._blocks, self._client, self._spec, self._arena, self._lease_seconds)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is not None:
            layer = self._layer_of.get(layer_name)
            if layer is not None:
                self._load.layer_done[layer].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # a turn is saved whole when it ends (wait_for_save hands it to the saver thread)

    def wait_for_save(self) -> None:
        self._finish_load()
        meta = self._connector_metadata
        if not isinstance(meta, TierdConnectorMetadata):
            return
        for job in meta.saves:
            # vLLM keeps the request's blocks until get_finished reports it: the copy runs off the step
            self._saver.submit(self._save, job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._saved_lock:
            done, self._saved = self._saved, set()
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._finish_load()
        self._saver.shutdown(wait=True)
        self._arena.close()
        self._client.close()

    # -- copies ------------------------------------------------------------------------------

    def _finish_load(self) -> None:
        load, self._load = self._load, None
        if load is not None:
            load.thread.join()
            self._load_errors |= load.failed

    def _save(self, job: SaveJob) -> None:
        try:
            if self._blocks is not None:
                self._store_turn(job)
        finally:
            with self._saved_lock:
                self._saved.add(job.req_id)

    def _store_turn(self, job: SaveJob) -> None:
        assert self._blocks is not None and self._spec is not None
        t0, lease = time.perf_counter(), None
        try:
            try:
                lease = self._client.begin_save(job.session, self._spec, len(job.token_ids), job.start_token,
                                                job.token_ids, ttl=self._lease_seconds, cache_salt=job.salt)
            except (FailedPrecondition, NotFound):
                # the snapshot changed since this turn loaded it, or this turn's prefix came from other
                # sessions' pages that vLLM had already (nothing was loaded into this one): store the turn
                # whole (pages tierd holds already are not copied again)
                lease = self._client.begin_save(job.session, self._spec, len(job.token_ids), 0, job.token_ids,
                                                ttl=self._lease_seconds, cache_salt=job.salt)
            for first, rows in self._arena.runs(lease):
                self._blocks.gather(job.block_ids[first : first + len(rows)], rows)
            self._client.commit_save(lease)
            self._client.release(job.session)
            log.info("tierd connector: saved session %r, tokens %d-%d, in %.1f ms", job.session,
                     lease.first_page * self._spec.block_tokens, len(job.token_ids), 1e3 * (time.perf_counter() - t0))
        except (TierdError, OSError, ValueError) as exc:
            log.warning("tierd connector: saving session %r failed: %s", job.session, exc)
            if lease is not None:
                try:
                    self._client.abort_save(lease)
                except TierdError:
                    pass  # the lease expires by itself


__all__ = ["TierdConnector", "TierdConnectorMetadata", "spec_for"]
