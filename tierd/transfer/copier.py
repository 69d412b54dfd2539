"""The copy engine: every byte tierd moves goes through here.

Tier-to-tier moves go through the handler registered for the media of
their two tiers (transfer/routes.py); engine gathers and scatters go run by
run, one copy per run and segment, or, where the GPU kernels reach both
sides, all of a call's runs in one kernel launch. Pages handed out of the daemon (to engine memory, a
lease, a Get stream) are checked against their checksums whatever the tier;
pages moved between tiers, where they are read from a tier that could corrupt
them (a file tier, the disk, always). Nothing that fails its check leaves the
copy engine. Counts copy operations and keeps a moving average of bandwidth
per route. Runs on the thread that calls it: RPC threads (save, restore,
Put, Get), movers (demotions, write-backs) and its own CPU workers for
large host copies.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.errors import DataLoss, InvalidArgument
from tierd.layout import EngineLayout
from tierd.tiers import FILE
from tierd.tiers.disk import aligned_buffer
from tierd.tiers.ioqueue import Priority, wait_all
from tierd.transfer import gpu, memory
from tierd.transfer.routes import route_of
from tierd.transfer.runs import Geometry, Span, block_runs, overlap_runs

DEFAULT_WINDOW = 16 << 20
EWMA_ALPHA = 0.3
READ_AHEAD = 4  # disk windows in flight per reader
BOUNCE_POOL = 8  # staging buffers kept for reuse (resident: no page faults)
HASH_CHUNK = 8 << 20  # host saves copy, then hash, this much at a time: it stays in the CPU's cache


@dataclass(eq=False)
class EngineMemory:
    """An engine's KV memory as the copy engine sees it: 1-D uint8 buffers
    (numpy on the host, torch on a GPU) and where each block lies in them."""

    layout: EngineLayout
    regions: list[Any]

    @property
    def medium(self) -> str:
        return "device" if any(memory.is_device(r) for r in self.regions) else "host"


class CopyEngine:
    def __init__(self, tiers: dict[str, Any], window_bytes: int = DEFAULT_WINDOW,
                 verify_tiers: tuple[str, ...] = ("disk",), hash_chunk_bytes: int = HASH_CHUNK,
                 kernels: gpu.Kernels | None = None) -> None:
        self.tiers = tiers
        self.window_bytes = window_bytes
        self.hash_chunk_bytes = hash_chunk_bytes
        self.kernels = kernels  # GPU copies and checksums in one launch, where CUDA is present
        self.verify_tiers = set(verify_tiers)
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

    def _stages_on_device(self, engine: EngineMemory) -> bool:
        """Whether disk windows bound for this engine are read straight into
        GPU staging buffers (kvikio), checked and scattered there."""
        disk = self.tiers.get("disk")
        return (self.kernels is not None and disk is not None and disk.device_io
                and all(not isinstance(r, np.ndarray) and self.kernels.reaches(r) for r in engine.regions))

    def view(self, tier: str, offset: int, nbytes: int) -> Any:
        return self.tiers[tier].view(offset, nbytes)

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
                priority: int = Priority.DEMAND, on_device: bool = False, handout: bool = False,
                host_checked_by_caller: bool = False,
                read_ahead: int = READ_AHEAD) -> Iterator[tuple[int, int, str, Any]]:
        """(first page, count, tier, buffer) over the spans' pages, checked where
        the tier is verified, or everywhere for a handout (bytes that leave the
        daemon); host spans are left to the caller to check where it says it
        checks them (as it uses them: in cache, or on the event loop in small
        steps). Host and device spans come out whole, as views (no copy);
        spans of a file tier (disk) through staging buffers (aligned host
        memory, or GPU memory with on_device), read_ahead windows ahead of the
        caller."""
        stride = geom.stride
        per_window = max(1, self.window_bytes // stride)
        file_jobs: list[tuple[int, int, int]] = []  # windows of file_tier, read together
        file_tier = ""
        for span in spans:
            if self.tiers[span.tier].medium != FILE or span.tier != file_tier:
                yield from self._read_windows(file_tier, file_jobs, geom, checksums, priority, on_device, read_ahead)
                file_jobs, file_tier = [], ""
            if self.tiers[span.tier].medium != FILE:
                buf = self.view(span.tier, span.offset, span.n_pages * stride)
                if (handout or span.tier in self.verify_tiers) and not (span.tier == "host" and host_checked_by_caller):
                    self.verify(buf, span.first_page, span.n_pages, geom, checksums, span.tier)
                yield span.first_page, span.n_pages, span.tier, buf
                continue
            file_tier = span.tier
            for k in range(0, span.n_pages, per_window):
                count = min(per_window, span.n_pages - k)
                file_jobs.append((span.first_page + k, count, span.offset + k * stride))
        yield from self._read_windows(file_tier, file_jobs, geom, checksums, priority, on_device, read_ahead)

    def _read_windows(self, tier: str, jobs: list[tuple[int, int, int]], geom: Geometry, checksums: np.ndarray,
                      priority: int, on_device: bool = False,
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
                pending[i] = (file.read_async(offset, buf, priority), time.perf_counter())

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

    # -- engine <-> tier -----------------------------------------------------

    def gather(self, engine: EngineMemory, block_ids: np.ndarray, dst: list[Span], geom: Geometry,
               first_page: int) -> np.ndarray:
        """Copy engine blocks into tier pages [first_page, first_page + len(block_ids))
        and return the pages' checksums, in page order.

        Between host buffers, each run goes in chunks of about hash_chunk_bytes,
        every chunk hashed right after its copy while its bytes are still in
        cache, chunks shared among the CPU workers: a separate hashing pass
        would read the whole snapshot from memory a second time."""
        layout = engine.layout
        t0 = time.perf_counter()
        sums = np.empty(len(block_ids), dtype=np.uint64)
        jobs: list[Callable[[], None]] = []
        launch: list[gpu.Copy] = []
        touched = []
        for run in block_runs(dst, block_ids, geom.stride, first_page):
            buf = self.view(run.tier, run.offset, run.count * geom.stride)
            pairs = [(memory.rows(buf, seg_off, run.count, geom.stride, seg.nbytes),
                      memory.rows(engine.regions[seg.region], seg.offset + run.block * seg.stride, run.count,
                                  seg.stride, seg.nbytes))
                     for seg, seg_off in zip(layout.segments, layout.page_offsets)]
            if not (isinstance(buf, np.ndarray) and all(isinstance(r, np.ndarray) for r in engine.regions)):
                if self._reachable(*(v for pair in pairs for v in pair)):
                    launch.extend(gpu.copy_of(d, s) for d, s in pairs)
                else:
                    for d, s in pairs:
                        memory.copy(d, s)
                        self.add_copies()
                touched.append(buf)
                continue
            per_chunk = max(1, self.hash_chunk_bytes // geom.stride)
            for c in range(0, run.count, per_chunk):
                jobs.append(functools.partial(self._copy_and_hash, pairs, buf, c, min(c + per_chunk, run.count),
                                              run.page, first_page, geom, sums))
        _run_jobs(jobs)
        if launch:
            self.kernels.copy(launch, Priority.DEMAND)  # every run and segment in one launch
            self.add_copies()
        if touched:  # pages in tensors (a save lands in one tier): hashed on the GPU, or from host copies
            memory.synchronize(*touched, *engine.regions)
            sums = self.checksums(dst, geom)
        self.record(f"engine->{dst[0].tier}" if dst else "engine", len(block_ids) * geom.page_bytes,
                    time.perf_counter() - t0)
        return sums

    def _copy_and_hash(self, pairs: list[tuple[np.ndarray, np.ndarray]], buf: np.ndarray, start: int, end: int,
                       run_page: int, first_page: int, geom: Geometry, sums: np.ndarray) -> None:
        """Pages [start, end) of one run: copy every segment, then hash the pages."""
        for d, s in pairs:
            np.copyto(d[start:end], s[start:end])  # numpy copies on this thread, without the GIL
        self.add_copies(len(pairs))
        stride = geom.stride
        for i in range(start, end):
            page = run_page + i
            sums[page - first_page] = page_checksum(buf[i * stride : i * stride + geom.size_of(page)])

    def scatter(self, src: list[Span], engine: EngineMemory, block_ids: np.ndarray, geom: Geometry,
                checksums: np.ndarray, priority: int = Priority.DEMAND) -> None:
        """Copy pages [0, len(block_ids)) into engine blocks block_ids. Where one
        kernel reaches both sides, the copies of all windows go in one launch
        (a disk window's in its own, before its staging buffer is reused)."""
        layout = engine.layout
        n = len(block_ids)
        launch: list[gpu.Copy] = []
        launched_bytes: dict[str, int] = {}
        t_call = time.perf_counter()
        on_device = self._stages_on_device(engine)
        host_engine = all(isinstance(r, np.ndarray) for r in engine.regions)
        for first, count, tier, buf in self.windows(_clip(src, n), geom, checksums, priority, on_device,
                                                    handout=True, host_checked_by_caller=host_engine):
            t0 = time.perf_counter()
            window = [Span(first, count, tier, 0)]
            pairs = []  # (first page of the run in the window, pages, engine rows, tier rows)
            for run in block_runs(window, block_ids[first : first + count], geom.stride, first):
                for seg, seg_off in zip(layout.segments, layout.page_offsets):
                    dst = memory.rows(engine.regions[seg.region], seg.offset + run.block * seg.stride, run.count,
                                      seg.stride, seg.nbytes)
                    src_rows = memory.rows(buf, run.offset + seg_off, run.count, geom.stride, seg.nbytes)
                    pairs.append((run.page - first, run.count, dst, src_rows))
            if tier == "host" and host_engine:
                self._copy_and_check(buf, first, count, pairs, geom, checksums)
            elif self._reachable(*(v for pair in pairs for v in pair[2:])):
                launch.extend(gpu.copy_of(d, s) for _, _, d, s in pairs)
                launched_bytes[tier] = launched_bytes.get(tier, 0) + count * geom.page_bytes
                if self.tiers[tier].medium == FILE:  # its staging buffer is reused for the next window
                    self._launch(launch, launched_bytes, priority, t_call)
                continue
            else:
                for _, _, d, s in pairs:
                    memory.copy(d, s)
                memory.synchronize(buf, *engine.regions)
            self.add_copies(len(pairs))
            self.record(f"{tier}->engine", count * geom.page_bytes, time.perf_counter() - t0)
        self._launch(launch, launched_bytes, priority, t_call)

    def _copy_and_check(self, buf: np.ndarray, first: int, count: int, pairs: list, geom: Geometry,
                        checksums: np.ndarray) -> None:
        """A host window into host engine memory, about hash_chunk_bytes of
        pages at a time, the pieces shared among the CPU workers: each piece's
        part of every run copied, then its pages checked against their
        checksums while they are still in the CPU's cache (checking the whole
        window apart read it from memory a second time). A page that fails
        fails the call: the engine's blocks it reached are not to be used. One
        copy per run and segment all the same, in pieces."""
        step = max(1, self.hash_chunk_bytes // geom.stride)
        _run_jobs([functools.partial(self._copy_and_check_piece, buf, first, a, min(count, a + step), pairs, geom,
                                     checksums) for a in range(0, count, step)])

    def _copy_and_check_piece(self, buf: np.ndarray, first: int, a: int, b: int, pairs: list, geom: Geometry,
                              checksums: np.ndarray) -> None:
        for start, n, d, s in pairs:
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                np.copyto(d[lo - start : hi - start], s[lo - start : hi - start])  # without the GIL
        self.verify(buf[a * geom.stride : b * geom.stride], first + a, b - a, geom, checksums, "host")

    def _launch(self, launch: list[gpu.Copy], nbytes: dict[str, int], priority: int, t0: float) -> None:
        """Run the collected copies in one launch and record them."""
        if not launch:
            return
        self.kernels.copy(launch, priority)
        self.add_copies()
        seconds = time.perf_counter() - t0
        for tier, b in nbytes.items():
            self.record(f"{tier}->engine", b, seconds)
        launch.clear()
        nbytes.clear()

    # -- tier <-> tier -------------------------------------------------------

    def move(self, src: list[Span], dst: list[Span], geom: Geometry, checksums: np.ndarray,
             priority: int = Priority.DEMOTION) -> int:
        """Copy the pages of dst's spans from src's spans; returns bytes moved."""
        moved = 0
        for run in overlap_runs(src, dst, geom.stride):
            t0 = time.perf_counter()
            route_of(self.tiers[run.src_tier], self.tiers[run.dst_tier])(self, run, geom, checksums, priority)
            nbytes = run.count * geom.stride
            self.record(f"{run.src_tier}->{run.dst_tier}", nbytes, time.perf_counter() - t0)
            moved += nbytes
        return moved

    # -- byte streams (Put / Get) ------------------------------------------------

    def page_writer(self, dst: list[Span], geom: Geometry) -> PageWriter:
        """A cursor that writes a stream of byte chunks, of any sizes, into the
        pages of dst (host spans) in page order."""
        return PageWriter(self, dst, geom)

    def read_stream(self, src: list[Span], geom: Geometry, checksums: np.ndarray, chunk_bytes: int,
                    priority: int = Priority.DEMAND) -> Iterator[tuple[bytes | memoryview, int]]:
        """The snapshot's logical bytes, in chunks of chunk_bytes (the last may be
        shorter), whatever the page size: a byte cursor over the pages. Each
        chunk comes with its XXH3 where already known, else 0: a chunk that
        is one whole page has the checksum the page was stored with. A chunk
        that lies inside one page comes as a memoryview of the tier's bytes
        (no copy), valid until the next chunk is asked for."""
        out = bytearray()
        # Host pages are checked one at a time as they go out: a Get from memory runs on the
        # event loop, and a whole snapshot checked at once would hold it ~4 ms per 100 MiB.
        # Two windows ahead: a Get goes out at network speed, and each open one holds its windows.
        for first, count, tier, buf in self.windows(src, geom, checksums, priority, handout=True,
                                                    host_checked_by_caller=True, read_ahead=2):
            host = memory.to_host(buf)
            for i in range(count):
                size = geom.size_of(first + i)
                page = memoryview(host[i * geom.stride : i * geom.stride + size])
                if tier == "host" and page_checksum(page) != checksums[first + i]:
                    self.verify(host[i * geom.stride : (i + 1) * geom.stride], first + i, 1, geom, checksums,
                                 "host")
                while len(page):
                    if not out and len(page) >= chunk_bytes:
                        whole = len(page) == size == chunk_bytes
                        yield page[:chunk_bytes], int(checksums[first + i]) if whole else 0
                        page = page[chunk_bytes:]
                        continue
                    take = min(len(page), chunk_bytes - len(out))
                    out += page[:take]
                    page = page[take:]
                    if len(out) == chunk_bytes:
                        yield bytes(out), 0
                        out.clear()
        if out:
            yield bytes(out), 0

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
                   priority: int = Priority.DEMAND) -> None:
        """Write pages [0, n_pages), each checked against its checksum, packed
        page_bytes apart into a lease's segment."""
        for first, count, tier, buf in self.windows(_clip(src, n_pages), geom, checksums, priority, handout=True):
            t0 = time.perf_counter()
            segment.write_from(first * geom.page_bytes, _pages(memory.to_host(buf), first, count, geom))
            self.add_copies()
            self.record(f"{tier}->lease", count * geom.page_bytes, time.perf_counter() - t0)

    # -- checksums -----------------------------------------------------------

    def checksums(self, spans: list[Span], geom: Geometry) -> np.ndarray:
        """Checksums of freshly stored pages (host or device spans), page order."""
        spans = sorted(spans, key=lambda s: s.first_page)
        return self._page_sums([(self.view(s.tier, s.offset, s.n_pages * geom.stride), s.first_page, s.n_pages)
                                for s in spans], geom)


class PageWriter:
    """Bytes of a stream written into tier pages in page order, chunk by
    chunk as they arrive (on the event loop: one memcpy each); `received`
    counts them. A chunk past what the pages hold is refused, unwritten."""

    def __init__(self, copier: CopyEngine, dst: list[Span], geom: Geometry) -> None:
        self._slots = []  # a view of each page's bytes
        for span in sorted(dst, key=lambda s: s.first_page):
            buf = copier.view(span.tier, span.offset, span.n_pages * geom.stride)
            for i in range(span.n_pages):
                self._slots.append(buf[i * geom.stride : i * geom.stride + geom.size_of(span.first_page + i)])
        self.capacity = sum(v.nbytes for v in self._slots)
        self.received = 0
        self._slot = self._within = 0

    def write(self, chunk: Any) -> None:
        data = np.frombuffer(chunk, dtype=np.uint8) if not isinstance(chunk, np.ndarray) else chunk.reshape(-1)
        if self.received + data.nbytes > self.capacity:
            raise InvalidArgument(f"the stream carries more than the {self.capacity} bytes its header announced",
                                  field="size", want=self.capacity)
        pos = 0
        while pos < data.nbytes:
            view = self._slots[self._slot]
            take = min(data.nbytes - pos, view.nbytes - self._within)
            view[self._within : self._within + take] = data[pos : pos + take]
            pos, self._within = pos + take, self._within + take
            if self._within == view.nbytes:
                self._slot, self._within = self._slot + 1, 0
        self.received += data.nbytes


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _run_jobs(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs on the CPU workers, each worker taking every n-th job, and
    wait for all; the first error is raised once all are done."""
    global _pool
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            job()
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tierd-copy")
    futures = [_pool.submit(_run_each, jobs[w::workers]) for w in range(workers)]
    errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def _run_each(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def _pages(buf: np.ndarray, first: int, count: int, geom: Geometry) -> list[memoryview]:
    """The bytes of `count` pages from page `first` on, stride apart in buf:
    one view when they lie back to back, else one per page."""
    if geom.stride == geom.page_bytes and geom.size_of(first + count - 1) == geom.page_bytes:
        return [memoryview(buf[: count * geom.stride])]
    return [memoryview(buf[i * geom.stride : i * geom.stride + geom.size_of(first + i)]) for i in range(count)]


def _clip(spans: list[Span], n_pages: int) -> list[Span]:
    """The spans' parts below page n_pages, in page order."""
    out = []
    for s in sorted(spans, key=lambda s: s.first_page):
        if s.first_page >= n_pages:
            break
        out.append(Span(s.first_page, min(s.n_pages, n_pages - s.first_page), s.tier, s.offset))
    return out
