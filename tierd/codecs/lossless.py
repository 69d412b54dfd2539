"""The `none` and `lossless` codecs.

`lossless` is bit-exact: a KV page of 16- or 32-bit elements is split into
byte planes (every element's first byte, then every second byte, ...: the
sign and exponent bytes of nearby values repeat, the low mantissa bytes are
close to random) and each page coded with zstd at level 1; a page of any
other bytes (opaque snapshots, 1-byte caches) goes to zstd as it is. A page
that would not get smaller is kept as it is. Blob: one byte saying which
(RAW, PLANES, ZSTD), then the data. zstandard (python-zstandard) does the
coding; its compressors are per thread (one is not safe to share)."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from tierd.codecs.base import PageShape, register
from tierd.errors import DataLoss

RAW, PLANES, ZSTD = 0, 1, 2
LEVEL = 1  # zstd's fastest level that still finds the repeated exponent bytes
_local = threading.local()


def _coders() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    coders = getattr(_local, "coders", None)
    if coders is None:
        coders = _local.coders = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
    return coders


def planes(page: np.ndarray, width: int) -> np.ndarray:
    """A page of little-endian `width`-byte elements as its byte planes, one after another."""
    words = page.view(f"<u{width}")
    out = np.empty(page.size, dtype=np.uint8)
    for k in range(width):
        np.right_shift(words, 8 * k, out=out[k * words.size : (k + 1) * words.size], casting="unsafe")
    return out


def unplanes(raw: np.ndarray, width: int, out: np.ndarray) -> None:
    """The planes put back together into out: the page they were cut from."""
    words = out.view(f"<u{width}")
    n = words.size
    np.copyto(words, raw[:n], casting="unsafe")
    for k in range(1, width):
        words |= np.left_shift(raw[k * n : (k + 1) * n], 8 * k, dtype=words.dtype)


class NoCodec:
    """Pages as they are."""

    name = "none"
    lossy = False

    def encode(self, pages: np.ndarray, shape: PageShape | None) -> list[bytes]:
        return [page.tobytes() for page in pages]

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None:
        if len(blob) != out.size:
            raise DataLoss(f"a page of {len(blob)} bytes where {out.size} were stored")
        out[:] = np.frombuffer(blob, dtype=np.uint8)


class Lossless:
    name = "lossless"
    lossy = False

    def encode(self, pages: np.ndarray, shape: PageShape | None) -> list[bytes]:
        width = shape.itemsize if shape is not None and shape.itemsize in (2, 4) else 1
        compress = _coders()[0].compress
        blobs = []
        for page in pages:
            if width > 1:
                data, kind = planes(page, width), PLANES
            else:
                data, kind = page.tobytes(), ZSTD
            packed = compress(data)
            blobs.append(bytes([kind]) + packed if len(packed) + 1 < page.size else bytes([RAW]) + page.tobytes())
        return blobs

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None:
        view = memoryview(blob)
        if not len(view):
            raise DataLoss("an empty lossless page")
        kind, body = view[0], view[1:]
        if kind == RAW:
            data = body
        elif kind in (PLANES, ZSTD):
            try:
                if zstandard.frame_content_size(body) != out.size:  # (read from the frame's header first)
                    raise DataLoss(f"a lossless page that would decode to other than {out.size} bytes")
                stream = _coders()[1].decompressobj()
                data = stream.decompress(body)
            except zstandard.ZstdError as exc:
                raise DataLoss(f"a lossless page does not decode: {exc}") from None
            if not stream.eof or stream.unused_data:
                raise DataLoss("a lossless page whose coded bytes are cut short or run on")
        else:
            raise DataLoss(f"a lossless page of unknown kind {kind}")
        if len(data) != out.size:
            raise DataLoss(f"a lossless page decodes to {len(data)} bytes, not {out.size}")
        raw = np.frombuffer(data, dtype=np.uint8)
        if kind != PLANES:
            out[:] = raw
        elif shape is None or shape.itemsize not in (2, 4):
            raise DataLoss("a lossless page of byte planes, for a spec without 2- or 4-byte elements")
        else:
            unplanes(raw, shape.itemsize, out)


NONE = register(NoCodec())
LOSSLESS = register(Lossless())
