"""Typed errors shared by the core, the API and the client.

Each class maps to exactly one gRPC status (see tierd.wire.status); the API
sends the class name in trailing metadata so the client raises the same class.
Errors keep the offending values as attributes.
"""

from __future__ import annotations

SHOWN_CHARS = 64  # of a value a message echoes


def shown(value: object) -> str:
    """A value for an error message: its repr, cut to SHOWN_CHARS. Messages
    echo what a request held, and gRPC sends the message as metadata (8 KiB
    at most by default): a long value echoed whole turned the error into
    RESOURCE_EXHAUSTED, and flooded logs."""
    if isinstance(value, (str, bytes)) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


class TierdError(Exception):
    """Base of every error tierd raises on purpose."""

    code = "INTERNAL"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


class InvalidArgument(TierdError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(TierdError):
    code = "NOT_FOUND"


class AlreadyExists(TierdError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(TierdError):
    code = "FAILED_PRECONDITION"


class IdentityMismatch(FailedPrecondition):
    """A snapshot was asked to go into memory of another model or layout."""


class ResourceExhausted(TierdError):
    code = "RESOURCE_EXHAUSTED"


class DataLoss(TierdError):
    """A checksum did not match: the bytes are never returned."""

    code = "DATA_LOSS"


class Unauthenticated(TierdError):
    code = "UNAUTHENTICATED"


class PermissionDenied(TierdError):
    code = "PERMISSION_DENIED"


class Unavailable(TierdError):
    code = "UNAVAILABLE"


class DeadlineExceeded(TierdError):
    code = "DEADLINE_EXCEEDED"


ALL_ERRORS: dict[str, type[TierdError]] = {
    cls.__name__: cls
    for cls in (
        TierdError,
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        IdentityMismatch,
        ResourceExhausted,
        DataLoss,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
    )
}