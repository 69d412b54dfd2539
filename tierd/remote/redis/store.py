"""RemoteStore: the Redis backend's face (the package's docstring says how
it works), built of its parts: the link (client, key names, bounded calls),
the manifests' reader, the tenants' bookkeeping and the fetcher. Publishing
and dropping are here. Runs on the thread that calls it (movers, RPC
threads, the publisher); thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import numpy as np

from tierd.errors import DataLoss, FailedPrecondition, Unavailable
from tierd.remote.backend import Refused, Unreplicated
from tierd.remote.coded import Coding
from tierd.remote.manifest import (
    Head,
    Manifest,
    check_bounds,
    dropped_at,
    made,
    next_version,
    owner_of,
)
from tierd.remote.redis import scripts
from tierd.remote.redis.fetch import Fetcher
from tierd.remote.redis.link import CHUNK_BYTES, PIPELINE, Link, chunks_of, rechunk
from tierd.remote.redis.manifests import Manifests
from tierd.remote.redis.notices import Notices
from tierd.remote.redis.replicas import Replicas
from tierd.remote.redis.tenants import Tenants
from tierd.types import SessionKey

log = logging.getLogger("tierd.remote.redis")


class RemoteStore:
    """Versions of sessions in a Redis Cluster or server (RemoteBackend)."""

    chunk_bytes = CHUNK_BYTES
    publish_window = PIPELINE * CHUNK_BYTES

    def __init__(self, client: Any, prefix: str = "tierd", ttl: float | None = None, hosts: str = "",
                 recheck: float = 0.0, replicas: int = 0) -> None:
        self.link = Link(client, prefix, ttl)
        self.replicas = Replicas(self.link, replicas)  # what a version waits for before it is durable
        self.client, self.prefix = client, prefix  # (what tools and tests name keys by)
        self.hosts = hosts  # where the store is, for the log
        # Sends one batch of chunks while a publish reads the next (the socket releases the GIL), and
        # reads the chunks of a fetch while its caller checks and places those that have arrived.
        self._sender = ThreadPoolExecutor(4, thread_name_prefix="tierd-remote")
        self.reader = Manifests(self.link)
        self.tenants = Tenants(self.link)
        self.fetcher = Fetcher(self.link, self._sender)
        self._cas = client.register_script(scripts.CAS)
        self._drop = client.register_script(scripts.DROP)
        self._spare: list[bytearray] = []  # chunk buffers between publishes
        self._spare_lock = threading.Lock()
        # Change notices: sent by every switch and drop (where the store's ACL lets this node publish on the
        # channel), heard where copies are trusted for `recheck` seconds.
        self._channel = f"{prefix}:n"
        self._refused_said = float("-inf")  # when the log last said the store refused a notice
        self.notices = Notices(self.link, recheck) if recheck > 0 else None
        if self.notices is not None:
            self.notices.start()
        # The protocol's reads, answered by the parts.
        self.heads, self.version_of = self.reader.heads, self.reader.version_of
        self.tombstones, self.missing = self.reader.tombstones, self.reader.missing
        self.usage, self.listed, self.unlist = self.tenants.usage, self.tenants.listed, self.tenants.unlist
        self.read_into, self.read = self.fetcher.read_into, self.fetcher.read

    def close(self) -> None:
        if self.notices is not None:
            self.notices.close()
        self._sender.shutdown(wait=True)
        self.link.close()

    def _sent(self, sent: Any) -> None:
        """A switch's or drop's notice was sent (1) or refused (0: the store's ACL
        gives this node's user no channel): said in the log, once a minute at most."""
        if sent == 0 and time.monotonic() - self._refused_said > 60:
            self._refused_said = time.monotonic()
            log.warning("remote tier: the store refuses this node's change notices (its user may not publish on %s): "
                        "nodes that trust them see its publishes and drops up to --remote-recheck seconds late",
                        self._channel)

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        """The session's current manifest (None: none, or a tombstone) and the
        version number at its key; remembered as its current version while
        notices say nothing changed (current())."""
        if self.notices is None:
            return self.reader.head(key)
        with self.notices.watching(self.link.key(key, "m")) as seen:
            m, at = self.reader.head(key)
            if seen is not None:
                seen.found = (at, m.write if m is not None else "")
        return m, at

    def replicated(self, keys: list[SessionKey]) -> list[bool]:
        return self.replicas.replicated([self.link.key(key, "r") for key in keys])

    def current(self, key: SessionKey) -> tuple[int, str] | None:
        return self.notices.current(self.link.key(key, "m")) if self.notices is not None else None

    def hears_changes(self) -> bool:
        return self.notices is not None and self.notices.live()

    def describe(self) -> str:
        from redis.cluster import RedisCluster

        kind = "cluster" if isinstance(self.link.client, RedisCluster) else "server"
        return f"redis {kind} at {self.hosts}" if self.hosts else f"redis {kind}"

    def ping(self) -> None:
        """Unavailable unless the store answers: every primary, for a cluster (one
        that hangs while the others answer is not a store that is up)."""
        from redis.cluster import RedisCluster

        if isinstance(self.link.client, RedisCluster):
            # The cluster as it is now (a replica promoted meanwhile is a primary), then each primary.
            self.link.call("a topology read", self.link.client.nodes_manager.initialize)
            self.link.call("a ping", self.link.client.ping, target_nodes=RedisCluster.PRIMARIES)
        else:
            self.link.call("a ping", self.link.client.ping)

    def publish(self, key: SessionKey, expect: int, spec: dict[str, Any], fingerprint: str, num_tokens: int,
                page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray,
                data: Iterable[tuple[bytes | memoryview, bool]], coding: Coding | None = None) -> Manifest:
        """Store a new version of the session: `data` is its logical bytes (or,
        with coding, its pages' coded bytes, coding filled once they are all
        read), in pieces of any size, each with whether it stays valid until
        this returns (sent as it is, no copy) or only until the next piece is
        asked for (copied). `expect` is the version this one replaces (0:
        none); if another writer published first, FailedPrecondition and
        nothing is left behind. Refused, before anything is written, for a
        session past what a manifest may be (check_bounds)."""
        check_bounds(len(checksums), np.asarray(token_hashes), coding is not None)
        write = secrets.token_hex(8)
        chunks = nbytes = 0
        batch: list[memoryview] = []
        sending: Future | None = None  # the batch before, sent by the sender thread meanwhile
        # Two batches of buffers: one being sent while the other fills (a buffer is filled
        # again only once the batch it went out in has been sent).
        buffers = self._take_buffers(2 * PIPELINE)
        try:
            for chunk in rechunk(data, buffers):
                batch.append(chunk)
                if len(batch) == PIPELINE:
                    if sending is not None:
                        sending.result()
                    sending = self._sender.submit(self._put, key, write, chunks, batch)
                    chunks, nbytes, batch = chunks + len(batch), nbytes + sum(map(len, batch)), []
            if sending is not None:
                sending.result()
                sending = None
            if batch:
                self._put(key, write, chunks, batch)
                chunks, nbytes = chunks + len(batch), nbytes + sum(map(len, batch))
            manifest = made(next_version(expect), write, fingerprint, spec, num_tokens, nbytes, page_bytes, checksums,
                            token_hashes, owner_of(key), coding)
            ok, old = self._switch(key, write, chunks, expect, manifest)
            if ok == 2:
                raise Refused(f"the remote store holds {old} of the {chunks} chunks written (lost in a fail-over, or "
                              "evicted): the version is not published")
        except BaseException:
            if sending is not None:
                wait([sending])
            self._delete(key, write, chunks + len(batch))  # what may have been written
            raise
        finally:
            self._give_back(buffers)  # no send is in flight here
        if not ok:
            self._delete(key, write, chunks)
            raise FailedPrecondition(f"another node published version {int(old)} of this session first",
                                     version=int(old))
        try:  # listed for its tenant: where this fails, the session is served, only not listed
            self.tenants.relist(key.tenant, [(key.session_id, nbytes)])
        except Unavailable:
            pass
        if old:
            try:
                previous = Head.parse(old)
            except DataLoss:
                return manifest  # unreadable: its chunks go by their TTL
            self._delete(key, previous.write, chunks_of(previous.stored))  # the version replaced: reclaimed
        return manifest

    def _switch(self, key: SessionKey, write: str, chunks: int, expect: int, manifest: Manifest) -> tuple[int, Any]:
        """The manifest's compare-and-set (scripts.CAS): its reply; Unreplicated
        where it switched and too few replicas acknowledged it in time."""
        name = self.link.key(key, "m")
        keys = [name] + [self.link.key(key, f"w{write}", str(i)) for i in range(chunks)]
        args = [expect, manifest.encode(), self.link.ttl_ms, self._channel, f"{manifest.version} {write}"]
        with self.notices.watching(name) if self.notices is not None else nullcontext() as seen:
            # Not as a call: the switch carries the manifest and checks every chunk (each read is bounded).
            [reply], durable = self.replicas.write(
                name, self.link.key(key, "r"), "the manifest switch",
                lambda pipe: self._cas(keys=keys, args=args, client=pipe),
                lambda: self.link.run("the manifest switch", self._cas, keys=keys, args=args))
            if not isinstance(reply, list) or len(reply) != (3 if reply and reply[0] == 1 else 2):
                raise Unavailable(f"the remote store answered the manifest switch with {str(reply)[:80]!r}")
            if reply[0] == 1:
                self._sent(reply[2])
                if seen is not None:
                    seen.found = (manifest.version, write)
        if reply[0] == 1 and not durable:
            raise Unreplicated(f"version {manifest.version} is published, but too few replicas acknowledged it in "
                               "time", manifest)
        return reply[0], reply[1]

    def _take_buffers(self, count: int) -> list[bytearray]:
        """Chunk buffers, the spare ones first: a new one costs a page fault per
        4 KiB when first filled, which on a busy host takes longer than the copy."""
        with self._spare_lock:
            taken, self._spare = self._spare[:count], self._spare[count:]
        return taken + [bytearray(CHUNK_BYTES) for _ in range(count - len(taken))]

    def _give_back(self, buffers: list[bytearray]) -> None:
        with self._spare_lock:  # kept for one publish at a time; the others' go back to the allocator
            self._spare.extend(buffers[: 2 * PIPELINE - len(self._spare)])

    def _put(self, key: SessionKey, write: str, first: int, chunks: list[memoryview]) -> None:
        pipe = self.link.client.pipeline(transaction=False)
        for i, chunk in enumerate(chunks):
            pipe.set(self.link.key(key, f"w{write}", str(first + i)), chunk, px=self.link.ttl_ms or None)
        self.link.run("a page write", pipe.execute)

    def _delete(self, key: SessionKey, write: str, chunks: int) -> None:
        """Delete a write's chunks (one slot: one call per 256); where the store
        does not answer, they go by their TTL."""
        names = [self.link.key(key, f"w{write}", str(i)) for i in range(chunks)]
        for i in range(0, len(names), 256):
            try:
                self.link.call("a reclaim", self.link.client.delete, *names[i : i + 256])
            except Unavailable:
                return

    def drop(self, key: SessionKey) -> bool:
        """Delete the session's current version, leaving a tombstone in its
        manifest's place; whether there was one. Unreplicated where the
        tombstone is taken but too few replicas acknowledged it in time."""
        name, barrier = self.link.key(key, "m"), self.link.key(key, "r")
        args = [self.link.ttl_ms, self._channel]

        def first(pipe: Any) -> None:
            self._drop(keys=[name], args=args, client=pipe)
            if self.replicas.count:  # a write of its own: WAIT covers a tombstone an earlier drop left too
                pipe.set(barrier, b"", px=1000)

        try:
            (reply, *_), durable = self.replicas.write(
                name, barrier, "a drop", first, lambda: self.link.call("a drop", self._drop, keys=[name], args=args))
        finally:
            if self.notices is not None:
                self.notices.forget(name)
        if not isinstance(reply, list) or len(reply) != 2:
            raise Unavailable(f"the remote store answered a drop with {str(reply)[:80]!r}")
        old, sent = reply
        self._sent(sent)
        self.tenants.unlist(key.tenant, [key.session_id])
        there = bool(old) and not dropped_at(old)
        if there:
            try:
                head = Head.parse(old)
            except DataLoss:
                head = None  # unreadable: its chunks go by their TTL
            if head is not None and head.meta.get("owner", "") == owner_of(key):  # (another's names its own)
                self._delete(key, head.write, chunks_of(head.stored))
        if not durable:
            raise Unreplicated("the drop is taken (a tombstone in the session's place), but too few replicas "
                               "acknowledged it in time", None)
        return there
