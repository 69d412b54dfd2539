import pytest

from tests.api.daemon import Daemon


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, "--host-idle", "1", "--writeback-idle", "0.3", "--device-idle", "0.5").start()
    yield d
    d.close()
