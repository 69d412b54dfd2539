"""Fault injection: every disk-tier system call of a save/demote/restore
workload fails in turn (ENOSPC or EIO, once or from then on). After each run
no failed store is visible, no wrong byte was ever served, an integrity scan
of the data dir is clean after a restart, and every session acknowledged
durable restores byte-exact."""

import errno
import logging
import threading

import pytest

from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key
from tierd.errors import TierdError
from tierd.policy.rules import RETRY_FIRST
from tierd.tiers.fileops import FileOps

A, B, C = (make_key("default", n) for n in "abc")


class FaultyOps(FileOps):
    """FileOps whose call number `fail_at` fails (and every later one, if persistent)."""

    def __init__(self, fail_at: int | None = None, err: int = errno.EIO, persistent: bool = False,
                 only: tuple[str, ...] = ()) -> None:
        self.fail_at, self.err, self.persistent, self.only = fail_at, err, persistent, only
        self.calls = 0
        self.failures = 0
        self._lock = threading.Lock()

    def _tick(self, what: str) -> None:
        if self.only and what not in self.only:
            return
        with self._lock:
            n = self.calls
            self.calls += 1
            fail = self.fail_at is not None and (n == self.fail_at or (self.persistent and n > self.fail_at))
            if fail:
                self.failures += 1
        if fail:
            raise OSError(self.err, f"injected {errno.errorcode[self.err]} on {what} call {n}")

    def open(self, path, flags, mode):
        self._tick("open")
        return super().open(path, flags, mode)

    def fallocate(self, fd, offset, length):
        self._tick("fallocate")
        super().fallocate(fd, offset, length)

    def truncate(self, fd, length):
        self._tick("truncate")
        super().truncate(fd, length)

    def pread(self, fd, view, offset):
        self._tick("pread")
        return super().pread(fd, view, offset)

    def pwrite(self, fd, view, offset):
        self._tick("pwrite")
        return super().pwrite(fd, view, offset)

    def fdatasync(self, fd):
        self._tick("fdatasync")
        super().fdatasync(fd)


def workload(store, eng, out):
    """Save, demote, restore, append, write back and prefetch; returns the
    content each session was last acknowledged durable with, and the content
    each live session must hold now."""
    durable, current = {}, {}

    def step(fn):
        try:
            fn()
            return True
        except TierdError:
            return False

    def save(key, blocks, start=0):
        tokens = (len(current.get(key, [])[: start // 16]) + len(blocks)) * 16 if start else len(blocks) * 16
        if step(lambda: store.save(key, eng.memory, SPEC, blocks, tokens, start_token=start)):
            current[key] = current.get(key, [])[: start // 16] + eng.pages(blocks) if start else eng.pages(blocks)

    def to_disk(key, free_faster):
        def go():
            if free_faster:
                store.demote(key)
            else:
                store.write_back(key)
        if step(go) and store.stat(key).durable:
            durable[key] = list(current[key])

    def read(key):
        n = len(current[key])
        if step(lambda: store.restore(key, out.memory, SPEC, list(range(n)))):
            assert out.pages(range(n)) == current[key], "a restore served wrong bytes"

    save(A, [0, 1, 2])
    to_disk(A, free_faster=False)
    save(B, [3, 4, 5, 6])
    to_disk(B, free_faster=True)
    read(A)
    if B in current:
        read(B)
        save(B, [7, 8], start=64)
        to_disk(B, free_faster=False)
    save(C, [9])
    to_disk(C, free_faster=True)
    if A in current:
        step(lambda: store.prefetch(A))
        store.drain(10)
        read(A)
    if C in current and step(lambda: store.drop(C)):
        current.pop(C)
        durable.pop(C, None)
    return durable, current


def run(root, ops):
    h = Harness(str(root), disk_ops=ops, host_budget=8 << 20, host_slab=8 << 20, disk_budget=64 << 20,
                disk_slab=4 << 20)
    store = h.open()
    eng, out = HostEngine(num_blocks=16, seed=1), HostEngine(num_blocks=16, seed=2)
    durable, current = workload(store, eng, out)
    calls, ops.fail_at = ops.calls, None  # the checks below read through a healthy disk
    assert store.check_accounting() == []  # no byte held by no session
    # no failed store is visible: every live session holds what was last stored successfully
    assert sorted(store.keys()) == sorted(current)
    for key, pages in current.items():
        info, reader = store.get(key)
        assert read_all(reader) == b"".join(pages)
    store = h.reopen(flush=False)  # a crash, then a healthy disk
    store.tiers["disk"].ops = FileOps()
    assert store.scan() == []
    for key, pages in durable.items():
        store.restore(key, out.memory, SPEC, list(range(len(pages))))
        assert out.pages(range(len(pages))) == pages, f"{key.session_id} lost acknowledged bytes"
    h.close()
    ops.calls = calls
    return durable


def test_the_workload_runs_clean(tmp_path):
    ops = FaultyOps()
    assert set(run(tmp_path, ops)) == {A, B}  # C was dropped
    assert ops.calls >= 10  # opens, fallocates, writes, syncs and reads


@pytest.mark.slow
@pytest.mark.parametrize("err,persistent", [(errno.EIO, False), (errno.ENOSPC, True)])
def test_every_disk_call_fails_in_turn(tmp_path, err, persistent):
    logging.getLogger("tierd").setLevel(logging.CRITICAL)  # thousands of expected errors
    try:
        total = FaultyOps()
        run(tmp_path / "clean", total)
        for k in range(total.calls):
            ops = FaultyOps(k, err, persistent)
            run(tmp_path / f"{k}", ops)
            assert ops.failures >= 1
    finally:
        logging.getLogger("tierd").setLevel(logging.NOTSET)


def test_a_failed_sync_is_never_trusted(tmp_path):
    ops = FaultyOps(only=("fdatasync",))
    h = Harness(str(tmp_path), disk_ops=ops)
    store = h.open()
    eng = HostEngine(seed=3)
    store.save(A, eng.memory, SPEC, [0, 1], 32)
    disk = store.tiers["disk"]
    epoch = disk.epoch()  # a writer that started before the failure...
    ops.fail_at = ops.calls
    with pytest.raises(TierdError, match="fdatasync"):
        store.write_back(A)
    assert not store.stat(A).durable and store.stat(A).tier == "host" and disk.used == 0
    assert store.check_accounting() == []
    with pytest.raises(OSError, match="may be lost"):
        disk.sync(epoch)  # ...is refused even though this fdatasync succeeds
    store.write_back(A)  # a fresh write and sync
    assert store.stat(A).durable
    h.close()


def test_a_full_disk_pauses_demotion_and_it_resumes(tmp_path, caplog):
    ops = FaultyOps(fail_at=0, err=errno.ENOSPC, persistent=True, only=("fallocate",))
    h = Harness(str(tmp_path), disk_ops=ops)
    store = h.open()
    store.save(A, HostEngine(seed=4).memory, SPEC, [0, 1], 32)
    store.release(A)
    h.clock.advance(700)
    with caplog.at_level(logging.WARNING, logger="tierd"):
        store.tick()
        store.drain(10)
    assert store.tiers["disk"].out_of_space
    assert "is full" in caplog.text and "demotion to disk pauses" in caplog.text
    assert store.stat(A).tier == "host"  # still served from host
    assert store.check_accounting() == []
    ops.fail_at = None  # space frees
    h.clock.advance(RETRY_FIRST)  # a failed demotion is tried again after this, not at every tick
    store.tick()  # the disk tier notices, and policy demotes again
    store.drain(10)
    assert not store.tiers["disk"].out_of_space
    store.tick()
    store.drain(10)
    assert store.stat(A).tier == "disk" and store.stat(A).durable
    h.close()
