"""Start-up over a damaged data dir: a missing or cut slab file, damaged index
rows, an index that is not a database any more. The store always opens; only
the sessions whose bytes or rows are damaged are lost (quarantined: one log
line and a metric each, removed from the index); every other session serves
byte-exact, and the accounting holds."""

import logging
import os
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import SPEC, Harness, HostEngine, read_all, wait_for
from tierd.core.store import make_key
from tierd.errors import ResourceExhausted
from tierd.layout import KVSpec
from tierd.metrics import Metrics
from tierd.testing import Daemon

MiB = 1 << 20
KEYS = [make_key("default", f"s{i}") for i in range(6)]
PAGES = 16  # 512 KiB a session: two sessions a 1 MiB slab


def quarantined(metrics, reason):
    return metrics.registry.get_sample_value("tierd_sessions_quarantined_total", {"reason": reason}) or 0


@pytest.fixture
def six(tmp_path):
    """Six durable sessions on disk only, two in each of three slab files."""
    metrics = Metrics(CollectorRegistry())
    h = Harness(str(tmp_path), disk_slab=MiB, events=metrics)
    store = h.open()
    eng = HostEngine(num_blocks=PAGES * len(KEYS), seed=1)
    content = {}
    for i, key in enumerate(KEYS):
        blocks = list(range(i * PAGES, (i + 1) * PAGES))
        store.save(key, eng.memory, SPEC, blocks, PAGES * SPEC.block_tokens)
        store.demote(key)
        content[key] = b"".join(eng.pages(blocks))
    # one piece each, in order: s0 and s1 fill slab 0, s2 and s3 slab 1, s4 and s5 slab 2
    offsets = [[p.offset for p in store.pieces(key, "disk")] for key in KEYS]
    assert offsets == [[i * PAGES * SPEC.page_bytes] for i in range(len(KEYS))]
    h.close()
    yield h, metrics, content, {key: i // 2 for i, key in enumerate(KEYS)}
    h.close()


def serves_exactly(store, content):
    """The store holds exactly these sessions, each byte-exact, and nothing else."""
    assert sorted(store.keys()) == sorted(content)
    for key, data in content.items():
        _, reader = store.get(key)
        assert b"".join(bytes(c) for c in reader) == data, f"{key.session_id} changed"
    assert store.scan() == [] and store.check_accounting() == []


def test_a_stray_slab_file_is_left_alone_and_every_session_serves(six, caplog):
    """An empty file named slab-099999.bin in the slab directory made the next
    start create and open 100,000 slabs, and the daemon never started."""
    h, metrics, content, _ = six
    stray = Path(h.root, "slabs", "slab-099999.bin")
    stray.touch()
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store = h.open()
    serves_exactly(store, content)
    assert "ignoring 1 slab files past" in caplog.text
    assert len(os.listdir(Path(h.root, "slabs"))) == 4 and stray.stat().st_size == 0


def test_a_slab_file_deleted_while_running_is_retired_and_what_is_reported_durable_survives(tmp_path, caplog):
    """A session written into a slab file deleted under the daemon was synced
    and reported durable, and was gone after the next start."""
    h = Harness(str(tmp_path), disk_slab=MiB)
    store = h.open()
    eng = HostEngine(num_blocks=3 * PAGES, seed=2)
    a, b = make_key("default", "a"), make_key("default", "b")
    store.save(a, eng.memory, SPEC, list(range(PAGES)), PAGES * SPEC.block_tokens)
    assert store.write_back(a).durable
    os.unlink(os.path.join(h.root, "slabs", "slab-000000.bin"))  # a's
    with caplog.at_level(logging.ERROR, logger="tierd"):
        store.tick()  # noticed on the tick
    assert "slab-000000.bin was deleted while in use" in caplog.text
    assert not store.stat(a).durable  # its pages are in the deleted file: gone at the next start
    store.save(b, eng.memory, SPEC, list(range(PAGES, 2 * PAGES)), PAGES * SPEC.block_tokens)
    assert store.write_back(b).durable  # into another slab: the deleted one takes nothing more
    assert all(p.offset >= MiB for p in store.pieces(b, "disk")) and store.check_accounting() == []
    want = b"".join(eng.pages(range(PAGES, 2 * PAGES)))
    store = h.reopen()
    assert store.keys() == [b]  # a is quarantined (missing_slab), b serves
    assert b"".join(bytes(c) for c in store.get(b)[1]) == want
    h.close()


@pytest.mark.parametrize("damage", ["deleted", "cut short"])
def test_a_lost_slab_costs_only_the_sessions_in_it(six, caplog, damage):
    h, metrics, content, slab_of = six
    path = os.path.join(h.root, "slabs", "slab-000001.bin")
    if damage == "deleted":
        os.unlink(path)  # the middle one of three
    else:
        os.truncate(path, MiB // 4)
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store = h.open()
    lost = sorted(k for k, s in slab_of.items() if s == 1)
    assert len(lost) == 2
    serves_exactly(store, {k: v for k, v in content.items() if k not in lost})
    for key in lost:
        assert f"quarantined default/{key.session_id}" in caplog.text
    reason = "missing_slab" if damage == "deleted" else "truncated_slab"
    assert quarantined(metrics, reason) == 2
    # the space is usable again, and the quarantine is recorded: a second start finds nothing to repair
    eng = HostEngine(num_blocks=64, seed=9)
    store.save(lost[0], eng.memory, SPEC, list(range(2 * PAGES)), 2 * PAGES * SPEC.block_tokens)
    store.demote(lost[0])
    content[lost[0]] = b"".join(eng.pages(range(2 * PAGES)))
    store = h.reopen()
    assert store.recovery_problems == []
    serves_exactly(store, {k: v for k, v in content.items() if k != lost[1]})


def _sql(h, *statements):
    db = sqlite3.connect(os.path.join(h.root, "index.db"))
    for sql, args in statements:
        db.execute(sql, args)
    db.commit()
    db.close()


PIECE = "UPDATE pieces SET {} WHERE session_id=?"
ROW = "UPDATE sessions SET {} WHERE session_id=?"
DAMAGE = {
    # name: (statements on the victims' rows, reason, victims beside s0)
    "short checksum blob": ([(PIECE.format("checksums=substr(checksums, 1, 8)"), ("s0",))], "bad_checksums", []),
    "token hashes cut": ([(PIECE.format("tokens=x'0102'"), ("s0",))], "bad_tokens", []),
    "two rows on one extent": ([(PIECE.format("offset=(SELECT offset FROM pieces WHERE session_id='s1')"),
                                 ("s0",))], "overlap", ["s1"]),
    "extents that share a page": ([(PIECE.format("offset=(SELECT offset - 8192 FROM pieces WHERE session_id='s1')"),
                                    ("s0",))], "overlap", ["s1"]),
    "unaligned offset": ([(PIECE.format("offset=offset + 512"), ("s0",))], "bad_extent", []),
    "extent smaller than its pages": ([(PIECE.format("alloc_bytes=4096"), ("s0",))], "bad_extent", []),
    "extent across two slabs": ([(PIECE.format("offset=offset + 786432"), ("s0",))], "bad_extent", []),
    "offset past the slab files": ([(PIECE.format("offset=1099511627776"), ("s0",))], "past_end", []),
    "text where a number belongs": ([(PIECE.format("offset='x'"), ("s0",))], "bad_row", []),
    "spec that does not parse": ([(ROW.format("spec='{not json'"), ("s0",))], "bad_spec", []),
    "negative page count": ([(ROW.format("num_pages=-3"), ("s0",))], "bad_row", []),
    "size that is not its pages": ([(ROW.format("nbytes=nbytes * 3"), ("s0",))], "bad_row", []),
    "a page missing": ([("DELETE FROM pieces WHERE session_id=?", ("s0",))], "missing_pieces", []),
    # before, each was served (then List failed INTERNAL) or crashed every start
    "2**40 pages claimed": ([(ROW.format("num_pages=1099511627776, nbytes=nbytes * 1099511627776 / num_pages"),
                              ("s0",))], "missing_pieces", []),
    "session id stored as a blob": ([(ROW.format("session_id=CAST(session_id AS BLOB)"), ("s0",))], "bad_row", []),
    "priority past 32 bits": ([(ROW.format("priority=1099511627776"), ("s0",))], "bad_row", []),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_row_quarantines_only_its_sessions(six, caplog, damage):
    """With no record to rebuild them from (records.bin lost as well)."""
    h, metrics, content, _ = six
    statements, reason, others = DAMAGE[damage]
    _sql(h, *statements)
    os.unlink(os.path.join(h.root, "records.bin"))
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store = h.open()
    victims = {make_key("default", n) for n in ["s0", *others]}
    serves_exactly(store, {k: v for k, v in content.items() if k not in victims})
    for key in victims:
        logged = f"b'{key.session_id}'" if damage == "session id stored as a blob" else key.session_id  # as held
        assert f"quarantined default/{logged}" in caplog.text
    assert quarantined(metrics, reason) == len(victims)
    assert store.index.count() == (len(KEYS) - len(victims),) * 2  # gone from the index too
    store = h.reopen()
    assert store.recovery_problems == []


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_session_whose_rows_are_damaged_is_rebuilt_from_its_record(six, caplog, damage):
    h, metrics, content, _ = six
    statements, reason, others = DAMAGE[damage]
    _sql(h, *statements)
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store = h.open()
    serves_exactly(store, content)  # every session, byte-exact
    assert "rebuilt from the session records" in caplog.text
    # only a row under an id no record names (the id stored as a blob) is quarantined
    assert quarantined(metrics, reason) == (damage == "session id stored as a blob")
    assert store.index.count()[0] == len(KEYS)
    store = h.reopen()
    assert store.recovery_problems == []
    serves_exactly(store, content)


def _garble(path, how):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "header":
            f.write(os.urandom(100))
        elif how == "pages":
            f.seek(4096)
            f.write(os.urandom(size - 4096))
        else:
            f.truncate(size // 2)


@pytest.mark.parametrize("how", ["header", "pages", "cut"])
def test_an_unreadable_index_is_moved_aside_and_rebuilt(six, caplog, how):
    h = six[0]
    index = Path(h.root) / "index.db"
    _garble(index, how)
    before = index.read_bytes()
    with caplog.at_level(logging.ERROR, logger="tierd"):
        store = h.open()
    aside = [n for n in os.listdir(h.root) if n.startswith("index.db.damaged-")]
    assert len(aside) == 1 and (Path(h.root) / aside[0]).read_bytes() == before
    assert f"moved to {os.path.join(h.root, aside[0])}" in caplog.text
    # a fresh index, rebuilt from the session records: every session served; a new version survives restarts
    content = six[2]
    serves_exactly(store, content)
    eng = HostEngine(seed=2)
    store.save(KEYS[0], eng.memory, SPEC, [0, 1], 32)
    store.demote(KEYS[0])
    store = h.reopen()
    serves_exactly(store, {**content, KEYS[0]: b"".join(eng.pages([0, 1]))})


def test_a_daemon_starts_on_a_garbled_index(tmp_path):
    d = Daemon(tmp_path)
    os.makedirs(d.data_dir, mode=0o700)
    with open(os.path.join(d.data_dir, "index.db"), "wb") as f:
        f.write(os.urandom(64 << 10))
    try:
        with d.start().client() as c:
            assert c.list() == []
            c.put("new", b"x" * 1000, KVSpec.opaque("m"), num_tokens=1)
        assert "the disk index" in d.log() and "index.db.damaged-" in d.log()
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_a_store_whose_recovery_fails_starts_no_thread(tmp_path, monkeypatch):
    """Recovery comes before the store's threads: a build it fails leaves
    none running (the movers; with a remote tier, tests/remote: also the
    publisher and the sweep)."""
    assert_no_thread_left(str(tmp_path / "n"), "", monkeypatch)


def assert_no_thread_left(data_dir: str, remote: str, monkeypatch, **kw) -> None:
    """Open a store whose recovery fails: it raises, and no thread of tierd's is left running."""
    import threading

    from tierd.core import recovery

    def unreadable(*args, **kw):
        raise OSError(5, "the index cannot be read")

    before = {t.ident for t in threading.enumerate()}
    monkeypatch.setattr(recovery, "recover", unreadable)
    with pytest.raises(OSError, match="cannot be read"):
        Harness(data_dir, remote=remote, **kw).open()

    # The remote tier's call threads are told to stop, not joined (a call on a store that hangs ends on its own):
    # they end soon after, not necessarily before open() returns.
    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("tierd")]

    wait_for(lambda: ours() == [], timeout=10, what="tierd's threads to end")


def test_a_durable_session_stored_again_from_token_0_is_recovered_as_it_was_until_the_new_one_is_durable(tmp_path):
    """Found by the chaos campaign (seed 6, "older than durable"): a session
    on disk, stored again from token 0 and killed before the new content was
    written back, came back as nothing (or as an older copy the remote tier
    held): the store had taken the durable version out of the index first.
    The index holds it until the new content is durable."""
    h = Harness(str(tmp_path))
    store = h.open()
    key = make_key("default", "again")
    eng = HostEngine(seed=11)
    store.save(key, eng.memory, SPEC, [0, 1, 2], 3 * SPEC.block_tokens)
    store.demote(key)
    assert store.stat(key).durable
    store.save(key, eng.memory, SPEC, [4, 5], 2 * SPEC.block_tokens)
    assert not store.stat(key).durable and store.check_accounting() == []
    assert read_all(store.get(key)[1]) == b"".join(eng.pages([4, 5]))
    h.close()  # as a kill: nothing more is written
    store = h.open()
    assert store.stat(key).durable and read_all(store.get(key)[1]) == b"".join(eng.pages([0, 1, 2]))
    # Stored again and written back, the new content replaces it, and its room is given back.
    used = store.stats()[-1].used
    store.save(key, eng.memory, SPEC, [4, 5], 2 * SPEC.block_tokens)
    store.demote(key)
    assert store.stat(key).durable and store.scan() == [] and store.stats()[-1].used < used
    h.close()
    store = h.open()
    assert read_all(store.get(key)[1]) == b"".join(eng.pages([4, 5]))
    store.drop(key)
    assert store.stats()[-1].used == 0 and store.scan() == []


def test_a_session_stored_again_gives_up_the_state_kept_where_the_disk_holds_only_one_of_them(tmp_path):
    """The durable state kept for a store from token 0 gives way when the disk
    tier has no room for it and the new content: the write-back goes through."""
    h = Harness(str(tmp_path), disk_budget=MiB, disk_slab=MiB)
    store = h.open()
    key = make_key("default", "big")
    eng = HostEngine(seed=12)
    store.save(key, eng.memory, SPEC, list(range(20)), 20 * SPEC.block_tokens)
    store.demote(key)
    store.save(key, eng.memory, SPEC, list(range(20, 40)), 20 * SPEC.block_tokens)
    assert 2 * store.tiers["disk"].used > MiB  # no room for two
    store.demote(key)
    assert store.stat(key).durable and store.scan() == [] and store.check_accounting() == []
    store = h.reopen()
    assert read_all(store.get(key)[1]) == b"".join(eng.pages(range(20, 40)))


def test_a_durable_session_appended_from_a_page_before_its_end_is_recovered_whole(tmp_path):
    """Found by an outside attack: turn 1 saved 40 tokens (its last page part
    full) and durable, turn 2 appended from token 32 (the README's engine
    flow), then kill -9: the session came back as its first 32 tokens, a
    state never stored, reported durable. The state on disk stays whole
    until the new content is durable."""
    h = Harness(str(tmp_path))
    store = h.open()
    key = make_key("default", "turns")
    eng = HostEngine(seed=13)
    bt = SPEC.block_tokens
    store.save(key, eng.memory, SPEC, [0, 1, 2], 2 * bt + 8)
    store.demote(key)
    used = store.stats()[-1].used
    store.save(key, eng.memory, SPEC, [3, 4], 4 * bt - 4, start_token=2 * bt)
    assert not store.stat(key).durable and store.scan() == [] and store.check_accounting() == []
    assert read_all(store.get(key)[1]) == b"".join(eng.pages([0, 1, 3, 4]))
    assert store.stats()[-1].used == used  # its first two pages: one copy on disk, held by both
    h.close()  # as a kill
    store = h.open()
    info = store.stat(key)
    assert info.durable and info.num_tokens == 2 * bt + 8
    assert read_all(store.get(key)[1]) == b"".join(eng.pages([0, 1, 2]))
    store.save(key, eng.memory, SPEC, [3, 4], 4 * bt - 4, start_token=2 * bt)
    store.demote(key)
    assert store.stat(key).durable and store.scan() == [] and store.check_accounting() == []
    store = h.reopen()
    assert store.stat(key).num_tokens == 4 * bt - 4 and read_all(store.get(key)[1]) == b"".join(eng.pages([0, 1, 3, 4]))
    assert store.scan() == [] and store.check_accounting() == []


def test_a_session_stored_again_with_more_than_the_disk_holds_keeps_its_state_on_disk(tmp_path):
    """Found by an outside attack: content that can never be written back (more
    than the disk tier's budget) made the store give up the state kept for it
    on every try, for nothing: a kill -9 then lost the session."""
    h = Harness(str(tmp_path), disk_budget=MiB, disk_slab=MiB)
    store = h.open()
    key = make_key("default", "too-big")
    eng = HostEngine(seed=14)
    store.save(key, eng.memory, SPEC, list(range(4)), 4 * SPEC.block_tokens)
    store.demote(key)
    store.save(key, eng.memory, SPEC, list(range(4, 44)), 40 * SPEC.block_tokens)  # 40 pages: more than 1 MiB
    with pytest.raises(ResourceExhausted):
        store.write_back(key)
    assert store.check_accounting() == [] and store.scan() == []
    h.close()
    store = h.open()
    assert read_all(store.get(key)[1]) == b"".join(eng.pages(range(4)))


def test_a_start_with_a_disk_budget_below_what_the_disk_holds_says_what_it_drops(tmp_path, caplog):
    """Found by an outside attack: started again with a smaller --disk-budget,
    the daemon dropped the least recently used durable sessions to fit it, and
    said nothing. It still does (the budget is the operator's), and says so."""
    h = Harness(str(tmp_path), disk_slab=MiB)
    store = h.open()
    eng = HostEngine(seed=15)
    for i, key in enumerate(KEYS[:3]):
        store.save(key, eng.memory, SPEC, list(range(8 * i, 8 * i + 8)), 8 * SPEC.block_tokens)
        store.demote(key)
        h.clock.advance(1)
    h.close()
    h.disk_budget = MiB // 2
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store = h.open()
    assert "the disk tier holds 768.0KiB, over its budget of 512.0KiB" in caplog.text
    assert "--disk-budget 768.0KiB or more" in caplog.text
    store.tick()
    assert store.drain(30)
    assert sorted(store.keys()) == KEYS[1:3] and store.check_accounting() == []  # the oldest went
