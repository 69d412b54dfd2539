"""Pages in and out of tiers: the part of the copy engine every copy uses.

Reads a snapshot's pages out of tiers as windows (windows.py: views of
memory tiers; staging buffers read ahead from file tiers and decoded coded
pages, each checked before the caller sees it), moves pages between tiers
through the route registered for the media of the two tiers
(transfer/routes.py), checks pages against their checksums, and keeps the
counts: copy operations and a moving average of bandwidth per route. Runs
on the thread that calls it: RPC threads (save, restore, Put, Get), movers
(demotions, write-backs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.errors import DataLoss
from tierd.tiers.fileops import aligned_buffer
from tierd.tiers.ioqueue import IOClass
from tierd.transfer import gpu, memory, windows
from tierd.transfer.coded import CodingEvents, TierCoding
from tierd.transfer.routes import route_of
from tierd.transfer.runs import Geometry, Span, overlap_runs
from tierd.transfer.windows import Window

DEFAULT_WINDOW = 16 << 20
EWMA_ALPHA = 0.3
READ_AHEAD = 4  # file-tier windows in flight per reader
BOUNCE_POOL = 8  # staging buffers kept for reuse (resident: no page faults)
HASH_CHUNK = 8 << 20  # host saves copy, then hash, this much at a time: it stays in the CPU's cache


class PageCopier:
    def __init__(self, tiers: dict[str, Any], window_bytes: int = DEFAULT_WINDOW,
                 verify_tiers: tuple[str, ...] = (), hash_chunk_bytes: int = HASH_CHUNK,
                 kernels: gpu.Kernels | None = None, codings: dict[str, TierCoding] | None = None,
                 events: CodingEvents | None = None) -> None:
        self.tiers = tiers
        self.codings = codings or {}  # file tiers whose pages are coded on their way there
        self.events = events  # where coding and decoding are counted (metrics), if anywhere
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

    def verify(self, buf: Any, first_page: int, count: int, geom: Geometry, checksums: np.ndarray,
               tier: str, want: np.ndarray | None = None) -> None:
        """Check `count` pages from first_page on, a stride apart in buf, against
        their checksums (want: theirs, where not the snapshot's)."""
        want = checksums[first_page : first_page + count] if want is None else want
        got = self._page_sums([(buf, first_page, count)], geom)
        bad = np.flatnonzero(got != want)
        if bad.size:
            page = first_page + int(bad[0])
            raise DataLoss(f"page {page} failed its checksum in the {tier} tier", page=page, tier=tier,
                           want=int(want[bad[0]]), got=int(got[bad[0]]))

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
                host_checked_by_caller: bool = False, read_ahead: int = READ_AHEAD) -> Iterator[Window]:
        """Windows over the spans' pages (transfer/windows.py), checked where
        the tier is verified, or everywhere for a handout (bytes that leave the
        daemon); views of host memory are left to the caller to check where it
        says it checks them (as it uses them: in cache, or on the event loop in
        small steps). Spans of memory tiers come out whole, as views (no copy,
        unless coded); spans of a file tier (disk) through staging buffers
        (aligned host memory, or GPU memory with on_device; coded spans decoded
        into host memory), read_ahead windows ahead of the caller."""
        return windows.read(self, spans, geom, checksums, io_class, on_device, handout, host_checked_by_caller,
                            read_ahead)

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
