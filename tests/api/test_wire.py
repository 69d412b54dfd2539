"""Get's chunk messages, built and read by hand: byte for byte what protobuf
builds, read without a copy, and anything else (other field order, unknown
fields, damage) either read as protobuf reads it or refused as DataLoss."""

import os

import pytest
import xxhash

from tierd.errors import DataLoss
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.chunks import _varint, chunk_message, read_chunk, read_header

SIZES = (0, 1, 127, 128, 16_383, 16_384, 1 << 20, (1 << 20) + 5)


def _protobuf(data: bytes) -> pb.GetResponse:
    return pb.GetResponse(chunk=pb.Chunk(data=data, xxh3=xxhash.xxh3_64_intdigest(data)))


@pytest.mark.parametrize("n", SIZES)
def test_hand_built_messages_are_what_protobuf_would_build(n):
    data = os.urandom(n)
    raw = chunk_message(data)
    assert pb.GetResponse.FromString(raw) == _protobuf(data)
    if n:  # protobuf leaves an empty bytes field out; chunk_message writes it, which reads the same
        assert raw == _protobuf(data).SerializeToString()
    assert chunk_message(memoryview(data)) == raw


@pytest.mark.parametrize("n", SIZES)
def test_a_chunk_is_read_as_a_view_of_its_message(n):
    data = os.urandom(n)
    raw = chunk_message(data)
    got = read_chunk(raw, 0)
    assert got == data and got.readonly
    assert got.obj is raw  # no copy
    assert read_chunk(_protobuf(data).SerializeToString(), 0) == data


def _inner(fields: bytes) -> bytes:
    return b"\x12" + _varint(len(fields)) + fields


def test_other_valid_layouts_are_read_as_protobuf_reads_them():
    data = os.urandom(1000)
    digest = xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")
    data_field = b"\x0a" + _varint(len(data)) + data
    for raw in (_inner(b"\x11" + digest + data_field),  # checksum first
                _inner(data_field + b"\x11" + digest + b"\x78\x01"),  # an unknown field after
                _inner(data_field),  # no checksum: unchecked
                chunk_message(data) + b"\x18\x05"):  # an unknown field in GetResponse
        assert read_chunk(raw, 3) == data


def test_damage_is_data_loss():
    data = os.urandom(5000)
    raw = bytearray(chunk_message(data))
    raw[100] ^= 1
    with pytest.raises(DataLoss, match="chunk 7 of the Get stream arrived damaged"):
        read_chunk(bytes(raw), 7)
    whole = chunk_message(data)
    for bad, why in ((whole[:-3], "not a GetResponse"), (b"\xff\xff\xff", "not a GetResponse"),
                     (pb.GetResponse(header=pb.SessionInfo(session_id="s")).SerializeToString(), "not a chunk")):
        with pytest.raises(DataLoss, match=why):
            read_chunk(bad, 2)


def test_a_stream_opens_with_its_header():
    info = pb.SessionInfo(session_id="s1", num_tokens=5)
    assert read_header(pb.GetResponse(header=info).SerializeToString()) == info
    for raw in (chunk_message(b"abc"), b"\xff\xff", b""):
        with pytest.raises(DataLoss, match="did not open with its header"):
            read_header(raw)
