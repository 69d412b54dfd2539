"""Pages coded into a tier's pieces, and decoded on the way out: on their
way into a file tier (`--codec disk=lossless`), and re-coded in a memory
tier to make room (core/store/recode.py).

A write codes a session's pages a batch at a time (BATCH_BYTES of pages):
each page alone (codecs), a share of them on each CPU worker, the batch's
blobs back to back in an aligned buffer that becomes one piece of the tier,
with its PageCodes (each page's coded size and the XXH3 of its coded bytes;
a lossy codec's also what each page decodes to, and its error). A read of a
coded span takes the bytes around its blobs, checks each blob against its
XXH3 before a decoder sees it (damaged coded bytes are DATA_LOSS, never
handed to a decoder), and decodes the pages into a window at the page
stride, which is then checked against what they decode to, as every window
is (transfer/windows.py). A file tier's codec (TierCoding) is one
registered lossless codec, or `auto` (codecs/auto.py: lossless or none,
whichever this node measured faster, writes and reads).

Runs on the thread that writes or reads the pages (movers: demotions,
write-backs, re-codes; RPC threads: restores, promotions, Gets of coded
pages; never the event loop) and on the CPU workers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tierd import codecs
from tierd.checksum import page_checksum
from tierd.codecs.auto import AUTO, AutoChoice, check_codec
from tierd.codecs.stored import PageCodes
from tierd.errors import DataLoss, InvalidArgument
from tierd.tiers.allocator import Piece
from tierd.tiers.fileops import ALIGN, aligned_buffer
from tierd.transfer import memory
from tierd.transfer.runs import Geometry, Span, between
from tierd.transfer.workers import run_jobs

log = logging.getLogger("tierd.transfer")
BATCH_BYTES = 16 << 20  # logical bytes of pages coded into one piece
PAGES_A_JOB = 4  # pages a CPU worker codes or decodes at a time


class CodingEvents(Protocol):
    def coded(self, codec: str, op: str, nbytes: int, coded: int, seconds: float) -> None: ...

    def codec_chosen(self, tier: str, codec: str, among: tuple[str, ...]) -> None: ...


class TierCoding:
    """A file tier's codec: a lossless codec's name, "none", or auto."""

    def __init__(self, tier: str, codec: str, events: CodingEvents) -> None:
        self.tier, self.codec, self.events = tier, self.check(tier, codec), events
        self.auto = AutoChoice(tier, events.codec_chosen) if self.codec == AUTO else None
        log.info("%s tier: pages coded %s on their way there", tier, self.codec)

    @staticmethod
    def check(tier: str, codec: str) -> str:
        """The codec's name, where it may code a file tier's pages; InvalidArgument for any other."""
        name = check_codec(codec)
        if name != AUTO and codecs.get(name).lossy:
            raise InvalidArgument(f"--codec {tier}={codec}: the {tier} tier codes pages lossless only (none, "
                                  f"lossless, auto): its copy is the exact one", field="codec", value=codec)
        return name

    def choose(self) -> str:
        """The codec the next write codes its pages with ("none": as they are)."""
        return self.auto.choose() if self.auto is not None else self.codec

    def measured(self, way: str, op: str, nbytes: int, seconds: float) -> None:
        """A write or read (op) of nbytes of pages coded `way` took seconds."""
        if self.auto is not None:
            self.auto.measured(way, op, nbytes, seconds)


@dataclass(frozen=True, eq=False)
class CodedBatch:
    """Pages [first_page, first_page + n_pages) coded: their blobs back to
    back at the start of data (aligned; zeros past them), and their codes."""

    first_page: int
    n_pages: int
    data: np.ndarray
    codes: PageCodes
    seconds: float  # spent coding them


def encode_windows(windows: Iterator[Any], geom: Geometry, codec_name: str, shape: codecs.PageShape | None,
                   bounds: np.ndarray | None = None) -> Iterator[CodedBatch]:
    """The pages of windows (as PageCopier.windows gives them) coded, a batch
    at a time; each batch's data is valid until the next is asked for. A
    lossy codec (whole KV pages of a shape it reads) decodes each page again
    at once and measures its error (codecs.code): a page past its bound
    (bounds: each page's, by page number) is kept as it is; the codes record
    what each page decodes to."""
    codec = codecs.get(codec_name)
    stride = geom.stride
    per_batch = max(1, BATCH_BYTES // stride)
    out = aligned_buffer(0)
    for w in windows:
        first, count, host = w.first, w.count, memory.to_host(w.buf)
        for k in range(0, count, per_batch):
            n = min(per_batch, count - k)
            page = first + k
            rows = host[k * stride : (k + n) * stride]
            t0 = time.perf_counter()
            whole = n if geom.size_of(page + n - 1) == geom.page_bytes else n - 1
            pages = rows[: whole * stride].reshape(whole, stride)[:, : geom.page_bytes]
            lossy = None
            if codec.lossy:
                assert bounds is not None and whole == n, "a lossy codec codes whole KV pages, within bounds"
                blobs, lossy = _lossy(codec, pages, shape, bounds[page : page + n])
            else:
                blobs = encode_pages(codec, pages, shape)
                if whole < n:  # a short last page (opaque bytes): coded alone, as bytes
                    blobs += codec.encode(rows[whole * stride : whole * stride + geom.size_of(page + n - 1)]
                                          .reshape(1, -1), None)
            sizes = np.array([len(b) for b in blobs], dtype=np.uint32)
            total = int(sizes.sum(dtype=np.int64))
            if out.nbytes < -(-total // ALIGN) * ALIGN:
                out = aligned_buffer(max(total, BATCH_BYTES))
            at = 0
            for blob in blobs:
                out[at : at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
                at += len(blob)
            data = out[: -(-total // ALIGN) * ALIGN]
            data[total:] = 0
            codes = PageCodes(codec.name, sizes, np.array([page_checksum(b) for b in blobs], dtype=np.uint64), shape,
                              *(lossy or ()))
            yield CodedBatch(page, n, data, codes, time.perf_counter() - t0)


def encode_pages(codec: codecs.Codec, pages: np.ndarray, shape: codecs.PageShape | None) -> list[bytes]:
    """Pages coded by a lossless codec, a share of them on each CPU worker (zstd codes without the GIL)."""
    parts = [(lo, min(lo + PAGES_A_JOB, len(pages))) for lo in range(0, len(pages), PAGES_A_JOB)]
    out: list[list[bytes]] = [[] for _ in parts]

    def job(i: int) -> None:
        out[i] = codec.encode(pages[parts[i][0] : parts[i][1]], shape)

    run_jobs([functools.partial(job, i) for i in range(len(parts))])
    return [blob for part in out for blob in part]


def _lossy(codec: codecs.Codec, pages: np.ndarray, shape: codecs.PageShape | None,
           bounds: np.ndarray) -> tuple[list[bytes], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Pages coded lossily, each past its bound kept as it is: their blobs,
    and what each decodes to (checksums), and its relative and largest error."""
    coded = codecs.code(codec, pages, shape, keep=True)
    blobs, rel, worst = coded.blobs, coded.rel_error.copy(), coded.max_error.copy()
    sums = np.empty(len(pages), dtype=np.uint64)
    for i, page in enumerate(pages):
        if coded.decoded is None or not rel[i] <= bounds[i]:  # (NaN: not within it)
            blobs[i], rel[i], worst[i] = codecs.as_is(page), 0.0, 0.0
            sums[i] = page_checksum(page)
        else:
            sums[i] = page_checksum(coded.decoded[i])
    return blobs, (sums, rel, worst)


def extent(span: Span) -> tuple[int, int]:
    """The aligned bytes [lo, hi) of the tier that hold a coded span's blobs."""
    assert span.codes is not None
    lo = span.offset - span.offset % ALIGN
    return lo, -(-(span.offset + span.codes.stored) // ALIGN) * ALIGN


def decode_window(coded: np.ndarray, span: Span, geom: Geometry, out: np.ndarray) -> None:
    """The pages of a coded span, whose blobs lie back to back at the start
    of coded, decoded into out at the page stride (the rest of a short last
    page's room zeroed). Each blob is checked against its XXH3 first."""
    codes = span.codes
    assert codes is not None
    codec = codecs.get(codes.codec)
    offsets = codes.offsets
    run_jobs([functools.partial(_decode_pages, codec, coded, offsets, span, geom, out, lo,
                                min(lo + PAGES_A_JOB, span.n_pages)) for lo in range(0, span.n_pages, PAGES_A_JOB)])


def _decode_pages(codec: codecs.Codec, coded: np.ndarray, offsets: np.ndarray, span: Span, geom: Geometry,
                  out: np.ndarray, lo: int, hi: int) -> None:
    """decode_window's pages [lo, hi) of the span (a CPU worker's share)."""
    codes = span.codes
    assert codes is not None
    stride = geom.stride
    for i in range(lo, hi):
        page = span.first_page + i
        blob = coded[offsets[i] : offsets[i + 1]]
        if page_checksum(blob) != int(codes.sums[i]):
            raise DataLoss(f"page {page} failed its checksum in the {span.tier} tier (its coded bytes)", page=page,
                           tier=span.tier)
        size = geom.size_of(page)
        try:
            codec.decode(memoryview(blob), codes.shape if size == geom.page_bytes else None,
                         out[i * stride : i * stride + size])
        except DataLoss as exc:
            raise DataLoss(f"page {page} of the {span.tier} tier does not decode: {exc}", page=page,
                           tier=span.tier) from None
        out[i * stride + size : (i + 1) * stride] = 0


def write(copier: Any, tier: str, src: list[Span], ranges: list[tuple[int, int]], geom: Geometry,
          checksums: np.ndarray, codec: str, shape: codecs.PageShape | None,
          alloc: Callable[[list[tuple[int, int]], int], list[Piece]], into: list[Piece], io_class: int) -> None:
    """Write the pages of `ranges` (page ranges, read from src) into the
    file tier, into pieces alloc(page ranges, stride) gives, appended to
    `into` as they are allocated, so that a failure leaves the caller what
    to free; the caller syncs the tier. As they are (codec "none"): one
    move into pieces of the ranges. Coded: read through the copier's
    windows (checked as any move checks them), a batch at a time, each
    batch's blobs into a piece of their own (one range of one page, of
    their size), which carries their codes."""
    if codec == "none":
        into += alloc(ranges, geom.stride)
        copier.move(src, [Span(p.first_page, p.n_pages, tier, p.offset) for p in into], geom, checksums, io_class)
        return
    file = copier.tiers[tier]
    stored, seconds, t0 = 0, 0.0, time.perf_counter()
    for first, count in ranges:
        for batch in encode_windows(copier.windows(between(src, first, first + count, geom.stride), geom, checksums,
                                                   io_class), geom, codec, shape):
            (piece,) = alloc([(batch.first_page, 1)], batch.data.nbytes)
            into.append(Piece(piece.offset, piece.alloc_bytes, batch.first_page, batch.n_pages, batch.codes))
            file.write(piece.offset, batch.data, io_class)
            copier.add_copies()
            stored, seconds = stored + batch.codes.stored, seconds + batch.seconds
    nbytes = sum(count for _, count in ranges) * geom.page_bytes
    if copier.events is not None:
        copier.events.coded(codec, "encode", nbytes, stored, seconds)
    copier.record(f"{src[0].tier}->{tier}", nbytes, time.perf_counter() - t0)
