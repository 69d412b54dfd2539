"""Windows: a snapshot's pages read out of tiers for a copy, a page stride
apart, each checked before the caller sees it (or, for views of host
memory, left to a caller that says it checks them as it uses them).

Spans of a memory tier come out whole, as views of its memory (no copy);
spans of a file tier (disk) through staging buffers, read ahead of the
caller; coded spans (a file tier's pages coded on their way there, a memory
tier's re-coded to make room) are decoded into staging buffers
(transfer/coded.py) and checked against what they decode to: the pages'
checksums, or, for pages coded lossily, the checksums their codes record
(the window's `sums`). Runs on the thread that reads: RPC threads (save,
restore, Put, Get), movers (demotions, write-backs).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tierd.tiers import FILE
from tierd.tiers.fileops import aligned_buffer
from tierd.tiers.ioqueue import wait_all
from tierd.transfer import coded
from tierd.transfer.runs import Geometry, Span

if TYPE_CHECKING:
    from tierd.transfer.pages import PageCopier


class Window(NamedTuple):
    """Pages [first, first + count) of a read, a page stride apart in buf:
    the memory of a memory tier itself (valid while the pages are held), or
    (staged) a staging buffer of the read's own, checked, valid until the
    next window. sums: the checksums its pages carry where they are not the
    snapshot's (a copy coded lossily), else None."""

    first: int
    count: int
    tier: str
    buf: Any
    staged: bool
    sums: np.ndarray | None = None

    @property
    def view(self) -> bool:
        """Whether buf is host memory of the tier itself: pages left unchecked
        where the caller said it checks them."""
        return not self.staged and isinstance(self.buf, np.ndarray)

    def checksums(self, snapshot_sums: np.ndarray) -> np.ndarray:
        """The checksums of the window's pages, as it holds them."""
        return self.sums if self.sums is not None else snapshot_sums[self.first : self.first + self.count]


def read(copier: PageCopier, spans: list[Span], geom: Geometry, checksums: np.ndarray, io_class: int,
         on_device: bool, handout: bool, host_checked_by_caller: bool, read_ahead: int) -> Iterator[Window]:
    """The windows over the spans' pages (see PageCopier.windows)."""
    stride = geom.stride
    per_window = max(1, copier.window_bytes // stride)
    file_jobs: list[Span] = []  # windows of file_tier, read together
    file_tier = ""
    for span in spans:
        if copier.tiers[span.tier].medium != FILE or span.tier != file_tier:
            yield from _file_windows(copier, file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)
            file_jobs, file_tier = [], ""
        if copier.tiers[span.tier].medium == FILE:
            file_tier = span.tier
            file_jobs += [span.part(k, min(per_window, span.n_pages - k), stride)
                          for k in range(0, span.n_pages, per_window)]
        elif span.codes is not None:
            yield from _decoded(copier, span, geom, checksums, per_window)
        else:
            window = Window(span.first_page, span.n_pages, span.tier,
                            copier.view(span.tier, span.offset, span.n_pages * stride), False)
            if (handout or span.tier in copier.verify_tiers) and not (host_checked_by_caller and window.view):
                copier.verify(window.buf, span.first_page, span.n_pages, geom, checksums, span.tier)
            yield window
    yield from _file_windows(copier, file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)


def _decoded(copier: PageCopier, span: Span, geom: Geometry, checksums: np.ndarray,
             per_window: int) -> Iterator[Window]:
    """A memory tier's coded span, decoded a window at a time into one staging buffer and checked."""
    stride = geom.stride
    buffers = [copier._bounce(min(span.n_pages, per_window) * stride)]
    try:
        for k in range(0, span.n_pages, per_window):
            part = span.part(k, min(per_window, span.n_pages - k), stride)
            assert part.codes is not None
            out = buffers[0][: part.n_pages * stride]
            t0 = time.perf_counter()
            coded.decode_window(copier.view(span.tier, part.offset, part.codes.stored), part, geom, out)
            _count(copier, span.tier, part, geom, time.perf_counter() - t0, None)
            copier.verify(out, part.first_page, part.n_pages, geom, checksums, span.tier, part.codes.checksums)
            yield Window(part.first_page, part.n_pages, span.tier, out, True, part.codes.checksums)
    finally:
        copier._return_bounce(buffers)


def _file_windows(copier: PageCopier, tier: str, jobs: list[Span], geom: Geometry, checksums: np.ndarray,
                  io_class: int, on_device: bool, read_ahead: int) -> Iterator[Window]:
    """Read windows of a file tier read_ahead deep: while the caller uses
    one window, the next ones are already being read. Each is checked
    (coded ones decoded first) before the caller sees it."""
    if not jobs:
        return
    file = copier.tiers[tier]
    stride = geom.stride
    size = max(min(copier.window_bytes, max(j.n_pages for j in jobs) * stride), stride)
    depth = min(read_ahead, len(jobs))
    extents = [coded.extent(j) for j in jobs if j.codes is not None]
    on_device = on_device and not extents  # coded pages are decoded on the host
    buffers = [copier._bounce(size, on_device) for _ in range(depth)]
    staging = [aligned_buffer(max(hi - lo for lo, hi in extents)) for _ in range(depth)] if extents else []
    pending: dict[int, tuple[list[Future], float]] = {}

    def start(i: int) -> None:
        if i < len(jobs):
            job = jobs[i]
            if job.codes is None:
                at, buf = job.offset, buffers[i % depth][: job.n_pages * stride]
            else:
                at, hi = coded.extent(job)
                buf = staging[i % depth][: hi - at]
            pending[i] = (file.read_async(at, buf, io_class), time.perf_counter())

    for i in range(depth):
        start(i)
    try:
        for i, job in enumerate(jobs):
            futures, t0 = pending.pop(i)
            wait_all(futures)
            buf = buffers[i % depth][: job.n_pages * stride]
            if job.codes is not None:
                lo, _ = coded.extent(job)
                t1 = time.perf_counter()
                coded.decode_window(staging[i % depth][job.offset - lo :], job, geom, buf)
                _count(copier, tier, job, geom, time.perf_counter() - t1, time.perf_counter() - t0)
            elif tier in copier.codings:
                copier.codings[tier].measured("none", "read", job.n_pages * geom.page_bytes, time.perf_counter() - t0)
            copier.record(f"{tier}->device" if on_device else f"{tier}->host", job.n_pages * stride,
                          time.perf_counter() - t0)
            sums = job.codes.checksums if job.codes is not None else None
            copier.verify(buf, job.first_page, job.n_pages, geom, checksums, tier, sums)
            yield Window(job.first_page, job.n_pages, tier, buf, True, sums)
            start(i + depth)  # the caller is done with this buffer
    finally:
        for futures, _ in pending.values():
            try:
                wait_all(futures)
            except BaseException:
                pass
        copier._return_bounce(buffers, on_device)


def _count(copier: PageCopier, tier: str, job: Span, geom: Geometry, decoding: float,
           seconds: float | None) -> None:
    """Count a coded window: its decoding in the codec's metrics, its read
    (seconds, a file tier's) for auto."""
    assert job.codes is not None
    nbytes = job.n_pages * geom.page_bytes
    if copier.events is not None:
        copier.events.coded(job.codes.codec, "decode", nbytes, job.codes.stored, decoding)
    coding = copier.codings.get(tier)
    if coding is not None and seconds is not None:
        coding.measured(job.codes.codec, "read", nbytes, seconds)
