"""What the parts of the Redis backend share: the client, the names of the
keys, the size of chunks, and calls on the store bounded by the timeout
(Faults, in the package's docstring). connect() opens the client. Runs on
the thread that calls it; a call waits on a thread of the link's pool.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Late
from typing import Any

from tierd.config.values import parse_remote_url
from tierd.errors import DataLoss, Unauthenticated, Unavailable
from tierd.remote.backend import Refused
from tierd.remote.manifest import tag_of
from tierd.types import SessionKey

CHUNK_BYTES = (1 << 20) - 4096  # below 1 MiB with Redis's own headers: the allocator's 1 MiB class
PIPELINE = 16  # chunks written (or read through redis-py) per round trip
CALL_THREADS = 32  # threads the calls that wait on the store run on


def chunks_of(nbytes: int) -> int:
    """The chunks that nbytes of a version take."""
    return -(-nbytes // CHUNK_BYTES)


class Link:
    def __init__(self, client: Any, prefix: str, ttl: float | None) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000) if ttl else 0
        self.timeout: float | None = client.get_connection_kwargs().get("socket_timeout")
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="tierd-remote-call")

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)  # a call on a store that hangs ends on its own
        self.client.close()

    def key(self, key: SessionKey, *parts: str) -> str:
        """The name of one of a session's keys (its hash tag names no one)."""
        return ":".join((self.prefix, "{" + tag_of(key) + "}", *parts))

    def index(self, tenant: str, what: str = "s") -> str:
        """The name of one of a tenant's keys of bookkeeping."""
        return f"{self.prefix}:{{t{hashlib.sha256(tenant.encode()).hexdigest()[:24]}}}:{what}"

    def call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a call on the store that moves no session's bytes,
        on a thread of the store's: whatever redis-py does on a node that does
        not answer, the caller waits `timeout` seconds at most (Unavailable)."""
        try:
            running = self._calls.submit(self.run, what, fn, *args, **kw)
        except RuntimeError:  # closed
            raise Unavailable(f"the remote store is closed ({what})") from None
        try:
            return running.result(self.timeout)
        except Late:
            running.cancel()
            raise Unavailable(f"the remote store did not answer ({what}) in {self.timeout:g} s") from None

    def run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a call on the store, here: redis-py's errors as tierd's."""
        import redis
        from redis.exceptions import RedisClusterException

        try:
            return fn(*args, **kw)
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException, OSError) as exc:
            raise Unavailable(f"the remote store did not answer ({what}): {exc}") from None
        except redis.ResponseError as exc:
            # One key holds something else (on its own, or as a pipeline's command): that session's copy is unusable.
            if re.match(r"(Command # \d+ .* caused error: )?WRONGTYPE", str(exc), re.DOTALL):
                raise DataLoss(f"the remote store holds something else than tierd wrote ({what}): {exc}",
                               tier="remote") from None
            raise Refused(f"the remote store refused {what}: {exc}") from None
        except redis.RedisError as exc:
            raise Unavailable(f"the remote store refused {what}: {exc}") from None
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            # redis-py's cluster client trips over its own state while nodes are down (a connection
            # that is None, say): the store did not answer, whatever the exception says.
            raise Unavailable(f"the remote store did not answer ({what}): {type(exc).__name__}: {exc}") from None


def connect(url: str, password: str | None = None, tls_ca: str | None = None, timeout: float = 0.5) -> Any:
    """A redis-py client for `redis[s]://[user@]host:port[,host:port...]`:
    a cluster client where the first reachable node is in cluster mode, else
    a plain one. Fails fast (timeout seconds a call); a wrong password is
    Unauthenticated, an unreachable store Unavailable, both saying which."""
    import redis
    import redis.connection
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException
    from redis.retry import Retry

    # With hiredis, replies are parsed in C (a fetch runs about 1.4 times as fast), but its command packer copies
    # every value into one buffer first (a publish runs at half speed): commands are packed in Python, values sent
    # as they lie. The flag is read each time a connection is made; the parser was chosen at import.
    redis.connection.HIREDIS_AVAILABLE = False
    scheme, user, nodes = parse_remote_url(url)
    opts: dict[str, Any] = {"password": password, "username": user or None,
                            "socket_timeout": timeout, "socket_connect_timeout": timeout}
    if scheme == "rediss":
        opts.update(ssl=True, ssl_ca_certs=tls_ca)
    last: Exception | None = None
    for host, port in nodes:
        probe = redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0), **opts)
        try:
            clustered = probe.info("cluster").get("cluster_enabled") == 1
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            if not isinstance(exc, redis.AuthenticationError) and "NOAUTH" not in str(exc) and \
                    "WRONGPASS" not in str(exc):
                raise Unavailable(f"the remote store at {host}:{port}: {exc}") from None
            if password is None:
                raise Unauthenticated(f"the remote store at {host}:{port} needs a password "
                                      "(--remote-password-file or TIERD_REMOTE_PASSWORD)") from None
            raise Unauthenticated(f"the remote store at {host}:{port} refused the password") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            last = exc
            continue
        finally:
            probe.close()
        # One retry, at once: a node that failed over answers the next try; a store that is down
        # fails the call within about two timeouts (redis-py's default backs off for seconds).
        if not clustered:
            return redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 1), **opts)
        try:  # reads the cluster's slots from its nodes: one that hangs fails the start, saying so
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], retry=Retry(NoBackoff(), 1),
                                **opts)
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            raise Unavailable(f"the remote store's cluster did not answer ({type(exc).__name__}: {exc})") from None
    raise Unavailable(f"no node of the remote store answered ({last})")


def rechunk(data: Iterable[tuple[bytes | memoryview, bool]], buffers: list[bytearray]) -> Iterator[memoryview]:
    """The bytes of data in chunks of CHUNK_BYTES (the last may be shorter):
    views of a piece that stays valid where a chunk lies in it, else copies
    into buffers in turn (a buffer is filled again len(buffers) copies later)."""
    turn, filled = 0, 0
    for piece, held in data:
        piece = memoryview(piece).cast("B")
        while len(piece):
            if held and not filled and len(piece) >= CHUNK_BYTES:
                yield piece[:CHUNK_BYTES]
                piece = piece[CHUNK_BYTES:]
                continue
            out = buffers[turn % len(buffers)]
            take = min(len(piece), CHUNK_BYTES - filled)
            out[filled : filled + take] = piece[:take]
            filled, piece = filled + take, piece[take:]
            if filled == CHUNK_BYTES:
                yield memoryview(out)
                turn, filled = turn + 1, 0
    if filled:
        yield memoryview(buffers[turn % len(buffers)])[:filled]
