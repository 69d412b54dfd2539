import os

import pytest

from tierd.testing import Daemon
from tests.helpers import Harness, SmallFS


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path))
    yield h
    h.close()


@pytest.fixture
def store(harness):
    return harness.open()


@pytest.fixture
def daemon(tmp_path):
    """A daemon process with short idle thresholds: written back after 0.3 s
    idle, on disk only after 1 s."""
    d = Daemon(tmp_path, "--host-idle", "1", "--writeback-idle", "0.3", "--device-idle", "0.5").start()
    yield d
    d.close()


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs at tmp_path/fs, for tests that fill a file system for
    real. Mounting needs root (or CAP_SYS_ADMIN), as CI has: the test is
    skipped only where mounting is not permitted, and fails on any other
    mount error."""
    fs = SmallFS(tmp_path / "fs", 24 << 20)
    why = fs.mount()
    if why is not None:
        if os.geteuid() != 0 or any(w in why.lower() for w in ("permission denied", "not permitted", "only root")):
            pytest.skip(f"mounting a tmpfs is not permitted here ({why}); the full-disk tests need root")
        pytest.fail(f"cannot mount a tmpfs: {why}")
    try:
        yield fs
    finally:
        fs.unmount()
