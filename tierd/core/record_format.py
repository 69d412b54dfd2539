"""The session records' format (core/records.py keeps them): a head
(magic, gen, body bytes, pieces, XXH3-64 of them and the body) and a body
of the index's sessions row and pieces rows, each value tagged by its kind.
Plain data and functions: any thread."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from tierd.types import SessionKey

MAGIC = b"tierdRC1"
HEAD = struct.Struct("<8sQIIQ")  # magic, gen, body bytes, pieces, XXH3-64 of (gen, body bytes, pieces, body)
ROW_VALUES, PIECE_VALUES = 11, 10  # the index's sessions and pieces columns


@dataclass(frozen=True, slots=True)
class Record:
    offset: int
    nbytes: int
    gen: int


@dataclass(frozen=True, slots=True)
class Found:
    """A sound record read back: where it is, and the index rows it holds."""

    record: Record
    row: tuple
    pieces: list[tuple]

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.row[0], self.row[1])


def _digest(gen: int, size: int, n: int, body: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(struct.pack("<QII", gen, size, n))  # (XXH3-64, seed 0: page_checksum's)
    h.update(body)
    return h.intdigest()


def encode(gen: int, row: tuple, pieces: list[tuple]) -> bytes:
    """A record of the index's sessions row and pieces rows (values as the index writes them)."""
    body = bytearray()
    for values in (row, *pieces):
        for v in values:
            if v is None:
                body += b"N"
            elif isinstance(v, int):
                body += b"I" + struct.pack("<q", v)
            elif isinstance(v, float):
                body += b"F" + struct.pack("<d", v)
            else:
                raw = v.encode() if isinstance(v, str) else bytes(v)
                body += (b"S" if isinstance(v, str) else b"B") + struct.pack("<I", len(raw)) + raw
    return HEAD.pack(MAGIC, gen, len(body), len(pieces), _digest(gen, len(body), len(pieces), body)) + body


def checked(data: bytes | memoryview) -> tuple[int, int, memoryview]:
    """(gen, pieces, body) of a whole record whose checksum holds; ValueError else."""
    if len(data) < HEAD.size:
        raise ValueError("shorter than a record's head")
    magic, gen, size, n, checksum = HEAD.unpack_from(data)
    body = memoryview(data)[HEAD.size : HEAD.size + size]
    if magic != MAGIC or len(body) != size or _digest(gen, size, n, body) != checksum:
        raise ValueError("not a sound record")
    return gen, n, body


def _values(body: bytes) -> Iterator[object]:
    """The values of a body, in order; ValueError (or struct.error) where one is cut or of no kind."""
    at = 0
    while at < len(body):
        tag, at = body[at : at + 1], at + 1
        if tag == b"N":
            yield None
        elif tag in (b"I", b"F"):
            yield struct.unpack_from("<q" if tag == b"I" else "<d", body, at)[0]
            at += 8
        elif tag in (b"S", b"B"):
            (length,) = struct.unpack_from("<I", body, at)
            if at + 4 + length > len(body):
                raise ValueError("a value runs past the body")
            raw, at = body[at + 4 : at + 4 + length], at + 4 + length
            yield raw.decode() if tag == b"S" else raw
        else:
            raise ValueError(f"a value of unknown kind {tag!r}")


def decode(data: bytes | memoryview) -> tuple[int, tuple, list[tuple]]:
    """(gen, row, pieces) of a record; ValueError where it is not a whole, sound one."""
    gen, n, view = checked(data)
    values = list(_values(bytes(view)))
    if len(values) != ROW_VALUES + n * PIECE_VALUES:
        raise ValueError(f"{len(values)} values for a row and {n} pieces")
    pieces = [tuple(values[i : i + PIECE_VALUES]) for i in range(ROW_VALUES, len(values), PIECE_VALUES)]
    return gen, tuple(values[:ROW_VALUES]), pieces


def leading_key(body: bytes) -> SessionKey:
    """The session key a record's body begins with (its row's tenant and id);
    ValueError where it does not begin with two strings."""
    values = _values(body)
    key = next(values, None), next(values, None)
    if not all(isinstance(v, str) for v in key):
        raise ValueError("the body does not begin with its key")
    return SessionKey(*key)
