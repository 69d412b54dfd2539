"""One place that maps tierd errors to gRPC status codes and back.

The server sends the error's class name in trailing metadata (tierd-error),
so the client raises the same class with the server's message.
"""

from __future__ import annotations

import grpc

from tierd import errors

ERROR_KEY = "tierd-error"

CODES: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "DATA_LOSS": grpc.StatusCode.DATA_LOSS,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}

# For errors that carry no tierd-error metadata (raised by gRPC itself).
_BY_STATUS: dict[grpc.StatusCode, type[errors.TierdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}


def status_of(exc: errors.TierdError) -> grpc.StatusCode:
    return CODES[exc.code]


def error_class(code: object) -> type[errors.TierdError] | None:
    """The error a status code's name (a TierdError's code) stands for, None
    if none: for answers that are no gRPC call's (the descriptor intake's)."""
    status = CODES.get(code) if isinstance(code, str) else None
    return _BY_STATUS.get(status) if status is not None else None


def from_rpc_error(err: grpc.RpcError) -> errors.TierdError:
    """The typed error a failed call stands for."""
    name = dict(err.trailing_metadata() or ()).get(ERROR_KEY)
    cls = errors.ALL_ERRORS.get(name) if name else None
    if cls is None:
        cls = _BY_STATUS.get(err.code(), errors.TierdError)
    exc = cls(err.details() or err.code().name)
    exc.status = err.code()
    return exc
