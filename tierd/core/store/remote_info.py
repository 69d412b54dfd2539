"""A remote manifest as the store describes a session: its spec, checked
against what the manifest says of its pages, and the SessionInfo of a
session only the remote tier holds. Plain functions: any thread."""

from __future__ import annotations

from tierd.core import tokens
from tierd.errors import DataLoss, shown
from tierd.layout import KVSpec
from tierd.remote.manifest import Manifest
from tierd.types import SessionInfo, SessionKey


def spec_of(key: SessionKey, m: Manifest, versions: str) -> KVSpec:
    """The manifest's spec, checked against what the manifest says of its
    pages (DataLoss if they disagree): the manifest is then safe to serve
    from (Stat, Lookup, List) and to fetch."""
    try:
        spec = KVSpec.from_dict(m.spec)
    except Exception as exc:  # noqa: BLE001 - whatever the store holds
        raise DataLoss(f"the remote copy of session {shown(key.session_id)} has a spec that does not parse "
                       f"({type(exc).__name__})", tier=versions) from None
    form = tokens.empty(0)
    if spec.fingerprint != m.fingerprint or m.page_bytes != spec.page_bytes or \
            (not spec.is_opaque and spec.pages_for_tokens(m.num_tokens) != m.n_pages) or \
            (len(m.token_hashes) and (m.token_hashes.dtype != form.dtype or
                                      m.token_hashes.shape[1:] != form.shape[1:])):
        raise DataLoss(f"the remote copy of session {shown(key.session_id)} does not agree with itself "
                       "(identity, page size, tokens or token hashes)", tier=versions)
    return spec


def info_of(key: SessionKey, m: Manifest, versions: str) -> SessionInfo:
    """What Stat, Lookup and List say of a session only the remote tier holds
    (its manifest; `versions`: the remote tier's name), DataLoss where the
    manifest does not agree with itself."""
    spec = spec_of(key, m, versions)
    return SessionInfo(tenant=key.tenant, session_id=key.session_id, tier=versions, tier_bytes={versions: m.nbytes},
                       state=versions, num_tokens=m.num_tokens, size_bytes=m.nbytes, num_pages=m.n_pages,
                       durable=False, last_access=m.saved, created=m.saved, priority=0, pins=0,
                       model_id=spec.model_id, fingerprint=m.fingerprint, spec=spec, remote_durable=True,
                       rel_error=m.rel_error, **coded_copy(versions, m.codec, m.stored, m.rel_error))


def coded_copy(tier: str, codec: str, stored: int, error: float) -> dict:
    """SessionInfo's codecs, coded_bytes and tier_errors of a tier's copy coded
    with codec, taking `stored` bytes, its worst page's relative error `error` (none: {})."""
    if codec == "none":
        return {}
    return {"codecs": {tier: codec}, "coded_bytes": {tier: stored}, "tier_errors": {tier: error} if error else {}}
