"""The disk index's schema (the tables as this version writes them, and
the format version it records), and how SQLite's failures read. Plain
data and functions: any thread (index.py holds the connection)."""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import time

from tierd.errors import ResourceExhausted, TierdError, Unavailable

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
CREATE TABLE IF NOT EXISTS records (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    offset INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    gen INTEGER NOT NULL,
    PRIMARY KEY (tenant, session_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS own (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    expect INTEGER,
    PRIMARY KEY (tenant, session_id)
) WITHOUT ROWID;
"""
FORMAT_VERSION = "7"  # 2: pieces record the token hashes of their pages (empty: not known); 3: sessions record
# the errors their pages carry (empty: exact); 4: pieces record the codec their pages are coded with and each
# page's coded size and checksum (empty: as they are); 5: sessions record a save's consent to lossy codes (NULL:
# the tenant's setting); 6: the records table names each session's record (core/records.py; the script creates
# it); 7: the own table names the sessions whose row is a history of this node's own, stored from token 0 here
# and not known to be in the remote tier, with the version its key held when a publish of it was tried (NULL:
# none was; the script creates it). A codec added later comes with a
# format of its own.
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
    "5": [],
    "6": [],
}
log = logging.getLogger("tierd.core.index")
SQLITE_FULL = 13  # the primary result code of "database or disk is full"


class IndexFormatError(RuntimeError):
    pass


class IndexUnavailable(RuntimeError):
    """The index cannot be opened for a reason other than damage (permissions,
    a file system with no room for a new database): nothing was changed."""


def unsound(exc: sqlite3.Error | UnicodeDecodeError) -> bool:
    """Whether the file is not a sound database. SQLite raises bare
    DatabaseError for that (SQLITE_CORRUPT, SQLITE_NOTADB), and subclasses for
    I/O errors, a full disk, locks; text that is not UTF-8 (a table's name in
    the schema, a row's column) is damage too, whether Python meets it in
    SQLite's message or in a row."""
    return type(exc) is sqlite3.DatabaseError or isinstance(exc, UnicodeDecodeError) or \
        (isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("Could not decode to UTF-8"))


def failed(exc: sqlite3.Error, doing: str, path: str) -> TierdError:
    """The tierd error for a failed SQLite call on the index at path."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11 on; before it, the message says
    full = (code & 0xFF) == SQLITE_FULL if code is not None else "is full" in str(exc)
    if full:
        return ResourceExhausted(f"the disk index has no room to {doing} ({exc}): free space under "
                                 f"{os.path.dirname(path)}; nothing was changed", path=path)
    return Unavailable(f"the disk index could not {doing} ({exc}); nothing was changed, try again", path=path)


def set_aside(path: str, why: str) -> str:
    """Move an unreadable index, with its WAL and wal-index, out of the way
    (a fresh one is opened next): never a start that fails over and over.
    Where it went."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    while os.path.lexists(aside):
        aside += "+"
    for suffix in ("", "-wal", "-shm"):
        if os.path.lexists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    log.error("the disk index %s is unreadable (%s): moved to %s; starting with an empty index, rebuilt from the "
              "session records beside the slab files where they are sound", path, why, aside)
    return aside


def columns(db: sqlite3.Connection) -> dict[str, list[str]]:
    return {t: [c[1] for c in db.execute(f"PRAGMA table_info({t})")]
            for t in ("sessions", "pieces", "meta", "records", "own")}


@functools.cache
def tierd_columns() -> dict[str, list[str]]:
    """The tables' columns as this version writes them."""
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    try:
        return columns(db)
    finally:
        db.close()
