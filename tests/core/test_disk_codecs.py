"""Pages coded on their way to the disk tier (--codec disk=lossless): a
store over real slab files and a real SQLite index. What is written coded
comes back bit-exact, from disk and after a restart, in fewer bytes;
damaged coded bytes and damaged codes in the index are DATA_LOSS or a
quarantined session, never bytes; a session may hold pages coded and pages
as they are; cut, shared and appended coded pieces stay exact; a lossy or
unknown codec for the disk stops the start."""

import os
import re
import sqlite3

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, kv_like, read_all
from tierd.codecs.auto import EXPLORE_EVERY
from tierd.core.events import NullEvents
from tierd.core.store import make_key
from tierd.errors import DataLoss, InvalidArgument
from tierd.transfer.coded import TierCoding

A = make_key("default", "a")
B = make_key("default", "b")
PAGE = SPEC.page_bytes


@pytest.fixture
def coded(tmp_path):
    h = Harness(str(tmp_path), disk_codec="lossless")
    yield h
    h.close()


def on_disk(store, key, engine, blocks, tokens=None, **kw):
    store.save(key, engine.memory, SPEC, blocks, tokens or 16 * len(blocks), **kw)
    store.demote(key)
    assert store.stat(key).tier == "disk"


def restored(store, key, blocks):
    out = HostEngine(seed=99)
    store.restore(key, out.memory, SPEC, blocks)
    return out.pages(blocks)


def test_pages_written_lossless_come_back_bit_exact_from_disk_and_after_a_restart_in_fewer_bytes(coded):
    store = coded.open()
    src = kv_like(HostEngine(seed=1), seed=1)
    blocks = list(range(40))
    on_disk(store, A, src, blocks)
    info = store.stat(A)
    assert info.codecs == {"disk": "lossless"} and info.coded_bytes["disk"] < 0.8 * info.size_bytes
    assert info.tier_bytes["disk"] < 0.85 * 40 * PAGE  # the room it takes, rounded to 4 KiB per piece
    pieces = store.pieces(A, "disk")
    assert all(p.codes is not None and p.codes.codec == "lossless" for p in pieces)
    assert restored(store, A, blocks[::-1]) == src.pages(blocks)  # into a table of blocks in reverse
    assert store.check_accounting() == [] and store.scan() == []
    store = coded.reopen()
    assert store.stat(A).codecs == {"disk": "lossless"} and store.stat(A).durable
    _, chunks = store.get(A)
    assert read_all(chunks) == b"".join(src.pages(blocks))
    assert store.prefetch(A) in ("queued", "ready")
    store.drain(10)
    assert store.stat(A).tier == "host" and restored(store, A, blocks) == src.pages(blocks)
    assert store.check_accounting() == [] and store.scan() == []


def test_random_bytes_and_a_short_last_page_of_opaque_bytes_round_trip_too(coded):
    store = coded.open()
    rnd = HostEngine(seed=2)  # random bytes: kept as they are inside their blobs
    on_disk(store, A, rnd, [0, 1, 2])
    assert restored(store, A, [0, 1, 2]) == rnd.pages([0, 1, 2])
    assert store.stat(A).codecs == {"disk": "lossless"}
    opaque = SPEC.opaque("test/state", page_bytes=64 << 10)
    data = bytes(100_000) + np.random.default_rng(3).integers(0, 8, 70_001, dtype=np.uint8).tobytes()
    store.put(B, opaque, 5, len(data), [data])
    store.demote(B)
    store = coded.reopen()
    _, chunks = store.get(B)
    assert read_all(chunks) == data
    assert store.stat(B).coded_bytes["disk"] < len(data)


def _flip(store, key, at):
    """Flip a bit of the byte `at` bytes into the session's first disk piece."""
    piece = store.pieces(key, "disk")[0]
    disk = store.tiers["disk"]
    slab, off = disk.locate(piece.offset + at)
    with open(disk.slab_path(slab), "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))


def test_damaged_coded_bytes_on_disk_are_data_loss_on_every_path_and_others_keep_working(coded):
    store = coded.open()
    src = kv_like(HostEngine(seed=4), seed=4)
    on_disk(store, A, src, [0, 1, 2, 3])
    on_disk(store, B, src, [4, 5, 6, 7])
    first = store.pieces(A, "disk")[0].codes
    _flip(store, A, int(first.sizes[0]) + 10)  # inside page 1's coded bytes
    out = HostEngine(seed=5)
    with pytest.raises(DataLoss, match="page 1 failed its checksum in the disk tier \\(its coded bytes\\)"):
        store.restore(A, out.memory, SPEC, [10, 11, 12, 13])
    assert out.page(11) != src.page(1) and store.stat(A).state == "damaged"
    with pytest.raises(DataLoss):
        read_all(store.get(A)[1])
    assert restored(store, B, [4, 5, 6, 7]) == src.pages([4, 5, 6, 7])
    assert any("page 1" in p for p in store.scan())
    store = coded.reopen()  # found again after a restart, never served
    with pytest.raises(DataLoss):
        store.restore(A, out.memory, SPEC, [10, 11, 12, 13])
    assert restored(store, B, [4, 5, 6, 7]) == src.pages([4, 5, 6, 7])


def test_a_damaged_blob_whose_checksum_was_rewritten_to_match_is_still_data_loss(coded):
    """Coded bytes damaged and the index edited to their new checksum: the
    page they decode to (if they decode) fails the page's own checksum."""
    from tierd.checksum import page_checksum

    store = coded.open()
    src = kv_like(HostEngine(seed=6), seed=6)
    on_disk(store, A, src, [0, 1])
    piece = store.pieces(A, "disk")[0]
    _flip(store, A, 200)
    disk = store.tiers["disk"]
    buf = np.empty(-(-piece.codes.stored // 4096) * 4096, dtype=np.uint8)
    coded.close()
    slab, off = disk.locate(piece.offset)
    with open(disk.slab_path(slab), "rb") as f:
        f.seek(off)
        buf[:] = np.frombuffer(f.read(buf.size), dtype=np.uint8)
    sums = piece.codes.sums.copy()
    sums[0] = page_checksum(buf[: piece.codes.sizes[0]])
    db = sqlite3.connect(os.path.join(coded.root, "index.db"))
    db.execute("UPDATE pieces SET codes=?", (piece.codes.sizes.astype("<u4").tobytes() + sums.astype("<u8").tobytes(),))
    db.commit()
    db.close()
    store = coded.open()
    with pytest.raises(DataLoss, match="page 0 (failed its checksum in the disk tier|of the disk tier does not decode)"):
        store.restore(A, HostEngine().memory, SPEC, [0, 1])


@pytest.mark.parametrize("edit, reason", [
    ("UPDATE pieces SET codec='zfuture'", "a codec this tierd does not know"),
    ("UPDATE pieces SET codec='fp8'", "lossy"),
    ("UPDATE pieces SET codes=substr(codes, 1, 10)", "bytes of page codes for"),
    ("UPDATE pieces SET codes=zeroblob(length(codes))", "a coded page of no bytes"),
    ("UPDATE pieces SET codec=''", "a codec this tierd does not know"),
    ("UPDATE pieces SET codes=x''", "0 bytes of page codes for 2 pages"),
])
@pytest.mark.parametrize("record", ["sound", "lost"])
def test_damaged_codes_in_the_index_cost_that_session_alone(coded, edit, reason, record):
    """Rebuilt from its record where that is sound (records.bin), else quarantined."""
    store = coded.open()
    src = kv_like(HostEngine(seed=7), seed=7)
    on_disk(store, A, src, [0, 1])
    on_disk(store, B, src, [2, 3])
    coded.close()
    db = sqlite3.connect(os.path.join(coded.root, "index.db"))
    db.execute(edit + " WHERE session_id='a'")
    db.commit()
    db.close()
    if record == "lost":
        os.unlink(os.path.join(coded.root, "records.bin"))
    store = coded.open()
    (problem,) = store.recovery_problems
    assert problem.key == A and problem.reason == "bad_codes"
    assert re.search(reason, problem.detail), problem.detail
    assert problem.quarantined == (record == "lost")
    assert store.keys() == ([B] if record == "lost" else [A, B]) and restored(store, B, [2, 3]) == src.pages([2, 3])
    if record == "sound":
        assert restored(store, A, [0, 1]) == src.pages([0, 1])  # its coded pages, from the codes its record holds
    assert store.check_accounting() == []


def test_one_session_holds_pages_coded_and_pages_as_they_are_and_a_cut_coded_piece_stays_exact(tmp_path):
    h = Harness(str(tmp_path))  # first without a codec
    store = h.open()
    src = kv_like(HostEngine(seed=8), seed=8)
    on_disk(store, A, src, [0, 1, 2, 3])
    h.close()
    h.disk_codec = "lossless"
    store = h.open()
    store.save(A, src.memory, SPEC, [10, 11], 96, start_token=64)  # an append: pages 4 and 5
    store.demote(A)
    assert store.stat(A).codecs == {"disk": "lossless+none"}
    want = src.pages([0, 1, 2, 3, 10, 11])
    assert restored(store, A, list(range(20, 26))) == want
    # A save from token 80 cuts the coded piece of pages 4 and 5 after page 4, and appends.
    store.save(A, src.memory, SPEC, [12, 13], 112, start_token=80)
    store.demote(A)
    want = src.pages([0, 1, 2, 3, 10, 12, 13])
    assert restored(store, A, list(range(30, 37))) == want
    store = h.reopen()
    assert restored(store, A, list(range(30, 37))) == want
    assert store.check_accounting() == [] and store.scan() == []


def test_coded_pages_another_session_holds_are_lent_not_stored_twice(coded):
    store = coded.open()
    src = kv_like(HostEngine(seed=9), seed=9)
    prompt = list(range(1000, 1064))
    store.save(A, src.memory, SPEC, [0, 1, 2, 3], 64, token_ids=prompt)
    store.write_back(A)
    store.save(B, src.memory, SPEC, [0, 1, 2, 3, 4], 80, token_ids=prompt + [7] * 16)
    store.write_back(B)
    a, b = store.pieces(A, "disk"), store.pieces(B, "disk")
    assert b[0].offset == a[0].offset and b[0].codes is not None  # the coded prompt pages, held by both
    for key in (A, B):
        store.demote(key)
    store.drop(A)
    store = coded.reopen()
    assert restored(store, B, list(range(10, 15))) == src.pages([0, 1, 2, 3, 4])
    assert store.check_accounting() == [] and store.scan() == []


class Chosen(NullEvents):
    def __init__(self):
        self.chosen, self.counted = [], []

    def codec_chosen(self, tier, codec, among):
        self.chosen.append((tier, codec))

    def coded(self, codec, op, nbytes, coded, seconds):
        self.counted.append((codec, op, nbytes, coded))


def test_auto_tries_both_ways_then_takes_the_faster_by_reads_once_both_were_read(tmp_path):
    events = Chosen()
    h = Harness(str(tmp_path), disk_codec="auto", events=events)
    store = h.open()
    src = kv_like(HostEngine(seed=10), seed=10)
    ways = []
    for i in range(2 * EXPLORE_EVERY):
        key = make_key("default", f"s{i}")
        on_disk(store, key, src, [0, 1, 2, 3])
        ways.append(store.stat(key).codecs.get("disk", "none"))
        assert restored(store, key, [4, 5, 6, 7]) == src.pages([0, 1, 2, 3])
    assert ways[:2] == ["lossless", "none"] and set(ways[2:]) == {"lossless", "none"}
    assert events.chosen and events.chosen[0][0] == "disk"
    chosen = events.chosen[-1][1]
    assert ways[2:].count(chosen) >= 2 * EXPLORE_EVERY - 4  # the rest: one write in 16 the other way
    assert {op for codec, op, *_ in events.counted if codec == "lossless"} == {"encode", "decode"}
    assert store.check_accounting() == []


def test_auto_weighs_reads_over_writes_where_both_ways_were_read():
    coding = TierCoding("disk", "auto", Chosen())
    assert [coding.choose(), coding.choose()] == ["lossless", "lossless"]  # not measured yet
    coding.measured("lossless", "write", 100, 1.0)
    coding.measured("none", "write", 100, 0.1)
    assert coding.choose() == "none"
    coding.measured("none", "read", 100, 1.0)
    coding.measured("lossless", "read", 100, 0.5)
    assert coding.choose() == "lossless" and coding.events.chosen[-1] == ("disk", "lossless")


@pytest.mark.parametrize("codec, error", [("fp8", "lossless only"), ("int4", "lossless only"),
                                          ("zstd9", "unknown codec 'zstd9'")])
def test_a_disk_codec_that_is_lossy_or_none_stops_the_start_and_changes_nothing(tmp_path, codec, error):
    h = Harness(str(tmp_path), disk_codec=codec)
    with pytest.raises(InvalidArgument, match=error):
        h.open()
    assert not os.path.exists(os.path.join(str(tmp_path), "index.db"))
