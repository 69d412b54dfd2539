"""What the disk index's rows mean: a session's complete state (Row), what
recovery reads back (Recovered), the checks a row must pass to be served, and
the statements that write them.

Runs inside the index at start (DiskIndex.recover). A row that fails a check
raises Damaged, and its session becomes a Problem: quarantined, with a reason
that is one word, a metric label.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np

from tierd import codecs
from tierd.codecs.stored import PageCodes
from tierd.core import tokens
from tierd.errors import InvalidArgument, shown
from tierd.layout import KVSpec
from tierd.tiers.allocator import Piece
from tierd.types import ID, SessionKey


@dataclass(frozen=True, slots=True)
class Row:
    spec: KVSpec
    num_tokens: int
    num_pages: int
    nbytes: int
    created: float
    last_access: float
    priority: int
    errors: bytes = b""  # each page's relative error (float32, little-endian), where any is not exact
    lossy: float | None = None  # a save's consent to lossy codes (Session.lossy)

    def cut(self, n_pages: int) -> Row | None:
        """The row of the session's first n_pages pages (None: no row, where
        nothing is left or the snapshot is opaque bytes); itself if it holds no more."""
        if self.num_pages <= n_pages:
            return self
        if self.spec.is_opaque or n_pages == 0:
            return None
        errors = self.errors[: 4 * n_pages]
        return Row(self.spec, min(self.num_tokens, n_pages * self.spec.block_tokens), n_pages,
                   n_pages * self.spec.page_bytes, self.created, self.last_access, self.priority,
                   errors if any(errors) else b"", self.lossy)


@dataclass(frozen=True, slots=True)
class Recovered:
    key: SessionKey
    row: Row
    pieces: list[Piece]
    checksums: np.ndarray
    token_hashes: np.ndarray


@dataclass(frozen=True, slots=True)
class Problem:
    """What recovery found and removed from the index: a committed session it
    cannot serve (quarantined), or what a crash left half-written (reclaimed)."""

    key: SessionKey
    reason: str  # one word, a metric label: bad_row, bad_spec, bad_checksums, ..., orphan, partial
    detail: str
    quarantined: bool = True

    def __str__(self) -> str:
        return f"{self.key.tenant}/{self.key.session_id}: {self.detail}"


class Damaged(Exception):
    """A row that cannot be served: reason (a metric label) and detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@functools.lru_cache(maxsize=1024)
def _spec(text: str) -> KVSpec:
    """A spec from its JSON. Sessions of one model share one text: parsing and
    checking it once per text, not per row, was most of a large recovery."""
    return KVSpec.from_dict(json.loads(text))


def _ints(*values: object) -> bool:
    return all(isinstance(v, int) for v in values)


def _size(blob: object) -> str:
    return f"{len(blob)} bytes" if isinstance(blob, bytes) else f"a {type(blob).__name__}"


def _codes(spec: KVSpec, first: int, n: int, alloc: int, codec: object, raw: object) -> PageCodes | None:
    """The codes of a piece's pages (None: as they are), checked against
    what this tierd writes to the disk tier: a lossless codec it knows, as
    many records as pages, coded bytes within the piece."""
    if codec == "" and raw == b"":
        return None
    where = f"the piece at page {first}"
    if not isinstance(codec, str) or not isinstance(raw, bytes):
        raise Damaged("bad_codes", f"{where} records its pages' codes in the wrong types")
    try:
        if codecs.get(codec).lossy:
            raise Damaged("bad_codes", f"{where} is coded with the lossy {shown(codec)}, which the disk tier "
                                       "never writes")
        codes = PageCodes.from_bytes(codec, raw, n, codecs.lossless_shape(spec))
    except InvalidArgument:
        raise Damaged("bad_codes", f"{where} is coded with {shown(codec)}, a codec this tierd does not know") from None
    except ValueError as exc:
        raise Damaged("bad_codes", f"{where}: {exc}") from None
    if codes.stored > alloc:
        raise Damaged("bad_codes", f"{where} holds {codes.stored} bytes of coded pages in {alloc} bytes")
    return codes


def with_pages(pieces: list[Piece], checksums: np.ndarray, hashes: np.ndarray,
               ) -> list[tuple[Piece, np.ndarray, np.ndarray]]:
    """Each piece with its pages' checksums and token hashes (what the index and records take)."""
    return [(p, checksums[p.first_page : p.first_page + p.n_pages], hashes[p.first_page : p.first_page + p.n_pages])
            for p in pieces]


def row_values(key: SessionKey, row: Row) -> tuple:
    """The sessions table's values for a session's row."""
    return (key.tenant, key.session_id, row.spec.to_json(), row.num_tokens, row.num_pages, row.nbytes, row.created,
            row.last_access, row.priority, row.errors, row.lossy)


def row_stmt(key: SessionKey, row: Row) -> tuple[str, tuple]:
    return "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row_values(key, row)


def piece_stmts(key: SessionKey, pieces: list[tuple[Piece, np.ndarray, np.ndarray]]) -> list[tuple[str, tuple]]:
    return [("INSERT OR REPLACE INTO pieces VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)
            for values in piece_values(key, pieces)]


def own_stmt(key: SessionKey, own: bool, expect: int | None = None) -> tuple[str, tuple]:
    """The row is (or is no longer) a history of this node's own, a publish
    of it tried over version `expect` of its key (None: none was; index_schema.py)."""
    if own:
        return "INSERT OR REPLACE INTO own VALUES (?, ?, ?)", (*key, expect)
    return "DELETE FROM own WHERE tenant=? AND session_id=?", tuple(key)


def piece_values(key: SessionKey, pieces: list[tuple[Piece, np.ndarray, np.ndarray]]) -> list[tuple]:
    """The pieces table's values for pieces with their pages' checksums and token hashes."""
    return [(key.tenant, key.session_id, p.first_page, p.n_pages, p.offset, p.alloc_bytes,
             np.ascontiguousarray(sums, dtype="<u8").tobytes(),
             np.ascontiguousarray(hashes, dtype=np.uint8).tobytes() if hashes.any() else b"",
             *((p.codes.codec, p.codes.to_bytes()) if p.codes is not None else ("", b"")))
            for p, sums, hashes in pieces]


def parse(key: SessionKey, r: tuple, recs: list[tuple]) -> Recovered:
    """A session from its row (spec, num_tokens, num_pages, nbytes, created,
    last_access, priority, errors, lossy) and its pieces' rows, checked against the format;
    raises Damaged."""
    if not all(isinstance(k, str) and ID.fullmatch(k) and ".." not in k for k in key):
        raise Damaged("bad_row", "its tenant or session id is not a valid id")
    try:
        spec = _spec(r[0])
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or foreign spec raises
        raise Damaged("bad_spec", f"unreadable spec ({exc})") from None
    num_tokens, num_pages, nbytes, created, last_access, priority, errors, lossy = r[1:]
    if not _ints(num_tokens, num_pages, nbytes, priority) or not all(
            isinstance(v, (int, float)) for v in (created, last_access)):
        raise Damaged("bad_row", "a field of its row has the wrong type")
    pb = spec.page_bytes
    if num_pages < 1 or num_tokens < 0 or not (num_pages - 1) * pb < nbytes <= num_pages * pb or (
            not spec.is_opaque and (nbytes != num_pages * pb or num_tokens > num_pages * spec.block_tokens)):
        raise Damaged("bad_row", f"{num_pages} pages, {nbytes} bytes and {num_tokens} tokens do not fit its spec")
    if not -(1 << 31) <= priority < 1 << 31:
        raise Damaged("bad_row", f"priority {priority} is out of range")
    if not isinstance(errors, bytes) or len(errors) not in (0, 4 * num_pages) or \
            not (np.frombuffer(errors, dtype="<f4") >= 0).all():  # (NaN is not)
        raise Damaged("bad_errors", f"{_size(errors)} of page errors for {num_pages} pages, or errors that are none")
    if lossy is not None and (not isinstance(lossy, float) or not 0 <= lossy <= 1):
        raise Damaged("bad_row", f"consent to lossy codes {lossy!r} is not a relative error in [0, 1]")
    row = Row(spec, num_tokens, num_pages, nbytes, created, last_access, priority, errors, lossy)
    # Every piece row is checked before anything is allocated for num_pages: their checksum blobs,
    # real bytes, bound the pages (a row claiming 2**40 pages must not take the start down).
    pages_held = 0
    for first, n, offset, alloc, blob, token_blob, _, _ in recs:
        if not _ints(first, n, offset, alloc) or n < 1:
            raise Damaged("bad_row", f"a piece row has the wrong type or no pages (page {first!r})")
        if first >= num_pages:
            break
        if not isinstance(blob, bytes) or len(blob) != 8 * n:
            raise Damaged("bad_checksums", f"the piece at page {first} holds {_size(blob)} of checksums for "
                                            f"{n} pages")
        if not isinstance(token_blob, bytes) or len(token_blob) not in (0, tokens.HASH_BYTES * n):
            raise Damaged("bad_tokens", f"the piece at page {first} holds {_size(token_blob)} of token hashes "
                                         f"for {n} pages")
        pages_held += n
    if pages_held < num_pages:
        raise Damaged("missing_pieces", f"pieces cover {pages_held} of {num_pages} pages")
    pieces, sums, covered = [], np.empty(num_pages, dtype=np.uint64), 0
    hashes = tokens.empty(num_pages)
    for first, n, offset, alloc, blob, token_blob, codec, codes in recs:
        if first != covered or covered >= num_pages:
            break
        keep = min(n, num_pages - first)
        pieces.append(Piece(offset, alloc, first, n, _codes(spec, first, n, alloc, codec, codes)).head(keep))
        sums[first : first + keep] = np.frombuffer(blob, dtype="<u8")[:keep]
        if token_blob:
            hashes[first : first + keep] = np.frombuffer(token_blob, dtype=np.uint8).reshape(n, -1)[:keep]
        covered += keep
    if covered != num_pages:
        raise Damaged("missing_pieces", f"pieces cover {covered} of {num_pages} pages")
    return Recovered(key, row, pieces, sums, hashes)
