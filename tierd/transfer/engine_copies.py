"""Engine memory <-> tiers: gathers (Save) and scatters (Restore).

One copy per run of consecutive blocks and per segment of the engine's
layout, or, where the GPU kernels reach both sides, all of a call's runs in
one kernel launch. Host copies go in pieces of about HASH_CHUNK on the CPU
workers, each piece hashed (a save) or checked (a restore) while its bytes
are still in cache. Runs on the RPC thread of the Save or Restore, and on
the CPU workers (workers.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.layout import EngineLayout
from tierd.tiers import FILE
from tierd.tiers.ioqueue import IOClass
from tierd.transfer import gpu, memory
from tierd.transfer.pages import PageCopier
from tierd.transfer.runs import Geometry, Span, block_runs, clip
from tierd.transfer.workers import run_jobs


@dataclass(eq=False)
class EngineMemory:
    """An engine's KV memory as the copy engine sees it: 1-D uint8 buffers
    (numpy on the host, torch on a GPU) and where each block lies in them."""

    layout: EngineLayout
    regions: list[Any]

    @property
    def on_device(self) -> bool:
        """Whether any of its memory is GPU memory."""
        return any(memory.is_device(r) for r in self.regions)


class EngineCopies(PageCopier):
    def _stages_on_device(self, engine: EngineMemory) -> bool:
        """Whether disk windows bound for this engine are read straight into
        GPU staging buffers (kvikio), checked and scattered there."""
        files = [t for t in self.tiers.values() if t.medium == FILE]
        return (self.kernels is not None and bool(files) and all(t.device_io for t in files)
                and all(not isinstance(r, np.ndarray) and self.kernels.reaches(r) for r in engine.regions))

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
        run_jobs(jobs)
        if launch:
            self.kernels.copy(launch, IOClass.DEMAND)  # every run and segment in one launch
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
                checksums: np.ndarray, io_class: int = IOClass.DEMAND) -> None:
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
        for w in self.windows(clip(src, n), geom, checksums, io_class, on_device, handout=True,
                              host_checked_by_caller=host_engine):
            first, count, tier, buf = w.first, w.count, w.tier, w.buf
            t0 = time.perf_counter()
            window = [Span(first, count, tier, 0)]
            pairs = []  # (first page of the run in the window, pages, engine rows, tier rows)
            for run in block_runs(window, block_ids[first : first + count], geom.stride, first):
                for seg, seg_off in zip(layout.segments, layout.page_offsets):
                    dst = memory.rows(engine.regions[seg.region], seg.offset + run.block * seg.stride, run.count,
                                      seg.stride, seg.nbytes)
                    src_rows = memory.rows(buf, run.offset + seg_off, run.count, geom.stride, seg.nbytes)
                    pairs.append((run.page - first, run.count, dst, src_rows))
            if host_engine and w.view:  # windows() left its pages to be checked here
                self._copy_and_check(tier, buf, first, count, pairs, geom, checksums)
            elif self._reachable(*(v for pair in pairs for v in pair[2:])):
                launch.extend(gpu.copy_of(d, s) for _, _, d, s in pairs)
                launched_bytes[tier] = launched_bytes.get(tier, 0) + count * geom.page_bytes
                if w.staged:  # its staging buffer is reused for the next window
                    self._launch(launch, launched_bytes, io_class, t_call)
                continue
            else:
                for _, _, d, s in pairs:
                    memory.copy(d, s)
                memory.synchronize(buf, *engine.regions)
            self.add_copies(len(pairs))
            self.record(f"{tier}->engine", count * geom.page_bytes, time.perf_counter() - t0)
        self._launch(launch, launched_bytes, io_class, t_call)
        if geom.last_bytes < geom.page_bytes and geom.n_pages <= n:  # nothing past the snapshot's end
            self._clear_tail(engine, int(block_ids[geom.n_pages - 1]), geom.last_bytes)

    @staticmethod
    def _clear_tail(engine: EngineMemory, block: int, keep: int) -> None:
        """Zero a block's bytes past its page's first `keep`: what the copy
        brought of a short last page's room is not the snapshot's."""
        layout = engine.layout
        for seg, at in zip(layout.segments, layout.page_offsets):
            lo = max(keep - at, 0)
            if lo < seg.nbytes:
                memory.clear(memory.rows(engine.regions[seg.region], seg.offset + block * seg.stride + lo, 1,
                                         seg.stride, seg.nbytes - lo))
        memory.synchronize(*engine.regions)

    def _copy_and_check(self, tier: str, buf: np.ndarray, first: int, count: int, pairs: list, geom: Geometry,
                        checksums: np.ndarray) -> None:
        """A host window into host engine memory, about hash_chunk_bytes of
        pages at a time, the pieces shared among the CPU workers: each piece's
        part of every run copied, then its pages checked against their
        checksums while they are still in the CPU's cache (checking the whole
        window apart read it from memory a second time). A page that fails
        fails the call: the engine's blocks it reached are not to be used. One
        copy per run and segment all the same, in pieces."""
        step = max(1, self.hash_chunk_bytes // geom.stride)
        run_jobs([functools.partial(self._copy_and_check_piece, tier, buf, first, a, min(count, a + step), pairs, geom,
                                     checksums) for a in range(0, count, step)])

    def _copy_and_check_piece(self, tier: str, buf: np.ndarray, first: int, a: int, b: int, pairs: list, geom: Geometry,
                              checksums: np.ndarray) -> None:
        for start, n, d, s in pairs:
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                np.copyto(d[lo - start : hi - start], s[lo - start : hi - start])  # without the GIL
        self.verify(buf[a * geom.stride : b * geom.stride], first + a, b - a, geom, checksums, tier)

    def _launch(self, launch: list[gpu.Copy], nbytes: dict[str, int], io_class: int, t0: float) -> None:
        """Run the collected copies in one launch and record them."""
        if not launch:
            return
        self.kernels.copy(launch, io_class)
        self.add_copies()
        seconds = time.perf_counter() - t0
        for tier, b in nbytes.items():
            self.record(f"{tier}->engine", b, seconds)
        launch.clear()
        nbytes.clear()
