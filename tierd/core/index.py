"""The disk tier's durable index: SQLite in WAL mode, synchronous=FULL.

Runs inside the store; every write is one transaction. The order that makes
it crash-safe is the caller's: page data is written and fdatasync'd before the
transaction that points to it commits, and a transaction that forgets pages
commits before their space is reused.

A session row records a complete state of the snapshot whose every page is on
disk: (num_tokens, num_pages, nbytes). Pieces past num_pages belong to a newer
state that had not reached disk whole; recovery drops them.

SQLite's failures (a full file system, an I/O error) come out as tierd errors,
ResourceExhausted or Unavailable, with the transaction rolled back: callers
write the index before they change anything in memory. At start, rows that
do not parse are quarantined (recover), and a file that is not a sound
database any more is moved aside for a fresh one. The schema, its format
version and how SQLite's failures read: core/index_schema.py; row checks: core/rows.py.
It holds the session records beside it (core/records.py), each of which its records table names.
Its own table names the rows that are histories of this node's own, not known to be in the remote tier.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from tierd.codecs.stored import PageCodes
from tierd.core import tokens
from tierd.core.index_schema import (FORMAT_VERSION, MIGRATIONS, SCHEMA, IndexFormatError, IndexUnavailable,
                                     columns, failed, set_aside, tierd_columns, unsound)
from tierd.core.record_format import Record
from tierd.core.records import Records, record_stmt
from tierd.core.rows import Damaged, Problem, Recovered, Row, own_stmt, parse, piece_stmts, row_stmt
from tierd.errors import TierdError
from tierd.tiers.allocator import Piece
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.index")


class DiskIndex:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: list[tuple[str, tuple]] = []  # recovery's repairs not yet committed (_repair)
        self.set_aside: str | None = None  # where an unreadable index was moved at start
        try:
            self._open()
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            if not unsound(exc):
                raise IndexUnavailable(f"cannot open the disk index {path}: {exc}") from None
            self._set_aside(str(exc))
            try:
                self._open()
            except sqlite3.Error as again:
                raise IndexUnavailable(f"cannot create a new disk index {path}: {again}") from None
        self.records = Records(os.path.join(os.path.dirname(os.path.abspath(path)), "records.bin"))

    def _open(self) -> None:
        try:
            self._db = self._connect(exclusive=False)
        except sqlite3.OperationalError as exc:
            # A full file system cannot hold the shared wal-index (index.db-shm).
            # Kept in this process's memory instead, the database is ours alone
            # while we run, as the data dir's lock already makes it.
            self._db = self._connect(exclusive=True)
            log.warning("disk index %s: no shared wal-index (%s); the index is held exclusively: other readers "
                        "wait until tierd stops", self.path, exc)
        try:
            self._db.executescript(SCHEMA)
            self._check_format()
            if columns(self._db) != tierd_columns():
                raise sqlite3.DatabaseError(f"its tables are not tierd's: {columns(self._db)}")
        except BaseException:
            self._db.close()
            raise

    def _check_format(self) -> None:
        found = self._db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
        if found is None:
            self._db.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT_VERSION,))
        elif found[0] in MIGRATIONS:
            self._tx([(stmt, ()) for stmt in MIGRATIONS[found[0]]] +
                     [("UPDATE meta SET value=? WHERE key='format'", (FORMAT_VERSION,))])
        elif found[0] != FORMAT_VERSION:
            raise IndexFormatError(f"the index {self.path} has format {found[0]}; this tierd reads format "
                                   f"{FORMAT_VERSION}")

    def _set_aside(self, why: str) -> None:
        self.set_aside = set_aside(self.path, why)

    def _connect(self, exclusive: bool) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            if exclusive:  # before the first access in WAL mode: the wal-index then lives in memory
                db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self.records.close()

    @contextmanager
    def _sqlite(self, doing: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise failed(exc, doing, self.path) from exc

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        # No cursor is kept in a local: a traceback that outlives the call (a
        # logged error) would keep its statement, and with it the database's
        # locks, alive after close().
        with self._lock, self._sqlite("record the change"):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in self._pending + statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
                self._pending = []
            except BaseException:
                # SQLite rolls some failures back itself (a full disk, an I/O error).
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def add_pieces(self, key: SessionKey, pieces: list[tuple[Piece, np.ndarray, np.ndarray]],
                   row: Row | None, record: Record | None = None, own: tuple[bool, int | None] | None = None,
                   replace: bool = False) -> None:
        """Record pieces already written and synced (or held by another session
        already: shared prefix pages), with their pages' checksums and token
        hashes; with row, mark a complete state (described by `record`; with
        own, whether it is a history of this node's own, and over what a publish of it was tried);
        with replace, in place of every piece, row and record of the session's the index holds."""
        stmts = self._delete_stmts(key)[:3] if replace else []
        stmts += piece_stmts(key, pieces) + ([row_stmt(key, row)] if row is not None else [])
        stmts += [own_stmt(key, *own)] if own is not None else []
        self._tx(stmts + ([record_stmt(key, record)] if record is not None else []))

    def truncate(self, key: SessionKey, n_pages: int, row: Row | None,
                 pieces: list[tuple[Piece, np.ndarray, np.ndarray]] | None = None, unrecord: bool = False) -> None:
        """Forget pages from n_pages on, and record `pieces` (as add_pieces,
        in the same transaction). row is the state that remains complete on
        disk, or None when no complete state remains; unrecord: its record
        describes it no more."""
        self._tx(self._truncate_stmts(key, n_pages, row) + piece_stmts(key, pieces or []) +
                 ([("DELETE FROM records WHERE tenant=? AND session_id=?", tuple(key))] if unrecord else []))

    def _truncate_stmts(self, key: SessionKey, n_pages: int, row: Row | None) -> list[tuple[str, tuple]]:
        stmts: list[tuple[str, tuple]] = [
            ("DELETE FROM pieces WHERE tenant=? AND session_id=? AND first_page>=?", (*key, n_pages)),
        ]
        with self._lock, self._sqlite("read the pieces to cut"):
            cut = self._db.execute(
                "SELECT first_page, n_pages, checksums, tokens, codes FROM pieces WHERE tenant=? AND session_id=? "
                "AND first_page<? AND first_page+n_pages>?", (*key, n_pages, n_pages)).fetchall()
        for first, n, blob, hashes, codes in cut:
            keep = n_pages - first
            stmts.append((
                "UPDATE pieces SET n_pages=?, checksums=?, tokens=?, codes=? WHERE tenant=? AND session_id=? "
                "AND first_page=?",
                (keep, blob[: 8 * keep], hashes[: tokens.HASH_BYTES * keep],
                 PageCodes.cut_bytes(codes, n, keep) if codes else b"", *key, first),
            ))
        if row is None:
            stmts.append(("DELETE FROM sessions WHERE tenant=? AND session_id=?", tuple(key)))
        else:
            stmts.append(row_stmt(key, row))
        return stmts

    @staticmethod
    def _delete_stmts(key: SessionKey) -> list[tuple[str, tuple]]:
        """Its pieces, row, record and own row forgotten (in that order)."""
        return [
            ("DELETE FROM pieces WHERE tenant=? AND session_id=?", tuple(key)),
            ("DELETE FROM sessions WHERE tenant=? AND session_id=?", tuple(key)),
            ("DELETE FROM records WHERE tenant=? AND session_id=?", tuple(key)),
            own_stmt(key, False),
        ]

    def delete(self, key: SessionKey, record: Record | None = None) -> None:
        """Forget the session. Its record is erased and synced first (a rebuild
        never brings it back), and put back where the index cannot forget it."""
        kept = self.records.wipe(record)
        try:
            self._tx(self._delete_stmts(key))
        except BaseException:
            self.records.put_back(record, kept)
            raise
        self.records.free(record)

    def highest_offset(self) -> int | None:
        """The highest piece offset recorded (None: none, or the index cannot say)."""
        try:
            with self._lock:
                row = self._db.execute("SELECT MAX(offset) FROM pieces WHERE typeof(offset) = 'integer'").fetchone()
        except sqlite3.Error:
            return None  # recover() finds out what is wrong with it
        return row[0] if row and isinstance(row[0], int) and row[0] >= 0 else None

    def recover(self, check: Callable[[list[Recovered]], list[Problem]] | None = None,
                ) -> tuple[list[Recovered], list[Problem]]:
        """Every complete session whose rows are sound (and pass `check`, which
        returns the problems of the sessions it refuses), and the problems
        found. Sessions with damaged rows are quarantined and what no complete
        state points to is reclaimed: both leave the index in one transaction
        (_repair)."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT * FROM sessions").fetchall()
                all_pieces = self._db.execute(
                    "SELECT tenant, session_id, first_page, n_pages, offset, alloc_bytes, checksums, tokens, codec, "
                    "codes FROM pieces ORDER BY tenant, session_id, first_page").fetchall()
                # After the reads, which leave the pages in the page cache: then
                # it costs ~25 ms on a million pages; first, on a cold cache, its
                # own order of reads took ~0.8 s.
                verdict = self._db.execute("PRAGMA quick_check(3)").fetchall()
            if verdict != [("ok",)]:
                raise sqlite3.DatabaseError("quick_check: " + " ".join(str(r[0]).replace("\n", " ") for r in verdict))
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            if not unsound(exc):
                raise failed(exc, "read its rows", self.path) from exc
            self._db.close()
            self._set_aside(str(exc))  # before anything was written to it: as it was found
            self._open()
            return [], []
        by_key: dict[SessionKey, list[tuple]] = {}
        for rec in all_pieces:
            by_key.setdefault(SessionKey(rec[0], rec[1]), []).append(rec[2:])
        problems: list[Problem] = []
        found: list[Recovered] = []
        for r in rows:
            key = SessionKey(r[0], r[1])
            try:
                found.append(parse(key, r[2:], by_key.get(key, [])))
            except Damaged as exc:
                problems.append(Problem(key, exc.reason, exc.detail))
        if check is not None:
            problems += check(found)
        refused = {p.key for p in problems}
        out = [rec for rec in found if rec.key not in refused]
        row_keys = {SessionKey(r[0], r[1]) for r in rows}
        problems += [Problem(k, "orphan", "pieces with no complete state; reclaimed", quarantined=False)
                     for k in by_key if k not in row_keys]
        stmts = [stmt for p in problems for stmt in self._delete_stmts(p.key)]
        for rec in out:
            if any(first + n > rec.row.num_pages for first, n, *_ in by_key[rec.key]):
                problems.append(Problem(rec.key, "partial", "pages past the last complete state; reclaimed",
                                        quarantined=False))
                stmts += self._truncate_stmts(rec.key, rec.row.num_pages, rec.row)
        self._repair(stmts)
        return out, problems

    def _repair(self, stmts: list[tuple[str, tuple]]) -> None:
        """Commit what recovery removes from the index now or, if the index
        cannot be written (a full disk), first thing in the next transaction:
        nothing new is recorded before it."""
        if not stmts:
            return
        with self._lock:
            self._pending = stmts
        try:
            self._tx([])
        except TierdError as exc:
            log.warning("disk index: cannot record what recovery repaired yet (%s); it is written before the "
                        "next change", exc)

    def count(self) -> tuple[int, int]:
        with self._lock, self._sqlite("count its rows"):
            return tuple(self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("sessions", "pieces"))

    def named_records(self) -> dict[SessionKey, Record]:
        """The record the index names for each session."""
        with self._lock, self._sqlite("read its records"):
            rows = self._db.execute("SELECT * FROM records").fetchall()
        return {SessionKey(t, s): Record(o, n, g) for t, s, o, n, g in rows
                if all(type(v) is int for v in (o, n, g))}

    def own(self) -> dict[SessionKey, int | None]:
        """The sessions whose row is a history of this node's own, each with
        the version its key held when a publish of it was tried (None: none was)."""
        with self._lock, self._sqlite("read its own table"):
            return {SessionKey(t, s): e for t, s, e in self._db.execute("SELECT * FROM own")
                    if e is None or type(e) is int}

    def apply(self, stmts: list[tuple[str, tuple]]) -> None:
        """Commit these statements in one transaction (a rebuild from records)."""
        self._tx(stmts)
