"""Each tenant's list of sessions in the shared directory: a file per
session under t/TENANT TAG/, named by the session's tag, holding its bytes
and its id. List and the tenant's quota read them; a file that does not
parse is skipped (bookkeeping, never a session's loss). Runs on the thread
that calls the backend."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator

from tierd.errors import Unavailable
from tierd.remote.files import fsio
from tierd.remote.manifest import tag_of
from tierd.types import SessionKey


class TenantLists:
    def __init__(self, root: str) -> None:
        self.root = root  # ROOT/PREFIX/t

    def _tenant(self, tenant: str) -> str:
        return os.path.join(self.root, hashlib.sha256(tenant.encode()).hexdigest()[:24])

    def add(self, key: SessionKey, nbytes: int) -> None:
        """List the session for its tenant; where this fails, the session is
        served, only not listed."""
        where = self._tenant(key.tenant)
        try:
            os.makedirs(where, exist_ok=True)
            fsio.replace(where, tag_of(key), f"{nbytes}\n{key.session_id}".encode())
        except OSError:
            pass

    def _entries(self, tenant: str) -> Iterator[tuple[str, int]]:
        """(session id, bytes) of each listed session."""
        where = self._tenant(tenant)
        try:
            names = os.listdir(where)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise Unavailable(f"the remote directory did not answer (a list): {exc}") from None
        for name in names:
            if name.startswith("."):
                continue
            try:
                with open(os.path.join(where, name), "rb") as f:
                    size, _, sid = f.read(1 << 16).partition(b"\n")
                yield sid.decode(), int(size)
            except (OSError, ValueError):
                continue

    def usage(self, tenant: str, session_id: str) -> tuple[int, int]:
        total = own = 0
        for sid, nbytes in self._entries(tenant):
            total += nbytes
            own = nbytes if sid == session_id else own
        return total, own

    def sample(self, tenant: str, count: int) -> list[str]:
        """Up to count of the tenant's listed ids, at random."""
        ids = [sid for sid, _ in self._entries(tenant)]
        return random.sample(ids, min(count, len(ids)))

    def listed(self, tenant: str, after: str = "", count: int = 100) -> list[str]:
        return sorted(sid for sid, _ in self._entries(tenant) if sid > after)[:count]

    def unlist(self, tenant: str, session_ids: list[str]) -> None:
        where = self._tenant(tenant)
        for sid in session_ids:
            fsio.unlink(os.path.join(where, tag_of(SessionKey(tenant, sid))))
