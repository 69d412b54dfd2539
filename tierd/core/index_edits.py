"""What the disk index is told when a session's content is cut, replaced
or forgotten, and the pieces that go with it, for placement.Placement
(Placement.edits: it hands in its index, durable tier, holders, store lock
and retire). Runs inside the store, called with the session's op lock held.

A store that replaces pages of a durable state (from token 0, or from a
page before its end; a client's, or the pages a restore takes from other
sessions) leaves that state in the index, whole, its pieces held by the
session (Session.kept) as well as by the content where it keeps them, until
the new content is durable (Placement._write_durable replaces the state in
one transaction) or the session is forgotten: a crash meanwhile finds it as
it was, never cut short, gone, or an older copy another tier holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from tierd.core.holders import Holders
from tierd.core.index import DiskIndex
from tierd.core.model import Session
from tierd.core.rows import with_pages
from tierd.tiers.allocator import Piece


class IndexEdits:
    def __init__(self, index: DiskIndex | None, durable: str | None, lock: threading.RLock, held: Holders,
                 retire: Callable[[Session, list[tuple[str, Piece]]], None]) -> None:
        self.index = index
        self.durable = durable
        self.lock = lock
        self.held = held
        self.retire = retire  # Placement.retire

    def truncate(self, session: Session, n_pages: int,
                 add: list[tuple[Piece, np.ndarray, np.ndarray]] | None = None, keep: bool = False
                 ) -> list[tuple[str, Piece]]:
        """Forget pages from n_pages on (the index first), recording in the
        index, in the same transaction, the durable tier's pieces `add` (with
        their checksums and token hashes) that the session takes from other
        sessions; returns pieces to free. With keep (any store but a fetch), a
        durable state the index holds is kept (the module's docstring), and
        `add` is recorded with the new content; without, or once the session is
        found damaged, a state kept is given up first."""
        snap = session.snap
        cut = n_pages < snap.n_pages
        if not cut and not add:
            return []
        if session.kept and (not keep or session.damaged):  # (a page of it may be what failed its check)
            self.give_up_kept(session)
        # A durable state the index holds (a damaged one is not worth keeping), its pieces each named there.
        durable_state = session.row is not None and not session.damaged and snap.pieces(self.durable)
        if keep and self.index is not None and (session.kept or cut and durable_state):
            if not session.kept:
                with self.lock:  # held by the state kept too: the content lets go of those past n_pages below
                    session.kept = list(snap.pieces(self.durable))
                    self.held.hold(self.durable, session.kept)
        elif self.index is not None and (add or snap.pieces(self.durable) or session.row is not None):
            row = session.row.cut(n_pages) if session.row is not None else None
            self.index.truncate(session.key, n_pages, row, add, unrecord=cut)
            session.row = row
            if cut:
                session.record = self.index.records.discard(session.record) if session.record is not None else None
        if not cut:
            return []
        with self.lock:
            freed = snap.truncate(n_pages)
            snap.version += 1
        return freed

    def give_up_kept(self, session: Session) -> None:
        """Let the durable state kept for a store go before the new content is
        durable (there is no room for both; or a fetch replaces the session):
        the index forgets it first, recording the durable tier's
        pieces the content holds (shared prefix pages) in the same transaction."""
        snap = session.snap
        self.index.truncate(session.key, 0, None, with_pages(snap.pieces(self.durable), snap.checksums,
                                                             snap.token_hashes), unrecord=True)
        session.row = None
        session.record = self.index.records.discard(session.record) if session.record is not None else None
        self.let_go_kept(session)

    def let_go_kept(self, session: Session) -> None:
        """Free the pieces of the state kept for a store (the index holds it no more)."""
        with self.lock:
            kept, session.kept = session.kept, []
        self.retire(session, [(self.durable, p) for p in kept])

    def unindex(self, session: Session) -> None:
        """Remove the session's index entry and record, the first step of forgetting
        it: where either cannot be written, this raises and the session is served as before."""
        if self.index is not None and (session.row is not None or session.snap.pieces(self.durable)):
            self.index.delete(session.key, session.record)
            session.row = session.record = None

    def forget(self, session: Session) -> None:
        """Free every copy of a session already unindexed."""
        with self.lock:
            placement = dict(session.snap.placement)
            session.snap.placement.clear()
        self.retire(session, [(t, p) for t, pieces in placement.items() for p in pieces])
        self.let_go_kept(session)
