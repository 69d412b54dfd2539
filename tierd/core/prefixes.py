"""The prefix table: for each tenant, which sessions hold each page of known
tokens, by identity fingerprint and chained token hash (tokens.py).

A page's chained hash covers every token before it, under the request's
cache salt, so a session that holds the page with hash h also holds, with
the same hashes, every page before it: the holders of a request's page i
can lend pages [0, i]. Tenants have tables of their own: no answer, and no
lookup's cost, depends on what another tenant holds.

Metadata only, no locks: the prefix index (core/store/sharing.py) keeps it
in step with the session table under the store lock, on whichever thread
changed the sessions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np

from tierd.core import tokens
from tierd.core.model import Session


class PrefixTable:
    def __init__(self) -> None:
        # tenant -> fingerprint + page hash -> the sessions holding that page (an ordered set)
        self._tenants: dict[str, dict[bytes, dict[object, Session]]] = {}
        # tenant -> tokens of known pages a session holds -> how many sessions hold that many
        self._depths: dict[str, Counter[int]] = {}

    @staticmethod
    def _names(fingerprint: str, hashes: np.ndarray) -> Iterator[bytes]:
        fp = fingerprint.encode()
        raw = np.ascontiguousarray(hashes[: tokens.known_pages(hashes)]).tobytes()
        for at in range(0, len(raw), tokens.HASH_BYTES):
            yield fp + raw[at : at + tokens.HASH_BYTES]

    def add(self, session: Session, fingerprint: str, hashes: np.ndarray, depth: int) -> None:
        """The session holds these pages (its snapshot's hashes; unknown ones
        are left out), `depth` tokens of them (what remove() is given back)."""
        names = list(self._names(fingerprint, hashes))
        if not names:
            return
        key = session.key
        table = self._tenants.setdefault(key.tenant, {})
        for name in names:
            table.setdefault(name, {})[key] = session
        self._depths.setdefault(key.tenant, Counter())[depth] += 1

    def remove(self, session: Session, fingerprint: str, hashes: np.ndarray, depth: int) -> None:
        """The session no longer holds these pages (what add() was given)."""
        key = session.key
        names = list(self._names(fingerprint, hashes))
        table = self._tenants.get(key.tenant)
        if not names or table is None:
            return
        for name in names:
            holders = table.get(name)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del table[name]
        depths = self._depths[key.tenant]
        depths[depth] -= 1
        if not depths[depth]:
            del depths[depth]
        if not table:
            del self._tenants[key.tenant], self._depths[key.tenant]

    def deepest(self, tenant: str) -> int:
        """The most tokens of known pages one session of the tenant holds:
        no request matches more of them."""
        depths = self._depths.get(tenant)
        return max(depths) if depths else 0

    def holders(self, tenant: str, fingerprint: str, page_hash: np.ndarray) -> Iterator[Session]:
        """The sessions of the tenant that hold a page with this hash, first added first."""
        table = self._tenants.get(tenant)
        if table is None:
            return iter(())
        return iter(table.get(fingerprint.encode() + page_hash.tobytes(), {}).values())

    def pages(self, tenant: str | None = None) -> int:
        """Distinct pages held (by one tenant, or by all)."""
        tables = self._tenants.values() if tenant is None else [self._tenants.get(tenant, {})]
        return sum(len(t) for t in tables)

    def references(self, tenant: str | None = None) -> int:
        """Pages held, counted once per session that holds them."""
        tables = self._tenants.values() if tenant is None else [self._tenants.get(tenant, {})]
        return sum(len(holders) for t in tables for holders in t.values())
