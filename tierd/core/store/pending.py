"""PendingWrite: pages on their way into a session, the one thing Save, Put
and save leases store through (writes.py). Its bytes are written by the
caller's thread (a Put's on the event loop, with no lock held)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tierd.layout import KVSpec
from tierd.tiers.allocator import Piece
from tierd.transfer.copier import PageWriter
from tierd.transfer.runs import Geometry, Span
from tierd.types import SessionKey


@dataclass(eq=False)
class PendingWrite:
    """Pages on their way into a session: allocated in `tier`, written by the
    caller, invisible until committed (or freed when aborted). Save, Put and
    save leases all store through one."""

    key: SessionKey
    spec: KVSpec
    tier: str
    first_page: int
    num_tokens: int
    nbytes: int  # the snapshot's bytes once committed
    geom: Geometry
    pieces: list[Piece]
    hashes: np.ndarray | None
    priority: int | None
    started: float
    writer: PageWriter | None = None  # Put: where the stream's bytes go, in page order
    streaming: int = 0  # Put: bytes counted against the tenant's Puts in progress (begin_put)
    # Pages [first_page, write_from) another session of the tenant holds already (sharing.py): pieces of its
    # allocations, held for this write, by tier, and their checksums. The caller writes from write_from on.
    lent: dict[str, list[Piece]] = field(default_factory=dict)
    lent_sums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    write_from: int = 0
    lossy: float | None = None  # the save's consent to lossy codes (None: the session's as it is)

    @property
    def spans(self) -> list[Span]:
        return [Span(p.first_page, p.n_pages, self.tier, p.offset) for p in self.pieces]

    @property
    def new_bytes(self) -> int:
        return self.nbytes - self.first_page * self.spec.page_bytes

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        """Put: the stream's next bytes (InvalidArgument past what was announced)."""
        assert self.writer is not None
        self.writer.write(data)
