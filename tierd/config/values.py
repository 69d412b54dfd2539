"""The values configuration takes, each parsed from a flag's, a variable's
or a TOML key's text (InvalidArgument naming what it wanted), and the
default directories. Plain functions: any thread."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from tierd.errors import InvalidArgument
from tierd.sizes import parse_size
from tierd.types import ID

AUTO = "auto"


def default_runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(base, "tierd") if base else f"/tmp/tierd-{os.getuid()}"


def default_data_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "tierd")


def _optional_seconds(text: Any) -> float | None:
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none", "off", "never")):
        return None
    return _seconds(text)


def _seconds(text: Any) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InvalidArgument(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"seconds must be a finite number, not negative, got {text!r}")
    return value


def _size_or_auto(text: Any) -> int | str:
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    return parse_size(text)


def _integer(minimum: int, what: str) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise InvalidArgument(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise InvalidArgument(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _integer(1, "a positive integer")
_count = _integer(0, "a whole number")


def parse_bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"expected true or false, got {text!r}")


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        value = str(text).strip().lower()
        if value not in options and not (value.startswith("cuda:") and "cuda" in options):
            raise InvalidArgument(f"expected one of {', '.join(options)}, got {text!r}")
        return value

    return parse


def _host_port(text: Any) -> str:
    value = str(text).strip()
    if value.lower() in ("", "off", "none"):
        return ""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"expected HOST:PORT, got {text!r}")
    return value


# Tiers a --codec may name: those whose pages are coded on their way there (host: re-coded in place to make room).
CODED_TIERS = ("disk", "host", "remote")


def _codecs(text: Any) -> dict[str, str]:
    """TIER=CODEC pairs: a flag given more than once (a list), a variable's
    or a string's comma-separated pairs, or a TOML table. The codec's name is
    checked where the tier is built (the codecs are the daemon's)."""
    if isinstance(text, dict):
        pairs = [(str(k), str(v)) for k, v in text.items()]
    else:
        items = text if isinstance(text, list) else [text]
        pairs = []
        for item in items:
            for part in str(item).split(","):
                if part.strip():
                    tier, sep, name = part.partition("=")
                    if not sep:
                        raise InvalidArgument(f"expected TIER=CODEC (remote=lossless, say), got {part.strip()!r}")
                    pairs.append((tier, name))
    out: dict[str, str] = {}
    for tier, name in pairs:
        tier, name = tier.strip().lower(), name.strip().lower()
        if tier not in CODED_TIERS:
            raise InvalidArgument(f"pages are coded on their way to the {' or '.join(CODED_TIERS)} tier, not "
                                  f"{tier!r}")
        if not name:
            raise InvalidArgument(f"{tier}= names no codec")
        out[tier] = name
    return out


def _tenants(text: Any) -> frozenset[str]:
    """Tenant names, comma-separated (or a TOML list); * for every tenant. A
    name no tenant can have (not an id) is refused: it would match nobody."""
    items = text if isinstance(text, list) else str(text).split(",")
    names = frozenset(str(t).strip() for t in items if str(t).strip())
    bad = sorted(t for t in names if t != "*" and not ID.fullmatch(t))
    if bad:
        raise InvalidArgument(f"{bad[0]!r} is no tenant's name (letters, digits and ._:@+=~-, up to 256)")
    return names


def _fraction(text: Any) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InvalidArgument(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise InvalidArgument(f"expected a number from 0 to 1, got {text!r}")
    return value


def _text(text: Any) -> str:
    return str(text)


def parse_remote_url(url: str) -> tuple[str, str, list[tuple[str, int]]]:
    """(scheme, user, [(host, port), ...]) of redis[s]://[USER@]HOST:PORT[,HOST:PORT...];
    InvalidArgument for anything else, a password in it included."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss") or not rest:
        raise InvalidArgument("expected redis://HOST:PORT[,HOST:PORT...] or rediss://..., "
                              f"got {url.split('@')[-1]!r}", field="remote")
    user, _, hosts = rest.rstrip("/").rpartition("@")
    if ":" in user:
        raise InvalidArgument("the remote tier's URL carries no password: use --remote-password-file or "
                              "TIERD_REMOTE_PASSWORD", field="remote")
    nodes = []
    for hp in hosts.split(","):
        host, _, port = hp.rpartition(":")
        if not host or host.startswith("[") != host.endswith("]") or not port.isascii() or not port.isdigit() \
                or not 0 < int(port) <= 65535:
            raise InvalidArgument(f"{hp!r} in the remote tier's URL is not HOST:PORT", field="remote")
        nodes.append((host.strip("[]"), int(port)))
    return scheme, user, nodes


# URL schemes a remote backend serves: these, and those registered later (tierd/remote/registry.py).
REMOTE_SCHEMES = {"redis", "rediss", "file"}


def _remote_url(text: Any) -> str:
    """A remote tier's URL: Redis's checked whole here, a shared directory's
    path absolute; another registered scheme's URL is the backend's to check
    when it is opened."""
    value = str(text).strip()
    if value.lower() in ("", "off", "none"):
        return ""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in REMOTE_SCHEMES:
        raise InvalidArgument("expected redis://HOST:PORT[,HOST:PORT...], rediss://... or file:///PATH, "
                              f"got {value.split('@')[-1]!r}", field="remote")
    if scheme in ("redis", "rediss"):
        parse_remote_url(value)
    elif scheme == "file" and not rest.startswith("/"):
        raise InvalidArgument(f"expected file:///ABSOLUTE/PATH for a shared directory, got {value!r}", field="remote")
    elif not rest:
        raise InvalidArgument(f"the remote tier's URL {value!r} names no store", field="remote")
    return value
