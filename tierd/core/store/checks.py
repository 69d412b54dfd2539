"""Argument checks that need no state: ids, priorities, token ranges, block
ids, token ids, lease times. Each raises InvalidArgument (or the error its
contract names) and changes nothing; they run on whichever thread calls the
store, before any lock is taken."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tierd.core import tokens
from tierd.core.model import Session
from tierd.errors import DataLoss, IdentityMismatch, InvalidArgument, NotFound, shown
from tierd.layout import KVSpec
from tierd.types import ID, SessionKey

MAX_PRIORITY = 1000
DEFAULT_LEASE_SECONDS = 60.0
MAX_LEASE_SECONDS = 3600.0
MAX_TOKENS = (1 << 63) - 1  # what the index holds of a token count


def check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not ID.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"{name} must be 1-256 characters of letters, digits and ._:@+=~- , not starting with '.' "
            f"or '-' and without '..', got {shown(value)}",
            field=name,
            value=value,
        )
    return value


def make_key(tenant: str, session_id: str) -> SessionKey:
    return SessionKey(check_id("tenant", tenant), check_id("session_id", session_id))


def check_priority(priority: int | None) -> None:
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidArgument(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                              f"got {shown(priority)}", field="priority", value=priority)


def check_identity(session: Session, spec: KVSpec) -> None:
    have = session.snap.spec
    if have.fingerprint != spec.fingerprint:
        fields = sorted(k for k, v in have.to_dict().items() if spec.to_dict().get(k) != v)
        raise IdentityMismatch(
            f"session {shown(session.key.session_id)} was saved by {shown(have.model_id)} with another identity "
            f"(differs in {', '.join(fields)})",
            want=have.fingerprint, got=spec.fingerprint, fields=fields)


def check_start(spec: KVSpec, start_token: int) -> int:
    """The first page a store from start_token replaces."""
    bt = spec.block_tokens
    if isinstance(start_token, bool) or not isinstance(start_token, int) or start_token < 0 or start_token % bt:
        raise InvalidArgument(f"start_token must be a non-negative multiple of block_tokens ({bt}), "
                              f"got {shown(start_token)}", field="start_token", value=start_token)
    if start_token and spec.is_opaque:
        raise InvalidArgument("opaque snapshots are replaced whole: start_token must be 0", field="start_token")
    return start_token // bt


def check_blocks_range(spec: KVSpec, start_token: int, num_tokens: int) -> int:
    """Tokens [start_token, num_tokens) of a KV spec, in whole pages from
    start_token: returns the first page."""
    if spec.is_opaque:
        raise InvalidArgument("an opaque spec has no blocks: use put", field="spec")
    first_page = check_start(spec, start_token)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not start_token < num_tokens <= MAX_TOKENS:
        raise InvalidArgument(f"num_tokens must be an integer above start_token ({start_token}) and under 2**63, "
                              f"got {shown(num_tokens)}", field="num_tokens", value=num_tokens)
    return first_page


def check_token_count(num_tokens: object) -> int:
    """A snapshot's token count as a Put or an opaque save lease gives it: an integer in [0, 2**63)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= MAX_TOKENS:
        raise InvalidArgument(f"num_tokens must be an integer from 0 to 2**63-1, got {shown(num_tokens)}",
                              field="num_tokens")
    return num_tokens


def check_opaque_size(spec: KVSpec, nbytes: object) -> tuple[int, int]:
    """An opaque snapshot of nbytes: (its pages, the bytes of its last)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgument(f"size must be a positive number of bytes, got {shown(nbytes)}", field="size")
    n_pages = -(-nbytes // spec.page_bytes)
    return n_pages, nbytes - (n_pages - 1) * spec.page_bytes


def check_blocks(block_ids: Iterable[int], num_blocks: int) -> np.ndarray:
    try:
        ids = np.asarray(list(block_ids) if not isinstance(block_ids, np.ndarray) else block_ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"block ids must be integers: {exc}", field="block_ids") from None
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidArgument("block ids must be a flat list of integers", field="block_ids")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise InvalidArgument(f"block id {bad} is outside the engine's {num_blocks} blocks",
                              field="block_ids", value=bad)
    if np.unique(ids).size != ids.size:
        raise InvalidArgument("block ids repeat: each block can hold one page", field="block_ids")
    return ids


def token_hashes(spec: KVSpec, token_ids: Iterable[int] | None, num_tokens: int, salt: str = "") -> np.ndarray | None:
    """The page hashes of a store's token ids (tokens [0, num_tokens)) under its cache salt, if given."""
    salt = tokens.check_salt(salt)
    if token_ids is None:
        return None
    if spec.is_opaque:
        raise InvalidArgument("opaque snapshots have no tokens: give no token ids", field="token_ids")
    return tokens.chain(tokens.check_ids(token_ids, num_tokens), spec.block_tokens, salt)


def check_readable(key: SessionKey, session: Session | None, verb: str) -> None:
    if session is None:
        raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
    if session.damaged:
        raise DataLoss(f"session {shown(key.session_id)} is damaged and cannot be {verb}",
                       session_id=key.session_id)


def check_ttl(ttl: float) -> float:
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_LEASE_SECONDS:
        raise InvalidArgument(f"a lease lasts more than 0 and at most {MAX_LEASE_SECONDS:g} seconds, "
                              f"got {shown(ttl)}", field="ttl_seconds", value=ttl)
    return float(ttl)


def check_lossy(bound: float | None, spec: KVSpec) -> float | None:
    """A save's consent to lossy codes as it gives it: None (as before), or the
    relative error each page may carry, in [0, 1] (0: lossless only). An
    opaque snapshot is never coded lossily: it may only say 0."""
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or
                              not 0 <= bound <= 1):
        raise InvalidArgument(f"lossy_max_error is a relative error in [0, 1] (0: lossless only), not {shown(bound)}",
                              field="lossy_max_error", value=bound)
    if bound and spec.is_opaque:
        raise InvalidArgument("an opaque snapshot is never coded lossily: lossy_max_error must be 0 or unset",
                              field="lossy_max_error", value=bound)
    return None if bound is None else float(bound)


def check_bound(bound: float | None) -> float | None:
    """An error bound as a call gives it: None, or a number from 0 on (InvalidArgument otherwise)."""
    if bound is not None and (not isinstance(bound, (int, float)) or not bound >= 0):
        raise InvalidArgument(f"max_error is a relative error from 0 on, not {bound!r}", field="max_error")
    return bound
