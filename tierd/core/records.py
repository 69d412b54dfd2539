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
never brings back a dropped session. At start, the records the index
names are read back whole (checksum and key), every other extent is punched out
(records a crash left between a record and its index commit) and the file
cut after the last; sessions with no record there (an index of an earlier
format, a records file lost) are described anew (recovery.py). A file that
cannot be opened is moved aside. A record that cannot be written (a full
file system) leaves the session durable as the index says, described by its
record before (if any), and is logged (once a minute at most). The format:
record_format.py.

Runs in the threads that write the index (movers, RPC threads), under the
session's op lock, and at start; a lock of its own guards the file's allocator.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
import threading
import time

import numpy as np

from tierd.core.record_format import HEAD, MAGIC, Found, Record, checked, decode, encode, leading_key
from tierd.core.rows import Row, piece_values, row_values
from tierd.errors import Unavailable
from tierd.tiers.allocator import ExtentAllocator, Piece
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.records")

GRANULE = 512
SPAN = 64 << 20  # the file's allocator grows it in spans of this size (sparse)
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def record_stmt(key: SessionKey, record: Record) -> tuple[str, tuple]:
    """The index's records-table row naming a session's record."""
    return "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)", (*key, record.offset, record.nbytes, record.gen)


class Records:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = _open_own(path)
        except OSError as exc:  # (a directory, a link, a device in its place): moved aside, as an unreadable
            aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"  # index is
            os.replace(path, aside)  # (the name: a link's target is never touched)
            log.error("records: %s cannot be used (%s): moved to %s; each session gets a record anew", path,
                      exc.strerror or exc, aside)
            self.fd = _open_own(path)
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
                    head = os.pread(self.fd, HEAD.size, pos + at)
                    try:
                        body = HEAD.unpack(head)[2] if len(head) == HEAD.size else -1
                        gen, row, pieces = decode(os.pread(self.fd, HEAD.size + max(body, 0), pos + at))
                        found = Found(Record(pos + at, HEAD.size + body, gen), row, pieces)
                        if found.key not in newest or newest[found.key].record.gen < gen:
                            newest[found.key] = found
                        self._gen = max(self._gen, gen)
                    except (ValueError, struct.error, UnicodeDecodeError):
                        pass  # not a record (page bytes, a torn or damaged record)
                at = chunk.find(MAGIC, at + 1)
            pos += max(len(chunk) - len(MAGIC), 1)
        return newest

    def read(self, named: dict[SessionKey, Record]) -> dict[SessionKey, Found]:
        """The records the index names that are there, sound, and of their session."""
        out = {}
        for key, r in named.items():
            try:
                gen, row, pieces = decode(os.pread(self.fd, r.nbytes, r.offset) if 0 < r.nbytes <= SPAN else b"")
            except (ValueError, struct.error, UnicodeDecodeError, OSError):
                continue
            if gen == r.gen and Found(r, row, pieces).key == key:
                out[key] = Found(r, row, pieces)
        return out

    def start(self, named: dict[SessionKey, Record], punch: bool = True) -> dict[SessionKey, Record]:
        """Hold the records the index names that are there (read back whole:
        returned); punch out every other extent of the file, cut it after the
        last record held (unless not punch)."""
        held: dict[SessionKey, Record] = {}
        end, chunk, chunk_at = 0, b"", 0  # (read in chunks of the file, in order: not a call per record)
        for key, r in sorted(named.items(), key=lambda kv: kv[1].offset):
            size = -(-r.nbytes // GRANULE) * GRANULE
            if not (r.offset % GRANULE == 0 and HEAD.size <= r.nbytes <= SPAN and r.offset >= end and
                    r.offset // SPAN == (r.offset + size - 1) // SPAN):
                continue
            if not chunk_at <= r.offset <= r.offset + r.nbytes <= chunk_at + len(chunk):
                chunk, chunk_at = self._read(max(8 << 20, r.nbytes), r.offset), r.offset
            if _whole(key, r, memoryview(chunk)[r.offset - chunk_at : r.offset - chunk_at + r.nbytes]):
                held[key], end = r, r.offset + size
        with self._lock:
            try:
                if punch:  # (a file cut after its records needs no allocator over a sparse tail)
                    os.ftruncate(self.fd, -(-end // SPAN) * SPAN)
                while self._alloc.capacity < max(end, os.fstat(self.fd).st_size):
                    self._alloc.add_slab()
                self._alloc.reserve_all([(r.offset, r.nbytes) for r in held.values()])
                self._gen = max([self._gen, *(r.gen for r in held.values())])
                for start, length in self._alloc.free_extents() if punch else []:
                    self._punch(start, length)
                os.fdatasync(self.fd)
            except OSError as exc:
                log.warning("records: could not punch out records no session holds (%s); the next start does", exc)
        return held

    def _read(self, nbytes: int, offset: int) -> bytes:
        try:
            return os.pread(self.fd, nbytes, offset)
        except OSError:
            return b""

    # -- while running -------------------------------------------------------------

    def describe(self, key: SessionKey, row: Row, pieces: list[tuple[Piece, np.ndarray, np.ndarray]]) -> Record | None:
        """Write and sync a record of the session's complete state: its row and
        every piece of it (with its pages' checksums and token hashes)."""
        return self.describe_many([(key, row, pieces)])[0]

    def describe_many(self, states: list[tuple[SessionKey, Row, list[tuple[Piece, np.ndarray, np.ndarray]]]],
                      ) -> list[Record | None]:
        """Records of these states, synced once; None for one that could not be written (logged)."""
        return self._write([(row_values(key, row), piece_values(key, sorted(pieces, key=lambda e: e[0].first_page)))
                            for key, row, pieces in states])

    def _write(self, states: list[tuple[tuple, list[tuple]]]) -> list[Record | None]:
        out: list[Record | None] = []
        for row, pieces in states:
            with self._lock:
                self._gen = gen = max(time.time_ns(), self._gen + 1)
                data = encode(gen, row, pieces)
                offset = self._alloc.alloc(len(data)) if len(data) <= SPAN else None
                while offset is None and len(data) <= SPAN:
                    self._alloc.add_slab()
                    offset = self._alloc.alloc(len(data))
            if offset is None:
                self._failed(f"a record of {len(data)} bytes is larger than {SPAN}")
                out.append(None)
                continue
            record = Record(offset, len(data), gen)
            try:
                if os.pwrite(self.fd, data, offset) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                out.append(record)
            except OSError as exc:
                self.discard(record)
                self._failed(f"{exc.strerror or exc}")
                out.append(None)
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            for record in out:
                self.discard(record)
            self._failed(f"{exc.strerror or exc}")
            return [None] * len(out)
        return out

    def wipe(self, record: Record | None) -> bytes:
        """Punch the record out and sync (before the index forgets its session);
        its extent stays held until free(). Its bytes, for put_back() where the
        index cannot forget it after all. Unavailable where it cannot be."""
        if record is None:
            return b""
        try:
            data = os.pread(self.fd, record.nbytes, record.offset)
            self._punch(record.offset, self._alloc.round(record.nbytes))
            os.fdatasync(self.fd)
        except OSError as exc:
            raise Unavailable(f"the session's record could not be erased ({exc.strerror or exc}); nothing was "
                              "changed, try again", path=self.path) from None
        return data

    def put_back(self, record: Record | None, data: bytes) -> None:
        """A wiped record written again (its session stays: the index could not forget it)."""
        if record is not None:
            try:
                os.pwrite(self.fd, data, record.offset)
                os.fdatasync(self.fd)
            except OSError as exc:
                self._failed(f"putting back a record: {exc.strerror or exc}")

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


def _open_own(path: str) -> int:
    """The records file, opened: a regular file of its own name alone (never
    through a link: its cuts and punches would reach another file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EEXIST, "not a regular file of its own (a link to another, or a device)")
    return fd


def _whole(key: SessionKey, r: Record, data: memoryview) -> bool:
    """Whether the bytes are record r whole (its checksum holds), of that session."""
    try:
        return HEAD.unpack_from(data)[:3] == (MAGIC, r.gen, r.nbytes - HEAD.size) and \
            checked(data) is not None and leading_key(bytes(data[HEAD.size : HEAD.size + 1024])) == key
    except (ValueError, struct.error, UnicodeDecodeError):
        return False
