import os
import sqlite3
from dataclasses import replace

import numpy as np
import pytest

from tests.helpers import SPEC
from tierd.core import tokens
from tierd.core.index import SCHEMA, DiskIndex, IndexFormatError, IndexUnavailable, Row
from tierd.tiers.allocator import Piece
from tierd.types import SessionKey

K = SessionKey("t", "s")


def row(pages, tokens=None):
    return Row(SPEC, tokens if tokens is not None else pages * SPEC.block_tokens, pages, pages * SPEC.page_bytes,
               1.0, 2.0, 0)


def sums(first, n):
    return np.arange(first, first + n, dtype=np.uint64) * 7919


def hashes(first, n):
    """Token hashes of pages [first, first + n): distinct, never the all-zero 'unknown'."""
    return np.repeat(np.arange(first + 1, first + n + 1, dtype=np.uint8)[:, None], tokens.HASH_BYTES, axis=1)


def piece(offset, nbytes, first, n, known=True):
    return Piece(offset, nbytes, first, n), sums(first, n), hashes(first, n) if known else tokens.empty(n)


def test_complete_state_is_recovered(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [piece(0, 8192, 0, 2), piece(65536, 4096, 2, 1)], row(3, 40))
    idx.close()
    (rec,), problems = DiskIndex(str(tmp_path / "i.db")).recover()
    assert problems == []
    assert rec.key == K and rec.row.num_tokens == 40 and rec.row.spec == SPEC
    assert [p.first_page for p in rec.pieces] == [0, 2]
    assert rec.checksums.tolist() == sums(0, 3).tolist()
    assert rec.token_hashes.tolist() == hashes(0, 3).tolist()


def test_pages_without_token_ids_recover_as_unknown(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [piece(0, 8192, 0, 2, known=False), piece(8192, 4096, 2, 1)], row(3))
    (rec,), _ = idx.recover()
    assert not rec.token_hashes[:2].any() and rec.token_hashes[2].tolist() == hashes(2, 1)[0].tolist()


@pytest.mark.parametrize("found", ["1", "2", "3", "4", "5"])
def test_an_index_of_an_earlier_format_is_upgraded_in_place(tmp_path, found):
    path = str(tmp_path / "i.db")
    db = sqlite3.connect(path)
    added = {"5": ["lossy REAL"], "4": ["codec TEXT NOT NULL DEFAULT ''", "codes BLOB NOT NULL DEFAULT x''"],
             "3": ["errors BLOB NOT NULL DEFAULT x''"], "2": ["tokens BLOB NOT NULL DEFAULT x''"]}  # by the format
    schema = SCHEMA[: SCHEMA.index("CREATE TABLE IF NOT EXISTS records")]  # (format 6 on)
    for version, cols in added.items():
        if version > found:
            for col in cols:
                assert f"    {col},\n" in schema
                schema = schema.replace(f"    {col},\n", "")
    db.executescript(schema)
    db.execute("INSERT INTO meta VALUES ('format', ?)", (found,))
    db.execute("INSERT INTO sessions (tenant, session_id, spec, num_tokens, num_pages, nbytes, created, last_access, "
               "priority) VALUES ('t', 's', ?, 32, 2, ?, 1.0, 2.0, 0)", (SPEC.to_json(), 2 * SPEC.page_bytes))
    db.execute("INSERT INTO pieces (tenant, session_id, first_page, n_pages, offset, alloc_bytes, checksums) "
               "VALUES ('t', 's', 0, 2, 0, 8192, ?)", (sums(0, 2).astype("<u8").tobytes(),))
    db.commit()
    db.close()
    (rec,), problems = DiskIndex(path).recover()
    assert problems == [] and rec.checksums.tolist() == sums(0, 2).tolist() and not rec.token_hashes.any()
    assert rec.row.errors == b""  # exact, as every page of an earlier format was
    assert all(p.codes is None for p in rec.pieces)  # as they are, as every page of an earlier format was
    assert rec.row.lossy is None  # no save said: the tenant's setting
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key='format'").fetchone()[0] == "7"


def test_the_errors_pages_carry_are_recovered_and_cut_with_them(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    errors = np.array([0.0, 0.02, 0.03], dtype="<f4").tobytes()
    idx.add_pieces(K, [piece(0, 8192, 0, 3)], replace(row(3), errors=errors))
    idx.add_pieces(SessionKey("t", "garbled"), [piece(8192, 8192, 0, 3)],
                   replace(row(3), errors=np.array([0.0, np.nan, 0.1], dtype="<f4").tobytes()))
    (rec,), problems = idx.recover()
    assert rec.row.errors == errors and rec.row.cut(1).errors == b"" and rec.row.cut(2).errors == errors[:8]
    assert [(p.key.session_id, p.reason) for p in problems] == [("garbled", "bad_errors")]


def test_pages_past_the_complete_state_are_reclaimed(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [piece(0, 8192, 0, 2)], row(2))
    # An append reached disk partly, then the process died: no row for 4 pages.
    idx.add_pieces(K, [piece(8192, 8192, 2, 2)], None)
    idx.add_pieces(SessionKey("t", "orphan"), [piece(16384, 4096, 0, 1)], None)
    (rec,), problems = idx.recover()
    assert rec.row.num_pages == 2 and len(rec.pieces) == 1
    assert len(problems) == 2
    assert idx.count() == (1, 1)  # the orphan and the partial append are gone from the file too


def test_truncate_keeps_a_valid_prefix(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [piece(0, 4 * 4096, 0, 4)], row(4))
    idx.truncate(K, 3, row(3))
    (rec,), _ = idx.recover()
    assert rec.row.num_pages == 3 and rec.pieces[0].n_pages == 3
    assert rec.checksums.tolist() == sums(0, 3).tolist()
    assert rec.token_hashes.tolist() == hashes(0, 3).tolist()
    idx.truncate(K, 0, None)
    assert idx.recover()[0] == [] and idx.count() == (0, 0)


def test_missing_pieces_drop_the_session(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [piece(0, 4096, 0, 1)], row(2))
    recs, problems = idx.recover()
    assert recs == [] and "cover 1 of 2" in str(problems[0])


def test_other_format_is_refused(tmp_path):
    path = str(tmp_path / "i.db")
    DiskIndex(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='format'")
    db.commit()
    db.close()
    with pytest.raises(IndexFormatError, match="format 99"):
        DiskIndex(path)


def test_wal_mode(tmp_path):
    DiskIndex(str(tmp_path / "i.db")).close()
    assert sqlite3.connect(str(tmp_path / "i.db")).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_tables_that_are_not_tierds_are_moved_aside(tmp_path):
    path = str(tmp_path / "i.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE sessions (id TEXT PRIMARY KEY, blob BLOB)")
    db.execute("INSERT INTO sessions VALUES ('x', x'00')")
    db.commit()
    db.close()
    idx = DiskIndex(path)
    assert idx.set_aside is not None and os.path.exists(idx.set_aside)
    assert idx.recover() == ([], []) and idx.count() == (0, 0)


def garbled(path, *changes):
    """The file with each (found bytes, offset past them, new bytes) written over."""
    data = bytearray(open(path, "rb").read())
    for found, past, new in changes:
        at = data.index(found) + past
        data[at : at + len(new)] = new
    open(path, "wb").write(data)


def test_an_index_whose_schema_names_a_table_in_bytes_that_are_not_text_is_moved_aside(tmp_path):
    """Found by the chaos campaign's hour (seed 1, an index garbled at random):
    SQLite's message about the malformed schema quoted the table's name, which
    was not UTF-8, and Python's UnicodeDecodeError stopped the daemon's start."""
    path = str(tmp_path / "i.db")
    DiskIndex(path).close()
    garbled(path, (b"CREATE TABLE sessions", 0, b"\xd5" * 6), (b"tablesessions", 5, b"\xd5\xd5"))
    with pytest.raises(UnicodeDecodeError):
        sqlite3.connect(path).execute("PRAGMA journal_mode=WAL")
    idx = DiskIndex(path)
    assert idx.set_aside is not None and os.path.exists(idx.set_aside)
    assert idx.recover() == ([], []) and idx.count() == (0, 0)


def test_an_index_whose_rows_hold_text_that_is_not_text_is_moved_aside(tmp_path):
    """A row's spec that is not UTF-8: SQLite cannot hand it over, and the
    start failed (UNAVAILABLE); it is damage, moved aside."""
    path = str(tmp_path / "i.db")
    idx = DiskIndex(path)
    idx.add_pieces(K, [piece(0, 8192, 0, 2)], row(2))
    idx.close()
    garbled(path, (b'{"', 2, b"\xd5\xd5"))
    idx = DiskIndex(path)
    assert idx.recover() == ([], []) and idx.set_aside is not None and os.path.exists(idx.set_aside)


def test_an_index_that_cannot_be_opened_is_not_moved_aside(tmp_path):
    path = tmp_path / "i.db"
    path.mkdir()  # SQLite cannot open it, and nothing says the data in it is damaged
    with pytest.raises(IndexUnavailable, match="cannot open"):
        DiskIndex(str(path))
    assert os.listdir(tmp_path) == ["i.db"]
