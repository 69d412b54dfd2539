"""Device tier: VRAM slabs allocated through torch, with a byte budget.

Slabs are uint8 tensors allocated once; pages are ranges inside them. The
class runs on any torch device, so the CPU suite exercises the same code with
device="cpu"; the daemon builds it only when CUDA is present.
"""

from __future__ import annotations

import logging
from typing import Any

from tierd.tiers import DEVICE
from tierd.tiers.slabs import SlabTier

log = logging.getLogger("tierd.tiers.device")


class DeviceTier(SlabTier):
    name = DEVICE

    def __init__(self, budget: int, device: str = "cuda", slab_bytes: int = 1 << 30) -> None:
        super().__init__(budget, slab_bytes)
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._slabs: dict[int, Any] = {}

    @property
    def backend(self) -> str:
        return f"torch-{self.device.type}"

    def _open_slab(self, index: int) -> None:
        try:
            self._slabs[index] = self._torch.empty(self.slab_bytes, dtype=self._torch.uint8, device=self.device)
        except RuntimeError as exc:  # out of memory on the card
            raise OSError(f"cannot allocate a {self.slab_bytes}-byte slab on {self.device}: {exc}") from exc

    def _close_slab(self, index: int) -> None:
        self._slabs.pop(index, None)
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()

    def view(self, offset: int, nbytes: int) -> Any:
        """The tier's bytes [offset, offset + nbytes) as a uint8 tensor (no copy)."""
        slab, off = self.locate(offset, nbytes)
        return self._slabs[slab][off : off + nbytes]
