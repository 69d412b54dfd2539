"""Put's and Get's chunk messages in wire format, built and read by hand.

A chunk is PutRequest{chunk: Chunk{data, xxh3}} or GetResponse{chunk: ...}:
field 2 in both, so both are laid out alike. Protobuf would copy the data
twice on each side, into and out of its arena; each fresh MiB buffer also
costs its page faults, which on a virtual machine cost more than the copy.
So the sender builds each message with one copy of the data, and the
receiver reads the data as a view of the message gRPC handed it, no copy.
Messages laid out otherwise (valid protobuf all the same, from another
client) are read by protobuf.
"""

from __future__ import annotations

import xxhash
from google.protobuf.message import DecodeError

from tierd.errors import DataLoss
from tierd.v1 import tierd_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["Tierd"].full_name
GET_METHOD, PUT_METHOD = f"/{_SERVICE}/Get", f"/{_SERVICE}/Put"
_CHUNK = 0x12  # GetResponse.chunk and PutRequest.chunk: field 2, length-delimited
_DATA = 0x0A  # Chunk.data: field 1, length-delimited
_XXH3 = 0x11  # Chunk.xxh3: field 2, fixed64


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]  # IndexError past the end
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def chunk_message(data: bytes | memoryview, digest: int = 0) -> bytes:
    """{chunk: Chunk{data, xxh3}} in wire format, one copy of data: a
    GetResponse, or a PutRequest. digest: data's XXH3 where already known."""
    digest = digest or xxhash.xxh3_64_intdigest(data)
    n = len(data)
    inner = 1 + len(_varint(n)) + n + 1 + 8  # field 1 (bytes) and field 2 (fixed64)
    return b"".join((bytes((_CHUNK,)), _varint(inner), bytes((_DATA,)), _varint(n), data, bytes((_XXH3,)),
                     digest.to_bytes(8, "little")))


def _fields(raw: bytes) -> tuple[memoryview, int]:
    """(data, xxh3) of a chunk message laid out as chunk_message lays it out;
    ValueError or IndexError for any other layout."""
    buf = memoryview(raw)
    if buf[0] != _CHUNK:
        raise ValueError("not a chunk")
    size, pos = _read_varint(buf, 1)
    if pos + size != len(buf) or buf[pos] != _DATA:
        raise ValueError("not laid out as expected")
    n, pos = _read_varint(buf, pos + 1)
    if pos + n + 9 != len(buf) or buf[pos + n] != _XXH3:
        raise ValueError("not laid out as expected")
    return buf[pos : pos + n], int.from_bytes(buf[pos + n + 1 :], "little")


def split_chunk(raw: bytes, message: type) -> tuple[memoryview, int] | None:
    """(data, xxh3) of a chunk message of type `message` (GetResponse or
    PutRequest), data as a read-only view of raw; None where raw is that
    message's other part, its header. Raises DecodeError where raw is not
    such a message."""
    try:
        return _fields(raw)
    except (ValueError, IndexError):
        msg = message.FromString(raw)
        if msg.WhichOneof("part") != "chunk":
            return None
        return memoryview(msg.chunk.data), msg.chunk.xxh3


# Sent as initial metadata once a Put's header is taken: the client sends its
# chunks only then, so a refused Put costs no transfer and its status arrives
# before anything else is written.
PUT_ACCEPTED = ("tierd-put", "accepted")


def put_accepted(metadata: object) -> bool:
    """Whether a Put's initial metadata says its header was taken."""
    return PUT_ACCEPTED in tuple(metadata or ())


def checked(data: memoryview, digest: int) -> bool:
    """Whether data matches its XXH3 (0: sent unchecked)."""
    return not digest or xxhash.xxh3_64_intdigest(data) == digest


def read_chunk(raw: bytes, n: int) -> memoryview:
    """The data of chunk n of a Get stream, checked against its XXH3: a
    read-only view of raw. Raises DataLoss."""
    try:
        parts = split_chunk(raw, pb.GetResponse)
    except DecodeError:
        raise DataLoss(f"message {n + 1} of the Get stream is not a GetResponse") from None
    if parts is None:
        raise DataLoss(f"message {n + 1} of the Get stream is not a chunk")
    if not checked(*parts):
        raise DataLoss(f"chunk {n} of the Get stream arrived damaged (checksum mismatch)")
    return parts[0]


def read_header(raw: bytes) -> pb.SessionInfo:
    """The SessionInfo that opens a Get stream. Raises DataLoss."""
    try:
        msg = pb.GetResponse.FromString(raw)
    except DecodeError:
        msg = None
    if msg is None or msg.WhichOneof("part") != "header":
        raise DataLoss("the Get stream did not open with its header")
    return msg.header
