"""Who is calling: the tenant comes from the caller's credentials, never from
a request field.

With `--auth-tokens FILE`, every call carries `authorization: Bearer TOKEN`;
the file holds one `TENANT:SHA256_HEX_OF_TOKEN` per line, optionally followed
by `:admin` (the operator calls: listing every tenant, changing budgets).
Tokens are compared by their SHA-256 in constant time against every entry.
Without the file, the Unix socket's permissions are the only gate: every
caller is tenant "default", with the operator calls allowed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from tierd.core.store import check_id
from tierd.errors import InvalidArgument, PermissionDenied, Unauthenticated

DEFAULT_TENANT = "default"
_LINE = re.compile(r"([^:]+):([0-9a-fA-F]{64})(?::(admin))?")


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    admin: bool

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{what} needs a token with the admin role", tenant=self.tenant)


@dataclass(frozen=True, slots=True)
class _Entry:
    tenant: str
    digest: bytes
    admin: bool


class Authenticator:
    def __init__(self, entries: list[_Entry] | None = None) -> None:
        self._entries = entries  # None: no tokens configured

    @property
    def enabled(self) -> bool:
        return self._entries is not None

    @classmethod
    def from_lines(cls, lines: Iterable[str], source: str = "tokens") -> Authenticator:
        entries = []
        for n, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _LINE.fullmatch(line)
            if not m:
                raise InvalidArgument(f"{source}:{n}: expected TENANT:SHA256_HEX (64 hex digits), optionally "
                                      f"followed by :admin")
            try:
                tenant = check_id("tenant", m.group(1))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{source}:{n}: {exc}") from None
            entries.append(_Entry(tenant, bytes.fromhex(m.group(2)), m.group(3) == "admin"))
        if not entries:
            raise InvalidArgument(f"{source} holds no tokens: every call would be refused")
        return cls(entries)

    @classmethod
    def from_file(cls, path: str) -> Authenticator:
        try:
            with open(path) as f:
                return cls.from_lines(f, path)
        except OSError as exc:
            raise InvalidArgument(f"cannot read the tokens file {path}: {exc.strerror}") from None

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        if self._entries is None:
            return Caller(DEFAULT_TENANT, admin=True)
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer ") or len(header) > 4096:
            raise Unauthenticated("this daemon requires 'authorization: Bearer TOKEN'")
        # (a token sent to the descriptor intake is any JSON string, lone surrogates too: it hashes, and matches none)
        digest = hashlib.sha256(header[len("Bearer "):].encode("utf-8", "surrogatepass")).digest()
        found = None
        for entry in self._entries:  # no early exit: every entry is compared
            if hmac.compare_digest(entry.digest, digest) and found is None:
                found = entry
        if found is None:
            raise Unauthenticated("unknown token")
        return Caller(found.tenant, found.admin)
