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
from tierd.transfer import coded, gpu, memory
from tierd.transfer.coded import TierCoding
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
                 kernels: gpu.Kernels | None = None, codings: dict[str, TierCoding] | None = None) -> None:
        self.tiers = tiers
        self.codings = codings or {}  # file tiers whose pages are coded on their way there
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
        memory, or GPU memory with on_device; coded spans decoded into host
        memory), read_ahead windows ahead of the caller."""
        stride = geom.stride
        per_window = max(1, self.window_bytes // stride)
        file_jobs: list[Span] = []  # windows of file_tier, read together
        file_tier = ""
        for span in spans:
            if self.tiers[span.tier].medium != FILE or span.tier != file_tier:
                yield from self._read_windows(file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)
                file_jobs, file_tier = [], ""
            if self.tiers[span.tier].medium != FILE:
                if span.codes is not None:
                    raise ValueError(f"the {span.tier} tier holds no coded pages")
                buf = self.view(span.tier, span.offset, span.n_pages * stride)
                if (handout or span.tier in self.verify_tiers) and not (host_checked_by_caller and
                                                                         self._host_view(span.tier, buf)):
                    self.verify(buf, span.first_page, span.n_pages, geom, checksums, span.tier)
                yield span.first_page, span.n_pages, span.tier, buf
                continue
            file_tier = span.tier
            file_jobs += [span.part(k, min(per_window, span.n_pages - k), stride)
                          for k in range(0, span.n_pages, per_window)]
        yield from self._read_windows(file_tier, file_jobs, geom, checksums, io_class, on_device, read_ahead)

    def _read_windows(self, tier: str, jobs: list[Span], geom: Geometry, checksums: np.ndarray,
                      io_class: int, on_device: bool = False,
                      read_ahead: int = READ_AHEAD) -> Iterator[tuple[int, int, str, Any]]:
        """Read windows of a file tier read_ahead deep: while the caller uses
        one window, the next ones are already being read. Each is checked
        (coded ones decoded first) before the caller sees it."""
        if not jobs:
            return
        file = self.tiers[tier]
        stride = geom.stride
        size = max(min(self.window_bytes, max(j.n_pages for j in jobs) * stride), stride)
        depth = min(read_ahead, len(jobs))
        extents = [coded.extent(j) for j in jobs if j.codes is not None]
        on_device = on_device and not extents  # coded pages are decoded on the host
        buffers = [self._bounce(size, on_device) for _ in range(depth)]
        coded_size = max((hi - lo for lo, hi in extents), default=0)
        staging = [aligned_buffer(coded_size) for _ in range(depth)] if extents else []
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
                    self._coded_read(tier, job, geom, time.perf_counter() - t1, time.perf_counter() - t0)
                elif tier in self.codings:
                    self.codings[tier].measured("none", "read", job.n_pages * geom.page_bytes,
                                                time.perf_counter() - t0)
                self.record(f"{tier}->device" if on_device else f"{tier}->host", job.n_pages * stride,
                            time.perf_counter() - t0)
                self.verify(buf, job.first_page, job.n_pages, geom, checksums, tier)
                yield job.first_page, job.n_pages, tier, buf
                start(i + depth)  # the caller is done with this buffer
        finally:
            for futures, _ in pending.values():
                try:
                    wait_all(futures)
                except BaseException:
                    pass
            self._return_bounce(buffers, on_device)

    def _coded_read(self, tier: str, job: Span, geom: Geometry, decoding: float, seconds: float) -> None:
        """Count a coded window read: decode time in the codec's metrics, read time for auto."""
        assert job.codes is not None
        nbytes = job.n_pages * geom.page_bytes
        coding = self.codings.get(tier)
        if coding is not None:
            coding.measured(job.codes.codec, "read", nbytes, seconds)
            coding.events.coded(job.codes.codec, "decode", nbytes, job.codes.stored, decoding)

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
