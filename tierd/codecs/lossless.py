"""The `none` and `lossless` codecs.

`lossless` is bit-exact: a KV page of 16- or 32-bit elements is split into
byte planes (every element's first byte, then every second byte, ...: the
sign and exponent bytes of nearby values repeat, the low mantissa bytes are
close to random) and each plane coded on its own with zstd at level 1, or
kept as it is where coding would save less than a 32nd of it (the low
mantissa bytes: neither coded nor decoded, which halves the time of both,
and one plane's statistics no longer spoil another's). A page of any other
bytes (opaque snapshots, 1-byte caches) goes to zstd as it is. A page that
would not get smaller is kept as it is. Blob: one byte saying which (RAW,
PLANES, ZSTD), then the data; PLANES: each plane's coded length (uint32,
little-endian; 0: kept as it is), then the planes. zstandard
(python-zstandard) does the coding; its compressors are per thread (one is
not safe to share)."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from tierd.codecs.base import PageShape, register
from tierd.errors import DataLoss

RAW, PLANES, ZSTD = 0, 1, 2
LEVEL = 1  # zstd's fastest level that still finds the repeated exponent bytes
KEEP_BELOW = 32  # a plane is kept as it is where coding saves less than 1/KEEP_BELOW of it
RETRY = 15  # pages of a batch that keep such a plane as it is before coding it is tried again
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
        kept = [0] * width  # per plane: pages left that keep it as it is without trying to code it
        for page in pages:
            if width > 1:
                blob = _coded_planes(planes(page, width), width, compress, kept)
            else:
                blob = bytes([ZSTD]) + compress(page.tobytes())
            blobs.append(blob if len(blob) < page.size + 1 else bytes([RAW]) + page.tobytes())
        return blobs

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None:
        view = memoryview(blob)
        if not len(view):
            raise DataLoss("an empty lossless page")
        kind, body = view[0], view[1:]
        if kind == RAW:
            if len(body) != out.size:
                raise DataLoss(f"a lossless page of {len(body)} bytes, not {out.size}")
            out[:] = np.frombuffer(body, dtype=np.uint8)
        elif kind == ZSTD:
            out[:] = np.frombuffer(_decompressed(body, out.size), dtype=np.uint8)
        elif kind != PLANES:
            raise DataLoss(f"a lossless page of unknown kind {kind}")
        elif shape is None or shape.itemsize not in (2, 4) or out.size % shape.itemsize:
            raise DataLoss("a lossless page of byte planes, for a spec without 2- or 4-byte elements")
        else:
            unplanes(_planes_of(body, shape.itemsize, out.size), shape.itemsize, out)


def _coded_planes(raw: np.ndarray, width: int, compress, kept: list[int]) -> bytes:  # noqa: ANN001
    """A PLANES blob of the byte planes in raw: each coded where that pays.
    A plane that did not pay on a page is kept as it is on the next RETRY
    pages without a try (kept counts them down: the random low mantissa
    bytes of one page are those of the next)."""
    n = raw.size // width
    lengths, parts = [], []
    for k in range(width):
        plane = raw[k * n : (k + 1) * n]
        packed = compress(plane.tobytes()) if not kept[k] else None
        if packed is not None and len(packed) < n - n // KEEP_BELOW:
            lengths.append(len(packed))
            parts.append(packed)
        else:
            kept[k] = RETRY if packed is not None else kept[k] - 1
            lengths.append(0)
            parts.append(plane.tobytes())
    return bytes([PLANES]) + np.array(lengths, dtype="<u4").tobytes() + b"".join(parts)


def _planes_of(body: memoryview, width: int, size: int) -> np.ndarray:
    """The byte planes of a PLANES blob's body, decoded, one after another (size bytes in all)."""
    n = size // width
    if len(body) < 4 * width:
        raise DataLoss("a lossless page of byte planes cut short")
    lengths = np.frombuffer(body[: 4 * width], dtype="<u4")
    if int(sum(int(x) if x else n for x in lengths)) != len(body) - 4 * width:
        raise DataLoss("a lossless page whose planes do not add up to its coded bytes")
    raw = np.empty(size, dtype=np.uint8)
    at = 4 * width
    for k, length in enumerate(int(x) for x in lengths):
        part = body[at : at + (length or n)]
        raw[k * n : (k + 1) * n] = np.frombuffer(part if not length else _decompressed(part, n), dtype=np.uint8)
        at += length or n
    return raw


def _decompressed(frame: memoryview, size: int) -> bytes:
    """One zstd frame that must decode to exactly size bytes (DataLoss for anything else)."""
    try:
        if zstandard.frame_content_size(frame) != size:  # (read from the frame's header first)
            raise DataLoss(f"a lossless page that would decode to other than {size} bytes")
        stream = _coders()[1].decompressobj()
        data = stream.decompress(frame)
    except zstandard.ZstdError as exc:
        raise DataLoss(f"a lossless page does not decode: {exc}") from None
    if not stream.eof or stream.unused_data or len(data) != size:
        raise DataLoss("a lossless page whose coded bytes are cut short or run on")
    return data


NONE = register(NoCodec())
LOSSLESS = register(Lossless())
