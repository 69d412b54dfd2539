import sqlite3

import numpy as np
import pytest

from tests.helpers import SPEC
from tierd.core.index import DiskIndex, IndexFormatError, Row
from tierd.core.model import SessionKey
from tierd.tiers.allocator import Piece

K = SessionKey("t", "s")


def row(pages, tokens=None):
    return Row(SPEC, tokens if tokens is not None else pages * SPEC.block_tokens, pages, pages * SPEC.page_bytes,
               1.0, 2.0, 0)


def sums(first, n):
    return np.arange(first, first + n, dtype=np.uint64) * 7919


def test_complete_state_is_recovered(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [(Piece(0, 8192, 0, 2), sums(0, 2)), (Piece(65536, 4096, 2, 1), sums(2, 1))], row(3, 40))
    idx.close()
    (rec,), problems = DiskIndex(str(tmp_path / "i.db")).recover()
    assert problems == []
    assert rec.key == K and rec.row.num_tokens == 40 and rec.row.spec == SPEC
    assert [p.first_page for p in rec.pieces] == [0, 2]
    assert rec.checksums.tolist() == sums(0, 3).tolist()


def test_pages_past_the_complete_state_are_reclaimed(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [(Piece(0, 8192, 0, 2), sums(0, 2))], row(2))
    # An append reached disk partly, then the process died: no row for 4 pages.
    idx.add_pieces(K, [(Piece(8192, 8192, 2, 2), sums(2, 2))], None)
    idx.add_pieces(SessionKey("t", "orphan"), [(Piece(16384, 4096, 0, 1), sums(0, 1))], None)
    (rec,), problems = idx.recover()
    assert rec.row.num_pages == 2 and len(rec.pieces) == 1
    assert len(problems) == 2
    assert idx.count() == (1, 1)  # the orphan and the partial append are gone from the file too


def test_truncate_keeps_a_valid_prefix(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [(Piece(0, 4 * 4096, 0, 4), sums(0, 4))], row(4))
    idx.truncate(K, 3, row(3))
    (rec,), _ = idx.recover()
    assert rec.row.num_pages == 3 and rec.pieces[0].n_pages == 3
    assert rec.checksums.tolist() == sums(0, 3).tolist()
    idx.truncate(K, 0, None)
    assert idx.recover()[0] == [] and idx.count() == (0, 0)


def test_missing_pieces_drop_the_session(tmp_path):
    idx = DiskIndex(str(tmp_path / "i.db"))
    idx.add_pieces(K, [(Piece(0, 4096, 0, 1), sums(0, 1))], row(2))
    recs, problems = idx.recover()
    assert recs == [] and "cover 1 of 2" in problems[0]


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
