"""The tiny model every vLLM test serves: built from a config, random weights."""

import pytest

from tests.vllm.server import tiny_llama


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    return path, AutoTokenizer.from_pretrained(path)
