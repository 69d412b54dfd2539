"""Local reads: a client on the daemon's machine gets a session's bytes
without a stream. read_local: through shared memory the daemon lends for
the read (a lease's segment, mapped here); get_into: those bytes copied
into a buffer of the caller's; LocalBuffer: memory of this process the
daemon reads sessions into itself (a registered engine of whole pages).
Every page is checked against its checksum on the way, as for any read.
read_local and get_into also for AsyncClient. Run in the client's process."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any


from tierd.client.shm import Arena, SharedKVCache
from tierd.errors import InvalidArgument
from tierd.layout import KVSpec
from tierd.types import Lease

if TYPE_CHECKING:
    from tierd.client.clients import AsyncClient, Client


@contextmanager
def read_local(client: Client, session_id: str, ttl: float = 60.0,
               spec: KVSpec | None = None) -> Iterator[memoryview]:
    """The session's bytes, read on the daemon's machine through shared
    memory it lends for the read: a read-only view, valid inside the
    block. The daemon copied them there once, every page checked; no
    stream carries them. The lease ends with the block, or at its ttl
    if this process dies first (NotFound at the end: it expired while
    the bytes were read, and they may have changed). With spec, a
    snapshot of another identity is IDENTITY_MISMATCH."""
    lease = client.begin_restore(session_id, spec, ttl=ttl)
    try:
        with lent(client, lease) as view:
            yield view
    finally:
        client.end_restore(lease)


@asynccontextmanager
async def read_local_async(client: AsyncClient, session_id: str, ttl: float = 60.0,
                           spec: KVSpec | None = None) -> AsyncIterator[memoryview]:
    """read_local, for the asyncio client."""
    lease = await client.begin_restore(session_id, spec, ttl=ttl)
    try:
        with lent(client, lease) as view:
            yield view
    finally:
        await client.end_restore(lease)


@contextmanager
def lent(client: Client | AsyncClient, lease: Lease) -> Iterator[memoryview]:
    """A read-only view of a restore lease's bytes, in its segment mapped by
    the client's arena; released when the block ends."""
    with client._arena_lock:
        if client._arena is None:
            client._arena = Arena()
        [(_, rows)] = client._arena.runs(lease)  # a restore lease is one segment, its pages back to back
    view = memoryview(rows.reshape(-1)[: lease.nbytes]).toreadonly()
    try:
        yield view
    finally:
        try:
            view.release()  # no reading it once the lease has ended
        except BufferError:
            pass  # a view of it is still alive: the caller's


def get_into(client: Client, session_id: str, out: Any, ttl: float = 60.0, spec: KVSpec | None = None) -> int:
    """Copy the session's bytes into `out` (a writable buffer: bytearray,
    numpy array, ...), read as read_local reads them; returns how many."""
    target = writable(out)
    with read_local(client, session_id, ttl, spec) as data:
        return copy_into(session_id, data, target)


async def get_into_async(client: AsyncClient, session_id: str, out: Any, ttl: float = 60.0,
                         spec: KVSpec | None = None) -> int:
    """get_into, for the asyncio client."""
    target = writable(out)
    async with read_local_async(client, session_id, ttl, spec) as data:
        return copy_into(session_id, data, target)


def writable(out: Any) -> memoryview:
    target = memoryview(out)
    if target.readonly:
        raise InvalidArgument("get_into writes into a writable buffer (a bytearray or a numpy array, say)",
                              field="out")
    return target.cast("B")


def copy_into(session_id: str, data: memoryview, target: memoryview) -> int:
    if target.nbytes < len(data):
        raise InvalidArgument(f"session {session_id!r} holds {len(data)} bytes; the buffer takes "
                              f"{target.nbytes}", field="out", need=len(data), got=target.nbytes)
    target[: len(data)] = data
    return len(data)


class LocalBuffer:
    """Shared memory of this process (a sealed memfd) registered with the
    daemon as memory it reads sessions of one spec into, whole pages at a
    time: read(session_id) has the daemon copy the session's pages there,
    every page checked on the way (one copy, no stream), and returns a view
    of its bytes, valid until the next read or close. Opaque bytes
    (llama.cpp state, say) and KV pages alike; a session of another spec is
    IDENTITY_MISMATCH, one larger than the buffer INVALID_ARGUMENT."""

    def __init__(self, client: Client, spec: KVSpec, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"a local buffer takes a positive number of bytes, not {nbytes!r}", field="nbytes")
        self.client, self.spec = client, spec
        self.pages = -(-nbytes // spec.page_bytes)
        self.memory = SharedKVCache(spec, self.pages, kind="cross_layer")
        try:  # let go by the daemon if this process dies
            self.engine = client.register_engine(spec, self.memory, pid=os.getpid())
        except BaseException:
            self.memory.close()
            raise

    def read(self, session_id: str) -> memoryview:
        r = self.engine.restore(session_id, range(self.pages), whole=True)  # one call: never part of a version
        return memoryview(self.memory.regions[0][: r.nbytes]).toreadonly()

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.memory.close()

    def __enter__(self) -> LocalBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
