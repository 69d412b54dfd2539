"""The tierd vLLM connector's loads for one step, in a thread of the
worker: a restore lease for each job first, then every job's pages copied
into vLLM's blocks layer by layer, each layer announced as soon as it is in
place (the forward pass waits for its own layer only). What fails is
reported as blocks that failed to load: vLLM recomputes them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from tierd.adapters.paged import LayerBlocks
from tierd.adapters.vllm_jobs import LoadJob
from tierd.client import Arena, Client, KVSpec, TierdError

log = logging.getLogger("vllm.tierd")  # under vLLM's logger, so its handlers print it


class Load:
    """Loads for one step, in a thread: leases first, then every job's pages
    layer by layer, each layer announced as soon as it is in place."""

    def __init__(self, jobs: list[LoadJob], blocks: LayerBlocks, client: Client, spec: KVSpec | None, arena: Arena,
                 lease_seconds: float) -> None:
        self.jobs = jobs
        self.blocks, self.client, self.spec, self.arena, self.lease_seconds = blocks, client, spec, arena, lease_seconds
        self.layer_done = [threading.Event() for _ in blocks.views]
        self.failed: set[int] = set()
        self.thread = threading.Thread(target=self._run, name="tierd-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        blocks, client = self.blocks, self.client
        t0 = time.perf_counter()
        leased: list[tuple[LoadJob, Any, list[tuple[list[int], np.ndarray]]]] = []
        try:
            for job in self.jobs:
                try:
                    lease = client.begin_restore(job.session, self.spec, job.num_pages, self.lease_seconds, job.token_ids,
                                                 job.salt)
                    parts = []
                    for first, rows in self.arena.runs(lease):
                        lo, hi = max(first, job.first_page), min(first + len(rows), job.num_pages)
                        if lo < hi:
                            parts.append((job.block_ids[lo - job.first_page : hi - job.first_page],
                                          rows[lo - first : hi - first]))
                    leased.append((job, lease, parts))
                except (TierdError, OSError, ValueError) as exc:
                    self._fail(job, exc)
            for layer, done in enumerate(self.layer_done):
                for job, _, parts in leased:
                    for block_ids, rows in parts:
                        blocks.scatter(rows, block_ids, [layer])
                done.set()
            for job, lease, _ in leased:
                try:
                    client.end_restore(lease)  # NotFound: the lease expired while we read; recompute
                    tokens = (job.num_pages - job.first_page) * self.spec.block_tokens  # type: ignore[union-attr]
                    log.info("tierd connector: loaded %d tokens of session %r in %.1f ms", tokens, job.session,
                             1e3 * (time.perf_counter() - t0))
                except TierdError as exc:
                    self._fail(job, exc)
        except BaseException as exc:  # never leave a layer waiting
            for job, _, _ in leased:
                self._fail(job, exc)
            raise
        finally:
            for done in self.layer_done:
                done.set()

    def _fail(self, job: LoadJob, exc: BaseException) -> None:
        self.failed.update(job.block_ids)
        log.warning("tierd connector: loading session %r failed (%s); vLLM recomputes it", job.session, exc)
