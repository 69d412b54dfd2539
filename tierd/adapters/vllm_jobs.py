"""What the tierd vLLM connector's scheduler half hands its workers (the
loads and saves of a step, as connector metadata), and what both halves
derive from vLLM's objects: a request's session and salt, the engine's KV
identity, and why an engine cannot use the connector. Runs in vLLM's
scheduler and workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tierd.adapters.sessions import session_key
from tierd.client import KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class LoadJob:
    req_id: str
    session: str
    salt: str             # the request's cache salt ("": none)
    token_ids: list[int]  # the prompt, up to the last page loaded
    num_pages: int        # pages [0, num_pages) of the snapshot are the prompt's ...
    first_page: int       # ... and pages from first_page on are copied (the rest vLLM has already)
    block_ids: list[int]  # destinations of pages first_page..num_pages-1


@dataclass
class SaveJob:
    req_id: str
    session: str
    salt: str
    token_ids: list[int]  # tokens [0, num_tokens), all with KV computed
    start_token: int      # pages before this are the snapshot's own (loaded from it): not written again
    block_ids: list[int]  # the request's blocks, one per page from page 0


@dataclass
class TierdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def session_of(request: Request) -> str | None:
    """The tierd session of a request: its session id, under its cache salt
    (users of one server are one tenant: the salt keeps theirs apart)."""
    sid = getattr(request, "session_id", None)
    if not sid and request.kv_transfer_params:
        sid = request.kv_transfer_params.get("session_id")
    return session_key(sid, getattr(request, "cache_salt", None)) if sid else None


def salt_of(request: Request) -> str:
    return getattr(request, "cache_salt", None) or ""


def spec_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVSpec:
    """The identity of this engine's KV pages: the same in the scheduler and the workers."""
    from vllm.platforms import current_platform

    group = kv_cache_config.kv_cache_groups[0]
    s = group.kv_cache_spec
    mc = vllm_config.model_config
    return KVSpec(mc.model, mc.revision or "", num_layers=len(group.layer_names), num_kv_heads=s.num_kv_heads,
                  head_dim=s.head_size, dtype=str(s.dtype).removeprefix("torch."), block_tokens=s.block_size,
                  arrangement=f"vllm:{current_platform.device_name}:{_kernels(vllm_config, s)}"
                              "[blocks,kv_heads,block_size,C]")


def _kernels(vllm_config: VllmConfig, s: object) -> str:
    """On the CPU, the ISA of vLLM's attention kernels and a colon: each lays
    a block's bytes out its own way (a block saved by one is not another's),
    so it is part of the pages' identity."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(s.dtype, s.block_size, s.head_size, vllm_config.cache_config.cache_dtype) + ":"


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why this engine cannot use the connector, or None."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        return "models with more than one KV cache group (hybrid or sliding-window mixes)"
    if vllm_config.parallel_config.tensor_parallel_size * vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "tensor or pipeline parallel engines"
    if vllm_config.model_config.use_mla:
        return "MLA models"
    return None
