"""Each tenant's bookkeeping in the Redis store: its sorted set of session
ids (List), the map of each session's bytes and their total (the remote
quota), kept by the LIST script; a key of another type is reset, and a list
gone (Redis evicts any key under allkeys-lru) made again from the map, each
with a log line, never taken for a session's damage. A recount checks
sessions of the list and of the map against what the store holds (Redis
expires and evicts sessions without telling anyone), then sums the total
again from the map: a total that is wrong, or counts sessions the map no
longer names, costs the tenant nothing past its first recount. Runs on the
thread that calls it.
"""

from __future__ import annotations

import logging

from tierd.errors import DataLoss, shown
from tierd.remote.backend import RECOUNT
from tierd.remote.manifest import Head, dropped_at
from tierd.remote.redis import scripts
from tierd.remote.redis.link import Link, chunks_of
from tierd.types import SessionKey

log = logging.getLogger("tierd.remote.redis")

LINE_BYTES = 4096  # of each manifest a recount reads: its first line, for any real one


class Tenants:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._list = link.client.register_script(scripts.LIST)

    def usage(self, tenant: str, session_id: str, recount: bool = False) -> tuple[int, int]:
        """Bytes of the tenant's sessions, and of this one, as their publishes
        recorded them; with recount, after some of its sessions were checked
        against what the store holds (see _recount)."""
        if recount:
            self._recount(tenant)
        total, own, _ = self.relist(tenant, [], own=session_id)
        return total, own

    def _recount(self, tenant: str) -> None:
        """Check up to RECOUNT of the tenant's listed sessions and as many of
        its map's, at random, against what the store holds: one whose manifest
        or any chunk is gone (expired, evicted) is unlisted, and its bytes no
        longer count; one that is there counts the bytes its manifest says.
        Then the total is summed again from the map (the script reads the
        tenant's map whole: one recount, on a publish the total refuses).
        Two round trips of one command a session. (A session published again
        meanwhile is listed again: its publish lists it after its switch, or
        the second look finds it.)"""
        ids = self.relist(tenant, [], sample=RECOUNT)[2]
        held = self._held(tenant, ids)
        gone = [i for i, n in held.items() if not n]
        if gone:
            log.info("remote tier: %d of tenant %s's sessions are gone from the store (expired or evicted); their "
                     "bytes no longer count", len(gone), shown(tenant))
            self.unlist(tenant, gone)
            held.update(self._held(tenant, gone))
        self.relist(tenant, [(i, n) for i, n in held.items() if n], resum=True)

    def _held(self, tenant: str, ids: list[str]) -> dict[str, int]:
        """The bytes of each session that the store holds whole (0: none, a
        tombstone, a manifest that does not parse, or a chunk gone); one whose
        manifest's first line is longer than LINE_BYTES is left out."""
        keys = [SessionKey(tenant, i) for i in ids]
        pipe = self.link.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self.link.key(key, "m"), 0, LINE_BYTES - 1)
        held: dict[str, int] = {}
        heads: dict[SessionKey, Head] = {}
        for key, raw in zip(keys, self.link.call("a recount", pipe.execute, raise_on_error=False)):
            if isinstance(raw, bytes) and len(raw) == LINE_BYTES and b"\n" not in raw:
                continue  # not known: left as it was listed
            held[key.session_id] = 0
            if isinstance(raw, bytes) and raw and not dropped_at(raw):
                try:
                    heads[key] = Head.parse(raw)
                except DataLoss:
                    pass
        if heads:
            pipe = self.link.client.pipeline(transaction=False)
            for key, head in heads.items():
                pipe.exists(*[self.link.key(key, f"w{head.write}", str(i)) for i in range(chunks_of(head.stored))])
            there = self.link.call("a recount", pipe.execute, raise_on_error=False)
            for (key, head), count in zip(heads.items(), there):
                held[key.session_id] = head.stored if count == chunks_of(head.stored) else 0
        return held

    def relist(self, tenant: str, entries: list[tuple[str, int]], own: str = "",
                sample: int = 0, resum: bool = False) -> tuple[int, int, list[str]]:
        """List or (bytes -1) unlist the tenant's sessions, keeping the total
        (with resum, summed again from the map of bytes), each of the tenant's
        keys that holds something else reset first and a list gone made again
        (one log line each); the total, the bytes of session `own`, and up to
        `sample` of the tenant's listed ids at random, and as many of its map's."""
        args = [self.link.ttl_ms, own, sample, int(resum)] + [x for entry in entries for x in entry]
        total, mine, ids, reset, remade = self.link.call(
            "a list entry", self._list, keys=[self.link.index(tenant, w) for w in ("s", "b", "u")], args=args)
        what = {"s": "list of sessions", "b": "bytes per session", "u": "total of bytes"}
        if reset:
            log.warning("remote tier: tenant %s's %s held something else than tierd writes there; reset",
                        shown(tenant), ", ".join(what[k.decode()[-1]] for k in reset))
        if remade:
            log.warning("remote tier: tenant %s's %s did not agree with its bytes per session (evicted, or changed "
                        "in the store); made again from them", shown(tenant),
                        ", ".join(what[k.decode()[-1]] for k in remade))
        return int(total), int(mine), [i.decode() for i in ids]

    def listed(self, tenant: str, after: str = "", count: int = 100) -> list[str]:
        """The tenant's session ids in the store's index, in order, after `after`."""
        def ids() -> list[bytes]:
            return self.link.call("a list", self.link.client.zrangebylex, self.link.index(tenant),
                                  f"({after}" if after else "-", "+", start=0, num=count)

        try:
            raw = ids()
        except DataLoss:  # the list holds something else: reset (made again from the map of bytes)
            self.relist(tenant, [])
            raw = ids()
        return [r.decode() for r in raw]

    def unlist(self, tenant: str, session_ids: list[str]) -> None:
        if session_ids:
            self.relist(tenant, [(i, -1) for i in session_ids])
