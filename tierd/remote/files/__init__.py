"""A remote store in a directory every node mounts (NFS, Lustre, 3FS, CephFS):
`--remote file:///mnt/kv`. The same contracts as the Redis backend
(backend.py), with the file system's own atomicity.

Layout under ROOT/PREFIX: `s/TAG[:2]/TAG/` per session, TAG a hash of tenant
and session id (no path names either): `m` its manifest (or tombstone),
`wWRITE` the bytes of one version, `lock` the file whose lock makes the
manifest's switch a compare-and-set across nodes. `t/TENANT TAG/TAG` lists a
tenant's sessions: the session's bytes and its id. `marker`, written at
first use: where it is missing (the share not mounted, or swapped), every
call is Unavailable, never an empty store that takes drops and publishes
into the mount point. Anything else than a plain file at a session's place
(a directory, a pipe) is that session's DataLoss, never a read that
blocks.

Publishing writes the version's bytes to a file of its own and syncs them;
then, holding the session's lock (a POSIX record lock, which NFS and Lustre
carry between nodes, and a thread lock, since record locks are per
process), it reads the manifest's version, compares it with the one
expected, and renames a synced new manifest over the old one (rename is
atomic: a reader opens the old file or the new, never a mix). The loser of
a race deletes its bytes; the winner deletes those of the version it
replaced. A reader holding the old manifest then finds its bytes gone:
NotFound, as for a chunk evicted from Redis. A version's file of another
size than its manifest says (torn, cut short, grown) is DataLoss; changed
bytes are found by the caller's page checksums. A drop renames a tombstone
over the manifest, then deletes the bytes: no node can resume what is
dropped. Bytes of a publish that died between its write and its switch are
deleted by the next publish of the session an hour on.

With a TTL, a manifest or tombstone last written longer ago than it counts
as gone, as a Redis key that expired (its bytes are deleted by the next
publish or drop of the session).

Runs on the thread that calls it (RPC threads, movers, the publisher).
"""

from __future__ import annotations

import os
from typing import Any

from tierd.errors import Unavailable
from tierd.remote.files.backend import FileBackend

__all__ = ["FileBackend", "open_backend"]


def open_backend(url: str, options: Any) -> FileBackend:
    """The backend for file:///PATH (an absolute path to a directory)."""
    path = url.partition("://")[2]
    if not path.startswith("/"):
        raise Unavailable(f"expected file:///ABSOLUTE/PATH, got {url!r}")
    if not os.path.isdir(path):
        raise Unavailable(f"the remote directory {path} does not exist (mount it, or create it)")
    return FileBackend(path, options.prefix, options.ttl)
