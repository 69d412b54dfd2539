"""Message conversions, which cache specs both ways: a cached value must never
leak a change from one answer into the next, and a bad spec must be refused
every time, not only the first."""

import pytest

from tierd.errors import InvalidArgument
from tierd.layout import KVSpec
from tierd.types import SessionInfo
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.convert import info_from_pb, info_to_pb, spec_from_pb, spec_to_pb

SPEC = KVSpec("test/llama", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


def _info(spec: KVSpec, session_id: str = "s1") -> SessionInfo:
    return SessionInfo(tenant="t", session_id=session_id, tier="host", tier_bytes={"host": 4096}, state="stored",
                       num_tokens=16, size_bytes=4096, num_pages=1, durable=False, last_access=1.0, created=0.5,
                       priority=0, pins=0, model_id=spec.model_id, fingerprint=spec.fingerprint, spec=spec)


def test_a_session_info_survives_the_round_trip():
    for spec in (SPEC, KVSpec.opaque("llama.cpp/x", page_bytes=8192)):
        info = _info(spec)
        assert info_from_pb(pb.SessionInfo.FromString(info_to_pb(info).SerializeToString())) == info


def test_changing_one_answer_leaves_the_next_untouched():
    first = info_to_pb(_info(SPEC))
    first.spec.model_id = "changed"
    first.spec.num_layers = 99
    again = info_to_pb(_info(SPEC, "s2"))
    assert (again.spec.model_id, again.spec.num_layers) == ("test/llama", 4)
    assert spec_to_pb(SPEC).model_id == "test/llama"


def test_the_same_message_gives_an_equal_spec_and_unset_fields_their_defaults():
    msg = pb.KVSpec(model_id="test/llama", revision="r1", num_layers=4, num_kv_heads=2, head_dim=64,
                    dtype="float16", block_tokens=16)
    assert spec_from_pb(msg) == spec_from_pb(pb.KVSpec.FromString(msg.SerializeToString())) == SPEC
    other = pb.KVSpec()
    other.CopyFrom(msg)
    other.num_layers = 8
    assert spec_from_pb(other).num_layers == 8


def test_a_bad_spec_is_refused_every_time():
    bad = pb.KVSpec(model_id="test/llama", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float13", block_tokens=16)
    for _ in range(3):
        with pytest.raises(InvalidArgument, match="dtype"):
            spec_from_pb(bad)
    with pytest.raises(InvalidArgument, match="model_id"):
        spec_from_pb(pb.KVSpec())
