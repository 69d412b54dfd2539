"""Fetching a version's chunks into the caller's memory: on a thread of the
store's, straight off the socket (replies.py), while the caller checks and
places the pages that have arrived; through redis-py from the first chunk
that came otherwise. Runs on the caller's thread and the store's sender
threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from tierd.checksum import page_checksum
from tierd.errors import DataLoss, NotFound, Unavailable
from tierd.remote.manifest import Manifest
from tierd.remote.redis.link import CHUNK_BYTES, PIPELINE, Link, chunks_of
from tierd.remote.redis.replies import Unexpected, read_values
from tierd.types import SessionKey


class Fetcher:
    def __init__(self, link: Link, sender: ThreadPoolExecutor) -> None:
        self.link = link
        self._sender = sender
        self.fallbacks = 0  # fetches finished through redis-py (see _fetch)

    def read_into(self, key: SessionKey, manifest: Manifest,
                  claim: Callable[[int], list[Any]]) -> Iterator[int]:
        """Read the version's chunks, in order, into the memory claim(n) gives
        for each next n bytes (writable buffers, in order; all claimed before
        the first is read), on a thread of the store's while the caller works
        on what has arrived; yields how many bytes are in place each time more
        chunks are (once for several where the caller was busy). The caller
        checks the pages they make up against the manifest's checksums.
        NotFound if any chunk is gone (the session is incomplete: recompute);
        nothing is written into claimed memory once this returns or raises."""
        stored = manifest.stored
        sinks = [claim(min(CHUNK_BYTES, stored - i * CHUNK_BYTES)) for i in range(chunks_of(stored))]
        arrivals = _Arrivals()
        reading = self._sender.submit(self._fetch, key, manifest.write, sinks, arrivals)
        reading.add_done_callback(arrivals.finish)
        try:
            seen, finished = 0, False
            while not finished:
                count, finished = arrivals.past(seen)
                if count > seen:
                    seen = count
                    yield min(stored, count * CHUNK_BYTES)
            if not reading.result():
                raise NotFound("the remote copy of this session is incomplete (evicted or expired)")
        finally:
            arrivals.stop = True  # the reader stops at its next batch
            wait([reading])  # its memory may be given back by the caller next

    def _fetch(self, key: SessionKey, write: str, sinks: list[list[Any]], arrivals: _Arrivals) -> bool:
        """GETs of the chunks straight into their sinks (each the buffers one
        chunk's bytes go to): each reply read off the connection's socket into
        them, with no copy on the way, and arrivals told as each is in place.
        Whether all were there (False too where arrivals.stop cut it short).
        Where the store answers anything else than a value of the size
        expected (a redirection while slots move, an error, a value of
        another size), the chunks from that one on are read through redis-py,
        which says what it was."""
        import redis

        if not sinks:
            return True
        names = [self.link.key(key, f"w{write}", str(i)) for i in range(len(sinks))]
        placed = 0  # the leading chunks in place (one past a missing chunk is not told)

        def read(i: int, found: bool) -> None:
            nonlocal placed
            if found and i == placed:
                placed += 1
                arrivals.arrived(placed)

        try:
            found = read_values(self.pool_of(names[0]), names, sinks, read, lambda: arrivals.stop)
            return len(found) == len(sinks) and all(found)
        except (redis.TimeoutError, TimeoutError) as exc:
            raise Unavailable(f"the remote store did not answer (a page read): {exc}") from None
        except (Unexpected, redis.RedisError, OSError):
            pass
        self.fallbacks += 1
        whole = True  # chunks before `placed` were told, so perhaps in the caller's hands: not written again
        for first in range(placed, len(sinks), PIPELINE):
            if arrivals.stop:
                return False
            for i, value in enumerate(self._get(key, write, first, min(PIPELINE, len(sinks) - first)), first):
                if value is not None:
                    views = [memoryview(v).cast("B") for v in sinks[i]]
                    if len(value) != sum(v.nbytes for v in views):
                        raise DataLoss(f"a chunk of the remote copy has {len(value)} bytes, not what its manifest "
                                       "says", tier="remote")
                    at = 0
                    for view in views:
                        view[:] = value[at : at + view.nbytes]
                        at += view.nbytes
                read(i, value is not None)
                whole = whole and value is not None
        return whole

    def _get(self, key: SessionKey, write: str, first: int, count: int) -> list[bytes | None]:
        pipe = self.link.client.pipeline(transaction=False)
        for i in range(first, first + count):
            pipe.get(self.link.key(key, f"w{write}", str(i)))
        return self.link.run("a page read", pipe.execute)

    def pool_of(self, name: str) -> Any:
        """The connection pool of the node that serves key `name`."""
        from redis.cluster import RedisCluster

        if not isinstance(self.link.client, RedisCluster):
            return self.link.client.connection_pool
        node = self.link.client.get_node_from_key(name)
        if node is None:
            raise Unexpected("no node serves the slot")
        return self.link.client.get_redis_connection(node).connection_pool

    def read(self, key: SessionKey, manifest: Manifest) -> Iterator[bytes]:
        """The session's pages in order, each checked against the manifest's
        checksum: DataLoss on a mismatch, NotFound if any chunk is gone. (A
        version stored as it is: coded pages are the core's to decode.)"""
        if manifest.coding is not None:
            raise ValueError("a version of coded pages: read_into its coded bytes")
        buf = memoryview(bytearray(manifest.nbytes))
        at = 0

        def claim(n: int) -> list[memoryview]:
            nonlocal at
            at += n
            return [buf[at - n : at]]

        for _ in self.read_into(key, manifest, claim):
            pass
        for page in range(manifest.n_pages):
            data = bytes(buf[page * manifest.page_bytes : page * manifest.page_bytes + manifest.size_of(page)])
            if page_checksum(data) != int(manifest.checksums[page]):
                raise DataLoss(f"page {page} failed its checksum in the remote tier", page=page, tier="remote")
            yield data


class _Arrivals:
    """How many chunks of a fetch are in place, in order (told by the thread
    that reads them), and whether that thread is done; stop asks it to stop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.count = 0
        self.done = False
        self.stop = False

    def arrived(self, count: int) -> None:
        with self._cv:
            self.count = count
            self._cv.notify_all()

    def finish(self, _: Any = None) -> None:
        with self._cv:
            self.done = True
            self._cv.notify_all()

    def past(self, seen: int) -> tuple[int, bool]:
        """Once more than seen chunks are in place or the reader is done:
        how many are, and whether it is done."""
        with self._cv:
            self._cv.wait_for(lambda: self.count > seen or self.done)
            return self.count, self.done
