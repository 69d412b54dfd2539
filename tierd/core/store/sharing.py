"""Prefix sharing: pages of the same tokens (same chained hash, under the
same cache salt) and the same identity are stored once per tenant.

A session that stores or restores pages another session of its tenant
already holds, or copies them into a tier where another holds them, takes
pieces of that session's allocations instead of room of its own (a fetch
from the remote tier writes every page of its own): each a piece cut to the pages it shares, its allocation
held once more (Placement.hold) and freed when its last holder lets go. The
lender's checksums come with its pages: a restore checks every page against
the bytes it really holds. Only whole pieces that start inside the range
taken are lent, so a piece always starts where its allocation starts.

The prefix table (core/prefixes.py) follows every change of a session's
token hashes: this component observes the session table (TableObserver),
which tells it under the store lock wherever they change (a store's
commit, a drop, recovery). A damaged page damages every session
holding its allocation, and damaged sessions lend nothing: the next store of
those tokens keeps a good copy of its own. Runs on whichever thread stores,
restores or moves the session; all of it under the store lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import numpy as np

from tierd.core import tokens
from tierd.core.holders import Holders
from tierd.core.model import Session, Snapshot
from tierd.core.ports import Lending
from tierd.core.prefixes import PrefixTable
from tierd.errors import DataLoss
from tierd.layout import KVSpec
from tierd.tiers import MEMORY, kind_of
from tierd.tiers.allocator import Piece
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.store")
LENDERS_TRIED = 8  # holders of a page looked at for a copy in a given tier


class Sharing:
    def __init__(self, lock: threading.RLock, tiers: dict) -> None:
        self._lock = lock  # the store lock
        self.holders = Holders(lock)  # allocations several pieces hold: placement holds and frees through these
        self.tiers = tiers
        self._prefixes = PrefixTable()

    @property
    def lending(self) -> Lending:
        """What placement needs of sharing."""
        return Lending(self.borrow, self.shared_ranges)

    # -- the table -------------------------------------------------------------------

    @staticmethod
    def _entry(snap: Snapshot) -> tuple[str, np.ndarray, int]:
        """What the prefix table records of a snapshot: fingerprint, hashes, tokens of its known pages it lends."""
        hashes = lendable(snap)
        known = tokens.known_pages(hashes)
        return snap.spec.fingerprint, hashes, min(snap.num_tokens, known * snap.spec.block_tokens)

    def entered(self, session: Session) -> None:
        """The session's content is new or changed (TableObserver). Store lock held."""
        if not session.snap.spec.is_opaque:
            self._prefixes.add(session, *self._entry(session.snap))

    def leaving(self, session: Session) -> None:
        """The session's content is about to change or go (TableObserver). Store lock held."""
        if not session.snap.spec.is_opaque:
            self._prefixes.remove(session, *self._entry(session.snap))

    def shared_ranges(self, session: Session, ranges: list[tuple[int, int]]) -> bool:
        """Whether another session holds a page in these ranges (by token hash:
        the first page of a range is enough, the chain covers the rest)."""
        with self._lock:
            return any(self._held_by_others(session, first) for first, _ in ranges)

    def _held_by_others(self, s: Session, page: int) -> bool:
        """Whether another session holds this page of the session's, by token hash. Store lock held."""
        snap = s.snap
        return page < tokens.known_pages(snap.token_hashes) and any(
            other.key != s.key
            for other in self._prefixes.holders(s.key.tenant, snap.spec.fingerprint, snap.token_hashes[page]))

    def shared_depth(self, s: Session) -> int:
        """How many leading pages of the session other sessions hold too (by
        token hash: a holder of page i holds the pages before it)."""
        with self._lock:  # (Stat's callers may not hold it: the table changes under it)
            lo, hi = 0, tokens.known_pages(s.snap.token_hashes)
            while lo < hi:  # the first page no other session holds
                mid = (lo + hi) // 2
                if self._held_by_others(s, mid):
                    lo = mid + 1
                else:
                    hi = mid
            return lo

    def deepest(self, tenant: str) -> int:
        """The most tokens one session of the tenant holds of known pages."""
        with self._lock:
            return self._prefixes.deepest(tenant)

    def match(self, tenant: str, spec: KVSpec, request: np.ndarray, salt: str, exclude: SessionKey | None
               ) -> tuple[Session | None, np.ndarray]:
        """The session of the tenant that holds the most leading pages of a
        request's tokens (under its salt), and those pages' hashes: hashed
        one page at a time, only as far as they match. Store lock held."""
        if spec.is_opaque:
            return None, tokens.empty()
        donor, found = self._walk(tenant, spec.fingerprint, tokens.chained(request, spec.block_tokens, salt), 0,
                                  exclude)
        return donor, np.array(found, dtype=np.uint8).reshape(len(found), tokens.HASH_BYTES)

    def _walk(self, tenant: str, fingerprint: str, pages: Iterable[np.ndarray], lo: int,
              exclude: SessionKey | None) -> tuple[Session | None, list[np.ndarray]]:
        """The session of the tenant that holds the most of these pages' hashes
        (pages lo, lo + 1, ...), and those of them it holds. A holder of page i
        holds every page before it: the table is asked only where the holder
        found so far stops matching."""
        donor, found = None, []
        for i, h in enumerate(pages, lo):
            held = lendable(donor.snap) if donor is not None else None
            if held is None or i >= len(held) or held[i].tobytes() != h.tobytes():
                lenders = self._lender(tenant, fingerprint, h, exclude)
                if not lenders:
                    break
                donor = lenders[0]
            found.append(h)
        return donor, found

    def _lender(self, tenant: str, fingerprint: str, page_hash: np.ndarray, exclude: SessionKey | None,
                tried: int = 1) -> list[Session]:
        """Up to `tried` sessions of the tenant that can lend the page with this hash."""
        out = []
        for s in self._prefixes.holders(tenant, fingerprint, page_hash):
            if s.key != exclude and not s.damaged and not s.dropped:
                out.append(s)
                if len(out) == tried:
                    break
        return out

    def donor(self, tenant: str, spec: KVSpec, hashes: np.ndarray, lo: int, hi: int,
               exclude: SessionKey | None) -> tuple[Session | None, int]:
        """The session of the tenant that holds the most of pages [lo, hi) of
        these hashes from lo on, and the page it holds them up to. Store lock held."""
        if spec.is_opaque:
            return None, lo
        donor, found = self._walk(tenant, spec.fingerprint, hashes[lo : min(hi, tokens.known_pages(hashes))], lo,
                                  exclude)
        return donor, lo + len(found)

    def lend(self, donor: Session, lo: int, upto: int) -> tuple[dict[str, list[Piece]], int]:
        """Pieces of the donor's pages [lo, upto), in every tier that holds
        them, each starting at or past lo and cut at the end: held for the
        borrower. Returns them and the page up to which they hold every page
        from lo. Store lock held."""
        snap = donor.snap
        covered = np.zeros(max(upto - lo, 0), dtype=bool)
        held = self.holders
        good = {t: [p for p in pieces if lendable_piece(t, p) and not held.is_damaged(t, p)]
                for t, pieces in snap.placement.items()}
        for pieces in good.values():
            for p in pieces:
                if lo <= p.first_page < upto:
                    covered[p.first_page - lo : min(p.first_page + p.n_pages, upto) - lo] = True
        gaps = np.flatnonzero(~covered)
        end = lo + (int(gaps[0]) if gaps.size else len(covered))
        lent: dict[str, list[Piece]] = {}
        for tier, pieces in good.items():
            cut = [p.head(min(p.n_pages, end - p.first_page))
                   for p in pieces if lo <= p.first_page < end]
            if cut:
                self.holders.hold(tier, cut)
                lent[tier] = cut
        return lent, end

    def borrow(self, session: Session, tier: str, ranges: list[tuple[int, int]]
                ) -> tuple[list[Piece], list[tuple[int, int]]]:
        """Placement's hook before a copy into `tier`: pieces there of pages
        in `ranges` that another session holds with the same hashes and
        checksums, held for this one, and the ranges still to copy."""
        snap = session.snap
        if snap.spec.is_opaque or not ranges:
            return [], ranges
        known = tokens.known_pages(snap.token_hashes)
        borrowed: list[Piece] = []
        left: list[tuple[int, int]] = []
        with self._lock:
            for first, count in ranges:
                at, stop = first, first + count
                while at < stop:
                    got = 0
                    if at < known:
                        best: list[Piece] = []
                        for lender in self._lender(session.key.tenant, snap.spec.fingerprint, snap.token_hashes[at],
                                                   session.key, LENDERS_TRIED):
                            pieces = self._same_pages(session, lender, tier, at, min(stop, known))
                            if sum(p.n_pages for p in pieces) > sum(p.n_pages for p in best):
                                best = pieces
                        got = sum(p.n_pages for p in best)
                        if got:
                            self.holders.hold(tier, best)
                            borrowed += best
                    if not got:
                        left.append((at, stop - at))
                        break
                    at += got
        return borrowed, left

    def _same_pages(self, session: Session, lender: Session, tier: str, lo: int, hi: int) -> list[Piece]:
        """The lender's pieces in `tier` that hold pages lo, lo + 1, ... (up
        to hi) with this session's hashes and checksums, cut where they stop
        (or an allocation found damaged starts)."""
        mine, theirs = session.snap, lender.snap
        hi = min(hi, theirs.n_pages)
        same = np.all(mine.token_hashes[lo:hi] == theirs.token_hashes[lo:hi], axis=1) & \
            (mine.checksums[lo:hi] == theirs.checksums[lo:hi])
        stops = np.flatnonzero(~same)
        hi = lo + (int(stops[0]) if stops.size else hi - lo)
        out, at = [], lo
        for p in theirs.pieces(tier):
            if p.first_page == at and at < hi and lendable_piece(tier, p) and not self.holders.is_damaged(tier, p):
                n = min(p.n_pages, hi - at)
                out.append(p.head(n))
                at += n
        return out

    def damage_holders(self, session: Session, exc: DataLoss) -> None:
        """A page of the session failed its checksum: every session holding
        the same allocation of that page is damaged too (they would serve the
        same bytes), and none of them lends it again."""
        tier, page = exc.details.get("tier"), exc.details.get("page")
        if not isinstance(page, int) or tier not in self.tiers:
            return
        snap = session.snap
        with self._lock:
            piece = next((p for p in snap.pieces(tier) if p.first_page <= page < p.first_page + p.n_pages), None)
            if piece is None or self.holders.holders(tier, piece) < 2 or \
                    page >= tokens.known_pages(snap.token_hashes):
                return
            self.holders.damage(tier, piece)  # lent no more, also by a store that took it before this
            hit = []
            for other in list(self._prefixes.holders(session.key.tenant, snap.spec.fingerprint,
                                                     snap.token_hashes[page])):
                if other is not session and not other.damaged and any(
                        p.offset == piece.offset for p in other.snap.pieces(tier)):
                    other.damaged = True
                    hit.append(other.key.session_id)
        if hit:
            log.error("%d other sessions of %s hold that copy of page %d and are damaged too: %s", len(hit),
                      session.key.tenant, page, ", ".join(hit[:8]) + (", ..." if len(hit) > 8 else ""))


def lendable_piece(tier: str, p: Piece) -> bool:
    """Whether a piece may be lent: not a copy a memory tier re-coded to make
    room (a serving copy of its session's, perhaps lossy)."""
    return p.codes is None or kind_of(tier).medium != MEMORY


def lendable(snap: Snapshot) -> np.ndarray:
    """The token hashes of the snapshot's pages another session may take: up
    to its first page that is not exact (a page fetched from a copy coded
    lossily is lent to no session: another's exact store of those tokens
    keeps pages of its own)."""
    if snap.errors.size:
        return snap.token_hashes[: int(np.argmax(snap.errors > 0))]
    return snap.token_hashes
