"""Pages coded on their way to the remote tier, and decoded on the way back.

A publish of a tier with a codec (`--codec remote=lossless`) reads the
session's pages as it would publish them (checked as any move), codes them a
batch at a time and hands the store each page's coded bytes, recording per
page its coded size, the XXH3 of its coded bytes, and the checksum of the
page a reader will decode (the page's own, for a lossless codec): the
version's manifest.Coding.

Lossy only by consent (Consent): a lossy codec codes the KV of sessions
whose save asked for it (within the error it gave) or, where it did not
say, whose tenant allows it (lossy_tenants; "*": every tenant), where it
can read their pages (a known arrangement of 2- or 4-byte elements: an FP8
cache and opaque snapshots are coded lossless); every other session of that
tier is coded lossless. Each page it codes is decoded again at once and its
error measured (codecs.code); a page past the session's bound is kept as it
is. The
manifest then records each page's error and the checksum of what it
decodes to (decoding is deterministic), and a digest of the pages' own
checksums (Coding.source), by which a node knows its exact copy as the
content of that version. A fetch reads the coded bytes into a buffer of
its own and, as each page's bytes are in, checks them against their XXH3
(damaged coded bytes are DATA_LOSS, never handed to a decoder), decodes the
page into its place in the landing tier; the fetch then checks every page
it wrote against the manifest's checksums, as any fetch does. The codec a
version was coded with is the manifest's: one this node does not know is a
clear error (FAILED_PRECONDITION), not a page.

`auto` chooses, for each publish, lossless or none, whichever measured
faster on this node end to end (codecs/auto.py): where decoding is slower than
the link (lossless in front of a fast network), coding costs more time
than the bytes it saves.

Runs where publishes and fetches run: the publisher's thread (or the RPC
thread of publish()), the RPC thread of the call that fetches, or a mover.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator

import numpy as np

from tierd import codecs
from tierd.checksum import page_checksum
from tierd.codecs.auto import AUTO, AutoChoice, check_codec
from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument, shown
from tierd.layout import KVSpec
from tierd.remote.coded import Coding, source_of
from tierd.remote.manifest import Manifest
from tierd.transfer.coded import PAGES_A_JOB, encode_pages
from tierd.transfer.copier import PageWriter
from tierd.transfer.runs import Geometry
from tierd.transfer.workers import run_jobs

BATCH_BYTES = 4 << 20  # pages coded at a time: large enough for the coder, small enough to stay in cache



class Consent:
    """Who consents to lossy codes, and to how much error: a save that says
    (Session.lossy: its bound, 0 for none) or else its tenant (lossy_tenants;
    "*": every tenant), each page within at most max_error (--lossy-max-error)."""

    def __init__(self, lossy_tenants: frozenset[str], max_error: float) -> None:
        self.lossy_tenants, self.max_error = lossy_tenants, max_error

    def describe(self, codec: str) -> str:
        """For the log, after a tier's codec: whose sessions it codes lossily
        and within what ("" for a codec that is not lossy, or auto)."""
        if codec == AUTO or not codecs.get(codec).lossy:
            return ""
        tenants = ", ".join(sorted(self.lossy_tenants))
        return (f" (lossy for the saves that ask{' and the tenants ' + tenants if tenants else ''}, within "
                f"{self.max_error}; lossless for the others)")

    def bound(self, session: Session) -> float | None:
        """The relative error a lossy codec's page of the session may carry,
        None where it may not code the session lossily: no consent, or pages
        a lossy codec does not read (an arrangement it knows, of 2- or 4-byte
        elements). Under the store lock."""
        shape = codecs.page_shape(session.snap.spec)
        if shape is None or not shape.codable:
            return None
        tenant = session.key.tenant
        asked = session.lossy if session.lossy is not None else \
            self.max_error if tenant in self.lossy_tenants or "*" in self.lossy_tenants else 0.0
        return min(asked, self.max_error) if asked > 0 else None


class PageCoder:
    """The remote tier's codec (`codec`: a registered codec's name; "none":
    pages as they are), and the coding and decoding of versions."""

    def __init__(self, codec: str, tier: str, events: StoreEvents, lossy_tenants: frozenset[str],
                 max_error: float) -> None:
        self.codec = check_codec(codec)
        self.tier = tier  # the remote tier's name, for errors
        self.events = events
        self.auto = AutoChoice(tier, events.codec_chosen, ("publish", "fetch")) if self.codec == AUTO else None
        self.consent = Consent(lossy_tenants, max_error)

    def coding_for(self, bound: float | None, n_pages: int, carried: np.ndarray) -> Coding | None:
        """What a publish of a session's pages records of them (None: as
        they are), bound: the error its consent allows a page (Consent.bound;
        None: lossless only). Pages that carry errors already (carried: each
        page's, or empty) are coded, lossless at least, so that their
        version records them."""
        codec = self.auto.choose() if self.auto is not None else self.codec
        codec = codec if codec != "none" or not carried.size else "lossless"
        if codec == "none":
            return None
        lossy = codecs.get(codec).lossy
        return Coding.empty(codec if not lossy or bound is not None else "lossless", n_pages)

    def encode(self, data: Iterable[tuple[bytes | memoryview, bool]], spec: KVSpec, geom: Geometry,
               checksums: np.ndarray, coding: Coding, carried: np.ndarray,
               bound: float | None) -> Iterator[tuple[bytes, bool]]:
        """The coded bytes of the pages whose logical bytes data holds (in
        pieces of any size, each valid until the next is asked for), a page's
        blob at a time (each stays valid), with coding filled as they go
        (and, once all are coded, its source: the digest of the pages'
        checksums). A page's recorded relative error is what the pages carried
        already (carried, from a lossy copy they were fetched from) plus what
        this coding adds: a bound on its error against the page first stored;
        a lossy codec's page past `bound` (less what it carries) is kept as it is."""
        codec, shape = codecs.get(coding.codec), codecs.page_shape(spec)
        per_batch = max(1, BATCH_BYTES // geom.page_bytes)
        flat = np.empty(per_batch * geom.page_bytes, dtype=np.uint8)
        pieces = (memoryview(piece).cast("B") for piece, _ in data)
        rest, page, seconds = memoryview(b""), 0, 0.0
        while page < geom.n_pages:
            count = min(per_batch, geom.n_pages - page)
            want, filled = (count - 1) * geom.page_bytes + geom.size_of(page + count - 1), 0
            while filled < want:
                if not len(rest):
                    rest = next(pieces)
                take = min(len(rest), want - filled)
                flat[filled : filled + take] = np.frombuffer(rest[:take], dtype=np.uint8)
                filled, rest = filled + take, rest[take:]
            t0 = time.perf_counter()
            blobs = self._code(codec, shape, flat[:want], page, count, geom, checksums, coding,
                               (bound or 0.0) - (carried[page : page + count] if carried.size else 0.0))
            seconds += time.perf_counter() - t0
            for blob in blobs:
                yield blob, True
            page += count
        coding.nbytes, coding.source = geom.nbytes, source_of(checksums)
        self.events.coded(coding.codec, "encode", geom.nbytes, coding.stored, seconds)
        if codec.lossy:
            self.events.coding_errors(coding.codec, coding.rel_error)
        n = min(carried.size, geom.n_pages)
        coding.rel_error[:n] += carried[:n]

    @staticmethod
    def _code(codec: codecs.Codec, shape: codecs.PageShape | None, flat: np.ndarray, page: int, count: int,
              geom: Geometry, checksums: np.ndarray, coding: Coding, max_error: float | np.ndarray) -> list[bytes]:
        """The blobs of `count` pages from page `page` on, back to back in
        flat, recorded in coding; a lossy codec's page past max_error (each
        page's: the bound less what the page carries already) is kept as it is."""
        at = slice(page, page + count)
        coding.checksums[at] = checksums[at]
        if codec.lossy:  # (consented: whole pages of a shape it reads)
            pages = flat.reshape(count, geom.page_bytes)
            coded = codecs.code(codec, pages, shape, keep=True)
            blobs = coded.blobs
            assert coded.decoded is not None
            bounds = np.broadcast_to(max_error, (count,))
            for i in range(count):
                if not coded.rel_error[i] <= bounds[i]:  # (NaN: not within it)
                    blobs[i] = codecs.as_is(pages[i])
                else:  # (what it decodes to: another page even where no value changed, -0.0 for 0.0 say)
                    coding.checksums[page + i] = page_checksum(coded.decoded[i])
                    coding.rel_error[page + i], coding.max_error[page + i] = coded.rel_error[i], coded.max_error[i]
        else:
            whole = count if geom.size_of(page + count - 1) == geom.page_bytes else count - 1
            blobs = encode_pages(codec, flat[: whole * geom.page_bytes].reshape(whole, geom.page_bytes), shape)
            if whole < count:  # a short last page (opaque bytes): coded alone, as bytes
                blobs += codec.encode(flat[whole * geom.page_bytes :].reshape(1, -1), None)
        coding.sizes[at] = [len(b) for b in blobs]
        coding.sums[at] = [page_checksum(b) for b in blobs]
        return blobs

    def measured(self, way: str, op: str, nbytes: int, seconds: float) -> None:
        """A version coded `way` ("none": as it is) was published or fetched (op) in `seconds`."""
        if self.auto is not None:
            self.auto.measured(way, op, nbytes, seconds)

    def decoder(self, m: Manifest, spec: KVSpec) -> Decoder | None:
        """How a fetch of m's version reads its pages (None: as they are, straight into theirs)."""
        if m.coding is None:
            return None
        try:
            codec = codecs.get(m.coding.codec)
        except InvalidArgument:
            raise FailedPrecondition(f"the remote tier holds this session's version coded with "
                                     f"{shown(m.coding.codec)}, a codec this node does not know (it knows "
                                     f"{', '.join(codecs.names())}): a newer tierd wrote it",
                                     codec=m.coding.codec) from None
        return Decoder(codec, m, spec, self.tier, self.events)


class Decoder:
    """A fetch of a coded version: its coded bytes read into a buffer of its
    own (claim), each page decoded into the pages a PageWriter gives once
    its bytes are in (decode_upto)."""

    def __init__(self, codec: codecs.Codec, m: Manifest, spec: KVSpec, tier: str, events: StoreEvents) -> None:
        assert m.coding is not None
        self.codec, self.m, self.coding, self.tier, self.events = codec, m, m.coding, tier, events
        self.shape = codecs.page_shape(spec)
        self.coded = np.empty(m.coding.stored, dtype=np.uint8)
        self.offsets = m.coding.offsets
        self._claimed = 0
        self.decoded = 0  # pages decoded
        self.seconds = 0.0

    def claim(self, nbytes: int) -> list[np.ndarray]:
        """Memory for the next nbytes of the version's coded bytes."""
        self._claimed += nbytes
        return [self.coded[self._claimed - nbytes : self._claimed]]

    def decode_upto(self, received: int, pages: PageWriter) -> int:
        """Decode every page whose coded bytes lie within the first `received`
        bytes and is not decoded yet, into the pages `pages` (a PageWriter)
        claims for it; how many pages are decoded."""
        t0 = time.perf_counter()
        m, offsets = self.m, self.offsets
        ready = []  # (page, the memory it decodes into), in page order
        while self.decoded < m.n_pages and offsets[self.decoded + 1] <= received:
            ready.append((self.decoded, pages.claim(m.size_of(self.decoded))[0]))
            self.decoded += 1
        run_jobs([functools.partial(self._decode, ready[lo : lo + PAGES_A_JOB])
                  for lo in range(0, len(ready), PAGES_A_JOB)])
        self.seconds += time.perf_counter() - t0
        if self.decoded == m.n_pages:
            self.events.coded(self.coding.codec, "decode", m.nbytes, self.coding.stored, self.seconds)
        return self.decoded

    def _decode(self, pages: list[tuple[int, np.ndarray]]) -> None:
        """Check and decode these pages (a CPU worker's share of decode_upto's)."""
        m, offsets = self.m, self.offsets
        for i, out in pages:
            blob = self.coded[offsets[i] : offsets[i + 1]]
            if page_checksum(blob) != int(self.coding.sums[i]):
                raise DataLoss(f"page {i} failed its checksum in the remote tier (its coded bytes)", page=i,
                               tier=self.tier)
            try:
                self.codec.decode(memoryview(blob), None if m.size_of(i) < m.page_bytes else self.shape, out)
            except DataLoss as exc:
                raise DataLoss(f"page {i} of the remote tier's copy does not decode: {exc}", page=i,
                               tier=self.tier) from None
