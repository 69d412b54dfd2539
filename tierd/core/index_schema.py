"""The disk index's schema (the tables as this version writes them, and
the format version it records), and how SQLite's failures read. Plain
data and functions: any thread (index.py holds the connection)."""

from __future__ import annotations

import functools
import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    spec TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    num_pages INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    priority INTEGER NOT NULL,
    errors BLOB NOT NULL DEFAULT x'',
    lossy REAL,
    PRIMARY KEY (tenant, session_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pieces (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    first_page INTEGER NOT NULL,
    n_pages INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    alloc_bytes INTEGER NOT NULL,
    checksums BLOB NOT NULL,
    tokens BLOB NOT NULL DEFAULT x'',
    codec TEXT NOT NULL DEFAULT '',
    codes BLOB NOT NULL DEFAULT x'',
    PRIMARY KEY (tenant, session_id, first_page)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""
FORMAT_VERSION = "5"  # 2: pieces record the token hashes of their pages (empty: not known); 3: sessions record
# the errors their pages carry (empty: exact); 4: pieces record the codec their pages are coded with and each
# page's coded size and checksum (empty: as they are); 5: sessions record a save's consent to lossy codes (NULL:
# the tenant's setting). A codec added later comes with a format of its own.
# What takes an index of an earlier format to this one, by the format found.
_CODES = ["ALTER TABLE pieces ADD COLUMN codec TEXT NOT NULL DEFAULT ''",
          "ALTER TABLE pieces ADD COLUMN codes BLOB NOT NULL DEFAULT x''"]
_ERRORS = ["ALTER TABLE sessions ADD COLUMN errors BLOB NOT NULL DEFAULT x''"]
_LOSSY = ["ALTER TABLE sessions ADD COLUMN lossy REAL"]
MIGRATIONS = {
    "1": ["ALTER TABLE pieces ADD COLUMN tokens BLOB NOT NULL DEFAULT x''", *_ERRORS, *_CODES, *_LOSSY],
    "2": [*_ERRORS, *_CODES, *_LOSSY],
    "3": [*_CODES, *_LOSSY],
    "4": _LOSSY,
}
SQLITE_FULL = 13  # the primary result code of "database or disk is full"


class IndexFormatError(RuntimeError):
    pass


class IndexUnavailable(RuntimeError):
    """The index cannot be opened for a reason other than damage (permissions,
    a file system with no room for a new database): nothing was changed."""


def unsound(exc: sqlite3.Error) -> bool:
    """Whether SQLite says the file is not a sound database. It raises bare
    DatabaseError for that alone (SQLITE_CORRUPT, SQLITE_NOTADB), and
    subclasses for I/O errors, a full disk, locks."""
    return type(exc) is sqlite3.DatabaseError


def columns(db: sqlite3.Connection) -> dict[str, list[str]]:
    return {t: [c[1] for c in db.execute(f"PRAGMA table_info({t})")] for t in ("sessions", "pieces", "meta")}


@functools.cache
def tierd_columns() -> dict[str, list[str]]:
    """The tables' columns as this version writes them."""
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    try:
        return columns(db)
    finally:
        db.close()
