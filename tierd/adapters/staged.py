"""Restore leases as an adapter holds them: begun ahead of the read that
needs them, on a thread of their own (an adapter's prefetch has the daemon
bring a session's bytes into shared memory from whichever tier holds them
while the engine still works on something else, so the restore that
follows is a copy out of memory already mapped), or at the read; ended
off the read's path. A lease's bytes are the session's until it ends or
expires; a read done before its deadline (its ttl, less a margin, from
before it was asked for) read them so, and the lease is then ended on a
thread of its own, the read not waiting for the call. One lease is staged
at a time; one another session's read does not take is ended. And
save_opaque: a snapshot of opaque bytes written into a save lease. Runs in
the engine's process: begin(), take() and save_opaque on the caller's
thread, the staging and ending on their own."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass, field

from tierd.client import Client, KVSpec, TierdError
from tierd.types import Lease

log = logging.getLogger("tierd.adapters")

T = TypeVar("T")

LEASE_TTL = 120.0  # seconds a lease waits for its read before the daemon ends it
MARGIN = 10.0  # seconds of it a read must finish within to count


@dataclass
class Held:
    """A restore lease and the monotonic time before which its bytes surely are the session's."""

    lease: Lease
    deadline: float


@dataclass
class _Stage:
    session_id: str
    done: threading.Event = field(default_factory=threading.Event)
    held: Held | None = None
    error: BaseException | None = None


class StagedRestore:
    """begin(session_id) stages a restore lease (and has prepare(lease) run
    on it there: mapping its memory, say); take(session_id) hands it over
    once staged (re-raising what begin_restore raised: NotFound,
    IdentityMismatch, ...), or None where another session's was staged, or
    none; hold(session_id) takes one at once; end(held) ends one."""

    def __init__(self, client: Client, spec: KVSpec, prepare: Callable[[Lease], object] = lambda lease: None,
                 ttl: float = LEASE_TTL) -> None:
        self.client, self.spec, self.prepare, self.ttl = client, spec, prepare, ttl
        self._stage: _Stage | None = None

    def hold(self, session_id: str) -> Held:
        """A restore lease of the session, now."""
        deadline = time.monotonic() + self.ttl - MARGIN
        return Held(self.client.begin_restore(session_id, self.spec, ttl=self.ttl), deadline)

    def begin(self, session_id: str) -> None:
        self.drop()
        stage = self._stage = _Stage(session_id)

        def work() -> None:
            try:
                held = self.hold(session_id)
                try:
                    self.prepare(held.lease)
                except BaseException:
                    self._end_lease(held.lease)  # never taken: ended here
                    raise
                stage.held = held
            except BaseException as exc:  # handed to take()
                stage.error = exc
            finally:
                stage.done.set()

        threading.Thread(target=work, name="tierd-stage", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the stage begun last is done (True where there is none)."""
        return self._stage is None or self._stage.done.wait(timeout)

    def take(self, session_id: str) -> Held | None:
        stage, self._stage = self._stage, None
        if stage is None:
            return None
        stage.done.wait()
        if stage.session_id != session_id:
            self._end(stage)
            return None
        if stage.error is not None:
            raise stage.error
        return stage.held

    def end(self, held: Held) -> bool:
        """End the lease after its read, off the caller's path; whether the
        read finished before its deadline (else what it read may have been
        another's: the daemon may have ended the lease and lent its memory)."""
        in_time = time.monotonic() < held.deadline
        threading.Thread(target=self._end_lease, args=(held.lease,), name="tierd-end", daemon=True).start()
        return in_time

    def drop(self) -> None:
        """End the staged lease, if any."""
        stage, self._stage = self._stage, None
        if stage is not None:
            stage.done.wait()
            self._end(stage)

    def _end(self, stage: _Stage) -> None:
        if stage.held is not None:
            self._end_lease(stage.held.lease)

    def _end_lease(self, lease: Lease) -> None:
        try:
            self.client.end_restore(lease)
        except TierdError as exc:  # expired meanwhile, or tierd gone: the daemon ends it by itself
            log.debug("restore lease %s not ended: %s", lease.lease_id, exc)


def save_opaque(client: Client, session_id: str, spec: KVSpec, num_tokens: int, size: int,
                write: Callable[[Lease], T]) -> T:
    """Store size bytes as the session: write(lease) fills the save lease's
    memory (one segment, its pages back to back), and it is committed and
    the session released; a write that raises aborts the lease. Returns
    what write returned."""
    lease = client.begin_save(session_id, spec, num_tokens, size=size)
    try:
        out = write(lease)
    except BaseException:
        try:
            client.abort_save(lease)
        except TierdError:
            pass  # (the lease ends with its ttl)
        raise
    client.commit_save(lease)
    client.release(session_id)
    return out
