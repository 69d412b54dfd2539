import pytest

from tests.helpers import Harness


@pytest.fixture
def harness(tmp_path):
    h = Harness(str(tmp_path))
    yield h
    h.close()


@pytest.fixture
def store(harness):
    return harness.open()
