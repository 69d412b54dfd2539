"""Maximal runs: the unit of every copy.

A restore into a block table costs one copy per run of pages that are
consecutive both in the tier (same extent) and in the engine (consecutive
block ids), per segment of the engine layout: never one per block. Pages sit
in tiers at a stride rounded up to 4 KiB, so every run starts aligned and
disk I/O needs no read-modify-write; coded pages (a span with codes) lie
back to back instead, and are read whole and decoded into a window at the
stride before any run copies them (transfer/pages.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierd.codecs.stored import PageCodes

ALIGN = 4096


def page_stride(page_bytes: int) -> int:
    return -(-page_bytes // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Geometry:
    """How a snapshot's pages are sized: every page holds page_bytes except the
    last, which holds last_bytes (opaque snapshots end short)."""

    page_bytes: int
    n_pages: int
    last_bytes: int

    @property
    def stride(self) -> int:
        return page_stride(self.page_bytes)

    def size_of(self, page: int) -> int:
        return self.last_bytes if page == self.n_pages - 1 else self.page_bytes

    @property
    def nbytes(self) -> int:
        return 0 if self.n_pages == 0 else (self.n_pages - 1) * self.page_bytes + self.last_bytes


@dataclass(frozen=True, slots=True)
class Span:
    """Pages [first_page, first_page + n_pages) stored contiguously in a tier
    at offset: a stride apart, or, with codes, coded back to back."""

    first_page: int
    n_pages: int
    tier: str
    offset: int
    codes: PageCodes | None = None

    def part(self, skip: int, count: int, stride: int) -> Span:
        """Its pages [first_page + skip, first_page + skip + count)."""
        if self.codes is None:
            return Span(self.first_page + skip, count, self.tier, self.offset + skip * stride)
        return Span(self.first_page + skip, count, self.tier, self.offset + self.codes.offset_of(skip),
                    self.codes.part(skip, count))


@dataclass(frozen=True, slots=True)
class BlockRun:
    """count pages from page, in a tier at offset, to or from engine blocks block.."""

    page: int
    count: int
    tier: str
    offset: int
    block: int


@dataclass(frozen=True, slots=True)
class MoveRun:
    """count pages from page, from src_tier at src_offset (coded there, with
    src_codes) to dst_tier at dst_offset."""

    page: int
    count: int
    src_tier: str
    src_offset: int
    dst_tier: str
    dst_offset: int
    src_codes: PageCodes | None = None

    @property
    def src(self) -> Span:
        return Span(self.page, self.count, self.src_tier, self.src_offset, self.src_codes)


def _cuts(ids: np.ndarray) -> np.ndarray:
    """The indices where a run of consecutive ids ends and another starts (sorted)."""
    return np.flatnonzero(np.diff(ids) != 1) + 1


def id_runs(block_ids: object) -> list[tuple[int, int, int]]:
    """(index into block_ids, first block, count) for each run of consecutive blocks."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    bounds = [0, *_cuts(ids).tolist(), ids.size]
    return [(a, int(ids[a]), b - a) for a, b in zip(bounds, bounds[1:])]


def block_runs(spans: list[Span], block_ids: np.ndarray, stride: int, first_page: int = 0) -> list[BlockRun]:
    """Runs for pages [first_page, first_page + len(block_ids)) going to or from
    engine blocks block_ids; the spans must cover those pages."""
    n = len(block_ids)
    if n == 0:
        return []
    ids = np.asarray(block_ids, dtype=np.int64)
    cuts = _cuts(ids)  # relative to first_page
    runs: list[BlockRun] = []
    for span in spans:
        if span.codes is not None:
            raise ValueError("coded pages are decoded into a window before they are copied to or from blocks")
        lo = max(span.first_page, first_page) - first_page
        hi = min(span.first_page + span.n_pages, first_page + n) - first_page
        if lo >= hi:
            continue
        inner = cuts[np.searchsorted(cuts, lo, side="right") : np.searchsorted(cuts, hi, side="left")]
        bounds = [lo, *inner.tolist(), hi]
        for a, b in zip(bounds, bounds[1:]):
            page = first_page + a
            runs.append(BlockRun(page, b - a, span.tier, span.offset + (page - span.first_page) * stride, int(ids[a])))
    covered = sum(r.count for r in runs)
    if covered != n:
        raise ValueError(f"spans cover {covered} of {n} pages")
    return runs


def overlap_runs(src: list[Span], dst: list[Span], stride: int) -> list[MoveRun]:
    """One run per overlap of a source span and a destination span."""
    runs: list[MoveRun] = []
    src, dst = sorted(src, key=lambda s: s.first_page), sorted(dst, key=lambda s: s.first_page)
    i = j = 0
    while i < len(src) and j < len(dst):
        s, d = src[i], dst[j]
        lo = max(s.first_page, d.first_page)
        hi = min(s.first_page + s.n_pages, d.first_page + d.n_pages)
        if d.codes is not None:
            raise ValueError("coded pages are written by the coded writer, not by runs")
        if lo < hi:
            part = s.part(lo - s.first_page, hi - lo, stride)
            runs.append(MoveRun(lo, hi - lo, s.tier, part.offset, d.tier, d.offset + (lo - d.first_page) * stride,
                                part.codes))
        if s.first_page + s.n_pages <= d.first_page + d.n_pages:
            i += 1
        else:
            j += 1
    return runs


def clip(spans: list[Span], n_pages: int) -> list[Span]:
    """The spans' parts below page n_pages, in page order."""
    out = []
    for s in sorted(spans, key=lambda s: s.first_page):
        if s.first_page >= n_pages:
            break
        out.append(s.part(0, min(s.n_pages, n_pages - s.first_page), 0))
    return out


def between(spans: list[Span], start: int, stop: int, stride: int) -> list[Span]:
    """The spans' parts in pages [start, stop), in page order (pages stride
    bytes apart in their tiers)."""
    out = []
    for s in clip(spans, stop):
        skip = max(0, start - s.first_page)
        if skip < s.n_pages:
            out.append(s.part(skip, s.n_pages - skip, stride))
    return out
