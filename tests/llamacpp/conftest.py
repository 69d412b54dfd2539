"""Fixtures of the llama.cpp tests: the tiny GGUF models (two, of other
weights) and a tierd daemon."""

import pytest

pytest.importorskip("llama_cpp")

from tests.llamacpp.model import tiny_llama  # noqa: E402
from tierd.testing import Daemon  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return tiny_llama(root / "tiny.gguf", seed=0), tiny_llama(root / "other.gguf", seed=1)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, "--host-idle", "600", "--writeback-idle", "0.3").start()
    yield d
    d.close()
