"""The remote store: sessions in a Redis Cluster (or one Redis or Valkey
server) that every node reaches, so a session saved on one node resumes on
any. Runs on the thread that calls it (movers, RPC threads), except that
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

Manifests. A read of a manifest returns the whole of it up to HEAD_BYTES,
else its head, whose first line says how long the whole is: a value of
another length is DataLoss before more of it is read, and a large manifest
is read whole once per version (kept, by key and first line, up to
MANIFESTS_KEPT bytes), one at a time.

Reading. A fetch keeps several small batches of GETs in flight on one
connection, so the store builds the next replies while these are read, and
reads the replies off the connection straight into the memory the caller
names (the host tier's pages): redis-py's parser would copy each value into
a bytes object of its own, and the caller would copy it again. Anything else
than a value of the size asked for (a redirection while slots move, an
error) closes that connection, and the rest is read through redis-py, which
handles it.

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

missing() tells a node which of the versions it holds copies of the store
lost, from the head of each manifest's key and its chunks' existence (no
value is read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as Late
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierd.checksum import page_checksum
from tierd.config import parse_remote_url
from tierd.errors import DataLoss, FailedPrecondition, NotFound, Unauthenticated, Unavailable, shown
from tierd.types import SessionKey

log = logging.getLogger("tierd.tiers.remote")

CHUNK_BYTES = (1 << 20) - 4096  # below 1 MiB with Redis's own headers: the allocator's 1 MiB class
PIPELINE = 16  # chunks written (or read through redis-py) per round trip
FIRST_VERSIONS = 10**12  # a history's first version is one of [FIRST_VERSIONS, 2 * FIRST_VERSIONS)
MAX_VERSION = 10**14 - 1  # what the scripts' Lua numbers (doubles, printed to 14 digits) hold exactly
READ_BATCH, READ_DEPTH = 4, 4  # chunks a fetch asks for per round trip, and round trips in flight
HEAD_BYTES = 64 << 10  # a manifest read returns the whole of one this long at most, else this much of its head
MANIFESTS_KEPT = 64 << 20  # bytes of large manifests kept so that they are not read again
RECOUNT = 256  # a tenant's sessions a recount checks against what the store holds
LINE_BYTES = 4096  # of each manifest a recount reads: its first line, for any real one
CALL_THREADS = 32  # threads the calls that wait on the store run on

_VERSION = f"local HEAD = {HEAD_BYTES}\n" + """
local function head(key)  -- the first HEAD bytes at key; '' for none, or a key of another type: replaced as none
  if redis.call('TYPE', key)['ok'] ~= 'string' then return '' end
  return redis.call('GETRANGE', key, 0, HEAD - 1)
end
local function version(cur)  -- a manifest's or tombstone's number; 0 for one that does not parse: replaced as none
  local v = tonumber(string.match(cur, '^(%d+) ')) or 0
  if v > 99999999999999 then return 0 end
  return v
end
"""

# KEYS[1]: the manifest, KEYS[2..]: the new version's chunks. ARGV: the version expected (0: none), the new
# manifest, its TTL in ms (0: none). Returns {1, old manifest's head} if switched, {0, current version} if another
# writer got there first, {2, chunks there} if some chunk is not (lost in a fail-over, or evicted already).
_CAS = _VERSION + """
local cur = head(KEYS[1])
local have = version(cur)
if have ~= tonumber(ARGV[1]) then return {0, have} end
local there = 0
for i = 2, #KEYS, 1000 do there = there + redis.call('EXISTS', unpack(KEYS, i, math.min(i + 999, #KEYS))) end
if there ~= #KEYS - 1 then return {2, there} end
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else redis.call('SET', KEYS[1], ARGV[2]) end
return {1, cur}
"""

# KEYS[1]: the manifest. ARGV: a TTL in ms (0: none). A session dropped leaves a tombstone, "N dropped", one
# version past the one it ends: a node holding a copy of a version before it learns the session is gone,
# and the next history goes on numbering from it. Returns the head of the manifest replaced ('': none).
_DROP = _VERSION + """
local cur = head(KEYS[1])
if redis.call('EXISTS', KEYS[1]) == 0 or (string.match(cur, '^%d+ dropped$') and version(cur) > 0) then
  return cur  -- none, or dropped
end
local n = version(cur) + 1
if n > 99999999999999 then n = 1 end  -- past what a Lua number holds exactly
local tomb = n .. ' dropped'
if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[1], tomb, 'PX', ARGV[1]) else redis.call('SET', KEYS[1], tomb) end
return cur
"""
_TOMBSTONE = re.compile(rb"(\d+) dropped")
_HEAD = re.compile(rb'(\d+) \{"write": "(\w+)"')  # a manifest's number and write id (Manifest.encode writes them first)
LOOK_BATCH = 8192  # keys missing() asks about in one round trip (a version's keys go together)


# KEYS[1]: a manifest. ARGV[1]: a length (0: none). Returns its length and the whole of it where that is HEAD
# bytes at most or ARGV[1] exactly, else its first HEAD bytes; {0, nil} for none (another type: WRONGTYPE).
_READ = f"local HEAD = {HEAD_BYTES}\n" + """
local n = redis.call('STRLEN', KEYS[1])
if n <= HEAD or n == tonumber(ARGV[1]) then return {n, redis.call('GET', KEYS[1])} end
return {n, redis.call('GETRANGE', KEYS[1], 0, HEAD - 1)}
"""

# KEYS: the tenant's sorted set of ids, its map of bytes per session, their total. ARGV: a TTL in ms (0: none),
# a session id (''), how many ids to sample, then pairs of session id and bytes (-1: unlisted). A key of another
# type is deleted first (a list deleted is made again from the map's ids); the total is kept equal to the map's
# sum (summed again where it is no count: none, garbled, or the map deleted). Returns the total, the session's
# bytes, up to that many of the tenant's ids at random, and the names of the keys deleted.
_LIST = """
local kinds, lost, reset = {'zset', 'hash', 'string'}, {}, {}
for i, k in ipairs(KEYS) do
  local kind = redis.call('TYPE', k)['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    redis.call('DEL', k)
    lost[i] = true
    reset[#reset + 1] = k
  end
end
if lost[1] then
  for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do redis.call('ZADD', KEYS[1], 0, id) end
end
local function count(v)  -- a count of bytes, or false
  if v and #v < 16 and string.match(v, '^%d+$') then return tonumber(v) end
  return false
end
local stored = redis.call('GET', KEYS[3])
local was = not lost[2] and count(stored)
local total = was
if not total then
  total = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + (count(v) or 0) end
end
for i = 4, #ARGV, 2 do
  local id, new = ARGV[i], tonumber(ARGV[i + 1])
  total = total - (count(redis.call('HGET', KEYS[2], id)) or 0)
  if new < 0 then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  else
    redis.call('ZADD', KEYS[1], 0, id)
    redis.call('HSET', KEYS[2], id, new)
    total = total + new
  end
end
if total < 0 then total = 0 end
if total ~= was and (stored or total > 0) then redis.call('SET', KEYS[3], string.format('%.0f', total)) end
if tonumber(ARGV[1]) > 0 and (#ARGV > 3 or #reset > 0 or total ~= was) then
  for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ARGV[1]) end
end
local own = ARGV[2] ~= '' and count(redis.call('HGET', KEYS[2], ARGV[2])) or 0
local sample = {}
if tonumber(ARGV[3]) > 0 then sample = redis.call('ZRANDMEMBER', KEYS[1], ARGV[3]) end
return {total, own, sample, reset}
"""


class Refused(Unavailable):
    """The remote store answered, with an error (out of memory, say): the call
    failed, the store is not down."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the remote store holds of one session's current version."""

    version: int
    write: str  # the id its chunks are stored under
    fingerprint: str  # the identity the bytes were made with (KVSpec.fingerprint)
    spec: dict[str, Any]  # KVSpec.to_dict()
    num_tokens: int
    nbytes: int
    page_bytes: int
    checksums: np.ndarray  # uint64, one per page
    token_hashes: np.ndarray  # one row per page where token ids were given, else empty
    saved: float = 0.0  # when it was published (seconds since the epoch)
    owner: str = ""  # owner_of(the session): a manifest copied under another session's keys is refused

    @property
    def n_pages(self) -> int:
        return len(self.checksums)

    @property
    def chunks(self) -> int:
        return _chunks(self.nbytes)

    def size_of(self, page: int) -> int:
        """Logical bytes of a page (the last may be short)."""
        return min(self.page_bytes, self.nbytes - page * self.page_bytes)

    def encode(self) -> bytes:
        meta = {"write": self.write, "fingerprint": self.fingerprint, "spec": self.spec,
                "num_tokens": self.num_tokens, "nbytes": self.nbytes, "page_bytes": self.page_bytes,
                "pages": self.n_pages, "saved": self.saved, "hash_dtype": self.token_hashes.dtype.str,
                "hash_shape": list(self.token_hashes.shape), "owner": self.owner}
        sums = np.ascontiguousarray(self.checksums, dtype="<u8").tobytes()
        return f"{self.version} ".encode() + json.dumps(meta).encode() + b"\n" + sums + \
            np.ascontiguousarray(self.token_hashes).tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        """The manifest in raw, checked to agree with itself (DataLoss if not):
        whatever the store holds, what comes out of here is safe to describe
        (and to share: its arrays are read-only)."""
        head = _Head.parse(raw)
        if len(raw) != head.length:
            raise DataLoss(f"a remote manifest of {len(raw)} bytes where its head says {head.length}", tier="remote")
        try:
            meta, n, rest = head.meta, head.pages, raw[len(head.line) + 1 :]
            sums = np.frombuffer(rest[: 8 * n], dtype="<u8").copy()
            hashes = np.frombuffer(rest[8 * n :], dtype=np.dtype(meta["hash_dtype"])).reshape(head.hash_shape).copy()
            if head.hash_shape and head.hash_shape[0] not in (0, n):
                raise ValueError("its token hashes do not add up")
            sums.flags.writeable = hashes.flags.writeable = False
            m = cls(head.version, head.write, str(meta["fingerprint"]), dict(meta["spec"]),
                    _whole(meta["num_tokens"], 0, 1 << 40), head.nbytes, _whole(meta["page_bytes"], 1, 1 << 34), sums,
                    hashes, float(meta.get("saved", 0.0)), str(meta.get("owner", "")))
            if not (n - 1) * m.page_bytes < m.nbytes <= n * m.page_bytes:
                raise ValueError("its pages do not hold its bytes")
            return m
        except Exception as exc:  # noqa: BLE001 - whatever the store holds: ValueError, RecursionError, ...
            raise DataLoss(f"a remote manifest does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None


MAX_MANIFEST_BYTES = 256 << 20  # 24 bytes a page: ten million pages
MAX_PAGES = 10_000_000


@dataclass(frozen=True, slots=True)
class _Head:
    """What a manifest's first line says: enough to know how long the whole is,
    and which chunks hold its bytes, before reading more of it."""

    line: bytes
    version: int
    meta: dict[str, Any]
    write: str
    nbytes: int
    pages: int
    hash_shape: tuple[int, ...]
    length: int  # of the whole manifest

    @property
    def chunks(self) -> int:
        return _chunks(self.nbytes)

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        """The head of the manifest that raw is, or begins with (HEAD_BYTES of
        it); DataLoss where it does not parse."""
        try:
            line, found, _ = raw[:HEAD_BYTES].partition(b"\n")
            if not found:
                raise ValueError(f"no first line in its first {len(line)} bytes")
            version, _, text = line.partition(b" ")
            meta = json.loads(text)
            if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict):
                raise ValueError("not an object with a spec")
            n = _whole(meta["pages"], 1, MAX_PAGES)
            shape = tuple(_whole(d, 0, 1 << 20) for d in meta["hash_shape"])
            length = len(line) + 1 + 8 * n + np.dtype(meta["hash_dtype"]).itemsize * math.prod(shape)
            head = cls(line, _whole(version.decode(), 1, MAX_VERSION), meta, str(meta["write"]),
                       _whole(meta["nbytes"], 1, 1 << 50), n, shape, length)
            if not head.write.isalnum() or length > MAX_MANIFEST_BYTES:
                raise ValueError(f"write {head.write[:40]!r}, {length} bytes")
            return head
        except Exception as exc:  # noqa: BLE001 - whatever the store holds: ValueError, RecursionError, ...
            raise DataLoss(f"a remote manifest does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None


def _chunks(nbytes: int) -> int:
    """The chunks that nbytes of a version take."""
    return -(-nbytes // CHUNK_BYTES)


def _whole(value: Any, low: int, high: int) -> int:
    """An integer in [low, high] (a bool, a float or a string of digits is not one)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{str(value)[:40]!r} is not a whole number from {low} to {high}")
    return value


def _owned(key: SessionKey, m: Manifest) -> Manifest:
    if m.owner != owner_of(key):
        raise DataLoss("the remote tier's manifest for this session is another session's (keys copied in the store?)",
                       tier="remote")
    return m


def owner_of(key: SessionKey) -> str:
    """Who a manifest belongs to: tenant and session id, hashed."""
    return hashlib.sha256(f"owner\x00{key.tenant}\x00{key.session_id}".encode()).hexdigest()


def tag_of(key: SessionKey) -> str:
    """The hash tag of a session's keys: its tenant and id, hashed (neither is in any key)."""
    return hashlib.sha256(f"{key.tenant}\x00{key.session_id}".encode()).hexdigest()[:24]


def connect(url: str, password: str | None = None, tls_ca: str | None = None, timeout: float = 0.5) -> Any:
    """A redis-py client for `redis[s]://[user@]host:port[,host:port...]`:
    a cluster client where the first reachable node is in cluster mode, else
    a plain one. Fails fast (timeout seconds a call); a wrong password is
    Unauthenticated, an unreachable store Unavailable, both saying which."""
    import redis
    import redis.connection
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
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
        if clustered:
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], retry=Retry(NoBackoff(), 1),
                                **opts)
        return redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 1), **opts)
    raise Unavailable(f"no node of the remote store answered ({last})")


class RemoteStore:
    """Versions of sessions in the remote store (see the module docstring)."""

    chunk_bytes = CHUNK_BYTES
    publish_window = PIPELINE * CHUNK_BYTES

    def __init__(self, client: Any, prefix: str = "tierd", ttl: float | None = None) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000) if ttl else 0
        self.timeout: float | None = client.get_connection_kwargs().get("socket_timeout")
        self._cas = client.register_script(_CAS)
        self._list = client.register_script(_LIST)
        self._drop = client.register_script(_DROP)
        self._read = client.register_script(_READ)
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="tierd-remote-call")
        # Large manifests read whole (see _manifest_at), by key: (first line, length, manifest), oldest first.
        self._kept: OrderedDict[str, tuple[bytes, int, Manifest]] = OrderedDict()
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        self._large = threading.Lock()  # one large manifest read at a time
        self._spare: list[bytearray] = []  # chunk buffers between publishes
        self._spare_lock = threading.Lock()
        # Sends one batch of chunks while a publish reads the next (the socket releases the GIL), and
        # reads the chunks of a fetch while its caller checks and places those that have arrived.
        self._sender = ThreadPoolExecutor(4, thread_name_prefix="tierd-remote")
        self.fallbacks = 0  # fetches finished through redis-py (see _fetch)
        self.hosts = ""  # where the store is, for the log

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self._calls.shutdown(wait=False, cancel_futures=True)  # a call on a store that hangs ends on its own
        self.client.close()

    def describe(self) -> str:
        from redis.cluster import RedisCluster

        kind = "cluster" if isinstance(self.client, RedisCluster) else "server"
        return f"redis {kind} at {self.hosts}" if self.hosts else f"redis {kind}"

    def _key(self, key: SessionKey, *parts: str) -> str:
        return ":".join((self.prefix, "{" + tag_of(key) + "}", *parts))

    def _index(self, tenant: str, what: str = "s") -> str:
        return f"{self.prefix}:{{t{hashlib.sha256(tenant.encode()).hexdigest()[:24]}}}:{what}"

    def usage(self, tenant: str, session_id: str, recount: bool = False) -> tuple[int, int]:
        """Bytes of the tenant's sessions, and of this one, as their publishes
        recorded them; with recount, after some of its sessions were checked
        against what the store holds (see _recount)."""
        if recount:
            self._recount(tenant)
        total, own, _ = self._relist(tenant, [], own=session_id)
        return total, own

    def _recount(self, tenant: str) -> None:
        """Check up to RECOUNT of the tenant's sessions, at random, against what
        the store holds: one whose manifest or any chunk is gone (expired,
        evicted) is unlisted, and its bytes no longer count; one that is there
        counts the bytes its manifest says. Two round trips of one command a
        session. (A session published again meanwhile is listed again: its
        publish lists it after its switch, or the second look finds it.)"""
        ids = self._relist(tenant, [], sample=RECOUNT)[2]
        held = self._held(tenant, ids)
        gone = [i for i, n in held.items() if not n]
        if gone:
            log.info("remote tier: %d of tenant %s's sessions are gone from the store (expired or evicted); their "
                     "bytes no longer count", len(gone), shown(tenant))
            self.unlist(tenant, gone)
            held.update(self._held(tenant, gone))
        self._relist(tenant, [(i, n) for i, n in held.items() if n])

    def _held(self, tenant: str, ids: list[str]) -> dict[str, int]:
        """The bytes of each session that the store holds whole (0: none, a
        tombstone, a manifest that does not parse, or a chunk gone); one whose
        manifest's first line is longer than LINE_BYTES is left out."""
        keys = [SessionKey(tenant, i) for i in ids]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self._key(key, "m"), 0, LINE_BYTES - 1)
        held: dict[str, int] = {}
        heads: dict[SessionKey, _Head] = {}
        for key, raw in zip(keys, self._call("a recount", pipe.execute, raise_on_error=False)):
            if isinstance(raw, bytes) and len(raw) == LINE_BYTES and b"\n" not in raw:
                continue  # not known: left as it was listed
            held[key.session_id] = 0
            if isinstance(raw, bytes) and raw and not _dropped_at(raw):
                try:
                    heads[key] = _Head.parse(raw)
                except DataLoss:
                    pass
        if heads:
            pipe = self.client.pipeline(transaction=False)
            for key, head in heads.items():
                pipe.exists(*[self._key(key, f"w{head.write}", str(i)) for i in range(head.chunks)])
            there = self._call("a recount", pipe.execute, raise_on_error=False)
            for (key, head), count in zip(heads.items(), there):
                held[key.session_id] = head.nbytes if count == head.chunks else 0
        return held

    def _relist(self, tenant: str, entries: list[tuple[str, int]], own: str = "",
                sample: int = 0) -> tuple[int, int, list[str]]:
        """List or (bytes -1) unlist the tenant's sessions, keeping the total,
        each of the tenant's keys that holds something else reset first (one
        log line); the total, the bytes of session `own`, and up to `sample`
        of the tenant's ids at random."""
        args = [self.ttl_ms, own, sample] + [x for entry in entries for x in entry]
        total, mine, ids, reset = self._call("a list entry", self._list,
                                             keys=[self._index(tenant, w) for w in ("s", "b", "u")], args=args)
        if reset:
            what = {"s": "list of sessions", "b": "bytes per session", "u": "total of bytes"}
            log.warning("remote tier: tenant %s's %s held something else than tierd writes there; reset",
                        shown(tenant), ", ".join(what[k.decode()[-1]] for k in reset))
        return int(total), int(mine), [i.decode() for i in ids]

    def listed(self, tenant: str, after: str = "", count: int = 100) -> list[str]:
        """The tenant's session ids in the store's index, in order, after `after`."""
        def ids() -> list[bytes]:
            return self._call("a list", self.client.zrangebylex, self._index(tenant), f"({after}" if after else "-",
                              "+", start=0, num=count)

        try:
            raw = ids()
        except DataLoss:  # the list holds something else: reset (made again from the map of bytes)
            self._relist(tenant, [])
            raw = ids()
        return [r.decode() for r in raw]

    def manifests(self, keys: list[SessionKey]) -> list[Manifest | None]:
        """The current manifest of each session (None: none, or one that does not parse)."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("EVAL", _READ, 1, self._key(key, "m"), 0)
        out: list[Manifest | None] = []
        for key, reply in zip(keys, self._call("a manifest read", pipe.execute, raise_on_error=False)):
            try:
                if isinstance(reply, Exception):  # a key of another type, say
                    raise DataLoss(str(reply))
                m = self._manifest_at(self._key(key, "m"), *reply)[0]
                out.append(_owned(key, m) if m is not None else None)
            except DataLoss:
                out.append(None)
        return out

    def unlist(self, tenant: str, session_ids: list[str]) -> None:
        if session_ids:
            self._relist(tenant, [(i, -1) for i in session_ids])

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a call on the store that moves no session's bytes,
        on a thread of the store's: whatever redis-py does on a node that does
        not answer, the caller waits `timeout` seconds at most (Unavailable)."""
        try:
            running = self._calls.submit(self._run, what, fn, *args, **kw)
        except RuntimeError:  # closed
            raise Unavailable(f"the remote store is closed ({what})") from None
        try:
            return running.result(self.timeout)
        except Late:
            running.cancel()
            raise Unavailable(f"the remote store did not answer ({what}) in {self.timeout:g} s") from None

    def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a call on the store, here: redis-py's errors as tierd's."""
        import redis
        from redis.exceptions import RedisClusterException

        try:
            return fn(*args, **kw)
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException, OSError) as exc:
            raise Unavailable(f"the remote store did not answer ({what}): {exc}") from None
        except redis.ResponseError as exc:
            # One key holds something else (on its own, or as a pipeline's command): that session's copy is unusable.
            if re.match(r"(Command # \d+ .* caused error: )?WRONGTYPE", str(exc), re.S):
                raise DataLoss(f"the remote store holds something else than tierd wrote ({what}): {exc}",
                               tier="remote") from None
            raise Refused(f"the remote store refused {what}: {exc}") from None
        except redis.RedisError as exc:
            raise Unavailable(f"the remote store refused {what}: {exc}") from None
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            # redis-py's cluster client trips over its own state while nodes are down (a connection
            # that is None, say): the store did not answer, whatever the exception says.
            raise Unavailable(f"the remote store did not answer ({what}): {type(exc).__name__}: {exc}") from None

    def ping(self) -> None:
        """Unavailable unless the store answers: every primary, for a cluster (one
        that hangs while the others answer is not a store that is up)."""
        from redis.cluster import RedisCluster

        if isinstance(self.client, RedisCluster):
            # The cluster as it is now (a replica promoted meanwhile is a primary), then each primary.
            self._call("a topology read", self.client.nodes_manager.initialize)
            self._call("a ping", self.client.ping, target_nodes=RedisCluster.PRIMARIES)
        else:
            self._call("a ping", self.client.ping)

    def manifest(self, key: SessionKey) -> Manifest | None:
        """The session's current manifest, or None; DataLoss for one that does
        not parse or is another session's (keys copied in the store)."""
        return self.head(key)[0]

    def head(self, key: SessionKey) -> tuple[Manifest | None, int]:
        """The session's current manifest (None: none, or a tombstone: the
        session was dropped) and the version number at its key (0: none);
        DataLoss for a manifest that does not parse or is another session's."""
        name = self._key(key, "m")
        m, at = self._manifest_at(name, *self._call("a manifest read", self._read, keys=[name], args=[0]))
        return (_owned(key, m) if m is not None else None), at

    def _manifest_at(self, name: str, length: int, raw: bytes | None) -> tuple[Manifest | None, int]:
        """What a read of key `name` found (`length` bytes, of which raw is the
        whole or the head): its manifest (None: none, or a tombstone) and the
        version number there. A large one is read whole once per version,
        one at a time; DataLoss where its head says another length."""
        for _ in range(2):
            if raw is None:
                return None, 0
            if _dropped_at(raw):
                return None, _dropped_at(raw)
            if len(raw) == length:
                m = Manifest.decode(raw)
                return m, m.version
            head = _Head.parse(raw)
            if head.length != length:
                raise DataLoss(f"a remote manifest of {length} bytes where its head says {head.length}",
                               tier="remote")
            with self._large:
                with self._kept_lock:
                    kept = self._kept.get(name)
                    if kept is not None and kept[:2] == (head.line, length):
                        self._kept.move_to_end(name)
                        return kept[2], kept[2].version
                # Not as a _call: a large manifest may take longer than the timeout (each read is bounded by it).
                length, raw = self._run("a manifest read", self._read, keys=[name], args=[length])
                if raw is not None and len(raw) == length > HEAD_BYTES:
                    m = Manifest.decode(raw)
                    self._keep(name, raw.partition(b"\n")[0], length, m)
                    return m, m.version
        raise Refused("the remote tier's manifest of this session changed twice as it was read")

    def _keep(self, name: str, line: bytes, length: int, m: Manifest) -> None:
        with self._kept_lock:
            old = self._kept.pop(name, None)
            self._kept_bytes += length - (old[1] if old is not None else 0)
            self._kept[name] = (line, length, m)
            while self._kept_bytes > MANIFESTS_KEPT:
                self._kept_bytes -= self._kept.popitem(last=False)[1][1]

    def tombstones(self, keys: list[SessionKey]) -> list[int]:
        """For each session, the version of its tombstone (0: not dropped),
        from the head of its manifest's key alone."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self._key(key, "m"), 0, 31)
        heads = self._call("a tombstone read", pipe.execute, raise_on_error=False)
        return [_dropped_at(h) for h in heads]

    def missing(self, versions: list[tuple[SessionKey, int, str, int]]) -> list[bool]:
        """For each version of a session (its number, write id and chunks),
        whether the store lost it: its manifest's key holds nothing, or that
        version with a chunk gone (evicted, expired, lost in a fail-over).
        Another version or a tombstone there is no loss (another node's store,
        or a drop), nor is anything the store did not answer plainly."""
        out: list[bool] = []
        pipe, asked, keys = self.client.pipeline(transaction=False), [], 0
        for key, version, write, chunks in versions:
            pipe.getrange(self._key(key, "m"), 0, 63)
            names = [self._key(key, f"w{write}", str(i)) for i in range(chunks)]
            for i in range(0, len(names), 1000):  # one slot: a command for 1000 keys
                pipe.exists(*names[i : i + 1000])
            asked.append((version, write, -(-chunks // 1000), chunks))
            keys += chunks + 1
            if keys >= LOOK_BATCH:
                out += self._missing(pipe, asked)
                pipe, asked, keys = self.client.pipeline(transaction=False), [], 0
        return out + self._missing(pipe, asked)

    def _missing(self, pipe: Any, asked: list[tuple[int, str, int, int]]) -> list[bool]:
        if not asked:
            return []
        replies = iter(self._call("a manifest read", pipe.execute, raise_on_error=False))
        out = []
        for version, write, commands, chunks in asked:
            head = next(replies)
            there = [next(replies) for _ in range(commands)]
            out.append(head == b"" or ((_version(head), _write_of(head)) == (version, write)
                                       and all(isinstance(n, int) for n in there) and sum(there) < chunks))
        return out

    def version_of(self, key: SessionKey) -> int:
        """The version number the manifest switch sees in the manifest's key,
        whatever the rest holds (0: none, or none it can read)."""
        try:
            raw = self._call("a manifest read", self.client.getrange, self._key(key, "m"), 0, 31)
        except DataLoss:
            return 0  # a key of another type: the switch replaces it as none
        return _version(raw)

    def publish(self, key: SessionKey, expect: int, spec: dict[str, Any], fingerprint: str, num_tokens: int,
                page_bytes: int, checksums: np.ndarray, token_hashes: np.ndarray,
                data: Iterable[tuple[bytes | memoryview, bool]]) -> Manifest:
        """Store a new version of the session: `data` is its logical bytes, in
        pieces of any size, each with whether it stays valid until this
        returns (sent as it is, no copy) or only until the next piece is asked
        for (copied). `expect` is the version this one replaces (0: none); if
        another writer published first, FailedPrecondition and nothing is
        left behind."""
        write = secrets.token_hex(8)
        chunks = nbytes = 0
        batch: list[memoryview] = []
        sending: Future | None = None  # the batch before, sent by the sender thread meanwhile
        # Two batches of buffers: one being sent while the other fills (a buffer is filled
        # again only once the batch it went out in has been sent).
        buffers = self._take_buffers(2 * PIPELINE)
        try:
            for chunk in _rechunk(data, buffers):
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
            # A history's first version is numbered at random: one that ended unseen (its manifest evicted
            # or expired, its tombstone too) has numbers no later one repeats, so a node still holding one
            # of its versions never takes the new history for it. (Below 10**14, which the scripts' Lua
            # numbers hold and print exactly: one at the top starts again at random.)
            number = expect + 1 if 0 < expect < MAX_VERSION else FIRST_VERSIONS + secrets.randbelow(FIRST_VERSIONS)
            manifest = Manifest(number, write, fingerprint,
                                spec, num_tokens, nbytes, page_bytes, np.asarray(checksums, dtype=np.uint64),
                                np.asarray(token_hashes), time.time(), owner_of(key))
            # Not as a _call: the switch carries the manifest and checks every chunk (each read is bounded).
            reply = self._run("the manifest switch", self._cas,
                               keys=[self._key(key, "m")] + [self._key(key, f"w{write}", str(i)) for i in range(chunks)],
                               args=[expect, manifest.encode(), self.ttl_ms])
            if not isinstance(reply, list) or len(reply) != 2:
                raise Unavailable(f"the remote store answered the manifest switch with {str(reply)[:80]!r}")
            ok, old = reply
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
            self._relist(key.tenant, [(key.session_id, nbytes)])
        except Unavailable:
            pass
        if old:
            try:
                previous = _Head.parse(old)
            except DataLoss:
                return manifest  # unreadable: its chunks go by their TTL
            self._delete(key, previous.write, previous.chunks)  # the version replaced: reclaimed
        return manifest

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
        pipe = self.client.pipeline(transaction=False)
        for i, chunk in enumerate(chunks):
            pipe.set(self._key(key, f"w{write}", str(first + i)), chunk, px=self.ttl_ms or None)
        self._run("a page write", pipe.execute)

    def _get(self, key: SessionKey, write: str, first: int, count: int) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for i in range(first, first + count):
            pipe.get(self._key(key, f"w{write}", str(i)))
        return self._run("a page read", pipe.execute)

    def _delete(self, key: SessionKey, write: str, chunks: int) -> None:
        """Delete a write's chunks (one slot: one call per 256); where the store
        does not answer, they go by their TTL."""
        names = [self._key(key, f"w{write}", str(i)) for i in range(chunks)]
        for i in range(0, len(names), 256):
            try:
                self._call("a reclaim", self.client.delete, *names[i : i + 256])
            except Unavailable:
                return

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
        sinks = [claim(min(CHUNK_BYTES, manifest.nbytes - i * CHUNK_BYTES)) for i in range(manifest.chunks)]
        arrivals = _Arrivals()
        reading = self._sender.submit(self._fetch, key, manifest.write, sinks, arrivals)
        reading.add_done_callback(arrivals.finish)
        try:
            seen, finished = 0, False
            while not finished:
                count, finished = arrivals.past(seen)
                if count > seen:
                    seen = count
                    yield min(manifest.nbytes, count * CHUNK_BYTES)
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
        names = [self._key(key, f"w{write}", str(i)) for i in range(len(sinks))]
        placed = 0  # the leading chunks in place (one past a missing chunk is not told)

        def read(i: int, found: bool) -> None:
            nonlocal placed
            if found and i == placed:
                placed += 1
                arrivals.arrived(placed)

        try:
            found = _read_into(self._pool_of(names[0]), names, sinks, read, lambda: arrivals.stop)
            return len(found) == len(sinks) and all(found)
        except (redis.TimeoutError, TimeoutError) as exc:
            raise Unavailable(f"the remote store did not answer (a page read): {exc}") from None
        except (_Unexpected, redis.RedisError, OSError):
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

    def _pool_of(self, name: str) -> Any:
        """The connection pool of the node that serves key `name`."""
        from redis.cluster import RedisCluster

        if not isinstance(self.client, RedisCluster):
            return self.client.connection_pool
        node = self.client.get_node_from_key(name)
        if node is None:
            raise _Unexpected("no node serves the slot")
        return self.client.get_redis_connection(node).connection_pool

    def read(self, key: SessionKey, manifest: Manifest) -> Iterator[bytes]:
        """The session's pages in order, each checked against the manifest's
        checksum: DataLoss on a mismatch, NotFound if any chunk is gone."""
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

    def drop(self, key: SessionKey) -> bool:
        """Delete the session's current version, leaving a tombstone in its
        manifest's place; whether there was one."""
        old = self._call("a drop", self._drop, keys=[self._key(key, "m")], args=[self.ttl_ms])
        self.unlist(key.tenant, [key.session_id])
        if not old or _dropped_at(old):
            return False
        try:
            head = _Head.parse(old)
        except DataLoss:
            return True  # unreadable: its chunks go by their TTL
        if head.meta.get("owner", "") == owner_of(key):  # (another session's manifest names chunks of its own)
            self._delete(key, head.write, head.chunks)
        return True


def _rechunk(data: Iterable[tuple[bytes | memoryview, bool]], buffers: list[bytearray]) -> Iterator[memoryview]:
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


def _version(raw: Any) -> int:
    """The version number the scripts see at a manifest's key (0: none, or one they do not take as one)."""
    found = re.match(rb"(\d+) ", raw) if isinstance(raw, bytes) else None
    return int(found.group(1)) if found and int(found.group(1)) <= MAX_VERSION else 0


def _write_of(raw: Any) -> str:
    """The write id at the head of a manifest ('': none there, or a tombstone)."""
    found = _HEAD.match(raw) if isinstance(raw, bytes) else None
    return found[2].decode() if found else ""


def _dropped_at(raw: Any) -> int:
    """The version of the tombstone at a manifest's key (0: not one the scripts take as one)."""
    return _version(raw) if isinstance(raw, bytes) and _TOMBSTONE.fullmatch(raw) else 0


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


class _Unexpected(Exception):
    """The store answered something else than the replies asked for."""


def _read_into(pool: Any, names: list[str], sinks: list[list[Any]], read: Callable[[int, bool], None],
               stop: Callable[[], bool]) -> list[bool]:
    """GETs of names on a connection of pool, READ_BATCH a round trip with
    READ_DEPTH of them in flight (the store builds the next replies while
    these are read), each value read into its sink and read(i, found) told
    as each is; whether each was there, for those read before stop() said so.
    The connection is closed on anything unexpected and where stopped (its
    stream is then not at a reply's start)."""
    batches = [names[i : i + READ_BATCH] for i in range(0, len(names), READ_BATCH)]
    conn = pool.get_connection()
    found: list[bool] = []
    try:
        replies = _Replies(conn._sock)
        for batch in batches[:READ_DEPTH]:
            conn.send_packed_command(conn.pack_commands([("GET", n) for n in batch]))
        for k in range(len(batches)):
            if stop():
                conn.disconnect()
                return found
            if k + READ_DEPTH < len(batches):
                conn.send_packed_command(conn.pack_commands([("GET", n) for n in batches[k + READ_DEPTH]]))
            for _ in batches[k]:
                found.append(replies.value_into(sinks[len(found)]))
                read(len(found) - 1, found[-1])
        if replies.buf:
            raise _Unexpected("more than the replies asked for")
        return found
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class _Replies:
    """RESP replies read off a socket: lines through a small buffer, a bulk
    value's bytes, past what that buffer already holds, straight into the
    caller's memory."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        got = self.sock.recv(1 << 16)
        if not got:
            raise ConnectionError("the remote store closed the connection")
        self.buf += got

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > 1024:
                raise _Unexpected("a reply line without an end")
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def value_into(self, sink: list[Any]) -> bool:
        """Read one GET's reply into the buffers of sink, which together take
        exactly its value's size; False for a nil (no such key)."""
        line = self._line()
        if line == b"$-1":
            return False
        views = [memoryview(v).cast("B") for v in sink]
        if line[:1] != b"$" or line[1:] != str(sum(v.nbytes for v in views)).encode():
            raise _Unexpected(line[:120].decode(errors="replace"))
        for view in views:
            take = min(view.nbytes, len(self.buf))
            view[:take] = self.buf[:take]
            del self.buf[:take]
            while take < view.nbytes:
                got = self.sock.recv_into(view[take:])
                if not got:
                    raise ConnectionError("the remote store closed the connection")
                take += got
        while len(self.buf) < 2:
            self._fill()
        if self.buf[:2] != b"\r\n":
            raise _Unexpected("a value longer than it said")
        del self.buf[:2]
        return True


__all__ = ["CHUNK_BYTES", "Manifest", "Refused", "RemoteStore", "connect", "owner_of", "tag_of"]


def open_backend(url: str, options: Any) -> RemoteStore:
    """The backend for redis[s]://[USER@]HOST:PORT[,HOST:PORT...] (registry.py)."""
    store = RemoteStore(connect(url, options.password, options.tls_ca, options.timeout), prefix=options.prefix,
                        ttl=options.ttl)
    store.hosts = url.partition("://")[2].rpartition("@")[2]
    return store
