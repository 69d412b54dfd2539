"""Background moves: a queue of session moves served by worker threads.

Runs inside the store (submit, cancel: any thread; jobs run on the mover
threads). Prefetches overtake demotions, which overtake write-backs; within
a class, tenants take turns (one tenant's flood of prefetches, at any
priority, delays another's by one job per mover at most), and within a
tenant, higher user priority first, then arrival. One job per session:
asking again merges into the queued job, and Drop cancels it. A prefetch
whose deadline passes before it starts is dropped as missed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionKey

log = logging.getLogger("tierd.core.move_queue")


@dataclass(eq=False)
class Job:
    key: SessionKey
    target: str  # a tier name, or "drop"
    reason: str  # prefetch, idle, pressure, writeback, ttl, ...
    io_class: IOClass
    priority: int = 0
    deadline: float | None = None
    keep: bool = False  # write a disk copy, keep the faster ones
    evict: bool = False  # room in the target may be made by eviction (pressure); else only free room is taken
    seq: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def sort_key(self) -> tuple[int, int, int]:
        return (int(self.io_class), -self.priority, self.seq)


class MoveQueue:
    def __init__(self, run: Callable[[Job], None], workers: int = 2) -> None:
        self._run = run
        # (class, tenant) -> that tenant's jobs of that class, best first; a class's
        # tenants in the order of their turns (the next first).
        self._heaps: dict[tuple[int, str], list[tuple[tuple[int, int, int], Job]]] = {}
        self._turns: dict[int, deque[str]] = {}
        self._queued: dict[SessionKey, Job] = {}
        self._running: dict[SessionKey, Job] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"tierd-mover-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _push(self, job: Job) -> None:
        slot = (int(job.io_class), job.key.tenant)
        heap = self._heaps.get(slot)
        if heap is None:
            heap = self._heaps[slot] = []
            self._turns.setdefault(slot[0], deque()).append(slot[1])
        heapq.heappush(heap, (job.sort_key(), job))
        self._cond.notify()

    def submit(self, job: Job, merge: Callable[[Job, Job], bool]) -> Job:
        """Queue job, or merge it into the job already queued for its session
        (merge(old, new) -> True if old changed). Returns the job that will run."""
        with self._cond:
            old = self._queued.get(job.key)
            if old is not None:
                if merge(old, job):
                    old.seq = next(self._seq)
                    self._push(old)  # the stale entry is skipped
                return old
            job.seq = next(self._seq)
            self._queued[job.key] = job
            self._push(job)
            return job

    def cancel(self, key: SessionKey) -> Job | None:
        with self._cond:
            job = self._queued.pop(key, None)
            if job is not None:
                job.cancelled = True
                job.done.set()
                self._cond.notify_all()
            return job

    def busy_keys(self, queued: bool = True) -> set[SessionKey]:
        """Sessions with a move running, or (queued) queued or running."""
        with self._cond:
            return set(self._queued) | set(self._running) if queued else set(self._running)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._running, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._queued.values():
                job.cancelled = True
                job.done.set()
            self._queued.clear()
            self._heaps.clear()
            self._turns.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _take(self, heap: list[tuple[tuple[int, int, int], Job]]) -> Job | None:
        """The best job of one tenant's heap whose session has no move running."""
        job, deferred = None, []
        while heap:
            entry = heapq.heappop(heap)
            cand = entry[1]
            if self._queued.get(cand.key) is not cand or entry[0] != cand.sort_key():
                continue  # merged or cancelled since it was pushed
            if cand.key in self._running:
                deferred.append(entry)  # one move per session at a time
                continue
            job = cand
            break
        for entry in deferred:
            heapq.heappush(heap, entry)
        return job

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                for io_class in sorted(self._turns):
                    turns = self._turns[io_class]
                    for _ in range(len(turns)):
                        tenant = turns.popleft()
                        heap = self._heaps[(io_class, tenant)]
                        job = self._take(heap)
                        if heap:
                            turns.append(tenant)  # its next turn comes after the others'
                        else:
                            del self._heaps[(io_class, tenant)]
                        if job is not None:
                            del self._queued[job.key]
                            self._running[job.key] = job
                            return job
                    if not turns:
                        del self._turns[io_class]
                if self._closed:
                    return None
                self._cond.wait()

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:
                log.exception("move of %s to %s failed", job.key, job.target)
            finally:
                with self._cond:
                    self._running.pop(job.key, None)
                    job.done.set()
                    self._cond.notify_all()
