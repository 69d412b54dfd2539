"""The calls that answer from the remote tier: Stat, Lookup and List of
sessions only it holds (the finder has read their manifests, once per
call), Drop (the remote copy first, then this node's), publish() on the
caller's thread, and what the publisher hears of each commit. On the RPC
thread of the call."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


from tierd.core import tokens
from tierd.core.model import Session, Snapshot
from tierd.core.pages import pages_within
from tierd.core.roles import TierRoles
from tierd.core.store.checks import check_identity
from tierd.core.store.fetcher import Fetcher
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.link import RemoteLink
from tierd.core.store.publisher import Publisher
from tierd.core.store.remote import PublishQueue, Remote, RemoteBusy
from tierd.core.store.remote_info import info_of
from tierd.core.store.table import SessionTable
from tierd.errors import DataLoss, NotFound, Unavailable, shown
from tierd.layout import KVSpec
from tierd.remote.backend import Unreplicated
from tierd.remote.manifest import Manifest
from tierd.types import LookupResult, SessionInfo, SessionKey


class RemoteCalls:
    def __init__(self, table: SessionTable, lifecycle: Lifecycle, fetcher: Fetcher, publisher: Publisher,
                 queue: PublishQueue, busy: RemoteBusy, link: RemoteLink, remote: Remote, roles: TierRoles) -> None:
        self.table = table
        self.lifecycle = lifecycle
        self.fetcher = fetcher
        self.publisher = publisher
        self.queue = queue
        self.busy = busy
        self.link = link
        self.remote = remote
        self.roles = roles

    def stat(self, key: SessionKey, m: Manifest) -> SessionInfo:
        """A session whose current version only the remote tier holds (manifest m)."""
        return info_of(key, m, self.roles.versions)

    def lookup(self, key: SessionKey, m: Manifest, token_ids: Iterable[int], spec: KVSpec | None = None,
               salt: str = "", max_error: float | None = None) -> LookupResult:
        """Lookup, answered from manifest m: the session's current version, which only the remote tier holds."""
        info = info_of(key, m, self.roles.versions)
        if spec is not None:
            check_identity(Session(key, Snapshot(info.spec), 0.0, 0.0), spec)
        bt = info.spec.block_tokens
        hashes = m.token_hashes if len(m.token_hashes) else tokens.empty(m.n_pages)
        request = tokens.check_ids(token_ids)
        pages = 0 if info.spec.is_opaque else tokens.matched_pages(hashes, m.num_tokens, bt, request,
                                                                   tokens.check_salt(salt))
        pages = min(pages, pages_within(m.errors, m.n_pages, max_error))
        return LookupResult(min(pages * bt, m.num_tokens), pages, m.num_tokens, self.roles.versions if pages else None)

    def list(self, page: list[SessionInfo], token: str, tenant: str | None, after: str,
             limit: int) -> tuple[list[SessionInfo], str]:
        """A page of this node's sessions (and its token) and, for one tenant,
        the sessions only the remote tier holds, merged in order of id
        (every tenant's: this node's only)."""
        if self.link.down.is_set():  # no node can fetch them meanwhile
            page = [dataclasses.replace(info, remote_durable=False) for info in page]
        if tenant is None:
            return page, token
        start = after.split("\x00", 1)[1] if after else ""
        try:
            listed = self.link.call("list", self.remote.store.listed, tenant, start, limit + 1)
            ids = [i for i in listed if not self.table.has(SessionKey(tenant, i))]
            found = self.link.call("list", self.remote.store.heads, [SessionKey(tenant, i) for i in ids])
        except Unavailable:
            return page, token
        gone = [i for i, m in zip(ids, found) if m is None]
        if gone:
            try:
                self.link.call("list", self.remote.store.unlist, tenant, gone)  # expired or evicted
            except Unavailable:
                pass
        infos = []
        for i, m in zip(ids, found):
            try:
                infos.append(None if m is None else
                             info_of(SessionKey(tenant, i), Manifest.listed(m), self.roles.versions))
            except DataLoss:
                pass  # a copy that does not agree with itself: not listed (Stat on it says why)
        merged = sorted(page + [info for info in infos if info is not None], key=lambda info: info.session_id)
        # Each source is complete up to the last id it returned, where it had more.
        ends = ([page[-1].session_id] if token and page else []) + ([listed[-1]] if len(listed) > limit else [])
        if ends:
            merged = [info for info in merged if info.session_id <= min(ends)]
        if len(merged) > limit:
            return merged[:limit], f"{tenant}\x00{merged[limit - 1].session_id}"
        if ends:
            return merged, f"{tenant}\x00{merged[-1].session_id if merged else min(ends)}"
        return merged, ""

    def drop(self, key: SessionKey) -> None:
        """Forget the session in the remote tier (unless it is read-only), then
        here. A drop the remote tier does not take fails (Unavailable) and
        changes nothing: the engine tries again (one taken there that no replica
        acknowledged in time is dropped here too, and is Unavailable: the next
        drop finds it gone, once a replica has it). Taken here alone, it would be
        undone once the tier answers (this node and the others would find the
        remote copy again). A fetch or publish of the session on this node
        ends before the drop starts, and none starts until it is done: no copy
        of the dropped version is taken in or published after its tombstone."""
        there, why = False, None
        if self.remote.write == "off":
            held = self._drop_here(key)
        else:
            with self.busy.dropping(key):
                try:
                    there = self.link.call("drop", self.remote.store.drop, key)
                except DataLoss as exc:  # the store holds something else there: no copy any node serves
                    why = exc
                except Unreplicated as exc:  # taken, not yet safe from a fail-over: dropped here too, and said so
                    self._drop_here(key)
                    raise Unavailable(f"session {shown(key.session_id)} is dropped, but {exc}: drop it again to have "
                                      "it on a replica (then it is not found)", session_id=key.session_id) from None
                except Unavailable as exc:
                    raise Unavailable(f"session {shown(key.session_id)} is not dropped: {exc}; nothing was changed, "
                                      "try again", session_id=key.session_id) from None
                held = self._drop_here(key)
        if not held and not there:
            raise why or NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)

    def _drop_here(self, key: SessionKey) -> bool:
        """Forget this node's copy, if it holds one; whether it did."""
        held = True
        try:
            self.lifecycle.drop(key)
        except NotFound:
            held = False
        self.fetcher.dropped(key)  # a queued fetch was cancelled with the drop
        return held

    def publish(self, key: SessionKey) -> bool:
        """Publish the session to the remote tier now, on this thread, as the
        publisher would; whether the remote tier then holds its content."""
        session = self.table.get(key)
        self.publisher.publish_one(key)
        with self.table.lock:
            return session.remote_durable and not session.dropped
