"""How a run of pages lies coded in a tier (PageCodes): the codec, and each
page's coded size and the XXH3 of its coded bytes, pages back to back from
where the run starts, and the shape the codec reads them in (known from the
session's spec, never stored). Coded lossily (a copy the host tier re-coded
to make room), also what each page decodes to: its checksum, and its
relative L2 and largest absolute error against the page. The disk tier's
pieces carry one (lossless only: core/index.py records the codec, sizes and
sums with the piece); a copy of a span of pages carries its part. Plain
data: any thread."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierd.codecs.base import PageShape

RECORD_BYTES = 4 + 8  # a page's coded size (uint32) and its coded bytes' XXH3 (uint64)


@dataclass(frozen=True, eq=False)
class PageCodes:
    codec: str
    sizes: np.ndarray  # uint32 [n]: each page's coded bytes
    sums: np.ndarray  # uint64 [n]: the XXH3 of each page's coded bytes
    shape: PageShape | None = None  # how the codec reads the pages (None: as bytes)
    # Coded lossily: each page's checksum as it decodes, and its relative and largest error (None: exact).
    checksums: np.ndarray | None = None
    rel_error: np.ndarray | None = None
    max_error: np.ndarray | None = None

    @property
    def lossy(self) -> bool:
        """Whether its pages decode to other than the pages they were coded from."""
        return self.checksums is not None

    @property
    def n_pages(self) -> int:
        return len(self.sizes)

    @property
    def stored(self) -> int:
        """Bytes the coded pages take, back to back."""
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def offsets(self) -> np.ndarray:
        """Where each page's coded bytes start (int64 [n + 1], the last: stored)."""
        return np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64)))

    def offset_of(self, page: int) -> int:
        """Where the coded bytes of the run's page `page` start."""
        return int(self.sizes[:page].sum(dtype=np.int64))

    def part(self, start: int, count: int) -> PageCodes:
        """The codes of the run's pages [start, start + count)."""
        if start == 0 and count == self.n_pages:
            return self
        at = slice(start, start + count)
        return PageCodes(self.codec, self.sizes[at], self.sums[at], self.shape,
                         *(a[at] if a is not None else None for a in (self.checksums, self.rel_error, self.max_error)))

    def same_as(self, other: PageCodes, n_pages: int) -> bool:
        """Whether both runs hold their first n_pages pages coded alike."""
        return self.codec == other.codec and bool(np.array_equal(self.sizes[:n_pages], other.sizes[:n_pages])) \
            and bool(np.array_equal(self.sums[:n_pages], other.sums[:n_pages]))

    def to_bytes(self) -> bytes:
        """Sizes (little-endian uint32), then sums (uint64), of lossless codes."""
        assert not self.lossy, "only lossless codes are recorded"
        return np.ascontiguousarray(self.sizes, dtype="<u4").tobytes() + \
            np.ascontiguousarray(self.sums, dtype="<u8").tobytes()

    @classmethod
    def from_bytes(cls, codec: str, raw: bytes, n_pages: int, shape: PageShape | None) -> PageCodes:
        """The codes to_bytes wrote for n_pages pages; ValueError where raw is not that."""
        if len(raw) != RECORD_BYTES * n_pages:
            raise ValueError(f"{len(raw)} bytes of page codes for {n_pages} pages")
        sizes = np.frombuffer(raw, dtype="<u4", count=n_pages).astype(np.uint32)
        sums = np.frombuffer(raw, dtype="<u8", offset=4 * n_pages).astype(np.uint64)
        if n_pages and int(sizes.min()) < 1:
            raise ValueError("a coded page of no bytes")
        return cls(codec, sizes, sums, shape)

    @staticmethod
    def cut_bytes(raw: bytes, n_pages: int, keep: int) -> bytes:
        """to_bytes of the first `keep` of n_pages pages, from to_bytes of all of them."""
        return raw[: 4 * keep] + raw[4 * n_pages : 4 * n_pages + 8 * keep]
