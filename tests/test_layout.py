import dataclasses

import pytest

from tierd.errors import InvalidArgument
from tierd.layout import EngineLayout, KVSpec, Segment

QWEN = KVSpec("Qwen/Qwen2.5-7B", "main", num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16",
              block_tokens=16)


def test_sizes_follow_the_shape():
    # 2 (K and V) x 28 layers x 4 heads x 128 dims x 2 bytes
    assert QWEN.bytes_per_token == 57_344
    assert QWEN.page_bytes == 16 * 57_344
    assert QWEN.pages_for_tokens(42_603) == 2663


def test_fingerprint_is_stable_and_covers_every_field():
    assert QWEN.fingerprint == KVSpec.from_dict(QWEN.to_dict()).fingerprint
    changes = {"model_id": "other", "revision": "v2", "num_layers": 27, "num_kv_heads": 8, "head_dim": 64,
               "dtype": "float16", "block_tokens": 32, "layout_version": 2, "arrangement": "block,layer,kv",
               "extra": "rope=yarn"}
    prints = {dataclasses.replace(QWEN, **{k: v}).fingerprint for k, v in changes.items()}
    assert QWEN.fingerprint not in prints
    assert len(prints) == len(changes)


def test_same_shape_different_arrangement_is_a_different_identity():
    other = dataclasses.replace(QWEN, arrangement="vllm-cpu:block,kv,head,token,dim")
    assert other.page_bytes == QWEN.page_bytes
    assert other.fingerprint != QWEN.fingerprint


@pytest.mark.parametrize("field,value,words", [
    ("model_id", "", "model_id"),
    ("model_id", "has space", "model_id"),
    ("num_layers", 0, "num_layers"),
    ("num_layers", True, "num_layers"),
    ("num_kv_heads", -1, "num_kv_heads"),
    ("head_dim", 1.5, "head_dim"),
    ("dtype", "float64", "dtype"),
    ("block_tokens", 0, "block_tokens"),
    ("kind", "weird", "kind"),
    ("block_tokens", 1 << 20, "over the"),
])
def test_bad_specs_name_the_field(field, value, words):
    with pytest.raises(InvalidArgument, match=words):
        dataclasses.replace(QWEN, **{field: value})


def test_opaque_spec():
    spec = KVSpec.opaque("llama.cpp/qwen", page_bytes=1 << 20)
    assert spec.is_opaque and spec.page_bytes == 1 << 20 and spec.bytes_per_token == 0
    with pytest.raises(InvalidArgument):
        KVSpec("x", kind="opaque", opaque_page_bytes=4096, num_layers=2)
    with pytest.raises(InvalidArgument, match="unknown spec fields"):
        KVSpec.from_dict({**spec.to_dict(), "bogus": 1})


def test_layouts_cover_a_page():
    lm = EngineLayout.layer_major(QWEN, 10)
    assert len(lm.segments) == 56 and lm.page_bytes == QWEN.page_bytes
    assert lm.page_offsets[1] == QWEN.page_bytes // 56
    lm.check(QWEN, [10 * QWEN.page_bytes // 56] * 56)
    cl = EngineLayout.cross_layer(QWEN, 10)
    cl.check(QWEN, [10 * QWEN.page_bytes])


def test_layout_errors():
    cl = EngineLayout.cross_layer(QWEN, 10)
    with pytest.raises(InvalidArgument, match="past the end of region"):
        cl.check(QWEN, [10 * QWEN.page_bytes - 1])
    with pytest.raises(InvalidArgument, match="names region 1"):
        EngineLayout(2, (Segment(1, 0, QWEN.page_bytes, QWEN.page_bytes),)).check(QWEN, [1 << 30])
    with pytest.raises(InvalidArgument, match="bytes per block"):
        EngineLayout(2, (Segment(0, 0, 4096, 4096),)).check(QWEN, [1 << 30])
    with pytest.raises(InvalidArgument, match="overlap"):
        EngineLayout(2, (Segment(0, 0, 100, 200),))
    opaque = KVSpec.opaque("x")  # its blocks are whole pages: memory a session is read into
    with pytest.raises(InvalidArgument, match="bytes per block"):
        cl.check(opaque, [1 << 30])
    EngineLayout.cross_layer(opaque, 4).check(opaque, [4 * opaque.page_bytes])


def test_a_page_is_at_least_4_KiB():
    """Each page takes a 4 KiB granule of a tier whatever its size: 1-byte opaque
    pages once let a 16 KiB Put hold 64 MiB of the host tier."""
    assert KVSpec.opaque("x", page_bytes=4096).page_bytes == 4096
    for page_bytes in (1, 4095):
        with pytest.raises(InvalidArgument, match="opaque_page_bytes"):
            KVSpec.opaque("x", page_bytes=page_bytes)
    with pytest.raises(InvalidArgument, match=r"opaque_page_bytes must be an integer in \[4096, 16777216\]"):
        KVSpec.opaque("x", page_bytes=32 << 20)  # eight 1-byte Puts held 224 MiB of the host tier
    with pytest.raises(InvalidArgument, match="under the 4096-byte minimum"):
        KVSpec("m", num_layers=1, num_kv_heads=1, head_dim=1, dtype="int8", block_tokens=1)
