"""Python clients for the tierd daemon: `Client` (blocking) and `AsyncClient`
(asyncio), with the same methods. gRPC errors become the typed exceptions
below, each carrying the daemon's message."""

from tierd.client.calls import AsyncEngine, Engine
from tierd.client.channel import default_address
from tierd.client.clients import AsyncClient, Client
from tierd.client.local import LocalBuffer
from tierd.client.shm import Arena, SharedKVCache
from tierd.errors import (
    DataLoss,
    FailedPrecondition,
    IdentityMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TierdError,
    Unauthenticated,
    Unavailable,
)
from tierd.layout import EngineLayout, KVSpec
from tierd.types import Lease, LookupResult, RestoreResult, SessionInfo

__all__ = [
    "Arena",
    "AsyncClient",
    "AsyncEngine",
    "Client",
    "DataLoss",
    "Engine",
    "EngineLayout",
    "FailedPrecondition",
    "IdentityMismatch",
    "InvalidArgument",
    "KVSpec",
    "Lease",
    "LocalBuffer",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RestoreResult",
    "SessionInfo",
    "SharedKVCache",
    "TierdError",
    "Unauthenticated",
    "Unavailable",
    "default_address",
]
