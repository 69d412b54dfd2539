"""Copies between tiers, one handler per (source medium, destination medium).

A tier is one of two media (tiers.MEMORY, tiers.FILE): a memory tier hands
out views of its bytes (the host arena, VRAM), a file tier reads and writes
them by offset through the I/O threads (the disk slabs). The copy engine
looks a run's handler up by the media of its two tiers, never by their
names: a new tier of a known medium copies through these handlers as it is,
and a new medium registers its handlers here with @route (vLLM's kv_offload
registers its transfer handlers per medium pair the same way).

Every handler copies one run (pages contiguous on both sides), checks what
it read from a tier the copy engine verifies (a file tier always), and
counts its copy operations. Runs on the thread that asked for the move: a
mover for demotions and write-backs, an RPC thread for a restore's
promotion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tierd.tiers import FILE, MEMORY
from tierd.tiers.fileops import aligned_buffer
from tierd.transfer import memory
from tierd.transfer.runs import Geometry, MoveRun

if TYPE_CHECKING:
    from tierd.transfer.pages import PageCopier

Route = Callable[["PageCopier", MoveRun, Geometry, np.ndarray, int], None]
ROUTES: dict[tuple[str, str], Route] = {}


def route(src_medium: str, dst_medium: str) -> Callable[[Route], Route]:
    """Register fn as the copy from a tier of src_medium into one of dst_medium."""

    def register(fn: Route) -> Route:
        if (src_medium, dst_medium) in ROUTES:
            raise ValueError(f"a route from {src_medium} to {dst_medium} is registered already")
        ROUTES[(src_medium, dst_medium)] = fn
        return fn

    return register


def route_of(src: Any, dst: Any) -> Route:
    """The handler for a run from tier src into tier dst."""
    try:
        return ROUTES[(src.medium, dst.medium)]
    except KeyError:
        raise ValueError(f"no route copies {src.name} ({src.medium}) into {dst.name} ({dst.medium})") from None


@route(MEMORY, MEMORY)
def memory_to_memory(copier: PageCopier, run: MoveRun, geom: Geometry, checksums: np.ndarray, io_class: int) -> None:
    """View to view: one copy (a DMA on the stream of its I/O class where the GPU kernels run)."""
    nbytes = run.count * geom.stride
    src = copier.view(run.src_tier, run.src_offset, nbytes)
    if run.src_tier in copier.verify_tiers:
        copier.verify(src, run.page, run.count, geom, checksums, run.src_tier)
    dst = copier.view(run.dst_tier, run.dst_offset, nbytes)
    if copier.kernels is not None:
        copier.kernels.dma(dst, src, io_class)
    else:
        memory.copy(dst, src)
        memory.synchronize(dst, src)
    copier.add_copies()


@route(MEMORY, FILE)
def memory_to_file(copier: PageCopier, run: MoveRun, geom: Geometry, checksums: np.ndarray, io_class: int) -> None:
    """Written straight from the view where the file tier takes that memory
    (host arrays; GPU memory through kvikio), else staged window by window
    through an aligned host buffer."""
    file, stride = copier.tiers[run.dst_tier], geom.stride
    verify = run.src_tier in copier.verify_tiers
    src = copier.view(run.src_tier, run.src_offset, run.count * stride)
    if file.takes(src):
        if verify:
            copier.verify(src, run.page, run.count, geom, checksums, run.src_tier)
        file.write(run.dst_offset, src, io_class)
        copier.add_copies()
        return
    per_window = max(1, copier.window_bytes // stride)
    bounce = aligned_buffer(min(run.count, per_window) * stride)
    for k in range(0, run.count, per_window):
        count = min(per_window, run.count - k)
        part = src[k * stride : (k + count) * stride]
        memory.copy(bounce[: count * stride], part)
        memory.synchronize(part)
        if verify:
            copier.verify(bounce, run.page + k, count, geom, checksums, run.src_tier)
        file.write(run.dst_offset + k * stride, bounce[: count * stride], io_class)
        copier.add_copies()


@route(FILE, MEMORY)
def file_to_memory(copier: PageCopier, run: MoveRun, geom: Geometry, checksums: np.ndarray, io_class: int) -> None:
    """Read straight into the view where the file tier takes that memory
    (host arrays; VRAM through GPUDirect Storage) and its pages lie there as
    they are, else through the copy engine's staging windows (read ahead;
    coded pages decoded), each checked before it is copied on."""
    file, stride = copier.tiers[run.src_tier], geom.stride
    dst = copier.view(run.dst_tier, run.dst_offset, run.count * stride)
    if file.takes(dst) and run.src_codes is None:
        t0 = time.perf_counter()
        file.read(run.src_offset, dst, io_class)
        copier.add_copies()
        copier.verify(dst, run.page, run.count, geom, checksums, run.src_tier)
        if run.src_tier in copier.codings:  # (auto weighs reads of pages as they are against coded ones)
            copier.codings[run.src_tier].measured("none", "read", run.count * geom.page_bytes,
                                                  time.perf_counter() - t0)
        return
    for w in copier.windows([run.src], geom, checksums, io_class):
        part = dst[(w.first - run.page) * stride : (w.first - run.page + w.count) * stride]
        memory.copy(part, w.buf[: w.count * stride])
        memory.synchronize(part)
        copier.add_copies()
