"""The llama-server front's parts that need no llama-server (those that do:
tests/llamacpp/test_llamaserver.py): the timings read out of answers, a
model's kind read out of a GGUF's metadata, the slot directory's checks,
conversation names."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tierd.adapters.llamacpp_state import gguf_kind
from tierd.adapters.llamaserver import Front
from tierd.adapters.llamaserver_http import FrontError, timings_of
from tierd.adapters.llamaserver_upstream import check_slot_dir
from tierd.client import Client


def test_timings_are_read_from_a_json_answer_and_from_the_last_event_of_a_stream():
    assert timings_of(json.dumps({"content": "x", "timings": {"cache_n": 612}}).encode()) == {"cache_n": 612}
    events = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in
                      ({"content": "a"}, {"content": "b"}, {"content": "", "timings": {"cache_n": 5}}))
    assert timings_of(events + b"data: [DONE]\n\n") == {"cache_n": 5}
    assert timings_of(b'data: {"content": "no timings"}\n\n') is None
    assert timings_of(b'data: {"timings": broken\n\n') is None
    assert timings_of(b'{"timings": [1, 2]}') is None


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _gguf(path, *kvs, version=3):
    """A GGUF's header and metadata (no tensors): kvs of (key, type, packed value)."""
    body = b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + body)
    return str(path)


def _arch(name):
    return ("general.architecture", 8, _string(name))


VOCAB = ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _string("a") + _string("bc") + _string("d"))
SCORES = ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 1, 2))


def test_a_model_kind_is_read_from_its_gguf(tmp_path):
    ctx = ("llama.context_length", 4, struct.pack("<I", 4096))
    assert gguf_kind(_gguf(tmp_path / "d.gguf", _arch("llama"), VOCAB, SCORES, ctx)) == "dense"
    swa = ("gemma3.attention.sliding_window", 4, struct.pack("<I", 512))
    assert gguf_kind(_gguf(tmp_path / "s.gguf", _arch("gemma3"), VOCAB, swa)) == "swa"
    no_window = ("llama.attention.sliding_window", 4, struct.pack("<I", 0))
    assert gguf_kind(_gguf(tmp_path / "z.gguf", _arch("llama"), no_window)) == "dense"
    assert gguf_kind(_gguf(tmp_path / "m.gguf", _arch("mamba2"), VOCAB)) == "recurrent"
    ssm = ("jamba.ssm.conv_kernel", 4, struct.pack("<I", 4))
    assert gguf_kind(_gguf(tmp_path / "h.gguf", _arch("jamba"), ssm, swa)) == "hybrid"


def test_a_file_that_is_no_readable_gguf_is_of_unknown_kind(tmp_path):
    good = _gguf(tmp_path / "g.gguf", _arch("llama"), VOCAB)
    data = Path(good).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-9])
    assert gguf_kind(str(tmp_path / "cut.gguf")) == "unknown"
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04" + data[4:])
    assert gguf_kind(str(tmp_path / "other.bin")) == "unknown"
    assert gguf_kind(_gguf(tmp_path / "v1.gguf", _arch("llama"), version=1)) == "unknown"
    assert gguf_kind(_gguf(tmp_path / "noarch.gguf", VOCAB)) == "unknown"
    bad_type = ("x", 99, b"")
    assert gguf_kind(_gguf(tmp_path / "t.gguf", _arch("llama"), bad_type)) == "unknown"
    assert gguf_kind(str(tmp_path / "missing.gguf")) == "unknown"


def test_the_slot_dir_is_made_private_and_one_others_may_write_or_a_link_is_refused(tmp_path):
    made = tmp_path / "slots"
    assert check_slot_dir(str(made)) == str(made.resolve())
    assert (made.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(ValueError, match="not writable by group or others"):
        check_slot_dir(str(shared))
    os.symlink(made, tmp_path / "link")
    with pytest.raises(ValueError, match="not a directory"):
        check_slot_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        check_slot_dir(str(tmp_path / "file"))


def test_conversation_names_are_checked(tmp_path):
    front = Front([], str(tmp_path / "slots"), Client(f"unix:{tmp_path}/none.sock"), namespace="ns")
    try:
        assert front.session_of("chat-1.a@b") == "ns-chat-1.a@b"
        assert front.session_of(None) is None
        for bad in ("", "../x", "a..b", "-a", ".a", "a/b", "a b", "x" * 201, "é"):
            with pytest.raises(FrontError) as err:
                front.session_of(bad)
            assert err.value.status == 400
    finally:
        front.close()
    with pytest.raises(ValueError, match="namespace"):
        Front([], str(tmp_path / "slots"), Client(f"unix:{tmp_path}/none.sock"), namespace="a/b")
