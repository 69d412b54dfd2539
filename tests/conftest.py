import pytest

from tierd.testing import Daemon
from tests.helpers import Harness


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
