"""Session records: each durable session's complete state (the index's row
and every piece, with its pages' checksums, token hashes and codes) in a
file of its own beside the slab files (records.bin), written and synced
before the index commits that state, so that an index lost or damaged is
rebuilt from them at start (recovery.py).

A record is checksummed (XXH3-64) and numbered (gen: increasing, across
restarts), in a granule-aligned extent of its own; the index names each
session's current record (its records table). A newer record replaces the
older, whose extent is then punched out; a dropped session's record is
punched out and synced before the index forgets the session, so a rebuild
never brings back a dropped session. At start, every extent no indexed
record holds is punched out (records a crash left between a record and its
index commit). A record that cannot be written (a full file system) leaves
the session durable as the index says, described by its record before (if
any), and is logged (once a minute at most).

Runs in the threads that write the index (movers, RPC threads), under the
session's op lock; a lock of its own guards the file's allocator.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from tierd.checksum import page_checksum
from tierd.core.rows import Row, piece_values, row_values
from tierd.errors import Unavailable
from tierd.tiers.allocator import ExtentAllocator, Piece
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.records")

MAGIC = b"tierdRC1"
_HEAD = struct.Struct("<8sQIIQ")  # magic, gen, body bytes, pieces, XXH3-64 of (gen, body bytes, pieces, body)
GRANULE = 512
SPAN = 64 << 20  # the file's allocator grows it in spans of this size (sparse)
ROW_VALUES, PIECE_VALUES = 11, 10  # the index's sessions and pieces columns
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


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
    meta = struct.pack("<QII", gen, len(body), len(pieces))
    return _HEAD.pack(MAGIC, gen, len(body), len(pieces), page_checksum(meta + body)) + body


def decode(data: bytes | memoryview) -> tuple[int, tuple, list[tuple]]:
    """(gen, row, pieces) of a record; ValueError where it is not a whole, sound one."""
    if len(data) < _HEAD.size:
        raise ValueError("shorter than a record's head")
    magic, gen, size, n, checksum = _HEAD.unpack_from(data)
    body = bytes(data[_HEAD.size : _HEAD.size + size])
    if magic != MAGIC or len(body) != size or page_checksum(struct.pack("<QII", gen, size, n) + body) != checksum:
        raise ValueError("not a sound record")
    values, at = [], 0
    while at < size:
        tag, at = body[at : at + 1], at + 1
        if tag == b"N":
            values.append(None)
        elif tag in (b"I", b"F"):
            values.append(struct.unpack_from("<q" if tag == b"I" else "<d", body, at)[0])
            at += 8
        elif tag in (b"S", b"B"):
            (length,) = struct.unpack_from("<I", body, at)
            raw, at = body[at + 4 : at + 4 + length], at + 4 + length
            values.append(raw.decode() if tag == b"S" else raw)
        else:
            raise ValueError(f"a value of unknown kind {tag!r}")
    if len(values) != ROW_VALUES + n * PIECE_VALUES:
        raise ValueError(f"{len(values)} values for a row and {n} pieces")
    pieces = [tuple(values[i : i + PIECE_VALUES]) for i in range(ROW_VALUES, len(values), PIECE_VALUES)]
    return gen, tuple(values[:ROW_VALUES]), pieces


class Records:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()
        self._alloc = ExtentAllocator(SPAN, GRANULE)
        self._gen = 0
        self._warned = 0.0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- at start ----------------------------------------------------------------

    def scan(self) -> dict[SessionKey, Found]:
        """The newest sound record of each session in the file."""
        newest: dict[SessionKey, Found] = {}
        size = os.fstat(self.fd).st_size
        pos = 0
        while pos < size:
            try:
                pos = os.lseek(self.fd, pos, os.SEEK_DATA)  # (punched-out extents read as holes)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # nothing but a hole from here on
                raise
            chunk = os.pread(self.fd, 8 << 20, pos)
            if not chunk:
                break
            at = chunk.find(MAGIC)
            while at >= 0:
                if (pos + at) % GRANULE == 0:
                    head = os.pread(self.fd, _HEAD.size, pos + at)
                    try:
                        body = _HEAD.unpack(head)[2] if len(head) == _HEAD.size else -1
                        gen, row, pieces = decode(os.pread(self.fd, _HEAD.size + max(body, 0), pos + at))
                        found = Found(Record(pos + at, _HEAD.size + body, gen), row, pieces)
                        if found.key not in newest or newest[found.key].record.gen < gen:
                            newest[found.key] = found
                        self._gen = max(self._gen, gen)
                    except (ValueError, struct.error, UnicodeDecodeError):
                        pass  # not a record (page bytes, a torn or damaged record)
                at = chunk.find(MAGIC, at + 1)
            pos += max(len(chunk) - len(MAGIC), 1)
        return newest

    def start(self, named: dict[SessionKey, Record], punch: bool = True) -> dict[SessionKey, Record]:
        """Hold the records the index names (those that lie where a record can:
        returned); punch out every other extent of the file (unless not punch)."""
        held: dict[SessionKey, Record] = {}
        end = 0
        for key, r in sorted(named.items(), key=lambda kv: kv[1].offset):
            size = -(-r.nbytes // GRANULE) * GRANULE
            if r.offset % GRANULE == 0 and 0 < r.nbytes <= SPAN and r.offset >= end and \
                    r.offset // SPAN == (r.offset + size - 1) // SPAN:
                held[key], end = r, r.offset + size
        with self._lock:
            while self._alloc.capacity < max(end, os.fstat(self.fd).st_size):
                self._alloc.add_slab()
            self._alloc.reserve_all([(r.offset, r.nbytes) for r in held.values()])
            self._gen = max([self._gen, *(r.gen for r in held.values())])
            size = os.fstat(self.fd).st_size
            try:
                for start, length in self._alloc.free_extents() if punch else []:
                    if start < size:
                        self._punch(start, min(length, size - start))
                os.fdatasync(self.fd)
            except OSError as exc:
                log.warning("records: could not punch out records no session holds (%s); the next start does", exc)
        return held

    # -- while running -------------------------------------------------------------

    def describe(self, key: SessionKey, row: Row, pieces: list[tuple[Piece, np.ndarray, np.ndarray]]) -> Record | None:
        """Write and sync a record of the session's complete state: its row and
        every piece of it (with its pages' checksums and token hashes)."""
        return self.write(row_values(key, row), piece_values(key, sorted(pieces, key=lambda e: e[0].first_page)))

    def write(self, row: tuple, pieces: list[tuple]) -> Record | None:
        """Write and sync a record of these index rows; None where it could not be (logged)."""
        with self._lock:
            self._gen = gen = max(time.time_ns(), self._gen + 1)
            data = encode(gen, row, pieces)
            offset = self._alloc.alloc(len(data)) if len(data) <= SPAN else None
            while offset is None and len(data) <= SPAN:
                self._alloc.add_slab()
                offset = self._alloc.alloc(len(data))
        if offset is None:
            self._failed(f"a record of {len(data)} bytes is larger than {SPAN}")
            return None
        record = Record(offset, len(data), gen)
        try:
            if os.pwrite(self.fd, data, offset) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            os.fdatasync(self.fd)
        except OSError as exc:
            self.discard(record)
            self._failed(f"{exc.strerror or exc}")
            return None
        return record

    def wipe(self, record: Record | None) -> None:
        """Punch the record out and sync (before the index forgets its session);
        its extent stays held until free(). Unavailable where it cannot be."""
        if record is None:
            return
        try:
            self._punch(record.offset, self._alloc.round(record.nbytes))
            os.fdatasync(self.fd)
        except OSError as exc:
            raise Unavailable(f"the session's record could not be erased ({exc.strerror or exc}); nothing was "
                              "changed, try again", path=self.path) from None

    def free(self, record: Record | None) -> None:
        """Give a record's extent back (None, for the caller's field)."""
        if record is not None:
            with self._lock:
                self._alloc.free(record.offset, record.nbytes)

    def discard(self, record: Record | None) -> None:
        """Punch out a record no index row names any more (not synced: a
        rebuild that still finds it takes the newer one) and free its extent
        (None, for the caller's field)."""
        if record is None:
            return
        try:
            self._punch(record.offset, self._alloc.round(record.nbytes))
        except OSError as exc:
            log.warning("records: could not punch out a replaced record (%s); the next start does", exc)
        self.free(record)

    def _punch(self, offset: int, nbytes: int) -> None:
        if _libc.fallocate(self.fd, _PUNCH, offset, nbytes) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(err, os.strerror(err))
            os.pwrite(self.fd, bytes(nbytes), offset)  # a file system that cannot punch holes: zeros

    def _failed(self, why: str) -> None:
        if time.monotonic() - self._warned > 60:
            self._warned = time.monotonic()
            log.warning("records: a session's record could not be written (%s): it is durable, but a rebuild of "
                        "the index would find it as it was at its last record, or not at all", why)
