"""Who is calling: the tenant comes from the caller's credentials, never from
a request field. Without configured tokens every caller is tenant "default",
and the Unix socket's file permissions are the only gate."""

from __future__ import annotations

import grpc

DEFAULT_TENANT = "default"


def tenant(context: grpc.aio.ServicerContext) -> str:
    return DEFAULT_TENANT
