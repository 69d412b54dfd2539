"""Repeated integer fields (token ids, block ids) read and written as arrays.

Runs in the servicer (on the event loop and the RPC threads) and in the
clients. Protobuf turns a `repeated int64` field into one Python int per
element: a prompt of 19 million token ids (57 MiB on the wire) cost about
1.5 GB in the daemon. Here those fields are read through copies of the
request messages in which they are declared `bytes`: their wire form, a
packed repeated field, is the same length-delimited run of varints, which
numpy decodes in blocks into one int64 array (8 bytes a token, plus the
message itself). The public proto keeps `repeated int64`: every client
encodes it packed, as proto3 asks. A client that sends the elements one by
one (legal, and never seen) is refused with a clear message rather than
read without its ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    unknown_fields,
)

from tierd.errors import InvalidArgument
from tierd.v1 import tierd_pb2 as pb

# (message, field) of every repeated integer field that may be long.
FIELDS = {
    "SaveRequest": ("block_ids", "token_ids"),
    "RestoreRequest": ("block_ids",),
    "PutHeader": ("token_ids",),
    "LookupRequest": ("token_ids",),
    "BeginSaveRequest": ("token_ids",),
    "BeginRestoreRequest": ("token_ids",),
}
_SCAN = 1 << 20  # wire bytes decoded at a time: temporaries of about 16 MiB
_BLOCK = 1 << 18  # values encoded at a time


def _shadow_pool() -> descriptor_pool.DescriptorPool:
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name = "tierd/v1/tierd_packed.proto"  # its own file in its own pool
    for msg in proto.message_type:
        for f in msg.field:
            if f.name in FIELDS.get(msg.name, ()):
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                f.label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
                f.ClearField("options")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


_POOL = _shadow_pool()


def message_class(name: str) -> type:
    """The request message `name` with its long repeated integer fields as bytes."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tierd.v1.{name}"))


def check_packed(msg: Any, path: str = "") -> None:
    """Refuse a message whose long integer fields came unpacked (they would
    land among its unknown fields, and the call would run without them)."""
    fields = FIELDS.get(msg.DESCRIPTOR.name, ())
    numbers = {msg.DESCRIPTOR.fields_by_name[f].number: f for f in fields}
    for item in unknown_fields.UnknownFieldSet(msg):
        if item.field_number in numbers:
            name = path + numbers[item.field_number]
            raise InvalidArgument(f"{name} must be sent packed (proto3's default encoding)", field=name)


def count(raw: bytes) -> int:
    """How many varints a packed field holds (one byte under 0x80 ends each)."""
    data = np.frombuffer(raw, dtype=np.uint8)
    return sum(int(np.count_nonzero(data[i : i + _SCAN] < 0x80)) for i in range(0, data.size, _SCAN))


def decode(raw: bytes, name: str = "token_ids", limit: int | None = None) -> np.ndarray:
    """The varints of a packed repeated int64 field as an int64 array, the
    first `limit` of them if given (a caller that needs no more decodes no
    more). Ids are non-negative: a negative value (a 10-byte varint) or a
    value past 63 bits is refused, and so is a truncated varint."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size and data[-1] & 0x80:
        raise InvalidArgument(f"{name} ends inside a varint", field=name)
    n = count(raw) if limit is None else min(limit, count(raw))
    out = np.empty(n, dtype=np.int64)
    done = pos = 0
    while done < n:
        block = data[pos : pos + _SCAN]
        ends = np.flatnonzero(block < 0x80)[: n - done]
        if not ends.size:
            raise InvalidArgument(f"{name} holds a negative or over 63-bit value", field=name)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if lengths.max() > 9:
            raise InvalidArgument(f"{name} holds a negative or over 63-bit value", field=name)
        used = block[: ends[-1] + 1]
        # Each byte's place in its varint, then its 7 bits shifted there and OR-ed per varint.
        place = np.arange(used.size, dtype=np.int64) - np.repeat(starts, lengths)
        bits = (used & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
        values = np.bitwise_or.reduceat(bits, starts)
        if (values >> np.uint64(63)).any():
            raise InvalidArgument(f"{name} holds a negative or over 63-bit value", field=name)
        out[done : done + ends.size] = values.view(np.int64)
        done += ends.size
        pos += used.size
    return out


def encode(ids: Any) -> bytes:
    """Non-negative integers as the varints of a packed repeated field."""
    a = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if a.size == 0:
        return b""
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidArgument("ids must be a flat list of integers", field="token_ids")
    if a.dtype.kind == "i" and a.min() < 0:
        raise InvalidArgument("ids must be non-negative", field="token_ids")
    v = a.astype(np.uint64)
    if (v >> np.uint64(63)).any():
        raise InvalidArgument("ids must fit in 63 bits", field="token_ids")
    return b"".join(_varints(v[i : i + _BLOCK]) for i in range(0, v.size, _BLOCK))


def _varints(v: np.ndarray) -> bytes:
    # Bytes per value: 1 + one more for each 7 bits past the first 7.
    lengths = np.ones(v.size, dtype=np.uint64)
    for k in range(1, 9):
        lengths += v >= np.uint64(1 << (7 * k))
    place = np.arange(int(lengths.max()), dtype=np.uint64)
    groups = (v[:, None] >> (np.uint64(7) * place)) & np.uint64(0x7F)  # [value, byte]: 7-bit groups
    groups |= (place + np.uint64(1) < lengths[:, None]).astype(np.uint64) << np.uint64(7)  # more follow
    return groups.astype(np.uint8)[place < lengths[:, None]].tobytes()  # row-major: each value's bytes in order
