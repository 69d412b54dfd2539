"""What the llama.cpp adapter stores of a sequence, without llama.cpp: the
snapshot's header is read back only for exactly the tokens it holds, a
damaged or cut one is nothing, names round-trip, and a GGUF's fingerprint
changes with any byte of it, also where the file is rewritten in place."""

import numpy as np
import pytest

from tierd.adapters.llamacpp_state import fingerprint, head_bytes, read_head, session_id, tokens_named, write_head


def snapshot(tokens, state=1000):
    buf = np.zeros(head_bytes(len(tokens)) + state, np.uint8)
    write_head(buf, np.asarray(tokens), state)
    return buf


def test_a_snapshot_s_head_reads_back_only_for_the_tokens_it_holds():
    tokens = np.arange(3, 503)
    buf = snapshot(tokens)
    assert read_head(buf, tokens) == 1000
    assert read_head(buf, tokens[:-1]) is None  # fewer tokens
    other = tokens.copy()
    other[17] += 1
    assert read_head(buf, other) is None  # one token other
    assert read_head(buf[:-1], tokens) is None  # cut short
    assert read_head(buf[:10], tokens) is None
    damaged = buf.copy()
    damaged[0] ^= 1  # not a snapshot of this format
    assert read_head(damaged, tokens) is None
    assert read_head(snapshot(tokens, state=0), tokens) is None


def test_names_carry_the_namespace_and_token_count():
    tokens = np.arange(40)
    sid = session_id("abc", tokens)
    assert tokens_named("abc", sid) == 40 and tokens_named("other", sid) is None
    assert session_id("abc", tokens) == sid != session_id("abc", tokens[::-1])
    for bad in ("abc-x-y", "abc-1", "abc-1-2-3", "chat-7"):
        assert tokens_named("abc", bad) is None


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    return path


def test_a_fingerprint_changes_with_any_byte_of_the_file_and_is_read_once_per_version(gguf, tmp_path):
    cache = str(tmp_path / "cache")
    fp = fingerprint(str(gguf), cache)
    assert len(fp) == 32 and fingerprint(str(gguf), cache) == fp
    data = bytearray(gguf.read_bytes())
    for offset in (100, 3 << 20, len(data) - 1):  # the header, any weight, the last byte
        other = tmp_path / f"other-{offset}.gguf"
        changed = bytearray(data)
        changed[offset] ^= 1
        other.write_bytes(bytes(changed))
        assert fingerprint(str(other), cache) != fp
    data[5 << 20] ^= 1  # the same file rewritten in place: its version changed, so it is read again
    gguf.write_bytes(bytes(data))
    assert fingerprint(str(gguf), cache) != fp
    assert fingerprint(str(gguf), str(gguf / "cache")) == fingerprint(str(gguf), cache)  # cache unwritable: read
