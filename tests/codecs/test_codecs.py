"""The KV codecs on real KV: a transformers Llama (random weights, built from
a config) fills a cache, its pages are coded and decoded. Lossless codecs
give back every bit; lossy ones stay within the bound each states, report
the error a recomputation finds, and pass through what they must not
scale; damaged blobs are DATA_LOSS; names and specs they cannot serve are
clear errors."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tierd import codecs
from tierd.adapters.hf import forward
from tierd.errors import DataLoss, InvalidArgument
from tierd.layout import KVSpec

LAYERS, HEADS, DIM, BLOCK = 3, 2, 32, 16
HEAD_MAJOR = "hf-dynamic-cache:layer,kv,head,token,dim"
TOKEN_MAJOR = "layer,kv,token,head,dim"
VLLM_CPU = "vllm:cpu:vec:[blocks,kv_heads,block_size,C]"  # per layer and head: K transposed, then V


def in_order(x: torch.Tensor, arrangement: str) -> torch.Tensor:
    """Pages [n, L, 2, H, T, D] as each arrangement orders them."""
    if arrangement == TOKEN_MAJOR:
        return x.permute(0, 1, 2, 4, 3, 5)
    if arrangement == VLLM_CPU:
        n = x.shape[0]
        k = x[:, :, 0].transpose(-1, -2).reshape(n, LAYERS, HEADS, -1)
        return torch.stack([k, x[:, :, 1].reshape(n, LAYERS, HEADS, -1)], dim=3)
    return x


ARRANGEMENTS = (HEAD_MAJOR, TOKEN_MAJOR, VLLM_CPU)
# What each lossy codec promises of a page of real KV: its relative L2 error at most.
BOUNDS = {"fp8": 0.07, "k16v8": 0.07, "int8": 0.02, "int4": 0.3}
LOSSY = sorted(BOUNDS)


def spec(dtype: str, arrangement: str = HEAD_MAJOR) -> KVSpec:
    return KVSpec("test/llama", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype,
                  block_tokens=BLOCK, arrangement=arrangement)


@pytest.fixture(scope="module")
def kv():
    """[layers, 2, heads, tokens, dim] float32 KV of 96 prompt tokens."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=HEADS * 2 * DIM, intermediate_size=256,
                                         num_attention_heads=HEADS * 2, num_key_value_heads=HEADS,
                                         num_hidden_layers=LAYERS, max_position_embeddings=512)).eval()
    cache = DynamicCache(config=model.config)
    forward(model, torch.randint(0, 256, (1, 96)), cache)
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def pages_of(kv: torch.Tensor, dtype: torch.dtype, arrangement: str = HEAD_MAJOR) -> np.ndarray:
    """KV as pages [n, page_bytes] of BLOCK tokens each, in the arrangement's order."""
    n = kv.shape[3] // BLOCK
    x = kv.view(LAYERS, 2, HEADS, n, BLOCK, DIM).permute(3, 0, 1, 2, 4, 5)  # [n, L, 2, H, T, D]
    return in_order(x, arrangement).to(dtype).contiguous().view(torch.uint8).reshape(n, -1).numpy()


def roundtrip(name: str, pages: np.ndarray, shape) -> tuple[codecs.Coded, np.ndarray]:
    codec = codecs.get(name)
    coded = codecs.code(codec, pages, shape)
    out = np.empty_like(pages)
    for i, blob in enumerate(coded.blobs):
        codec.decode(blob, shape, out[i])
    return coded, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lossless_gives_back_every_bit_and_says_its_error_is_none(kv, dtype):
    s = spec(dtype)
    pages = pages_of(kv, getattr(torch, dtype))
    coded, out = roundtrip("lossless", pages, codecs.page_shape(s))
    assert np.array_equal(out, pages)
    assert not coded.rel_error.any() and not coded.max_error.any()
    assert coded.nbytes < pages.size  # real KV's exponent bytes repeat


def test_lossless_codes_opaque_bytes_and_keeps_what_does_not_shrink():
    rng = np.random.default_rng(1)
    pages = np.stack([np.frombuffer(b"llama.cpp state " * 256, dtype=np.uint8), rng.integers(0, 256, 4096, np.uint8)])
    coded, out = roundtrip("lossless", pages, codecs.page_shape(KVSpec.opaque("test/opaque", page_bytes=4096)))
    assert np.array_equal(out, pages)
    assert len(coded.blobs[0]) < 200 and len(coded.blobs[1]) == 4097  # random bytes: kept as they are, and a byte


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_lossy_codecs_stay_within_their_bound_and_report_the_error_a_recomputation_finds(kv, name, arrangement):
    s = spec("bfloat16", arrangement)
    shape = codecs.page_shape(s)
    pages = pages_of(kv, torch.bfloat16, arrangement)
    coded, out = roundtrip(name, pages, shape)
    original = torch.from_numpy(pages).view(torch.bfloat16).double()
    decoded = torch.from_numpy(out).view(torch.bfloat16).double()
    for i in range(len(pages)):
        diff = decoded[i] - original[i]
        rel = float(diff.norm() / original[i].norm())
        assert rel <= BOUNDS[name], f"page {i}: {rel}"
        assert coded.rel_error[i] == pytest.approx(rel, rel=1e-3, abs=1e-6)
        assert coded.max_error[i] == pytest.approx(float(diff.abs().max()), rel=1e-3, abs=1e-6)
    assert coded.nbytes < pages.size / (1.2 if name == "k16v8" else 1.5)
    if name == "k16v8":  # K as it was, to the bit
        assert torch.equal(shape.values(out)[:, :, 0], shape.values(pages)[:, :, 0])


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_a_page_shape_reads_each_arrangement_as_the_kv_it_holds_and_writes_it_back(kv, arrangement):
    shape = codecs.page_shape(spec("float32", arrangement))
    pages = pages_of(kv, torch.float32, arrangement)
    n = len(pages)
    want = kv.view(LAYERS, 2, HEADS, n, BLOCK, DIM).permute(3, 0, 1, 2, 4, 5)
    assert torch.equal(shape.values(pages), want)  # K is K, V is V, whatever order the bytes hold them in
    out = np.empty_like(pages[0])
    shape.write(want[1], out)
    assert np.array_equal(out, pages[1])


def test_fewer_bits_cost_more_error(kv):
    shape = codecs.page_shape(spec("bfloat16"))
    pages = pages_of(kv, torch.bfloat16)
    worst = {name: float(roundtrip(name, pages, shape)[0].rel_error.max()) for name in ("int8", "fp8", "int4")}
    assert 0 < worst["int8"] < worst["fp8"] < worst["int4"]


def test_a_page_whose_bytes_changed_is_never_said_to_be_exact():
    shape = codecs.page_shape(spec("float16"))
    page = np.zeros(shape.page_bytes, dtype=np.uint8)
    page.view(np.float16)[::3] = -0.0  # -0.0 equals 0.0, but its bytes are others
    decoded = np.zeros_like(page)
    rel, largest = codecs.error(shape, page, decoded)
    assert 0 < rel < 1e-30 and largest == 0
    assert codecs.error(shape, page, page.copy()) == (0.0, 0.0)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_codecs_pass_an_fp8_cache_and_pages_that_are_not_finite_through_unchanged(kv, name):
    fp8 = pages_of(kv, torch.float8_e4m3fn)
    coded, out = roundtrip(name, fp8, codecs.page_shape(spec("float8_e4m3fn")))
    assert np.array_equal(out, fp8) and not coded.rel_error.any()
    pages = pages_of(kv, torch.float16)
    typed = pages[1].view(np.float16)
    typed[7] = np.inf
    shape = codecs.page_shape(spec("float16"))
    coded, out = roundtrip(name, pages, shape)
    assert np.array_equal(out[1], pages[1])  # never scaled: the page as it is
    assert coded.rel_error[1] == 0 and coded.rel_error[0] > 0


@pytest.mark.parametrize("name", ["lossless"] + LOSSY)
def test_damaged_blobs_are_data_loss(kv, name):
    shape = codecs.page_shape(spec("bfloat16"))
    pages = pages_of(kv, torch.bfloat16)
    codec = codecs.get(name)
    blob = codec.encode(pages[:1], shape)[0]
    out = np.empty(pages.shape[1], dtype=np.uint8)
    for bad in (blob[:-1], blob + b"\0", b"", bytes([9]) + blob[1:]):
        with pytest.raises(DataLoss):
            codec.decode(bad, shape, out)
    if name == "lossless":
        with pytest.raises(DataLoss):
            codec.decode(blob[:1] + bytes(len(blob) - 1), shape, out)  # the coded bytes zeroed
        lengths = [int(x) for x in np.frombuffer(blob[1:9], dtype="<u4")]  # bfloat16: two planes
        assert lengths[0] == 0 < lengths[1]  # the low mantissa bytes kept as they are, the high ones coded
        for wrong in (lengths[::-1], [1, lengths[1] - 1], [0, lengths[1] + 1]):
            with pytest.raises(DataLoss):
                codec.decode(blob[:1] + np.array(wrong, dtype="<u4").tobytes() + blob[9:], shape, out)


def test_names_and_specs_a_codec_cannot_serve_are_clear_errors():
    with pytest.raises(InvalidArgument, match="unknown codec 'zip'; codecs are .*fp8.*lossless"):
        codecs.get("zip")
    opaque = KVSpec.opaque("test/opaque")
    assert codecs.for_spec("lossless", opaque).name == "lossless"
    for name in LOSSY:
        with pytest.raises(InvalidArgument, match="lossy and codes no opaque snapshots"):
            codecs.for_spec(name, opaque)
        with pytest.raises(InvalidArgument, match="arranged as 'engine:own'"):
            codecs.for_spec(name, spec("bfloat16", "engine:own"))
    assert codecs.for_spec("int4", spec("bfloat16")).lossy


def test_a_codec_is_one_registration():
    class Reverse:
        name, lossy = "test-reverse", False

        def encode(self, pages, shape):
            return [page[::-1].tobytes() for page in pages]

        def decode(self, blob, shape, out):
            out[:] = np.frombuffer(blob, dtype=np.uint8)[::-1]

    codec = codecs.register(Reverse())
    assert codecs.get("test-reverse") is codec and "test-reverse" in codecs.names()
    pages = np.arange(8192, dtype=np.uint32).view(np.uint8).reshape(4, -1)
    _, out = roundtrip("test-reverse", pages, None)
    assert np.array_equal(out, pages)
    with pytest.raises(ValueError, match="registered already"):
        codecs.register(Reverse())
