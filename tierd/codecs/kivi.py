"""The `int8` and `int4` codecs: asymmetric integer KV as KIVI quantizes
it (Liu et al., 2024): K grouped per channel (each head and dim over the
page's tokens: K's outliers sit in fixed channels), V per token (each head
and token over dim), each group with a scale and a zero point (its least
value), in float16.

Blob: one byte, AS_IS (the page as it is: a 1-byte cache, or a page holding
a value that is not finite or past float16's range, which a float16 zero
point cannot hold) or CODED; then K's scales and zero points, V's, and the
codes: one byte each (int8) or two to a byte, low nibble first (int4).
torch does the arithmetic, so the same code runs on a GPU's tensors."""

from __future__ import annotations

import numpy as np
import torch

from tierd.codecs.base import CODED, PageShape, as_is, coded_bytes, register

HALF_MAX = 60000.0  # float16 holds a zero point up to 65504; with room for rounding


def quantize(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x grouped along dim: (scale, zero, codes 0..levels), scale and zero in float16 (as stored)."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((x - zero.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return scale, zero, codes


def dequantize(scale: torch.Tensor, zero: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale.float() + zero.float()


def pack4(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack4(packed: torch.Tensor, count: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:count]


class Kivi:
    lossy = True

    def __init__(self, name: str, bits: int) -> None:
        self.name = name
        self.bits = bits
        self.levels = (1 << bits) - 1

    def _sizes(self, shape: PageShape) -> tuple[int, int, int]:
        """Bytes of K's parameters, V's, and the codes."""
        L, H, T, D = shape.layers, shape.heads, shape.tokens, shape.dim
        n = 2 * L * H * T * D
        return 4 * L * H * D, 4 * L * H * T, n if self.bits == 8 else (n + 1) // 2

    def encode(self, pages: np.ndarray, shape: PageShape | None) -> list[bytes]:
        if shape is None or not shape.codable:
            return [as_is(page) for page in pages]
        x = shape.values(pages)  # [n, L, 2, H, T, D]
        ok = (torch.isfinite(x) & (x.abs() < HALF_MAX)).flatten(1).all(1)
        ks, kz, kc = quantize(x[:, :, 0], dim=-2, levels=self.levels)  # per channel, over tokens
        vs, vz, vc = quantize(x[:, :, 1], dim=-1, levels=self.levels)  # per token, over dim
        blobs = []
        for i, page in enumerate(pages):
            if not ok[i]:
                blobs.append(as_is(page))
                continue
            codes = torch.stack([kc[i], vc[i]], dim=1)  # [L, 2, H, T, D]
            codes = codes if self.bits == 8 else pack4(codes)
            params = [t[i].contiguous().view(torch.uint8).numpy().tobytes() for t in (ks, kz, vs, vz)]
            blobs.append(bytes([CODED]) + b"".join(params) + codes.contiguous().numpy().tobytes())
        return blobs

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None:
        k_params, v_params, n_codes = self._sizes(shape) if shape is not None else (0, 0, 0)
        body = coded_bytes(self.name, blob, shape, k_params + v_params + n_codes, out)
        if body is None:
            return
        assert shape is not None
        L, H, T, D = shape.layers, shape.heads, shape.tokens, shape.dim
        raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        half = raw[: k_params + v_params].view(torch.float16)
        ks, kz = half[: L * H * D].view(L, H, 1, D), half[L * H * D : 2 * L * H * D].view(L, H, 1, D)
        rest = half[2 * L * H * D :]
        vs, vz = rest[: L * H * T].view(L, H, T, 1), rest[L * H * T :].view(L, H, T, 1)
        codes = raw[k_params + v_params :]
        if self.bits == 4:
            codes = unpack4(codes, 2 * L * H * T * D)
        codes = codes.view(L, 2, H, T, D)
        x = torch.stack([dequantize(ks, kz, codes[:, 0]), dequantize(vs, vz, codes[:, 1])], dim=1)
        shape.write(x, out)


INT8 = register(Kivi("int8", 8))
INT4 = register(Kivi("int4", 4))
