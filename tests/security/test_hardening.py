"""Quotas, admission by bytes in flight, and a data dir that is checked at start."""

import glob
import hashlib
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from tierd.api.inflight import InflightBytes
from tierd.client import KVSpec, ResourceExhausted
from tierd.testing import ROOT, Daemon
from tierd.tiers import shm

KiB, MiB = 1 << 10, 1 << 20
OPAQUE = KVSpec.opaque("m", page_bytes=64 * KiB)


def serve(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "tierd", "serve", "--data-dir", str(tmp_path / "data"),
                           "--socket", str(tmp_path / "run" / "s.sock"), "--metrics", "off", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_world_writable_data_dir_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    os.chmod(tmp_path / "data", 0o777)
    out = serve(tmp_path)
    assert out.returncode == 1 and "writable by anyone" in out.stderr


@pytest.mark.parametrize("name", ["index.db", "slabs"])
def test_symlinks_in_the_data_dir_are_refused(tmp_path, name):
    (tmp_path / "data").mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / name)
    out = serve(tmp_path)
    assert out.returncode == 1 and "symbolic link" in out.stderr
    assert os.listdir(tmp_path / "elsewhere") == []  # nothing was written through the link


def test_a_symlinked_slab_file_is_refused(tmp_path):
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.put("s", b"x" * 1000, OPAQUE, num_tokens=1)
    d.stop()  # flushes: a slab file now exists
    slab = tmp_path / "data" / "slabs" / "slab-000000.bin"
    os.rename(slab, tmp_path / "outside.bin")
    os.symlink(tmp_path / "outside.bin", slab)
    with pytest.raises(RuntimeError, match="symbolic link"):
        d.start()


def _tree(*roots):
    """Every path under these directories (themselves included)."""
    for root in roots:
        yield root
        for parent, dirs, files in os.walk(root):
            yield from (os.path.join(parent, n) for n in dirs + files)


def test_every_file_the_daemon_creates_is_private(tmp_path):
    """Regression: the index (index.db, -wal, -shm) was created by SQLite
    under the process umask, 0644 where the umask is 022. The daemon sets
    its umask to 077 before it creates anything: whatever it creates is its
    user's alone, under any umask it was started with."""
    old = os.umask(0)  # the widest the daemon can inherit
    try:
        d = Daemon(tmp_path, "--writeback-idle", "0").start()
    finally:
        os.umask(old)
    try:
        with d.client() as c:
            c.put("s", np.ones(200 * KiB, dtype=np.uint8), OPAQUE, num_tokens=1)
            c.release("s")
            deadline = time.monotonic() + 30
            while not c.stat("s").durable:  # the write-back has run: slab file, index rows
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # while it serves: the index's -wal and -shm exist as well
            paths = list(_tree(d.data_dir, os.path.dirname(d.socket)))
            paths += glob.glob(os.path.join("/dev/shm", glob.escape(shm.read_prefix(d.data_dir)) + ".*"))
        names = {os.path.relpath(p, tmp_path) if p.startswith(str(tmp_path)) else "/dev/shm/arena" for p in paths}
        assert {"data/index.db", "data/index.db-wal", "data/index.db-shm", "data/tierd.lock", "data/shm-prefix",
                "data/slabs/slab-000000.bin", "run/tierd.sock", "run/tierd.sock.lock", "run/tierd.sock.fds",
                "/dev/shm/arena"} <= names
        modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in paths}
        assert {p: oct(m) for p, m in modes.items() if m & 0o077} == {}
        assert all(modes[p] == 0o700 for p in paths if os.path.isdir(p))
    finally:
        d.close()


def test_tenant_quotas_per_tier_and_sessions(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t}:{hashlib.sha256(t.encode()).hexdigest()}\n" for t in ("alice", "bob")))
    d = Daemon(tmp_path, "--auth-tokens", str(tokens), "--tenant-host-quota", "1MiB", "--tenant-sessions", "2",
               "--writeback-idle", "off").start()
    try:
        alice, bob = d.client(token="alice"), d.client(token="bob")
        data = np.random.default_rng(0).integers(0, 256, 640 * KiB, dtype=np.uint8).tobytes()
        alice.put("a1", data, OPAQUE, num_tokens=1)
        # a second 640 KiB session takes alice past 1 MiB of host: her own a1 goes to disk to make room
        alice.put("a2", data, OPAQUE, num_tokens=1)
        assert alice.stat("a1").tier == "disk" and alice.stat("a2").tier == "host"
        assert alice.get("a1") == data
        # bob's quota is his own
        bob.put("b1", data, OPAQUE, num_tokens=1)
        assert bob.stat("b1").tier == "host"
        with pytest.raises(ResourceExhausted, match="may hold 2 sessions"):
            alice.put("a3", b"x", OPAQUE, num_tokens=1)
        with pytest.raises(ResourceExhausted, match="may hold 1048576 bytes of the host tier"):
            bob.put("b2", b"y" * (2 * MiB), OPAQUE, num_tokens=1)
        assert [s.session_id for s in bob.list()] == ["b1"]
        alice.put("a2", b"replacing counts as the same session", OPAQUE, num_tokens=1)
    finally:
        d.close()


def test_bytes_in_flight_are_capped_per_tenant():
    inflight = InflightBytes(cap=8 * MiB)
    with inflight.hold("alice", 6 * MiB):
        with pytest.raises(ResourceExhausted, match="in flight"):
            with inflight.hold("alice", 3 * MiB):
                pass
        with inflight.hold("bob", 6 * MiB):  # other tenants are not held back
            assert inflight.held("bob") == 6 * MiB
        with inflight.hold("alice", 2 * MiB):
            assert inflight.held("alice") == 8 * MiB
    with inflight.hold("alice", 100 * MiB):  # a call alone is admitted, however large
        pass
    assert inflight.held("alice") == 0 and inflight.held("bob") == 0


def test_a_call_of_no_bytes_may_end_after_the_others():
    inflight = InflightBytes(cap=8 * MiB)
    empty = inflight.hold("alice", 0)  # a refused 0-byte Put, say: its entry went with the other call's
    with inflight.hold("alice", MiB):
        empty.__enter__()
    empty.__exit__(None, None, None)  # (a KeyError: INTERNAL, before)
    assert inflight.held("alice") == 0


def test_a_stream_in_flight_holds_its_bytes(tmp_path):
    d = Daemon(tmp_path, "--tenant-inflight-bytes", "1MiB", "--writeback-idle", "off").start()
    try:
        with d.client() as c, d.client() as other:
            c.put("big", np.zeros(32 * MiB, dtype=np.uint8), OPAQUE, num_tokens=1)
            info, chunks = c.get_stream("big", chunk_bytes=64 * KiB)  # the stream stays open, unread
            next(chunks)
            with pytest.raises(ResourceExhausted, match="in flight"):
                other.put("more", b"z" * 1000, OPAQUE, num_tokens=1)
            assert sum(len(x) for x in chunks) == 32 * MiB - 64 * KiB
            other.put("more", b"z" * 1000, OPAQUE, num_tokens=1)  # admitted once the stream is done
    finally:
        d.close()
