"""The copy engine's CPU workers: jobs that copy, hash, code or decode
pieces of a call's pages on every core (numpy's copies, XXH3 and zstd run
without the GIL). Called from the thread of the call (an RPC thread, a
mover), never from a worker: a job waits for none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def run_jobs(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs on the CPU workers, each worker taking every n-th job, and
    wait for all; the first error is raised once all are done."""
    global _pool
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            job()
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tierd-copy")
    futures = [_pool.submit(_run_each, jobs[w::workers]) for w in range(workers)]
    errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def _run_each(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()
