"""Hugging Face transformers caches <-> tierd sessions.

Runs in the engine's process, beside the model. `CacheStore.save` turns a
`DynamicCache` into pages (one page: block_tokens tokens of K and V for every
layer, in the layout "layer, kv, head, token, dim") and stores only the pages
added since the last save; `CacheStore.restore` builds a new `DynamicCache`
that continues exactly where the saved one stopped. Sliding-window layers hold
only their last window - 1 tokens, so their bytes for older tokens are zero
in the pages and never read back. Pages travel through a shared-memory
region registered with the daemon ("shm", no bytes in messages) or as a byte
stream ("bytes").
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from tierd.client import Client, IdentityMismatch, InvalidArgument, KVSpec, NotFound, SessionInfo, SharedKVCache

ARRANGEMENT = "hf-dynamic-cache:layer,kv,head,token,dim"
SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


def forward(model: Any, input_ids: torch.Tensor, cache: Any) -> Any:
    """model(input_ids) extending `cache`, without gradients, whichever keyword
    this transformers version takes for the cache (`cache`, or `past_key_values`)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        return model(input_ids, use_cache=True, **{name: cache})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_types(config: Any) -> list[tuple[str, int | None]]:
    """(type, sliding window) per decoder layer, as transformers builds the cache."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    out = []
    for t, kw in zip(types, kwargs):
        if t not in SUPPORTED_LAYERS:
            raise InvalidArgument(f"cache layers of type {t!r} are not supported (only {SUPPORTED_LAYERS})")
        out.append((t, kw.get("sliding_window")))
    return out


def spec_for(config: Any, dtype: torch.dtype, *, model_id: str | None = None, revision: str = "",
             block_tokens: int = 16) -> KVSpec:
    """The identity of a model's cache: shape from the config, and its layer
    structure (which layers slide, and how far) in `extra`."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    structure = ",".join(t if w is None else f"{t}:{w}" for t, w in layer_types(config))
    name = model_id or getattr(config, "_name_or_path", "") or config.model_type
    return KVSpec(name, revision, num_layers=text.num_hidden_layers, num_kv_heads=heads, head_dim=head_dim,
                  dtype=_dtype_name(dtype), block_tokens=block_tokens, arrangement=ARRANGEMENT,
                  extra=f"model_type={config.model_type};layers={structure}")


class CacheStore:
    """Save and restore one model's transformers caches as tierd sessions."""

    def __init__(self, client: Client, config: Any, *, dtype: torch.dtype = torch.float32,
                 model_id: str | None = None, revision: str = "", block_tokens: int = 16,
                 transport: str = "shm") -> None:
        if transport not in ("shm", "bytes"):
            raise InvalidArgument(f"transport must be 'shm' or 'bytes', not {transport!r}")
        self.client = client
        self.config = config
        self.dtype = dtype
        self.spec = spec_for(config, dtype, model_id=model_id, revision=revision, block_tokens=block_tokens)
        self.transport = transport
        self.layers = layer_types(config)
        self._kv: SharedKVCache | None = None
        self._engine: Any = None

    # -- pages <-> cache ---------------------------------------------------------

    def _page_view(self, buf: torch.Tensor, n_pages: int) -> torch.Tensor:
        s = self.spec
        return buf.view(self.dtype).view(n_pages, s.num_layers, 2, s.num_kv_heads, s.block_tokens, s.head_dim)

    def _pack(self, cache: Any, first_page: int, n_pages: int, out: torch.Tensor) -> None:
        """Write pages [first_page, first_page + n_pages) of the cache into out (uint8)."""
        s, bt = self.spec, self.spec.block_tokens
        pages = self._page_view(out, n_pages)
        pages.zero_()
        total = cache.get_seq_length()
        lo, hi = first_page * bt, min((first_page + n_pages) * bt, total)
        for i, layer in enumerate(cache.layers):
            for kv, tensor in enumerate((layer.keys, layer.values)):
                held = tensor.shape[-2]  # a sliding layer holds the last `held` tokens
                start = max(lo, total - held)
                if start >= hi:
                    continue
                src = tensor[0, :, start - (total - held) : hi - (total - held), :]  # [H, tokens, D]
                grid = torch.zeros(s.num_kv_heads, n_pages * bt, s.head_dim, dtype=self.dtype)
                grid[:, start - lo : hi - lo] = src
                pages[:, i, kv] = grid.view(s.num_kv_heads, n_pages, bt, s.head_dim).permute(1, 0, 2, 3)

    def _unpack(self, data: torch.Tensor, num_tokens: int) -> Any:
        """A new DynamicCache holding num_tokens tokens from pages in data (uint8)."""
        from transformers import DynamicCache

        s = self.spec
        n_pages = s.pages_for_tokens(num_tokens)
        pages = self._page_view(data[: n_pages * s.page_bytes], n_pages)
        cache = DynamicCache(config=self.config)
        for i, layer in enumerate(cache.layers):
            kv = [pages[:, i, j].permute(1, 0, 2, 3).reshape(s.num_kv_heads, n_pages * s.block_tokens, s.head_dim)
                  [:, :num_tokens].unsqueeze(0).clone() for j in (0, 1)]
            layer.update(kv[0], kv[1])  # a sliding layer keeps its last window - 1 tokens, as after a prefill
        return cache

    # -- save / restore ------------------------------------------------------------

    def _check(self, cache: Any) -> int:
        if len(cache.layers) != self.spec.num_layers:
            raise InvalidArgument(f"the cache has {len(cache.layers)} layers, the model {self.spec.num_layers}")
        first = cache.layers[0].keys
        if first is None or first.shape[0] != 1:
            raise InvalidArgument("save takes a filled cache of one sequence (batch size 1)")
        if first.dtype != self.dtype:
            raise InvalidArgument(f"the cache holds {first.dtype}, this store was made for {self.dtype}")
        return cache.get_seq_length()

    def _stored_tokens(self, session_id: str) -> int:
        try:
            info = self.client.stat(session_id)
        except NotFound:
            return 0
        return info.num_tokens if info.fingerprint == self.spec.fingerprint else 0

    def _shm(self, n_pages: int) -> Any:
        """The registered shared-memory region, grown to hold n_pages pages."""
        if self._kv is None or self._kv.layout.num_blocks < n_pages:
            self.close()
            self._kv = SharedKVCache(self.spec, max(n_pages, 64), kind="cross_layer")
            self._engine = self.client.register_engine(self.spec, self._kv)
        return self._engine

    def save(self, session_id: str, cache: Any, append: bool = True) -> SessionInfo:
        """Store the cache as the session's snapshot. With append, only the
        pages after what the session already holds are sent (the last, partial
        page again): the cache must extend what was saved before."""
        total = self._check(cache)
        bt = self.spec.block_tokens
        stored = self._stored_tokens(session_id) if append else 0
        first = min(stored, total) // bt
        n = self.spec.pages_for_tokens(total) - first
        if self.transport == "shm":
            engine = self._shm(n)
            self._pack(cache, first, n, torch.from_numpy(self._kv.regions[0][: n * self.spec.page_bytes]))
            return engine.save(session_id, range(n), total, start_token=first * bt)
        out = torch.empty(n * self.spec.page_bytes, dtype=torch.uint8)
        self._pack(cache, first, n, out)
        return self.client.put(session_id, out.numpy(), self.spec, total, start_token=first * bt)

    def restore(self, session_id: str) -> Any:
        """A new DynamicCache holding the session's tokens, identical to the one
        saved. Refused (IdentityMismatch) when the session is of another model."""
        if self.transport == "shm":
            info = self.client.stat(session_id)
            engine = self._shm(info.num_pages)
            result = engine.restore(session_id, range(info.num_pages))  # the daemon checks the identity
            data = torch.from_numpy(self._kv.regions[0][: result.num_pages * self.spec.page_bytes])
            return self._unpack(data, result.num_tokens)
        info, chunks = self.client.get_stream(session_id)
        if info.fingerprint != self.spec.fingerprint:
            raise IdentityMismatch(f"session {session_id!r} was saved by another model or layout "
                                   f"({info.model_id}, {info.spec.extra}); this store is for {self.spec.model_id}")
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
        return self._unpack(torch.from_numpy(data), info.num_tokens)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    def __enter__(self) -> CacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
