"""How a version's pages are coded in the remote store (Coding): what its
manifest records of each coded page, and how. Plain data: any thread."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tierd.remote.manifest import Manifest

CODED_BYTES_PER_PAGE = 4 + 8 + 4 + 4  # a coded page's size, coded bytes' checksum, relative and largest error


@dataclass(eq=False)
class Coding:
    """How a version's pages are coded in the store, page by page: what a
    reader needs to find each page's coded bytes (sizes, in page order),
    check them (sums: XXH3 of each page's coded bytes) and know what they
    cost (rel_error, max_error: what decoding gives back against the page,
    measured when it was coded; 0 for lossless). checksums are the pages as
    a reader decodes them (the pages themselves, unless the codec is lossy),
    nbytes their logical bytes. A publisher fills it as the store reads the
    version's coded bytes; the store records it once they are all read."""

    codec: str
    checksums: np.ndarray  # uint64 [n]
    sizes: np.ndarray  # uint32 [n]
    sums: np.ndarray  # uint64 [n]
    rel_error: np.ndarray  # float32 [n]
    max_error: np.ndarray  # float32 [n]
    nbytes: int = 0
    source: str = ""  # source_of(the pages' own checksums): what the version holds, coded or not

    @classmethod
    def empty(cls, codec: str, n_pages: int) -> Coding:
        return cls(codec, np.zeros(n_pages, np.uint64), np.zeros(n_pages, np.uint32), np.zeros(n_pages, np.uint64),
                   np.zeros(n_pages, np.float32), np.zeros(n_pages, np.float32))

    @property
    def stored(self) -> int:
        """Bytes the coded pages take in the store."""
        return int(self.sizes.sum(dtype=np.uint64))

    @property
    def offsets(self) -> np.ndarray:
        """Where each page's coded bytes start in the version's (int64 [n + 1], the last: stored)."""
        return np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64)))

    def encode(self) -> bytes:
        return b"".join(np.ascontiguousarray(a, dtype=t).tobytes() for a, t in
                        ((self.sizes, "<u4"), (self.sums, "<u8"), (self.rel_error, "<f4"), (self.max_error, "<f4")))

    @classmethod
    def decode(cls, codec: str, raw: bytes, checksums: np.ndarray, nbytes: int, stored: int, source: str) -> Coding:
        n = len(checksums)
        if not isinstance(codec, str) or not codec.isascii() or not codec.isidentifier() or len(codec) > 64:
            raise ValueError(f"codec {str(codec)[:40]!r} is not a codec's name")
        if len(raw) != CODED_BYTES_PER_PAGE * n:
            raise ValueError("its coded pages' records do not add up")
        parts, at = [], 0
        for dtype in ("<u4", "<u8", "<f4", "<f4"):
            width = np.dtype(dtype).itemsize * n
            part = np.frombuffer(raw[at : at + width], dtype=dtype).copy()
            part.flags.writeable = False
            parts.append(part)
            at += width
        coding = cls(codec, checksums, *parts, nbytes=nbytes, source=str(source))
        if n and (int(coding.sizes.min()) < 1 or coding.stored != stored):
            raise ValueError(f"its coded pages take {coding.stored} bytes, not the {stored} it says")
        if not (coding.rel_error >= 0).all() or not (coding.max_error >= 0).all():
            raise ValueError("its pages' errors are not errors")
        if coding.source and not coding.rel_error.any() and coding.source != source_of(checksums):
            raise ValueError("its pages are said to be exact, and are not the pages they were coded from")
        return coding


def source_of(checksums: np.ndarray) -> str:
    """A digest of pages' checksums: the same pages, coded or not, give the same."""
    return hashlib.sha256(np.ascontiguousarray(checksums, dtype="<u8").tobytes()).hexdigest()[:32]


def holds(m: Manifest, fingerprint: str, checksums: np.ndarray) -> bool:
    """Whether m's version is of these pages (this identity, these page
    checksums): as a reader decodes them, or the pages they were coded from."""
    if m.fingerprint != fingerprint or m.n_pages != len(checksums):
        return False
    return bool(np.array_equal(m.checksums, checksums)) or \
        m.coding is not None and m.coding.source == source_of(checksums)
