"""Session records (records.bin beside the slab files): an index lost or
garbled is rebuilt from them, serving every session whose record and pages
are sound, each as its newest durable state; a dropped session never comes
back, a damaged record costs only its session, and a record that names
bytes a newer one holds is cut before them (never another session's bytes)."""

import logging
import os
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.core.test_recovery import KEYS, serves_exactly, six  # noqa: F401 - six: the fixture
from tests.helpers import SPEC, HostEngine, wait_for
from tierd.client import KVSpec
from tierd.core.record_format import decode, encode
from tierd.core.records import GRANULE, Records
from tierd.errors import TierdError
from tierd.testing import Daemon


def lose_index(root, how="deleted"):
    index = Path(root) / "index.db"
    if how == "deleted":
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(f"{index}{suffix}"):
                os.unlink(f"{index}{suffix}")
    else:  # garbled past its header: SQLite opens it and finds it damaged on the first read
        with open(index, "r+b") as f:
            f.seek(100)
            f.write(os.urandom(8192))


def records_in(root):
    r = Records(os.path.join(root, "records.bin"))
    try:
        return r.scan()
    finally:
        r.close()


def test_an_index_deleted_is_rebuilt_from_the_records(six):
    h, _, content, _ = six
    lose_index(h.root)
    serves_exactly(h.open(), content)
    assert sqlite3.connect(os.path.join(h.root, "index.db")).execute("SELECT COUNT(*) FROM records").fetchone() == (6,)
    serves_exactly(h.reopen(), content)  # (the rebuilt index is an index like any)


def test_a_rebuild_serves_each_session_as_its_newest_durable_state_and_never_a_dropped_one(six):
    h, _, content, _ = six
    store = h.open()
    store.drop(KEYS[1])
    eng = HostEngine(seed=9)
    store.save(KEYS[2], eng.memory, SPEC, [0, 1, 2], 48)  # a new version of s2
    store.demote(KEYS[2])
    want = {k: v for k, v in content.items() if k != KEYS[1]} | {KEYS[2]: b"".join(eng.pages([0, 1, 2]))}
    serves_exactly(store, want)
    assert len(records_in(h.root)) == 5  # the dropped one's record is gone, the replaced one too
    h.close()
    lose_index(h.root, "garbled")
    serves_exactly(h.open(), want)


def test_a_damaged_record_costs_only_its_session(six):
    h, _, content, _ = six
    found = records_in(h.root)
    at = found[KEYS[3]].record.offset
    with open(os.path.join(h.root, "records.bin"), "r+b") as f:
        f.seek(at + 40)
        f.write(b"\xff" * 8)
    lose_index(h.root)
    serves_exactly(h.open(), {k: v for k, v in content.items() if k != KEYS[3]})


def test_a_record_damaged_while_the_index_is_sound_is_written_anew_at_start(six):
    h, _, content, _ = six
    at = records_in(h.root)[KEYS[3]].record.offset
    with open(os.path.join(h.root, "records.bin"), "r+b") as f:
        f.seek(at + 40)  # in its body: its head is whole
        f.write(b"\xff" * 8)
    serves_exactly(h.open(), content)
    assert len(records_in(h.root)) == 6
    h.close()
    lose_index(h.root)
    serves_exactly(h.open(), content)


def test_a_record_that_names_another_sessions_bytes_is_cut_before_them(six):
    """An older record (another tenant's, say) naming the pages of a newer
    one: the newer session is served, the older one not (nothing of it is
    left before the shared bytes), and no byte of one is served as the other's."""
    h, _, content, _ = six
    found = records_in(h.root)
    victim = found[KEYS[0]]
    row = ("mallory", "copy", *victim.row[2:])
    pieces = [("mallory", "copy", *p[2:]) for p in victim.pieces]
    forged = encode(victim.record.gen - 1, row, pieces)
    path = os.path.join(h.root, "records.bin")
    end = -(-os.path.getsize(path) // GRANULE) * GRANULE
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(forged)
    assert decode(forged)[0] == victim.record.gen - 1
    lose_index(h.root)
    store = h.open()
    serves_exactly(store, content)
    assert len(records_in(h.root)) == 6  # the forged record is punched out at start


def test_a_records_file_lost_is_written_anew_at_start(six):
    """Deleted, the index kept: every session is served and gets a record
    again at start (else the next loss of the index lost them all)."""
    h, _, content, _ = six
    os.unlink(os.path.join(h.root, "records.bin"))
    serves_exactly(h.open(), content)
    assert len(records_in(h.root)) == 6
    h.close()
    lose_index(h.root)
    serves_exactly(h.open(), content)


@pytest.mark.parametrize("what", ["a directory", "a link to a slab file", "a hard link to a slab file",
                                  "a link to /dev/null"])
def test_a_records_file_that_is_not_its_own_is_moved_aside_and_nothing_else_is_touched(six, caplog, what):
    """A link to a slab file made the start cut and punch out that slab file's pages."""
    h, _, content, _ = six
    path = os.path.join(h.root, "records.bin")
    slab = os.path.join(h.root, "slabs", "slab-000000.bin")
    os.unlink(path)
    before = Path(slab).read_bytes()
    {"a directory": lambda: os.mkdir(path), "a link to a slab file": lambda: os.symlink(slab, path),
     "a hard link to a slab file": lambda: os.link(slab, path),
     "a link to /dev/null": lambda: os.symlink("/dev/null", path)}[what]()
    with caplog.at_level(logging.ERROR, logger="tierd"):
        serves_exactly(h.open(), content)
    assert "records.bin cannot be used" in caplog.text
    assert [n for n in os.listdir(h.root) if n.startswith("records.bin.damaged-")]
    assert Path(slab).read_bytes() == before
    h.close()
    lose_index(h.root)
    serves_exactly(h.open(), content)


def test_a_records_file_grown_huge_and_sparse_is_cut_at_start(six):
    h, _, content, _ = six
    path = os.path.join(h.root, "records.bin")
    os.truncate(path, 1 << 42)  # 4 TiB of holes
    serves_exactly(h.open(), content)
    assert os.path.getsize(path) <= 64 << 20


def test_a_records_row_that_names_another_sessions_record_gets_the_session_a_record_of_its_own(six):
    h, _, content, _ = six
    db = sqlite3.connect(os.path.join(h.root, "index.db"))
    db.execute("UPDATE records SET (offset, nbytes, gen) = (SELECT offset, nbytes, gen FROM records "
               "WHERE session_id='s1') WHERE session_id='s0'")
    db.commit()
    db.close()
    serves_exactly(h.open(), content)
    found = records_in(h.root)
    assert len(found) == 6 and found[KEYS[0]].record != found[KEYS[1]].record
    h.close()
    lose_index(h.root)
    serves_exactly(h.open(), content)


def test_a_session_whose_row_and_records_row_are_both_gone_is_found_in_the_records_file(six):
    """Its pieces' rows left behind (damage): the file is scanned, not only what the index names."""
    h, _, content, _ = six
    db = sqlite3.connect(os.path.join(h.root, "index.db"))
    db.execute("DELETE FROM sessions WHERE session_id='s2'")
    db.execute("DELETE FROM records WHERE session_id='s2'")
    db.commit()
    db.close()
    serves_exactly(h.open(), content)


def test_a_drop_the_index_cannot_take_leaves_the_sessions_record(six):
    """Drop erases the record before the index forgets the session: where the
    index then fails, the record is put back (the session is still served)."""
    h, _, content, _ = six
    store = h.open()
    blocker = sqlite3.connect(os.path.join(h.root, "index.db"), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the index's writer waits, then gives up
    try:
        with pytest.raises(TierdError, match="disk index"):
            store.drop(KEYS[0])
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    serves_exactly(store, content)
    h.close()
    lose_index(h.root)
    serves_exactly(h.open(), content)


def test_a_daemon_with_500_durable_sessions_serves_them_all_after_its_index_is_garbled(tmp_path):
    spec = KVSpec.opaque("records/500", page_bytes=4096)
    rng = np.random.default_rng(5)
    data = {f"s{i:03d}": rng.bytes(16384 + i) for i in range(500)}
    d = Daemon(tmp_path, "--writeback-idle", "0", "--disk-slab", "16MiB", "--host-budget", "64MiB")
    try:
        with d.start().client() as c:
            for sid, blob in data.items():
                c.put(sid, blob, spec, 1)
                c.release(sid)
            wait_for(lambda: sum(s.durable for s in c.list_page(limit=1000)[0]) == 500, 120, "every session durable")
        d.kill()  # no clean stop: what is durable is what the disk holds
        lose_index(d.data_dir, "garbled")
        with d.start().client() as c:
            served = sum(1 for sid, blob in data.items() if c.get(sid) == blob)
        assert served >= 499, f"{served} of 500 sessions served byte-exact"
        assert "rebuilt from the session records: 500 sessions" in d.log()
    finally:
        d.close()


def test_a_record_round_trips_and_anything_else_is_refused():
    row = ("t", "s", "{}", 1, 1, 10, 1.5, 2.5, 0, b"", None)
    pieces = [("t", "s", 0, 1, 4096, 4096, b"\x01" * 8, b"", "", b"")]
    data = encode(7, row, pieces)
    assert decode(data) == (7, row, pieces)
    for bad in (data[:-1], data[:8] + b"\x00" + data[9:], data[:30] + bytes([data[30] ^ 1]) + data[31:],
                encode(7, row[:-1], pieces), b"tierdRC1" + struct.pack("<QIIQ", 1, 0, 0, 0)):
        try:
            decode(bad)
        except ValueError:
            continue
        raise AssertionError(f"decoded {bad[:40]!r}")
