"""A session's copy in a memory tier re-coded in place, smaller (Recoding,
recoding.py, says when and with what): a move the eviction plans make
before any session leaves the tier (policy's RECODE), run on the mover or
on the thread that needs the room, with the session's lock held.

The session is written back first where it is not durable yet; its pages
there not coded yet are then let go of and coded again from the exact copy
on disk (read and checked as any move reads them), a batch at a time into
pieces of the tier of their own, which carry their codes (a lossy codec's:
each page's checksum as it decodes, and its error, a page past the bound
counting what it carries already kept as it is). Room is taken where the
tier has it free, never by evicting: a re-code that finds none stops there,
the pages it did not code left on disk alone, as an eviction leaves them.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from tierd import codecs
from tierd.core.events import StoreEvents
from tierd.core.model import Session
from tierd.core.placement import Placement
from tierd.core.store.recoding import Recoding
from tierd.core.store.table import SessionTable
from tierd.errors import DataLoss
from tierd.policy import RECODE
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.transfer import coded, memory
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import between

log = logging.getLogger("tierd.core.store")


class Recoder:
    def __init__(self, recoding: Recoding, table: SessionTable, placement: Placement, copier: CopyEngine,
                 tiers: dict, events: StoreEvents) -> None:
        self.recoding = recoding
        self.table = table
        self.placement = placement
        self.copier = copier
        self.tiers = tiers
        self.events = events

    def recode(self, session: Session, io_class: IOClass) -> None:
        """Re-code the session's pages in the tier not coded yet (the session's op lock held)."""
        tier, snap = self.recoding.tier, session.snap
        with self.table.lock:
            if not self.recoding.may(session):
                return
        if not session.durable:
            self.placement.write_durable(session, io_class, RECODE, True)
        with self.table.lock:
            plain = [p for p in snap.pieces(tier) if p.codes is None]
            if not plain or session.readers or not session.durable:
                return
            snap.placement[tier] = [p for p in snap.pieces(tier) if p.codes is not None]
        self.placement.retire(session, [(tier, p) for p in plain])
        new: list[Piece] = []
        try:
            self._code(session, [(p.first_page, p.n_pages) for p in plain], new, io_class)
        except DataLoss as exc:
            self.placement.faults.damaged(session, exc)
            raise
        except OSError as exc:
            raise self.placement.faults.io_failed("read", exc, session.key) from exc
        finally:
            with self.table.lock:
                snap.add_pieces(tier, new)

    def _code(self, session: Session, ranges: list[tuple[int, int]], into: list[Piece], io_class: IOClass) -> None:
        tier, snap = self.recoding.tier, session.snap
        geom, t = snap.geometry, self.tiers[tier]
        with self.table.lock:
            codec, bound = self.recoding.codec_for(session)
        lossy = codecs.get(codec).lossy
        shape = codecs.page_shape(snap.spec) if lossy else codecs.lossless_shape(snap.spec)
        bounds = None
        if lossy:  # a page's bound counts the error it carries already
            bounds = np.full(snap.n_pages, bound, dtype=np.float64)
            bounds[: snap.errors.size] -= snap.errors
        src = snap.spans(self.recoding.durable)
        windows = (w for first, count in ranges for w in self.copier.windows(
            between(src, first, first + count, geom.stride), geom, snap.checksums, io_class))
        nbytes = stored = 0
        seconds, t0 = 0.0, time.perf_counter()
        for batch in coded.encode_windows(windows, geom, codec, shape, bounds):
            got = t.alloc_pages(1, batch.codes.stored, owner=session.key.tenant)  # no eviction for a re-code
            if not got:
                log.info("re-coding %s/%s in the %s tier stopped at page %d: the tier has no room free",
                         *session.key, tier, batch.first_page)
                break
            piece = Piece(got[0].offset, got[0].alloc_bytes, batch.first_page, batch.n_pages, batch.codes)
            memory.copy(self.copier.view(tier, piece.offset, batch.codes.stored), batch.data[: batch.codes.stored])
            into.append(piece)
            nbytes += batch.n_pages * geom.page_bytes
            stored, seconds = stored + batch.codes.stored, seconds + batch.seconds
            if batch.codes.rel_error is not None:
                self.events.coding_errors(codec, batch.codes.rel_error)
        self.events.coded(codec, "encode", nbytes, stored, seconds)
        self.recoding.measured(nbytes, stored)
        self.copier.record(f"{self.recoding.durable}->{tier}", nbytes, time.perf_counter() - t0)
