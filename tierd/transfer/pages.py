"""Pages in and out of tiers: the part of the copy engine every copy uses.

Reads a snapshot's pages out of tiers as windows (views of memory tiers;
staging buffers read ahead from file tiers, each checked before the caller
sees it), moves pages between tiers through the route registered for the
media of the two tiers (transfer/routes.py), checks pages against their
checksums, and keeps the counts: copy operations and a moving average of
bandwidth per route. Runs on the thread that calls it: RPC threads (save,
restore, Put, Get), movers (demotions, write-backs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.errors import DataLoss
from tierd.tiers import FILE, MEMORY
from tierd.tiers.fileops import aligned_buffer
from tierd.tiers.ioqueue import IOClass, wait_all
from tierd.transfer import gpu, memory
from tierd.transfer.routes import route_of
from tierd.transfer.runs import Geometry, Span, overlap_runs

DEFAULT_WINDOW = 16 << 20
EWMA_ALPHA = 0.3
READ_AHEAD = 4  # file-tier windows in flight per reader
BOUNCE_POOL = 8  # staging buffers kept for reuse (resident: no page faults)
HASH_CHUNK = 8 << 20  # host saves copy, then hash, this much at a time: it stays in the CPU's cache


class PageCopier:
    def __init__(self, tiers: dict[str, Any], window_bytes: int = DEFAULT_WINDOW,
                 verify_tiers: tuple[str, ...] = (), hash_chunk_bytes: int = HASH_CHUNK,
                 kernels: gpu.Kernels | None = None) -> None:
        self.tiers = tiers
        self.window_bytes = window_bytes
        self.hash_chunk_bytes = hash_chunk_bytes
        self.kernels = kernels  # GPU copies and checksums in one launch, where CUDA is present
        self.verify_tiers = set(verify_tiers)  # memory tiers checked on moves too (file tiers always are)
        self.copy_ops = 0
        self.bandwidth: dict[str, float] = {}
        self.moved_bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._bounce_pool: list[np.ndarray] = []
        self._device_pool: list[Any] = []  # GPU staging buffers, where disk reads go straight to the GPU

    # -- bookkeeping ---------------------------------------------------------

    def add_copies(self, n: int = 1) -> None:
        with self._lock:
            self.copy_ops += n

    def record(self, route: str, nbytes: int, seconds: float) -> None:
        """Fold one transfer into the route's bandwidth average (bytes/s)."""
        if nbytes <= 0:
            return
        rate = nbytes / max(seconds, 1e-9)
        with self._lock:
            old = self.bandwidth.get(route)
            self.bandwidth[route] = rate if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * rate
            self.moved_bytes[route] = self.moved_bytes.get(route, 0) + nbytes

    def _bounce(self, nbytes: int, on_device: bool = False) -> Any:
        """A staging buffer: a pooled one (resident, no page faults) when it is
        large enough, else a new one; aligned host memory, or GPU memory."""
        pool = self._device_pool if on_device else self._bounce_pool
        with self._lock:
            for i, buf in enumerate(pool):
                if buf.nbytes >= nbytes:
                    return pool.pop(i)
        size = max(nbytes, self.window_bytes)
        return self.kernels.empty(size) if on_device else aligned_buffer(size)

    def _return_bounce(self, buffers: list[Any], on_device: bool = False) -> None:
        pool = self._device_pool if on_device else self._bounce_pool
        with self._lock:
            for buf in buffers:
                if buf.nbytes == self.window_bytes and len(pool) < BOUNCE_POOL:
                    pool.append(buf)

    def view(self, tier: str, offset: int, nbytes: int) -> Any:
        return self.tiers[tier].view(offset, nbytes)

    def _host_view(self, tier: str, buf: Any) -> bool:
        """Whether buf, a window of tier, is a view of a memory tier in host
        memory: a caller that asked to can check its pages as it uses them."""
        return self.tiers[tier].medium == MEMORY and isinstance(buf, np.ndarray)

    def verify(self, buf: Any, first_page: int, count: int, geom: Geometry, checksums: np.ndarray,
               tier: str) -> None:
        got = self._page_sums([(buf, first_page, count)], geom)
        bad = np.flatnonzero(got != checksums[first_page : first_page + count])
        if bad.size:
            page = first_page + int(bad[0])
            raise DataLoss(f"page {page} failed its checksum in the {tier} tier", page=page, tier=tier,
                           want=int(checksums[page]), got=int(got[bad[0]]))

    def _page_sums(self, parts: list[tuple[Any, int, int]], geom: Geometry) -> np.ndarray:
        """Checksums of the pages of each (buffer, first page, count), pages
        stride apart in a host array or a tensor, in order. Pages the GPU
        kernels reach are hashed there, all in one launch (but pages short
        enough for XXH3's short forms, hashed on the CPU)."""
        stride = geom.stride
        out = np.empty(sum(count for _, _, count in parts), dtype=np.uint64)
        on_gpu: list[tuple[int, int]] = []  # (address, length)
        slots: list[int] = []  # where each of those goes in out
        k = 0
        for buf, first_page, count in parts:
            gpu_buf = self.kernels is not None and not isinstance(buf, np.ndarray) and self.kernels.reaches(buf)
            host = None if gpu_buf else memory.to_host(buf)
            for i in range(count):
                size = geom.size_of(first_page + i)
                if gpu_buf and size > gpu.SHORT_PAGE:
                    on_gpu.append((buf.data_ptr() + i * stride, size))
                    slots.append(k)
                else:
                    page = host[i * stride : i * stride + size] if host is not None else \
                        memory.to_host(buf[i * stride : i * stride + size])
                    out[k] = page_checksum(page)
                k += 1
        if on_gpu:
            out[slots] = self.kernels.checksums(on_gpu)
        return out

    def _reachable(self, *views: Any) -> bool:
        """Whether one kernel launch reaches every view."""
        return self.kernels is not None and all(self.kernels.reaches(v) for v in views)

    # -- reading pages out of tiers -----------------------------------------

    def windows(self, spans: list[Span], geom: Geometry, checksums: np.ndarray,
                io_class: int = IOClass.DEMAND, on_device: bool = False, handout: bool = False,
                host_checked_by_caller: bool = False,
                read_ahead: int = READ_AHEAD) -> Iterator[tuple[int, int, str, Any]]:
        """(first page, count, tier, buffer) over the spans' pages, checked where
        the tier is verified, or everywhere for a handout (bytes that leave the
        daemon); views of host memory are left to the caller to check where it
        says it checks them (as it uses them: in cache, or on the event loop in
        small steps). Spans of memory tiers come out whole, as views (no copy);
        spans of a file tier (disk) through staging buffers (aligned host
        memory, or GPU memory with on_device), read_ahead windows ahead of the
        caller."""
        stride = geom.stride
        per_window = max(1, self.window_bytes // stride)
        file_jobs: list[tuple[int, int, int]] = []  # windows of file_tier, read together
        file_tier = ""
        for span in spans:
            if self.tiers[span.tier].medium != FILE or span.tier != file_tier:
                yield from self._read_windows(file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)
                file_jobs, file_tier = [], ""
            if self.tiers[span.tier].medium != FILE:
                buf = self.view(span.tier, span.offset, span.n_pages * stride)
                if (handout or span.tier in self.verify_tiers) and not (host_checked_by_caller and
                                                                         self._host_view(span.tier, buf)):
                    self.verify(buf, span.first_page, span.n_pages, geom, checksums, span.tier)
                yield span.first_page, span.n_pages, span.tier, buf
                continue
            file_tier = span.tier
            for k in range(0, span.n_pages, per_window):
                count = min(per_window, span.n_pages - k)
                file_jobs.append((span.first_page + k, count, span.offset + k * stride))
        yield from self._read_windows(file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)

    def _read_windows(self, tier: str, jobs: list[tuple[int, int, int]], geom: Geometry, checksums: np.ndarray,
                      io_class: int, on_device: bool = False,
                      read_ahead: int = READ_AHEAD) -> Iterator[tuple[int, int, str, Any]]:
        """Read windows of a file tier read_ahead deep: while the caller uses
        one window, the next ones are already being read. Each is checked
        before the caller sees it."""
        if not jobs:
            return
        file = self.tiers[tier]
        stride = geom.stride
        size = max(min(self.window_bytes, max(c for _, c, _ in jobs) * stride), stride)
        buffers = [self._bounce(size, on_device) for _ in range(min(read_ahead, len(jobs)))]
        pending: dict[int, tuple[list[Future], float]] = {}

        def start(i: int) -> None:
            if i < len(jobs):
                _, count, offset = jobs[i]
                buf = buffers[i % len(buffers)][: count * stride]
                pending[i] = (file.read_async(offset, buf, io_class), time.perf_counter())

        for i in range(len(buffers)):
            start(i)
        try:
            for i, (page, count, _) in enumerate(jobs):
                futures, t0 = pending.pop(i)
                wait_all(futures)
                self.record(f"{tier}->device" if on_device else f"{tier}->host", count * stride,
                            time.perf_counter() - t0)
                buf = buffers[i % len(buffers)][: count * stride]
                self.verify(buf, page, count, geom, checksums, tier)
                yield page, count, tier, buf
                start(i + len(buffers))  # the caller is done with this buffer
        finally:
            for futures, _ in pending.values():
                try:
                    wait_all(futures)
                except BaseException:
                    pass
            self._return_bounce(buffers, on_device)

    # -- tier <-> tier -------------------------------------------------------

    def move(self, src: list[Span], dst: list[Span], geom: Geometry, checksums: np.ndarray,
             io_class: int = IOClass.DEMOTION) -> int:
        """Copy the pages of dst's spans from src's spans; returns bytes moved."""
        moved = 0
        for run in overlap_runs(src, dst, geom.stride):
            t0 = time.perf_counter()
            route_of(self.tiers[run.src_tier], self.tiers[run.dst_tier])(self, run, geom, checksums, io_class)
            nbytes = run.count * geom.stride
            self.record(f"{run.src_tier}->{run.dst_tier}", nbytes, time.perf_counter() - t0)
            moved += nbytes
        return moved

    # -- checksums -----------------------------------------------------------

    def checksums(self, spans: list[Span], geom: Geometry) -> np.ndarray:
        """Checksums of freshly stored pages (host or device spans), page order."""
        spans = sorted(spans, key=lambda s: s.first_page)
        return self._page_sums([(self.view(s.tier, s.offset, s.n_pages * geom.stride), s.first_page, s.n_pages)
                                for s in spans], geom)


def clip(spans: list[Span], n_pages: int) -> list[Span]:
    """The spans' parts below page n_pages, in page order."""
    out = []
    for s in sorted(spans, key=lambda s: s.first_page):
        if s.first_page >= n_pages:
            break
        out.append(Span(s.first_page, min(s.n_pages, n_pages - s.first_page), s.tier, s.offset))
    return out


def between(spans: list[Span], start: int, stop: int, stride: int) -> list[Span]:
    """The spans' parts in pages [start, stop), in page order (pages stride
    bytes apart in their tiers)."""
    out = []
    for s in clip(spans, stop):
        skip = max(0, start - s.first_page)
        if skip < s.n_pages:
            out.append(Span(s.first_page + skip, s.n_pages - skip, s.tier, s.offset + skip * stride))
    return out
