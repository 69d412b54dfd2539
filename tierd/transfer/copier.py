"""The copy engine: every byte tierd moves goes through here.

Built in layers, one module each: transfer/pages.py reads pages out of tiers
(windows) and moves them between tiers (through transfer/routes.py);
transfer/engine_copies.py gathers and scatters engine memory; this module
adds byte streams (Put, Get) and lease segments. Pages handed out of the
daemon (to engine memory, a lease, a Get stream) are checked against their
checksums whatever the tier; pages moved between tiers, where they are read
from a tier that could corrupt them (a file tier, the disk, always). Nothing
that fails its check leaves the copy engine. Runs on the thread that calls
it: RPC threads and the event loop (a Put's chunks, a Get from memory),
movers (demotions, write-backs).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.errors import InvalidArgument
from tierd.tiers.ioqueue import IOClass
from tierd.transfer import memory
from tierd.transfer.engine_copies import EngineCopies, EngineMemory
from tierd.transfer.pages import DEFAULT_WINDOW
from tierd.transfer.runs import Geometry, Span, clip

__all__ = ["DEFAULT_WINDOW", "CopyEngine", "EngineMemory", "PageWriter"]


class CopyEngine(EngineCopies):
    def page_writer(self, dst: list[Span], geom: Geometry, skip: tuple[int, int] = (0, 0)) -> PageWriter:
        """A cursor that writes a stream of byte chunks, of any sizes, into the
        pages of dst (host spans) in page order; the stream's pages
        [skip[0], skip[1]), ahead of dst's, are read past and not kept."""
        return PageWriter(self, dst, geom, skip)

    def read_stream(self, src: list[Span], geom: Geometry, checksums: np.ndarray, chunk_bytes: int,
                    io_class: int = IOClass.DEMAND) -> Iterator[tuple[bytes | memoryview, int]]:
        """The snapshot's logical bytes, in chunks of chunk_bytes (the last may be
        shorter), whatever the page size: a byte cursor over the pages. Each
        chunk comes with its XXH3 where already known, else 0: a chunk that
        is one whole page has the checksum the page was stored with. A chunk
        that lies inside one page comes as a memoryview of the tier's bytes
        (no copy), valid until the next chunk is asked for; one that spans
        pages comes as a memoryview of a bytearray of its own, never reused."""
        out, filled = bytearray(chunk_bytes), 0
        # Host pages are checked one at a time as they go out: a Get from memory runs on the
        # event loop, and a whole snapshot checked at once would hold it ~4 ms per 100 MiB.
        # Two windows ahead: a Get goes out at network speed, and each open one holds its windows.
        for w in self.windows(src, geom, checksums, io_class, handout=True, host_checked_by_caller=True,
                              read_ahead=2):
            first, host, sums = w.first, memory.to_host(w.buf), w.checksums(checksums)
            for i in range(w.count):
                size = geom.size_of(first + i)
                page = memoryview(host[i * geom.stride : i * geom.stride + size])
                if w.view and page_checksum(page) != sums[i]:  # (windows() left a view's pages to check here)
                    self.verify(host[i * geom.stride : (i + 1) * geom.stride], first + i, 1, geom, checksums, w.tier)
                while len(page):
                    if not filled and len(page) >= chunk_bytes:
                        whole = len(page) == size == chunk_bytes
                        yield page[:chunk_bytes], int(sums[i]) if whole else 0
                        page = page[chunk_bytes:]
                        continue
                    take = min(len(page), chunk_bytes - filled)
                    out[filled : filled + take] = page[:take]  # the one copy of a chunk that spans pages
                    filled += take
                    page = page[take:]
                    if filled == chunk_bytes:
                        yield memoryview(out), 0
                        out, filled = bytearray(chunk_bytes), 0
        if filled:
            yield memoryview(out)[:filled], 0

    def views(self, src: list[Span], geom: Geometry, checksums: np.ndarray, io_class: int = IOClass.DEMAND,
              piece_bytes: int = 0, handout: bool = True) -> Iterator[tuple[memoryview, bool]]:
        """The snapshot's logical bytes as views, with no copy: a window of
        packed pages (stride == page_bytes) as one view, else page by page.
        Each comes with whether it stays valid while the caller holds the
        session as a reader (a memory tier's pages, or a device window's own
        copy), or only until the next is asked for (a file tier's staging
        buffer). Pages are checked first: every page for a handout, else as
        a move between tiers checks them (a file tier's always, a memory
        tier's where it is verified). With piece_bytes, a memory tier's views
        are cut where the snapshot's bytes reach a multiple of it, and each
        piece's pages are checked as it is asked for: the checks overlap what
        the caller does with the pieces before."""
        for w in self.windows(src, geom, checksums, io_class, handout=handout, host_checked_by_caller=True):
            first, count, tier, buf = w.first, w.count, w.tier, w.buf
            if not w.view:
                held = not isinstance(buf, np.ndarray)  # to_host: a copy of its own
                for view in _pages(memory.to_host(buf), first, count, geom):
                    yield view, held
                continue
            at = first * geom.page_bytes  # where the next view starts in the snapshot's bytes
            checked = 0 if handout or tier in self.verify_tiers else count  # pages of the window checked
            for view in _pages(buf, first, count, geom):
                while len(view):
                    take = len(view) if not piece_bytes else min(len(view), piece_bytes - at % piece_bytes)
                    upto = min(count, -(-(at + take) // geom.page_bytes) - first)  # the pages this piece reaches
                    if upto > checked:
                        self.verify(buf[checked * geom.stride : upto * geom.stride], first + checked,
                                    upto - checked, geom, checksums, tier)
                        checked = upto
                    yield view[:take], True
                    view, at = view[take:], at + take

    # -- lease segments: files the daemon reads and writes, never maps --------

    def from_segment(self, segment: Any, dst: list[Span], geom: Geometry, first_page: int) -> np.ndarray:
        """Read pages from first_page on, packed page_bytes apart in a lease's
        segment, into tier pages (host spans); returns their checksums."""
        t0 = time.perf_counter()
        for span in sorted(dst, key=lambda sp: sp.first_page):
            buf = self.view(span.tier, span.offset, span.n_pages * geom.stride)
            segment.read_into((span.first_page - first_page) * geom.page_bytes, _pages(buf, span.first_page,
                                                                                       span.n_pages, geom))
            self.add_copies()
        sums = self.checksums(dst, geom)
        self.record("lease->host", sum(sp.n_pages for sp in dst) * geom.page_bytes, time.perf_counter() - t0)
        return sums

    def to_segment(self, src: list[Span], geom: Geometry, checksums: np.ndarray, n_pages: int, segment: Any,
                   io_class: int = IOClass.DEMAND) -> None:
        """Write pages [0, n_pages), each checked against its checksum, packed
        page_bytes apart into a lease's segment."""
        for w in self.windows(clip(src, n_pages), geom, checksums, io_class, handout=True):
            t0 = time.perf_counter()
            segment.write_from(w.first * geom.page_bytes, _pages(memory.to_host(w.buf), w.first, w.count, geom))
            self.add_copies()
            self.record(f"{w.tier}->lease", w.count * geom.page_bytes, time.perf_counter() - t0)


class PageWriter:
    """Bytes of a stream written into tier pages in page order, chunk by
    chunk as they arrive (on the event loop: one memcpy each), or read into
    them by whoever claims the memory the next bytes go to; `received`
    counts them. Bytes past what the pages hold are refused, unwritten."""

    def __init__(self, copier: CopyEngine, dst: list[Span], geom: Geometry, skip: tuple[int, int] = (0, 0)) -> None:
        self._slots = []  # a view of each page's bytes
        if skip[1] > skip[0]:
            scratch = np.empty(geom.stride, dtype=np.uint8)  # pages read past all land here
            self._slots += [scratch[: geom.size_of(page)] for page in range(*skip)]
        for span in sorted(dst, key=lambda s: s.first_page):
            buf = copier.view(span.tier, span.offset, span.n_pages * geom.stride)
            for i in range(span.n_pages):
                size = geom.size_of(span.first_page + i)
                self._slots.append(buf[i * geom.stride : i * geom.stride + size])
                if size < geom.stride:  # a short last page: the rest of its room holds zeros, not what was there
                    buf[i * geom.stride + size : (i + 1) * geom.stride] = 0
        self.capacity = sum(v.nbytes for v in self._slots)
        self.received = 0
        self._slot = self._within = 0

    def claim(self, nbytes: int) -> list[np.ndarray]:
        """The pages' memory the next nbytes of the stream go to, in order, as
        views (one per page they reach); they count as received."""
        if self.received + nbytes > self.capacity:
            raise InvalidArgument(f"the stream carries more than the {self.capacity} bytes its header announced",
                                  field="size", want=self.capacity)
        out = []
        while nbytes:
            view = self._slots[self._slot]
            take = min(nbytes, view.nbytes - self._within)
            out.append(view[self._within : self._within + take])
            nbytes, self.received, self._within = nbytes - take, self.received + take, self._within + take
            if self._within == view.nbytes:
                self._slot, self._within = self._slot + 1, 0
        return out

    def write(self, chunk: Any) -> None:
        data = np.frombuffer(chunk, dtype=np.uint8) if not isinstance(chunk, np.ndarray) else chunk.reshape(-1)
        pos = 0
        for view in self.claim(data.nbytes):
            view[:] = data[pos : pos + view.nbytes]
            pos += view.nbytes


def _pages(buf: np.ndarray, first: int, count: int, geom: Geometry) -> list[memoryview]:
    """The bytes of `count` pages from page `first` on, stride apart in buf:
    one view when they lie back to back (the last may end short), else one per page."""
    if geom.stride == geom.page_bytes:
        return [memoryview(buf[: (count - 1) * geom.stride + geom.size_of(first + count - 1)])]
    return [memoryview(buf[i * geom.stride : i * geom.stride + geom.size_of(first + i)]) for i in range(count)]
