"""An engine's paged KV memory seen as pages: one tensor per layer whose
first dimension is the block, each block's bytes contiguous inside it (vLLM
and SGLang keep their caches so). A page is every layer's block bytes, in
layer order, each in the engine's own arrangement; pages move between the
engine and rows of the daemon's host arena (a lease) with one copy per run of
consecutive blocks per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from tierd.transfer.runs import id_runs


class LayerBlocks:
    """Per-layer uint8 [num_blocks, block_bytes] views of an engine's KV tensors."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.views: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            if t.dim() < 2 or not t[0].is_contiguous():
                raise ValueError(f"layer {i}: a block's bytes must be contiguous (shape {tuple(t.shape)}, "
                                 f"strides {t.stride()})")
            u8 = t if t.dtype == torch.uint8 else t.view(torch.uint8)
            self.views.append(u8.reshape(u8.shape[0], -1))
        if not self.views:
            raise ValueError("no KV tensors")
        self.num_blocks = min(v.shape[0] for v in self.views)
        self.block_bytes = [v.shape[1] for v in self.views]
        self.offsets = np.concatenate([[0], np.cumsum(self.block_bytes)]).tolist()
        self.page_bytes = int(self.offsets[-1])

    def _check(self, block_ids: Sequence[int], rows: np.ndarray) -> torch.Tensor:
        if rows.ndim != 2 or rows.shape[0] != len(block_ids) or rows.shape[1] < self.page_bytes:
            raise ValueError(f"{len(block_ids)} blocks need [{len(block_ids)}, {self.page_bytes}] rows, "
                             f"got {rows.shape}")
        if len(block_ids) and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return torch.from_numpy(rows)

    def gather(self, block_ids: Sequence[int], rows: np.ndarray) -> None:
        """Engine -> arena: the pages of these blocks into rows (one per block)."""
        dst = self._check(block_ids, rows)
        runs = id_runs(block_ids)
        for layer, view in enumerate(self.views):
            lo, hi = self.offsets[layer], self.offsets[layer + 1]
            for i, first, count in runs:
                dst[i : i + count, lo:hi].copy_(view[first : first + count])

    def scatter(self, rows: np.ndarray, block_ids: Sequence[int], layers: Iterable[int] | None = None) -> None:
        """Arena -> engine: rows (one page per block) into these blocks, for
        the given layers (default all)."""
        src = self._check(block_ids, rows)
        runs = id_runs(block_ids)
        for layer in range(len(self.views)) if layers is None else layers:
            view = self.views[layer]
            lo, hi = self.offsets[layer], self.offsets[layer + 1]
            for i, first, count in runs:
                view[first : first + count].copy_(src[i : i + count, lo:hi])
