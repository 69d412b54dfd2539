"""The mover's jobs, run on its threads: a prefetch, a demotion, a
write-back, a re-code in place (recode.py) or a drop of a session, each
under the session's lock (a prefetch waits for it; the others skip a busy
session, which policy asks about again next tick), and a fetch from the
remote tier (the fetcher's, fetcher.py), followed by a promotion where the
prefetch asked for a faster tier than the fetch lands in."""

from __future__ import annotations

import logging

from tierd.clock import Clock
from tierd.core.events import StoreEvents
from tierd.core.move_queue import Job
from tierd.core.placement import Placement
from tierd.core.store.fetcher import Fetcher
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.recode import Recoder
from tierd.core.store.table import SessionTable
from tierd.errors import TierdError
from tierd.policy.rules import DROP, RECODE
from tierd.tiers.ioqueue import IOClass

log = logging.getLogger("tierd.core.store")


class Jobs:
    def __init__(self, table: SessionTable, lifecycle: Lifecycle, placement: Placement, fetcher: Fetcher | None,
                 clock: Clock, events: StoreEvents, recoder: Recoder | None = None) -> None:
        self.recoder = recoder
        self.table = table
        self.lifecycle = lifecycle
        self.placement = placement
        self.fetcher = fetcher
        self.clock = clock
        self.events = events

    def run(self, job: Job) -> None:
        if job.reason == "fetch" and self.fetcher is not None:
            self.fetcher.run_job(job, self._run)
        else:
            self._run(job)

    def _run(self, job: Job) -> None:
        session = self.table.find(job.key)
        if session is None:
            if job.reason == "prefetch":
                self.events.prefetch_outcome("missed")
            return
        if job.reason == "prefetch":
            if job.deadline is not None and self.clock.now() > job.deadline:
                self.events.prefetch_outcome("missed")
                return
            session.op.acquire()
        elif not session.op.acquire(blocking=False):
            return  # busy: policy asks again next tick
        try:
            if session.dropped:
                return
            with self.table.lock:
                session.moving = True
            if job.reason == "prefetch":
                self.placement.promote(session, job.target, IOClass.PREFETCH)
                now = self.lifecycle.expect(session)
                self.events.prefetch_outcome("late" if job.deadline is not None and now > job.deadline else "in_time")
            elif job.target == DROP:
                self.lifecycle.forget(session, job.reason)
            elif job.reason == RECODE and self.recoder is not None:
                self.recoder.recode(session, job.io_class)
            elif job.keep:
                self.placement.write_durable(session, job.io_class, job.reason, job.evict)
            else:
                self.lifecycle.demote_session(session, job.target, job.io_class, job.reason, evict=job.evict)
        except TierdError as exc:
            if job.reason == "prefetch":
                self.events.prefetch_outcome("missed")
                log.warning("prefetch of %s/%s to %s failed: %s", *job.key, job.target, exc)
            else:
                delay, first = self.lifecycle.move_failed(session)
                log.log(logging.WARNING if first else logging.DEBUG, "%s of %s/%s to %s failed: %s; tried again "
                        "in %g s", job.reason, *job.key, job.target, exc, delay)
        else:
            if job.reason != "prefetch":
                self.lifecycle.move_done(session)
        finally:
            with self.table.lock:
                session.moving = False
            session.op.release()
            self.table.notify()
