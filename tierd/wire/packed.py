"""Repeated integer fields (token ids, block ids) read and written as arrays.

Runs in the servicer (on the event loop and the RPC threads) and in the
clients. Protobuf turns a `repeated int64` field into one Python int per
element, and copies the field on its way in: a prompt of 19 million token
ids (57 MiB on the wire) cost about 1.5 GB in the daemon. Here those fields
are cut out of the request's bytes before protobuf parses the rest: each
stays a view of the bytes received, a packed run of varints that numpy
decodes in blocks into one int64 array (8 bytes an id), and only as far as
the caller needs. The public proto keeps `repeated int64`, which every
client encodes packed, as proto3 asks; a request that sends such a field
one element at a time (legal, and never seen) is refused with a clear
message rather than read without its ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from tierd.errors import InvalidArgument

# The repeated integer fields that may be long, by message.
FIELDS = {
    "SaveRequest": ("block_ids", "token_ids"),
    "RestoreRequest": ("block_ids", "token_ids"),
    "PutHeader": ("token_ids",),
    "LookupRequest": ("token_ids",),
    "BeginSaveRequest": ("token_ids",),
    "BeginRestoreRequest": ("token_ids",),
}
_SCAN = 1 << 20  # wire bytes decoded at a time: temporaries of about 16 MiB
_BLOCK = 1 << 18  # values encoded at a time
_LEN = 2  # wire type of length-delimited fields (a packed field is one)
# Top-level fields a request may have: each message of the API has a dozen at
# most (a long field may come in a few parts). This walk is pure Python: a
# 2 MB request of a million 2-byte unknown fields held the event loop 10 s.
MAX_FIELDS = 256


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated or over-long varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(raw: bytes | memoryview) -> list[tuple[int, int, memoryview, memoryview]]:
    """The top-level fields of a message's bytes: (number, wire type, the whole
    field, its payload), views of raw. Raises DecodeError, also past MAX_FIELDS."""
    buf = memoryview(raw)
    out = []
    pos = 0
    while pos < len(buf):
        if len(out) == MAX_FIELDS:
            raise DecodeError(f"more than {MAX_FIELDS} top-level fields")
        tag, at = _varint(buf, pos)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            end = _varint(buf, at)[1]
        elif kind == 1:
            end = at + 8
        elif kind == 5:
            end = at + 4
        elif kind == _LEN:
            size, at = _varint(buf, at)
            end = at + size
        else:
            raise DecodeError(f"wire type {kind} (groups) is not used by this API")
        if number == 0 or end > len(buf):
            raise DecodeError("truncated message")
        out.append((number, kind, buf[pos:end], buf[at:end]))
        pos = end
    return out


class Request:
    """A parsed request message and, apart, its long id fields as views of
    the bytes received (empty when absent). Reads as the message otherwise."""

    __slots__ = ("msg", "ids")

    def __init__(self, msg: Any, ids: dict[str, memoryview]) -> None:
        self.msg, self.ids = msg, ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)

    def id_field(self, name: str) -> memoryview:
        return self.ids.get(name, memoryview(b""))


def parse(cls: type, raw: bytes | memoryview) -> Request:
    """Message `cls` from its bytes, its long id fields cut out first (kept
    as views). Raises DecodeError, or InvalidArgument for an id field sent
    unpacked."""
    names = FIELDS.get(cls.DESCRIPTOR.name)
    if not names:
        return Request(cls.FromString(bytes(raw)), {})
    numbers = {cls.DESCRIPTOR.fields_by_name[n].number: n for n in names}
    keep: list[memoryview] = []
    ids: dict[str, list[memoryview]] = {}
    for number, kind, whole, payload in fields(raw):
        name = numbers.get(number)
        if name is None:
            keep.append(whole)
        elif kind != _LEN:
            raise InvalidArgument(f"{name} must be sent packed (proto3's default encoding)", field=name)
        else:
            ids.setdefault(name, []).append(payload)
    views = {n: parts[0] if len(parts) == 1 else memoryview(b"".join(parts)) for n, parts in ids.items()}
    return Request(cls.FromString(b"".join(keep)), views)


class Deferred:
    """A packed id field decoded only when it is used as an array (np.asarray):
    by the store, on an RPC thread, after the checks that cost nothing. A Put
    header's 15 million token ids were decoded on the event loop before the
    Put was refused for its spec."""

    __slots__ = ("raw", "name")

    def __init__(self, raw: memoryview, name: str = "token_ids") -> None:
        self.raw, self.name = raw, name

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        ids = decode(self.raw, self.name)
        return ids if dtype is None else ids.astype(dtype, copy=False)


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited field in wire form: appended to a serialized
    message, it sets that field (ids encoded with encode(), say)."""
    out = bytearray()
    for n in ((number << 3) | _LEN, len(payload)):
        while True:
            low, n = n & 0x7F, n >> 7
            out.append(low | (0x80 if n else 0))
            if not n:
                break
    return bytes(out) + payload


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
