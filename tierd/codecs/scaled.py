"""The `fp8` and `k16v8` codecs: KV as float8 e4m3 with a scale per page,
layer, K/V and head (the slab's largest magnitude maps to e4m3's largest
finite value, 448, so nothing saturates; a value past it, which no scale
here produces, would be clamped to it); `k16v8` keeps K as it is and codes
V so (attention is more sensitive to K's error than to V's).

Blob: one byte, AS_IS (the page as it is: a 1-byte cache passes through
unchanged, and a page holding a value that is not finite is never
scaled) or CODED, then the K slabs' bytes as they are (k16v8), the scales
(float32, one per coded layer, K/V and head), and the e4m3 bytes. torch
does the arithmetic, so the same code runs on a GPU's tensors."""

from __future__ import annotations

import numpy as np
import torch

from tierd.codecs.base import CODED, PageShape, as_is, coded_bytes, register

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Per page of x [n, ...]: whether every value is finite."""
    return torch.isfinite(x).flatten(1).all(1)


def to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., tokens, dim] as e4m3 bytes, scaled per [..., :, :] slab: (scales float32 [...], bytes)."""
    amax = x.abs().amax(dim=(-2, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return scale, q.view(torch.uint8)


def from_e4m3(scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return q.view(E4M3).to(torch.float32) * scale[..., None, None]


class Fp8:
    lossy = True

    def __init__(self, name: str, keep_k: bool) -> None:
        self.name = name
        self.keep_k = keep_k  # k16v8: K as it is

    def _groups(self, shape: PageShape) -> int:
        return shape.layers * (1 if self.keep_k else 2) * shape.heads

    def encode(self, pages: np.ndarray, shape: PageShape | None) -> list[bytes]:
        if shape is None or not shape.codable:
            return [as_is(page) for page in pages]
        x = shape.values(pages)  # [n, L, 2, H, T, D]
        ok = _finite(x)
        coded = x[:, :, 1:] if self.keep_k else x
        scales, q = to_e4m3(coded)
        blobs = []
        for i, page in enumerate(pages):
            if not ok[i]:
                blobs.append(as_is(page))
                continue
            kept = x[i, :, 0].to(shape.torch_dtype).contiguous().view(torch.uint8).numpy().tobytes() \
                if self.keep_k else b""
            blobs.append(bytes([CODED]) + kept + scales[i].numpy().tobytes() + q[i].contiguous().numpy().tobytes())
        return blobs

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None:
        groups = self._groups(shape) if shape is not None else 0
        k_bytes = shape.page_bytes // 2 if shape is not None and self.keep_k else 0
        size = k_bytes + 4 * groups + groups * shape.tokens * shape.dim if shape is not None else 0
        body = coded_bytes(self.name, blob, shape, size, out)
        if body is None:
            return
        assert shape is not None
        L, H, T, D = shape.layers, shape.heads, shape.tokens, shape.dim
        scales = torch.frombuffer(bytearray(body[k_bytes : k_bytes + 4 * groups]), dtype=torch.float32)
        q = torch.frombuffer(bytearray(body[k_bytes + 4 * groups :]), dtype=torch.uint8)
        kv = 1 if self.keep_k else 2
        x = from_e4m3(scales.view(L, kv, H), q.view(L, kv, H, T, D))
        if self.keep_k:
            k = torch.frombuffer(bytearray(body[:k_bytes]), dtype=torch.uint8).view(shape.torch_dtype)
            x = torch.stack([k.view(L, H, T, D).to(torch.float32), x[:, 0]], dim=1)
        shape.write(x, out)


FP8 = register(Fp8("fp8", keep_k=False))
K16V8 = register(Fp8("k16v8", keep_k=True))
