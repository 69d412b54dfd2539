"""A thread pool that serves the most urgent work first (by I/O class).

Disk I/O is cut into chunks and queued here, so a demand restore overtakes a
background demotion at chunk granularity, and the bytes in flight are bounded
by workers x chunk size.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, Callable


class IOClass(IntEnum):
    """How urgent a copy or an I/O request is; lower runs first. (A
    session's priority is another thing: its weight in eviction order.)"""

    DEMAND = 0  # a restore or get the engine waits on
    PREFETCH = 1  # a promotion asked for ahead of a turn
    DEMOTION = 2  # making room or idle demotion
    WRITEBACK = 3  # background copy to disk for durability


class IOExecutor:
    def __init__(self, workers: int, name: str = "tierd-io") -> None:
        self._heap: list[tuple[int, int, Future, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, io_class: int, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("executor is shut down")
            heapq.heappush(self._heap, (int(io_class), next(self._seq), future, fn, args))
            self._cond.notify()
        return future

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                _, _, future, fn, args = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


def wait_all(futures: list[Future]) -> None:
    """Wait for every future, then raise the first error if any."""
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
