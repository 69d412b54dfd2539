"""Token-aware pages: a chained hash of each page's token ids.

Page i of a snapshot holds tokens [i * block_tokens, ...); its hash covers
the hash of page i-1 and its own token ids, so equal hashes mean equal whole
prefixes. The last page may hold fewer tokens than block_tokens; its hash
covers just those. An all-zero hash means "not known" (stored without token
ids): no request matches it, nor anything after it (pages appended after an
unknown page are unknown too).

A cache salt (vLLM's `cache_salt`: one per user of a shared server) seeds
the chain: the same tokens under another salt hash differently, so pages are
matched and shared only among requests with the same salt. No salt seeds
the chain with the all-zero hash, as before salts existed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from tierd.errors import InvalidArgument

HASH_BYTES = 16
UNKNOWN = bytes(HASH_BYTES)
MAX_TOKEN_ID = (1 << 63) - 1
MAX_SALT = 256  # characters


def check_salt(salt: object) -> str:
    """A cache salt: a string of at most MAX_SALT characters ("" for none)."""
    if salt is None:
        return ""
    if not isinstance(salt, str) or len(salt) > MAX_SALT:
        raise InvalidArgument(f"a cache salt is a string of at most {MAX_SALT} characters", field="cache_salt")
    return salt


def seed(salt: str = "") -> bytes:
    """What page 0's hash chains from: the all-zero hash, or one of the salt's own."""
    if not salt:
        return UNKNOWN
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES, person=b"tierd-salt").digest()


def empty(n_pages: int = 0) -> np.ndarray:
    return np.zeros((n_pages, HASH_BYTES), dtype=np.uint8)


def check_ids(token_ids: object, want: int | None = None) -> np.ndarray:
    """Token ids as int64, each non-negative (and exactly `want` of them, if given)."""
    try:
        arrays = isinstance(token_ids, np.ndarray) or hasattr(token_ids, "__array__")  # (a deferred packed field)
        ids = np.asarray(token_ids if arrays else list(token_ids))  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"token ids must be integers: {exc}", field="token_ids") from None
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidArgument("token ids must be a flat list of integers", field="token_ids")
    if want is not None and ids.size != want:
        raise InvalidArgument(f"{want} token ids were expected (one per stored token), got {ids.size}",
                              field="token_ids", want=want, got=int(ids.size))
    if ids.size and (ids.min() < 0 or (ids.dtype.kind == "u" and ids.max() > MAX_TOKEN_ID)):
        raise InvalidArgument("token ids must be non-negative 63-bit integers", field="token_ids")
    return ids.astype("<i8", copy=False)


def _step(prev: bytes, ids: np.ndarray) -> bytes:
    h = hashlib.blake2b(prev, digest_size=HASH_BYTES, person=b"tierd-tokens")
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.digest()


def chain(token_ids: np.ndarray, block_tokens: int, salt: str = "") -> np.ndarray:
    """The hash of every page that token_ids (a snapshot's tokens from 0) fill."""
    digests = b"".join(_digests(token_ids, block_tokens, salt))
    return np.frombuffer(digests, dtype=np.uint8).reshape(-1, HASH_BYTES).copy() if digests else empty()


def chained(token_ids: np.ndarray, block_tokens: int, salt: str = "") -> Iterator[np.ndarray]:
    """chain()'s hashes one page at a time: a caller that stops early hashes no further."""
    for digest in _digests(token_ids, block_tokens, salt):
        yield np.frombuffer(digest, dtype=np.uint8)


def _digests(token_ids: np.ndarray, block_tokens: int, salt: str) -> Iterator[bytes]:
    prev = seed(salt)
    for lo in range(0, len(token_ids), block_tokens):
        prev = _step(prev, token_ids[lo : lo + block_tokens])
        yield prev


def known(hashes: np.ndarray) -> bool:
    """Every page has a token hash."""
    return bool(hashes.any(axis=1).all())


def known_pages(hashes: np.ndarray) -> int:
    """How many leading pages have a token hash."""
    unknown = np.flatnonzero(~hashes.any(axis=1))
    return int(unknown[0]) if unknown.size else len(hashes)


def matched_pages(stored: np.ndarray, num_tokens: int, block_tokens: int, token_ids: np.ndarray,
                  salt: str = "") -> int:
    """How many leading pages of a snapshot (hashes `stored`, `num_tokens`
    tokens) the request's token ids (under its salt) reproduce exactly."""
    prev = seed(salt)
    for i in range(len(stored)):
        lo = i * block_tokens
        hi = min(lo + block_tokens, num_tokens)
        if hi > len(token_ids) or not stored[i].any():
            return i
        prev = _step(prev, token_ids[lo:hi])
        if prev != stored[i].tobytes():
            return i
    return len(stored)
