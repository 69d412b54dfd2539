"""The Redis backend (`--remote redis://HOST:PORT,...`): sessions in a Redis
Cluster (or one Redis or Valkey server) that every node reaches, so a
session saved on one node resumes on any. Runs on the thread that calls it (movers, RPC threads), except that
each call that waits on the store runs on a thread of the store's, waited
for `timeout` seconds at most (see Faults); redis-py's clients are
thread-safe.

Layout. A session's keys share one hash tag (its slot), derived by hash from
tenant and session id, so no key names either: `PREFIX:{TAG}:m` holds the
manifest, `PREFIX:{TAG}:w{WRITE}:{i}` the snapshot's logical bytes in
chunks of CHUNK_BYTES, a little below a power of two (jemalloc rounds an
exact 2**n value up by a quarter). Every key has the store's TTL. Each
tenant's session ids are members of one sorted set, `PREFIX:{TENANT TAG}:s`
(for List; a member whose manifest is gone is dropped when found), and
`PREFIX:{TENANT TAG}:b` maps each to its bytes and `PREFIX:{TENANT TAG}:u`
holds their sum (the tenant's quota, read in one call whatever its number
of sessions). These three are bookkeeping: one that holds something else is
reset (the list made again from the map), a total that is no count summed
again, and a recount checks listed sessions against what the store holds
(Redis expires and evicts sessions without telling anyone).

One history per session. A version is published in two steps: its chunks
under a write id of its own, then the manifest switched by compare-and-set
(a Lua script on the manifest's key): a writer that expected another
version loses (FailedPrecondition) and deletes its chunks; the winner
deletes the chunks of the version it replaced. A reader never sees a mix.
A drop leaves a tombstone at the manifest's key, and a history's first
version is numbered at random: a node's copy of a version that ended is
never taken for the current one.

Parts. store.py publishes and drops, and answers the protocol through
manifests.py (manifests read bounded by their size, large ones kept),
tenants.py (each tenant's list, bytes and total), fetch.py and replies.py
(chunks read off the socket straight into the caller's memory), all over
link.py (the client, key names, calls bounded by the timeout); scripts.py
holds the Lua the store runs; notices.py hears of every switch and drop
(each script publishes one), so that current() knows, without asking the
store, which version a key holds; replicas.py has a switch wait until the
primary's replicas acknowledge it (remote-durable: on a replica).

Never wrong KV. The manifest carries the identity fingerprint, the page
checksums and the token hashes; every page read back is checked (DataLoss
on a mismatch). A chunk that is gone (evicted, expired, lost in a fail-over)
makes the whole session NotFound: recompute, never a part.

Faults. redis-py, on a node that does not answer, finds the cluster again
and tries once more, and a pipeline sends its commands to that node again
one at a time: each call that moves no session's bytes runs on a thread of
the store's and its caller waits `timeout` seconds at most (Unavailable),
while redis-py finishes on its own. A publish's chunks and a fetch are
bounded by the timeout per read or write.
"""

from __future__ import annotations

from typing import Any

from tierd.remote.redis.link import connect
from tierd.remote.redis.store import RemoteStore


def open_backend(url: str, options: Any) -> RemoteStore:
    """The backend for redis[s]://[USER@]HOST:PORT[,HOST:PORT...] (registry.py)."""
    return RemoteStore(connect(url, options.password, options.tls_ca, options.timeout), prefix=options.prefix,
                       ttl=options.ttl, hosts=url.partition("://")[2].rpartition("@")[2], recheck=options.recheck,
                       replicas=options.replicas)


__all__ = ["RemoteStore", "connect", "open_backend"]
