"""Messages <-> core types, shared by the servicer and the client."""

from __future__ import annotations

import functools
from typing import Any

from tierd.errors import InvalidArgument
from tierd.layout import KVSpec
from tierd.types import Lease, LookupResult, SessionInfo, Slot
from tierd.v1 import tierd_pb2 as pb

_SPEC_FIELDS = [f.name for f in pb.KVSpec.DESCRIPTOR.fields]
_DEFAULTED = {"layout_version", "arrangement", "kind"}  # may be left unset; the rest must be given


# Every Stat, List and Save answer carries its session's spec, and a daemon
# sees few distinct ones: both directions are cached. A cached message is only
# ever copied into another (the constructors copy), never changed.
@functools.lru_cache(maxsize=256)
def spec_to_pb(spec: KVSpec) -> pb.KVSpec:
    return pb.KVSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def spec_from_pb(msg: pb.KVSpec) -> KVSpec:
    """A KVSpec from a message; unset fields take their defaults. Raises InvalidArgument."""
    if not msg.model_id:
        raise InvalidArgument("spec.model_id is required", field="spec.model_id")
    defaults = KVSpec.__dataclass_fields__
    values = {}
    for name in _SPEC_FIELDS:
        value = getattr(msg, name)
        if name in _DEFAULTED and value in ("", 0):
            value = defaults[name].default  # unset in the message
        values[name] = value
    if values["kind"] == "opaque":
        values.update(num_layers=0, num_kv_heads=0, head_dim=0, dtype="uint8", block_tokens=1)
    return _spec(tuple(values.items()))


@functools.lru_cache(maxsize=256)
def _spec(items: tuple[tuple[str, Any], ...]) -> KVSpec:
    return KVSpec(**dict(items))  # checks and fingerprints it; a spec that fails is not cached


def info_to_pb(info: SessionInfo) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=info.session_id, tenant=info.tenant, tier=info.tier or "", tier_bytes=info.tier_bytes,
        state=info.state, num_tokens=info.num_tokens, size_bytes=info.size_bytes, num_pages=info.num_pages,
        durable=info.durable, last_access=info.last_access, created=info.created, priority=info.priority,
        pins=info.pins, spec=spec_to_pb(info.spec), fingerprint=info.fingerprint, remote_durable=info.remote_durable,
        shared_bytes=info.shared_bytes, codecs=info.codecs, coded_bytes=info.coded_bytes,
        tier_errors=info.tier_errors, rel_error=info.rel_error)


def info_from_pb(msg: pb.SessionInfo) -> SessionInfo:
    spec = spec_from_pb(msg.spec)
    return SessionInfo(
        tenant=msg.tenant, session_id=msg.session_id, tier=msg.tier or None, tier_bytes=dict(msg.tier_bytes),
        state=msg.state, num_tokens=msg.num_tokens, size_bytes=msg.size_bytes, num_pages=msg.num_pages,
        durable=msg.durable, last_access=msg.last_access, created=msg.created, priority=msg.priority,
        pins=msg.pins, model_id=spec.model_id, fingerprint=msg.fingerprint, spec=spec,
        remote_durable=msg.remote_durable, shared_bytes=msg.shared_bytes, codecs=dict(msg.codecs),
        coded_bytes=dict(msg.coded_bytes), tier_errors=dict(msg.tier_errors), rel_error=msg.rel_error)


def lease_to_pb(lease: Lease) -> pb.Lease:
    return pb.Lease(
        lease_id=lease.lease_id, page_bytes=lease.page_bytes, page_stride=lease.page_stride,
        first_page=lease.first_page, num_pages=lease.num_pages, num_tokens=lease.num_tokens, ttl_seconds=lease.ttl,
        nbytes=lease.nbytes, rel_error=lease.rel_error,
        slots=[pb.Slot(shm_name=s.shm_name, offset=s.offset, first_page=s.first_page, num_pages=s.n_pages)
               for s in lease.slots])


def lease_from_pb(msg: pb.Lease) -> Lease:
    return Lease(msg.lease_id, [Slot(s.shm_name, s.offset, s.first_page, s.num_pages) for s in msg.slots],
                 msg.page_bytes, msg.page_stride, msg.first_page, msg.num_pages, msg.num_tokens, msg.ttl_seconds,
                 msg.nbytes, msg.rel_error)


def optional_spec_to_pb(spec: KVSpec | None) -> pb.KVSpec | None:
    return spec_to_pb(spec) if spec is not None else None


def optional_spec_from_pb(msg: Any) -> KVSpec | None:
    """A request's spec, or None where it names none (no identity check)."""
    return spec_from_pb(msg.spec) if msg.HasField("spec") else None


def lookup_to_pb(r: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(num_tokens=r.num_tokens, num_pages=r.num_pages, stored_tokens=r.stored_tokens,
                             tier=r.tier or "")


def lookup_from_pb(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(msg.num_tokens, msg.num_pages, msg.stored_tokens, msg.tier or None)
