"""Which tierd session an engine request belongs to, for adapters that serve
many end users as one tierd tenant (a vLLM server, say).

Runs in the engine's process. Every end user of such a server is the same
tenant to tierd, so a session id alone is shared by whoever sends it: two
users who pick the same id would read and overwrite one snapshot. Engines
separate users' caches with a per-request salt (vLLM's `cache_salt`); the
salt is folded into the session's key here, so the same id under another
salt is another session. Session ids must still be unguessable: without a
salt, the id is all that tells one user's conversation from another's.
"""

from __future__ import annotations

import hashlib

_KEEP = 200  # characters of the id kept readable in the key (ids are at most 256)


def session_key(session_id: str, salt: str | None = None) -> str:
    """The tierd session id for a request's session id and cache salt: the id
    itself without a salt, else a prefix of it and a hash of both."""
    if not salt:
        return session_id
    h = hashlib.blake2b(digest_size=16, person=b"tierd-salt")
    for part in (salt, session_id):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return f"{session_id[:_KEEP]}~{h.hexdigest()}"
