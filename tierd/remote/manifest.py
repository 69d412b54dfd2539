"""What every remote backend stores of a session's version, whatever holds
the bytes: the manifest (identity, sizes, page checksums, token hashes, its
owner), how it is written and read back, checked to agree with itself, and
the tombstone a drop leaves in its place. Plain data and functions: any
thread.

A manifest is one line `VERSION {json}` (version first, so a backend reads
it off its first bytes), then the pages' checksums and the token hashes as
raw arrays, and, for a version whose pages are coded (Coding), each page's
coded size, the checksum of its coded bytes and the error its codec
measured. A tombstone is `VERSION dropped`. What a manifest's key holds
is known by its first line and length alone (held_at: what missing() asks).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierd.errors import DataLoss
from tierd.remote.backend import Refused
from tierd.remote.coded import CODED_BYTES_PER_PAGE, Coding
from tierd.types import SessionKey

FIRST_VERSIONS = 10**12  # a history's first version is one of [FIRST_VERSIONS, 2 * FIRST_VERSIONS)
MAX_VERSION = 10**14 - 1  # what Lua numbers (doubles, printed to 14 digits) hold exactly: Redis's scripts compare them
HEAD_BYTES = 64 << 10  # a manifest's first line is within this many bytes
# What a manifest may be, writers and readers alike: a session of millions of tokens (24 bytes a page), well within
# what a backend keeps of the large ones it read, so that none is read whole again on every call.
MAX_PAGES = 500_000
MAX_MANIFEST_BYTES = 16 << 20
_TOMBSTONE = re.compile(rb"(\d+) dropped")
_EXACT = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the remote store holds of one session's current version."""

    version: int
    write: str  # the id its chunks are stored under
    fingerprint: str  # the identity the bytes were made with (KVSpec.fingerprint)
    spec: dict[str, Any]  # KVSpec.to_dict()
    num_tokens: int
    nbytes: int
    page_bytes: int
    checksums: np.ndarray  # uint64, one per page
    token_hashes: np.ndarray  # one row per page where token ids were given, else empty
    saved: float = 0.0  # when it was published (seconds since the epoch)
    owner: str = ""  # owner_of(the session): a manifest copied under another session's keys is refused
    coding: Coding | None = None  # how its pages are coded (None: as they are)

    @property
    def n_pages(self) -> int:
        return len(self.checksums)

    @property
    def codec(self) -> str:
        return self.coding.codec if self.coding is not None else "none"

    @property
    def errors(self) -> np.ndarray:
        """Each page's relative error against the page it was coded from (empty: every page exact)."""
        return self.coding.rel_error if self.coding is not None else _EXACT

    @property
    def rel_error(self) -> float:
        """The worst relative error of a page of it (0: every page exact)."""
        return float(self.errors.max()) if self.errors.size else 0.0

    @property
    def stored(self) -> int:
        """Bytes the version takes in the store (its coded pages', or its logical bytes)."""
        return self.coding.stored if self.coding is not None else self.nbytes

    def size_of(self, page: int) -> int:
        """Logical bytes of a page (the last may be short)."""
        return min(self.page_bytes, self.nbytes - page * self.page_bytes)

    def encode(self) -> bytes:
        meta = {"write": self.write, "fingerprint": self.fingerprint, "spec": self.spec,
                "num_tokens": self.num_tokens, "nbytes": self.nbytes, "page_bytes": self.page_bytes,
                "pages": self.n_pages, "saved": self.saved, "hash_dtype": self.token_hashes.dtype.str,
                "hash_shape": list(self.token_hashes.shape), "owner": self.owner}
        coded = b""
        if self.coding is not None:
            meta.update(codec=self.coding.codec, stored=self.coding.stored, source=self.coding.source)
            coded = self.coding.encode()
        sums = np.ascontiguousarray(self.checksums, dtype="<u8").tobytes()
        return f"{self.version} ".encode() + json.dumps(meta).encode() + b"\n" + sums + \
            np.ascontiguousarray(self.token_hashes).tobytes() + coded

    @classmethod
    def listed(cls, head: Head) -> Manifest:
        """The manifest as its first line describes it, for a listing: its
        checksums a zero-strided view (no memory), no token hashes. Never
        read pages against it."""
        meta = head.meta
        try:
            sums = np.broadcast_to(np.uint64(0), (head.pages,))
            hashes = np.empty((0, *head.hash_shape[1:]), dtype=np.dtype(meta["hash_dtype"]))
            return cls(head.version, head.write, str(meta["fingerprint"]), dict(meta["spec"]),
                       whole(meta["num_tokens"], 0, 1 << 40), head.nbytes, whole(meta["page_bytes"], 1, 1 << 34),
                       sums, hashes, float(meta.get("saved", 0.0)), str(meta.get("owner", "")))
        except Exception as exc:  # noqa: BLE001 - whatever the store holds
            raise DataLoss(f"a remote manifest does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        """The manifest in raw, checked to agree with itself (DataLoss if not):
        whatever the store holds, what comes out of here is safe to describe
        (and to share: its arrays are read-only)."""
        head = Head.parse(raw)
        if len(raw) != head.length:
            raise DataLoss(f"a remote manifest of {len(raw)} bytes where its head says {head.length}", tier="remote")
        try:
            meta, n, rest = head.meta, head.pages, raw[len(head.line) + 1 :]
            hash_end = 8 * n + np.dtype(meta["hash_dtype"]).itemsize * math.prod(head.hash_shape)
            sums = np.frombuffer(rest[: 8 * n], dtype="<u8").copy()
            hashes = np.frombuffer(rest[8 * n : hash_end], dtype=np.dtype(meta["hash_dtype"]))
            hashes = hashes.reshape(head.hash_shape).copy()
            if head.hash_shape and head.hash_shape[0] not in (0, n):
                raise ValueError("its token hashes do not add up")
            sums.flags.writeable = hashes.flags.writeable = False
            coding = Coding.decode(head.codec, rest[hash_end:], sums, head.nbytes, head.stored,
                                   meta.get("source", "")) if head.coded else None
            m = cls(head.version, head.write, str(meta["fingerprint"]), dict(meta["spec"]),
                    whole(meta["num_tokens"], 0, 1 << 40), head.nbytes, whole(meta["page_bytes"], 1, 1 << 34), sums,
                    hashes, float(meta.get("saved", 0.0)), str(meta.get("owner", "")), coding)
            if not (n - 1) * m.page_bytes < m.nbytes <= n * m.page_bytes:
                raise ValueError("its pages do not hold its bytes")
            return m
        except Exception as exc:  # noqa: BLE001 - whatever the store holds: ValueError, RecursionError, ...
            raise DataLoss(f"a remote manifest does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None


@dataclass(frozen=True, slots=True)
class Head:
    """What a manifest's first line says: enough to know how long the whole is,
    and which chunks hold its bytes, before reading more of it."""

    line: bytes
    version: int
    meta: dict[str, Any]
    write: str
    nbytes: int
    pages: int
    hash_shape: tuple[int, ...]
    length: int  # of the whole manifest
    codec: str = "none"  # its pages' codec
    stored: int = 0  # bytes the version takes in the store

    @property
    def coded(self) -> bool:
        return self.codec != "none"

    @classmethod
    def parse(cls, raw: bytes) -> Head:
        """The head of the manifest that raw is, or begins with (HEAD_BYTES of
        it); DataLoss where it does not parse."""
        try:
            line, found, _ = raw[:HEAD_BYTES].partition(b"\n")
            if not found:
                raise ValueError(f"no first line in its first {len(line)} bytes")
            version, _, text = line.partition(b" ")
            meta = json.loads(text)
            if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict):
                raise ValueError("not an object with a spec")
            n = whole(meta["pages"], 1, MAX_PAGES)
            shape = tuple(whole(d, 0, 1 << 20) for d in meta["hash_shape"])
            codec = meta.get("codec", "none")
            if not isinstance(codec, str):
                raise ValueError("its codec is not a name")
            length = len(line) + 1 + 8 * n + np.dtype(meta["hash_dtype"]).itemsize * math.prod(shape) + \
                (CODED_BYTES_PER_PAGE * n if codec != "none" else 0)
            nbytes = whole(meta["nbytes"], 1, 1 << 50)
            stored = whole(meta["stored"], 1, 1 << 50) if codec != "none" else nbytes
            head = cls(line, whole(version.decode(), 1, MAX_VERSION), meta, str(meta["write"]), nbytes, n, shape,
                       length, codec, stored)
            if not head.write.isalnum() or length > MAX_MANIFEST_BYTES:
                raise ValueError(f"write {head.write[:40]!r}, {length} bytes")
            return head
        except Exception as exc:  # noqa: BLE001 - whatever the store holds: ValueError, RecursionError, ...
            raise DataLoss(f"a remote manifest does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None


def made(version: int, write: str, fingerprint: str, spec: dict[str, Any], num_tokens: int, stored: int,
         page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray, owner: str,
         coding: Coding | None) -> Manifest:
    """The manifest of a version a backend has just stored `stored` bytes of:
    its pages as they are (checksums: theirs), or coded as `coding` says
    (filled by then: the coded pages' records, and the checksums and
    logical bytes of the pages a reader decodes)."""
    if coding is not None and (coding.stored != stored or len(coding.sizes) != len(checksums)):
        raise ValueError(f"{stored} bytes stored of pages whose coding says {coding.stored}")
    nbytes, sums = (stored, checksums) if coding is None else (coding.nbytes, coding.checksums)
    return Manifest(version, write, fingerprint, spec, num_tokens, nbytes, page_bytes,
                    np.asarray(sums, dtype=np.uint64), np.asarray(token_hashes), time.time(), owner, coding)


def check_bounds(n_pages: int, token_hashes: np.ndarray, coded: bool = False) -> None:
    """Refused where a manifest of n_pages and these token hashes (and, coded,
    each page's records) would be past what readers take (MAX_PAGES,
    MAX_MANIFEST_BYTES): known before a byte of the version is written; the
    session stays in the node's own tiers."""
    length = HEAD_BYTES + (8 + CODED_BYTES_PER_PAGE * coded) * n_pages + token_hashes.nbytes  # first line: HEAD_BYTES
    if n_pages > MAX_PAGES or length > MAX_MANIFEST_BYTES:
        raise Refused(f"a session of {n_pages} pages ({length >> 20} MiB of manifest) is past what the remote tier "
                      f"takes ({MAX_PAGES} pages, {MAX_MANIFEST_BYTES >> 20} MiB): it stays in this node's tiers")


def whole(value: Any, low: int, high: int) -> int:
    """An integer in [low, high] (a bool, a float or a string of digits is not one)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{str(value)[:40]!r} is not a whole number from {low} to {high}")
    return value


def owned(key: SessionKey, m: Manifest) -> Manifest:
    if m.owner != owner_of(key):
        raise DataLoss("the remote tier's manifest for this session is another session's (keys copied in the store?)",
                       tier="remote")
    return m


def owner_of(key: SessionKey) -> str:
    """Who a manifest belongs to: tenant and session id, hashed."""
    return hashlib.sha256(f"owner\x00{key.tenant}\x00{key.session_id}".encode()).hexdigest()


def tag_of(key: SessionKey) -> str:
    """The hash tag of a session's keys: its tenant and id, hashed (neither is in any key)."""
    return hashlib.sha256(f"{key.tenant}\x00{key.session_id}".encode()).hexdigest()[:24]


def next_version(expect: int) -> int:
    """The number of the version that replaces `expect` (0: none, or a
    tombstone's). A history's first version is numbered at random: one that
    ended unseen (its manifest evicted or expired, its tombstone too) has
    numbers no later one repeats, so a node still holding one of its versions
    never takes the new history for it. One at MAX_VERSION starts again at
    random."""
    return expect + 1 if 0 < expect < MAX_VERSION else FIRST_VERSIONS + secrets.randbelow(FIRST_VERSIONS)


def version_at(raw: Any) -> int:
    """The version number at the head of a manifest or tombstone (0: none, or none a backend takes as one)."""
    found = re.match(rb"(\d+) ", raw) if isinstance(raw, bytes) else None
    return int(found.group(1)) if found and int(found.group(1)) <= MAX_VERSION else 0


def held_at(key: SessionKey, line: bytes | None, length: int) -> tuple[int, str] | None:
    """What a session's manifest key holds, by its first line (`line`: up to
    its newline, or more) and its length in bytes: the version number and
    write id there (a tombstone: its number and ''), or None where nothing
    there resumes the session: none, bytes that are no manifest nor
    tombstone, a manifest of another length than its head says, or another
    session's."""
    if not line:
        return None
    if dropped_at(line):
        return dropped_at(line), ""
    try:
        head = Head.parse(line)
    except DataLoss:
        return None
    if head.length != length or str(head.meta.get("owner", "")) != owner_of(key):
        return None
    return head.version, head.write


def dropped_at(raw: Any) -> int:
    """The version of the tombstone at a manifest's place (0: not one a backend takes as one)."""
    return version_at(raw) if isinstance(raw, bytes) and _TOMBSTONE.fullmatch(raw) else 0


def listed_head(key: SessionKey, raw: Any) -> Head | None:
    """The head of the session's manifest that raw begins with (its first
    line, at least), for a listing; None for none, a tombstone, bytes that
    are no manifest, or another session's."""
    if not isinstance(raw, bytes) or not raw or dropped_at(raw):
        return None
    try:
        head = Head.parse(raw)
    except DataLoss:
        return None
    return head if head.meta.get("owner", "") == owner_of(key) else None
