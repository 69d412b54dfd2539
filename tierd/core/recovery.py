"""Recovery: what the store serves after a start, from the disk index and the slab files.

Runs once in the store's constructor, before any call. The disk tier opens
the slab files it finds (recreating a missing one, sparse), the index parses
its rows and quarantines those it cannot read (DiskIndex.recover), and here
each remaining session's pieces are checked against the slab files: aligned,
inside one slab whose file was whole, and sharing no byte with another
session's, unless both hold the same allocation of shared prefix pages (same
tenant, same offset, size and first page, and the same checksums and codes
for the pages both hold). A session that fails is quarantined too. Each quarantined session
gets one log line and one count in tierd_sessions_quarantined_total{reason},
and leaves the index; the rest are reserved in the disk tier and served.

Sessions are then rebuilt from the session records beside the slab files
(core/records.py): where the index holds none (new, or moved aside
unreadable), each session's newest sound record; else the record the index
names of each session it did not serve (damaged rows, or a record named
beside no row), unless its slab file is lost. Newer records first, a record
is cut before its first piece that shares bytes with a newer one's or a
served session's (other than the same allocation of shared pages); the
rebuilt rows are then checked as any. Last, the records file holds the
recovered sessions' records and punches out the rest, and sessions with no
record there get one.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from tierd.core.events import StoreEvents
from tierd.core.index import DiskIndex
from tierd.core.record_format import Found, Record
from tierd.core.records import record_stmt
from tierd.core.rows import Damaged, Problem, Recovered, parse, piece_stmts, row_stmt, with_pages
from tierd.errors import TierdError
from tierd.sizes import format_size
from tierd.tiers.allocator import Piece
from tierd.tiers.disk import DiskTier
from tierd.transfer.runs import page_stride
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.recovery")


def recover(index: DiskIndex, disk: DiskTier, events: StoreEvents,
            ) -> tuple[list[Recovered], list[Problem], dict[SessionKey, Record]]:
    """The sessions to serve, reserved in the disk tier, what was repaired,
    and the sessions' records."""
    # Slabs the budget allows, or as many as the index records pieces in: a stray
    # file named slab-099999.bin made the disk tier create and open 100,000 slabs.
    top = index.highest_offset()
    lost = disk.open_existing(max(disk.max_slabs(), 0 if top is None else top // disk.slab_bytes + 1))
    named = _named(index)  # (read before recovery removes the rows of what it refuses)

    def check(recs: list[Recovered]) -> list[Problem]:
        return extent_problems(recs, disk, lost)

    found, problems = index.recover(check)
    found, problems, punch = _from_records(index, named, found, problems, check)
    allocations = {p.offset: (p, rec.key.tenant) for rec in found for p in rec.pieces}  # a shared one once
    disk.reserve(list(allocations.values()))
    for problem in problems:
        if problem.quarantined:
            log.error("recovery: quarantined %s/%s (%s): %s; it is not served and its disk space is reused",
                      problem.key.tenant, problem.key.session_id, problem.reason, problem.detail)
            events.quarantined(problem.reason)
        else:
            log.warning("recovery: %s", problem)
    log.info("recovered %d sessions from the disk index", len(found))
    if disk.used > disk.budget:  # (started with a smaller --disk-budget: policy drops what does not fit)
        log.warning("recovery: the disk tier holds %s, over its budget of %s: the least recently used sessions "
                    "there are dropped until it fits (start with --disk-budget %s or more to keep them)",
                    format_size(disk.used), format_size(disk.budget), format_size(disk.used))
    named = index.named_records() if problems or not named else named  # (unchanged where nothing was)
    records = index.records.start({rec.key: named[rec.key] for rec in found if rec.key in named}, punch)
    records.update(_describe_missing(index, [rec for rec in found if rec.key not in records]))
    return found, problems, records


def _named(index: DiskIndex) -> dict[SessionKey, Record]:
    try:
        return index.named_records()
    except TierdError:
        return {}  # (an index that is not sound: recover() sets it aside, and the records are scanned)


def _from_records(index: DiskIndex, named: dict[SessionKey, Record], found: list[Recovered], problems: list[Problem],
                  check: Callable[[list[Recovered]], list[Problem]]) -> tuple[list[Recovered], list[Problem], bool]:
    """With the sessions the index lost or held damaged rows of rebuilt from
    their records (the newest of each session recovery did not serve, from a
    scan of the file where the index holds no session or recovery found
    damage; else the ones the index names). Whether the records file may
    then be cut to what is held."""
    have = {rec.key for rec in found}
    lost = {p.key for p in problems if p.reason in ("missing_slab", "truncated_slab")}  # (its record would not help)
    damage = any(p.reason != "partial" for p in problems)  # (pages a crash left past a complete state are none)
    try:
        # Damage found (or no session at all): every record in the file, as a damaged row may have taken its
        # records row with it; else the records the index names of sessions it did not serve.
        candidates = index.records.scan() if not found or damage else index.records.read(
            {key: r for key, r in named.items() if key not in have})
        rebuilt = rebuild(index, {k: f for k, f in candidates.items() if k not in have and k not in lost}, found)
    except (OSError, TierdError) as exc:  # the records stay as they are for the next start
        log.error("recovery: sessions could not be rebuilt from the session records (%s)", exc)
        return found, problems, False
    if not rebuilt:
        return found, problems, True
    found, again = index.recover(check)
    have = {rec.key for rec in found}
    log.warning("recovery: rebuilt from the session records: %d sessions; %d served in all", rebuilt, len(found))
    again_keys = {p.key for p in again}
    return found, [replace(p, quarantined=False, detail=f"{p.detail}; rebuilt from its record")
                   if p.quarantined and p.key in have else p for p in problems if p.key not in again_keys] + again, True


def _describe_missing(index: DiskIndex, found: list[Recovered]) -> dict[SessionKey, Record]:
    """Records written now for sessions served with none there (an index of
    an earlier format, a records file lost or cut)."""
    states = [(rec.key, rec.row, with_pages(rec.pieces, rec.checksums, rec.token_hashes)) for rec in found]
    made = {rec.key: r for rec, r in zip(found, index.records.describe_many(states)) if r is not None} if found else {}
    try:
        index.apply([record_stmt(key, r) for key, r in made.items()])
    except TierdError as exc:
        log.warning("recovery: the records of %d sessions could not be named in the index (%s)", len(made), exc)
        for r in made.values():
            index.records.discard(r)
        return {}
    if made:
        log.info("recovery: %d sessions had no record: written", len(made))
    return made


def rebuild(index: DiskIndex, newest: dict[SessionKey, Found], taken: list[Recovered] = ()) -> int:
    """Rows for the sessions of these records, into the index (newer records
    first; one whose pieces share bytes with a newer one's, or with those of
    the sessions `taken`, other than the same allocation of the same shared
    pages, is cut before the first such piece); how many sessions."""
    def holder(rec: Recovered, p: Piece) -> tuple:  # what one allocation of shared pages has the same
        return p.offset + p.alloc_bytes, rec.key.tenant, p.first_page, rec.checksums[p.first_page]

    claimed = {p.offset: holder(rec, p) for rec in taken for p in rec.pieces}
    starts = sorted(claimed)  # claimed: start of each piece taken -> holder()
    stmts: list[tuple[str, tuple]] = []
    for found in sorted(newest.values(), key=lambda f: -f.record.gen):
        key = found.key
        try:
            if any(p[:2] != tuple(key) for p in found.pieces):
                raise Damaged("bad_row", "pieces of another session")
            rec = parse(key, found.row[2:], [p[2:] for p in found.pieces])
        except Damaged as exc:
            log.warning("recovery: the record of %s/%s is not used (%s)", *key, exc.detail)
            continue
        keep = rec.row.num_pages
        for p in rec.pieces:
            end, at = p.offset + p.alloc_bytes, bisect.bisect_right(starts, p.offset) - 1
            shared = claimed.get(p.offset) == holder(rec, p)  # (its first page's checksum: not an older tenant)
            inside = bisect.bisect_left(starts, end) > at + 1  # (a piece taken starts inside this one)
            if not shared and (at >= 0 and claimed[starts[at]][0] > p.offset or inside):
                keep = p.first_page
                break
        row = rec.row.cut(keep)
        if row is None:
            continue
        pieces = [p.head(min(p.n_pages, keep - p.first_page)) for p in rec.pieces if p.first_page < keep]
        for p in pieces:
            if p.offset not in claimed:
                bisect.insort(starts, p.offset)
            claimed[p.offset] = holder(rec, p)
        stmts.append(row_stmt(key, row))
        stmts += piece_stmts(key, with_pages(pieces, rec.checksums, rec.token_hashes))
        if row is rec.row:  # (a record of more pages than kept describes it no more: punched out)
            stmts.append(record_stmt(key, found.record))
    if stmts:
        index.apply(stmts)
    return sum(1 for sql, _ in stmts if "INTO sessions" in sql)


def extent_problems(found: list[Recovered], disk: DiskTier, lost: dict[int, int | None]) -> list[Problem]:
    """The sessions whose pieces the slab files cannot hold: unaligned, too
    small for their pages or across a slab boundary; past the last slab; in a
    slab file that was missing or cut short (`lost`: the bytes such files held,
    None for none); or sharing bytes with another piece (every session
    involved) other than the same allocation of shared pages."""
    slab_bytes, granule = disk.slab_bytes, disk.allocator.granule
    bad: dict[SessionKey, Problem] = {}
    extents: list[tuple[int, int, SessionKey]] = []
    for rec in found:
        stride = page_stride(rec.row.spec.page_bytes)
        for p in rec.pieces:
            slab, off = divmod(p.offset, slab_bytes)
            survived = lost.get(slab, slab_bytes)  # bytes of the slab's file that were there at start
            where = f"the piece at page {p.first_page} ([{p.offset}, {p.offset + p.alloc_bytes}))"
            if p.offset < 0 or p.offset % granule or p.alloc_bytes % granule or p.alloc_bytes < p.held_bytes(stride) \
                    or off + p.alloc_bytes > slab_bytes:
                problem = Problem(rec.key, "bad_extent", f"{where} is unaligned, smaller than its pages or crosses "
                                                         "a slab boundary")
            elif slab >= disk.allocator.num_slabs:
                problem = Problem(rec.key, "past_end", f"{where} lies past the last slab file")
            elif survived is None:
                problem = Problem(rec.key, "missing_slab", f"{where} was in slab file {slab}, which is missing")
            elif survived < off + -(-p.held_bytes(stride) // granule) * granule:  # (the aligned bytes read)
                problem = Problem(rec.key, "truncated_slab", f"{where} lay past the end of slab file {slab}, "
                                                             f"cut to {survived} bytes")
            else:
                extents.append((p.offset, p.offset + p.alloc_bytes, rec.key))
                continue
            bad.setdefault(rec.key, problem)
    by_offset: dict[int, list[tuple[Recovered, Piece]]] = {}
    for rec in found:
        if rec.key not in bad:
            for p in rec.pieces:
                by_offset.setdefault(p.offset, []).append((rec, p))
    again: set[tuple[int, SessionKey]] = set()  # a later holder of an allocation shared with the first
    for holders in by_offset.values():
        (first, p0), others = holders[0], holders[1:]
        for rec, p in others:
            n = min(p.n_pages, p0.n_pages)
            pages = slice(p.first_page, p.first_page + n)
            if (rec.key.tenant, rec.row.spec.fingerprint, p.alloc_bytes, p.first_page) != \
                    (first.key.tenant, first.row.spec.fingerprint, p0.alloc_bytes, p0.first_page) or not np.array_equal(rec.checksums[pages], first.checksums[pages]) \
                    or (p.codes is None) != (p0.codes is None) or p.codes is not None and not p.codes.same_as(p0.codes, n):
                continue  # not one shared allocation: the sweep below finds the overlap
            again.add((p.offset, rec.key))
    reach, holder = -1, None
    for start, end, key in sorted((e for e in extents if e[2] not in bad and (e[0], e[2]) not in again),
                                  key=lambda e: e[:2]):
        if start < reach and holder is not None:
            for k, other in ((key, holder), (holder, key)):
                bad.setdefault(k, Problem(k, "overlap", f"its pieces share bytes at {start} with those of "
                                                        f"{other.tenant}/{other.session_id}"))
        if end > reach:
            reach, holder = end, key
    return list(bad.values())
