"""Remote backends by URL scheme: `--remote SCHEME://...` opens the backend
registered for SCHEME, importing its module only then (a backend's client
library is loaded only where it is used). A new backend is a package beside
this module and one `register` line here (or in a plugin's import).

Runs at start, on the thread that builds the daemon."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tierd.config.values import REMOTE_SCHEMES
from tierd.errors import InvalidArgument
from tierd.remote.backend import RemoteBackend


@dataclass(frozen=True)
class Options:
    """What every backend is opened with (each takes what applies to it)."""

    prefix: str = "tierd"  # one per deployment sharing the store
    ttl: float | None = None  # seconds a version is kept (None: until dropped or replaced)
    timeout: float = 0.5  # seconds a call may take
    password: str | None = None
    tls_ca: str | None = None
    recheck: float = 0.0  # seconds a version notices say is current is trusted without asking (0: always ask)
    replicas: int = 0  # replicas that must acknowledge a version before it is durable (0: the store's own ack)


_BACKENDS: dict[str, tuple[str, str]] = {}


def register(scheme: str, module: str, factory: str = "open_backend") -> None:
    """Serve SCHEME:// URLs with module.factory(url, Options), imported when first used."""
    _BACKENDS[scheme] = (module, factory)
    REMOTE_SCHEMES.add(scheme)  # the configuration takes its URLs from now on


def schemes() -> list[str]:
    return sorted(_BACKENDS)


def open_backend(url: str, options: Options) -> RemoteBackend:
    """The backend for url, opened: InvalidArgument for a scheme no backend
    serves; the backend's own errors (Unavailable, Unauthenticated) as they are."""
    scheme = url.partition("://")[0].lower()
    if scheme not in _BACKENDS:
        raise InvalidArgument(f"no remote backend serves {scheme!r} URLs (known: {', '.join(schemes())})",
                              field="remote")
    module, factory = _BACKENDS[scheme]
    opened: Any = getattr(importlib.import_module(module), factory)(url, options)
    return opened


register("redis", "tierd.remote.redis")
register("rediss", "tierd.remote.redis")
register("file", "tierd.remote.files")
