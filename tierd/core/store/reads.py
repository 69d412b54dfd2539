"""The read path: Restore (pages scattered into engine blocks, under the
session's lock), Get (a byte stream read with no lock held; the pages it
reads stay allocated until its reader closes) and Lookup (how much of a
prompt the pages hold). Every page that leaves is checked against its
save-time checksum, from any tier; a mismatch damages the session."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from tierd.core import tokens
from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.model import Session, Snapshot
from tierd.core.pages import pages_within
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.store.checks import check_blocks, check_identity, check_readable
from tierd.core.store.describe import Describe
from tierd.core.store.sharing import Sharing
from tierd.core.store.snapshot_reader import SnapshotReader
from tierd.core.store.table import SessionTable
from tierd.core.store.writes import Writer
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, shown
from tierd.layout import KVSpec
from tierd.tiers import tier_rank
from tierd.transfer.copier import CopyEngine, EngineMemory
from tierd.transfer.runs import Geometry, Span
from tierd.types import LookupResult, RestoreResult, SessionInfo, SessionKey


class Reader:
    def __init__(self, table: SessionTable, sharing: Sharing, writer: Writer, placement: Placement,
                 describe: Describe, copier: CopyEngine, roles: TierRoles, clock: Clock, events: StoreEvents) -> None:
        self.table = table
        self.sharing = sharing
        self.writer = writer
        self.placement = placement
        self.describe = describe
        self.copier = copier
        self.roles = roles
        self.clock = clock
        self.events = events

    def read_out(self, session: Session, copy: Callable[[], None]) -> None:
        """Run a copy of the session's pages out of the daemon (every page
        checked against its checksum): a mismatch damages the session, a
        failed disk read is UNAVAILABLE."""
        try:
            copy()
        except DataLoss as exc:
            self.placement.faults.damaged(session, exc)
            raise DataLoss(f"session {shown(session.key.session_id)}: {exc}", session_id=session.key.session_id,
                           **exc.details) from None
        except OSError as exc:
            raise self.placement.faults.io_failed("read", exc, session.key) from None

    def restore(self, key: SessionKey, engine: EngineMemory, spec: KVSpec, block_ids: Iterable[int],
                token_ids: Iterable[int] | None = None, salt: str = "", whole: bool = False) -> RestoreResult:
        """Scatter the snapshot's first len(block_ids) pages into those blocks
        (with whole, every page of it into the first of them: whatever size
        it has when the call comes, never a part).
        Waits for a move of the session in flight rather than starting another.
        With token_ids (the request's prompt, under its cache salt), pages that
        hold other tokens are refused (never replaced), and a session that
        does not exist (or whose pages are a prefix of the request's, fewer
        than other sessions of the tenant hold) starts from theirs, as
        begin_restore does."""
        ids = check_blocks(block_ids, engine.layout.num_blocks)
        request = tokens.check_ids(token_ids) if token_ids is not None else None
        salt = tokens.check_salt(salt)
        lock, session = self.table.acquire(key)
        try:
            if request is not None:
                session = self.start_shared(key, lock, session, spec, request, salt, int(ids.size)) or session
            check_readable(key, session, "restored")
            assert session is not None
            check_identity(session, spec)
            snap = session.snap
            if whole:
                ids = whole_of(key, snap, ids)
            if not 0 < ids.size <= snap.n_pages:
                raise InvalidArgument(f"the snapshot has {snap.n_pages} pages; give 1 to {snap.n_pages} block ids, "
                                      f"not {ids.size}", field="block_ids", have=snap.n_pages, got=int(ids.size))
            if request is not None and tokens.matched_pages(snap.token_hashes[: ids.size], snap.num_tokens,
                                                            snap.spec.block_tokens, request, salt) < ids.size:
                raise FailedPrecondition(f"the first {ids.size} pages of session {shown(key.session_id)} hold other "
                                         "tokens than the request's: look it up again", field="token_ids")
            spans = snap.best_spans()
            source = max((s.tier for s in spans if s.first_page < ids.size), key=tier_rank)
            t0 = time.perf_counter()
            self.read_out(session, lambda: self.copier.scatter(spans, engine, ids, snap.geometry, snap.checksums))
            return self.restored(session, snap.spec, snap.num_tokens, snap.nbytes, int(ids.size), source,
                                 time.perf_counter() - t0)
        finally:
            lock.release()

    def restored(self, session: Session, spec: KVSpec, num_tokens: int, nbytes: int, n_pages: int, source: str,
                 seconds: float) -> RestoreResult:
        """Account for the first n_pages of a snapshot (of spec, num_tokens
        and nbytes) scattered into an engine's blocks from source."""
        with self.table.lock:
            session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
            error = session.snap.served_error(n_pages)
        self.events.restored(source, n_pages * spec.page_bytes, seconds)
        return RestoreResult(min(num_tokens, n_pages * spec.block_tokens), n_pages, source, seconds,
                             min(nbytes, n_pages * spec.page_bytes), error)

    def get(self, key: SessionKey, chunk_bytes: int = 1 << 20) -> tuple[SessionInfo, SnapshotReader]:
        """The snapshot's info and a reader of its bytes, checked against their
        checksums whatever the tier. No lock is held while it reads: pages it
        reads that the session gives up meanwhile (a move, a drop, a new save)
        are freed only once the reader is closed, so the stream stays the
        snapshot as it was when the call came."""
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= 64 << 20:
            raise InvalidArgument(f"chunk size must be 1 byte to 64 MiB, got {shown(chunk_bytes)}", field="chunk_bytes")
        session = self.table.get(key)
        with self.table.lock:
            check_readable(key, session, "read")
            snap = session.snap
            info = self.describe.info(session)
            spans, geom, sums = snap.best_spans(), snap.geometry, snap.checksums
            session.readers += 1
        return info, SnapshotReader(self._stream(session, spans, geom, sums, chunk_bytes),
                                    lambda: self.placement.end_read(session))

    def _stream(self, session: Session, spans: list[Span], geom: Geometry, sums: np.ndarray,
                chunk_bytes: int) -> Iterator[tuple[bytes | memoryview, int]]:
        t0 = time.perf_counter()
        try:
            yield from self.copier.read_stream(spans, geom, sums, chunk_bytes)
        except DataLoss as exc:
            self.placement.faults.damaged(session, exc)
            raise DataLoss(f"session {shown(session.key.session_id)}: {exc}", **exc.details) from None
        except OSError as exc:
            raise self.placement.faults.io_failed("read", exc, session.key) from None
        with self.table.lock:
            session.last_access, session.released_at, session.awaited = self.clock.now(), None, False
        self.events.restored(max((s.tier for s in spans), key=tier_rank) if spans else self.roles.landing, geom.nbytes,
                             time.perf_counter() - t0)

    def lookup(self, key: SessionKey, token_ids: Iterable[int], spec: KVSpec | None = None,
               salt: str = "", max_error: float | None = None) -> LookupResult:
        """How many leading tokens of a request (its token ids, under its
        cache salt) the snapshot supplies: whole pages whose chained token
        hashes match. With spec, a snapshot of another identity is refused,
        and where the session does not exist, or its pages are a prefix of
        the request's and fewer than other sessions of the tenant hold, their
        pages answer: a restore with the same token ids starts the session
        from them. With max_error, only the leading pages within that
        relative error count (pages other sessions lend are exact)."""
        request = tokens.check_ids(token_ids)
        salt = tokens.check_salt(salt)
        session = self.table.find(key)
        pages, stored, source, extends = 0, 0, None, True
        if session is not None:
            with self.table.lock:
                snap = session.snap
                if spec is not None:
                    check_identity(session, spec)
                hashes, stored, damaged, n_pages = snap.token_hashes, snap.num_tokens, session.damaged, snap.n_pages
                bt = snap.spec.block_tokens
                errors = snap.served_errors() if max_error is not None else snap.errors
            pages = 0 if snap.spec.is_opaque else tokens.matched_pages(hashes, stored, bt, request, salt)
            pages = min(pages, pages_within(errors, n_pages, max_error))
            extends = pages == n_pages  # (pages of other tokens are never replaced by a restore)
            pages = 0 if damaged else pages
            with self.table.lock:
                source = snap.source_of(pages)
        if spec is not None and not spec.is_opaque and extends:
            with self.table.lock:
                donor, hashes = self.sharing.match(key.tenant, spec, request, salt, key)
                upto = len(hashes)
                shared = donor is not None and upto > pages
                if shared:
                    pages, stored = upto, min(upto * spec.block_tokens, len(request))
                    source = donor.snap.source_of(pages)
            if shared:
                self.events.shared("lookup", 0, 0)
        if session is None and not pages:
            raise NotFound(f"session {shown(key.session_id)} not found", session_id=key.session_id)
        bt = spec.block_tokens if spec is not None else session.snap.spec.block_tokens  # type: ignore[union-attr]
        return LookupResult(min(pages * bt, stored), pages, stored, source)

    def start_shared(self, key: SessionKey, lock: threading.Lock, session: Session | None, spec: KVSpec,
                      request: np.ndarray, salt: str, need: int) -> Session | None:
        """With the key's lock held: where the session does not hold the
        first `need` pages of the request (0: as many as it can), but other
        sessions of the tenant do, the session starts again from theirs:
        created if new, extended if its pages are a prefix of the request's.
        A read never replaces pages that hold other tokens: a session holding
        them is FAILED_PRECONDITION where more pages are asked for than it
        holds of the request, else read as it is. Returns it, or None."""
        bt = spec.block_tokens
        if session is not None and session.snap.spec.fingerprint != spec.fingerprint:
            return None  # a snapshot of another identity is refused, not replaced (check_identity says so)
        own = 0
        if session is not None:
            snap = session.snap
            own = tokens.matched_pages(snap.token_hashes, snap.num_tokens, snap.spec.block_tokens, request, salt)
            if own < snap.n_pages:
                if own < need:
                    raise FailedPrecondition(
                        f"session {shown(key.session_id)} holds other tokens than the request's from page {own} on "
                        f"(it holds {own} of its pages), and a read never replaces them: look it up again",
                        field="token_ids", have=own)
                return None
            if session.damaged:
                own = 0  # (its pages hold the request's tokens: good copies of them may replace them)
        with self.table.lock:
            donor, hashes = self.sharing.match(key.tenant, spec, request, salt, key)
            upto = len(hashes)
            if donor is not None and session is None and upto < need:
                raise InvalidArgument(f"session {shown(key.session_id)} does not exist, and other sessions hold "
                                      f"{upto} pages of the request's tokens: ask for 1 to {upto}, not {need}",
                                      field="num_pages", have=upto)
            if donor is None or own >= (need or upto) or upto < need:
                return None
            lent, upto = self.sharing.lend(donor, 0, upto)
            sums = donor.snap.checksums[:upto].copy()
        if upto <= own or upto < need:  # (pages found damaged are not lent)
            self.writer.let_go(lent)
            return None
        try:
            self.writer.check_append(key, session, spec, 0)
            session = self.writer.install(key, lock, session, spec, 0, [], self.roles.landing, sums,
                                    min(upto * bt, len(request)), upto * spec.page_bytes, None, hashes[:upto], lent)
        except BaseException:
            self.writer.let_go(lent)
            raise
        self.events.shared("restore", upto, upto * spec.page_bytes)
        return session


    def own_tokens(self, key: SessionKey) -> int:
        """The tokens the session's own snapshot holds (NotFound without one)."""
        with self.table.lock:
            return self.table.get(key).snap.num_tokens

    def prompt_limit(self, key: SessionKey) -> int:
        """How many of a request's token ids can match anything the tenant
        holds (the caller decodes no more of a prompt): the most tokens one
        of its sessions holds."""
        session = self.table.find(key)
        own = session.snap.num_tokens if session is not None else 0
        return max(own, self.sharing.deepest(key.tenant))


def whole_of(key: SessionKey, snap: Snapshot, ids: np.ndarray) -> np.ndarray:
    """The block ids a whole snapshot goes into: the first of ids, as many as its pages."""
    if ids.size < snap.n_pages:
        raise InvalidArgument(f"session {shown(key.session_id)} holds {snap.nbytes} bytes in {snap.n_pages} pages; "
                              f"this buffer takes {ids.size * snap.spec.page_bytes} ({ids.size} blocks): give at "
                              f"least {snap.n_pages} block ids to restore it whole", field="block_ids",
                              have=snap.n_pages, got=int(ids.size))
    return ids[: snap.n_pages]
