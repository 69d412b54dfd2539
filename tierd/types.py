"""What crosses the wire and reaches the client: results and records of the
API, shared by the daemon and the client (which loads no module of the
daemon's). Standard library only, plus the identity of a snapshot's bytes
(tierd.layout) that SessionInfo carries."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tierd.layout import KVSpec


# What a tenant or a session id may be (matched whole, and never holding ".."):
# they never become file names, but they are printed, logged and indexed.
ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=~-]{0,255}")


class SessionKey(NamedTuple):
    tenant: str
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionInfo:
    tenant: str
    session_id: str
    tier: str | None  # the slowest tier a full restore reads from (None: no pages)
    tier_bytes: dict[str, int]
    state: str
    num_tokens: int
    size_bytes: int
    num_pages: int
    durable: bool
    last_access: float
    created: float
    priority: int
    pins: int
    model_id: str
    fingerprint: str
    spec: KVSpec
    remote_durable: bool = False  # the remote tier holds this content: any node can serve it
    shared_bytes: int = 0  # of size_bytes, in pages other sessions of the tenant hold too (prefix sharing)
    codecs: dict[str, str] = field(default_factory=dict)  # tier -> the codec its copy is in (absent: as it is)
    coded_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes its coded copy takes there
    tier_errors: dict[str, float] = field(default_factory=dict)  # tier -> worst relative error of a page there (lossy)
    rel_error: float = 0.0  # worst relative L2 error of a page a restore of it serves here (0: every page exact)

    @property
    def own_bytes(self) -> int:
        """Of size_bytes, in pages no other session holds."""
        return self.size_bytes - self.shared_bytes


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    budget: int
    used: int
    capacity: int
    sessions: int
    backend: str
    saved: int = 0  # bytes it would hold more if the pages sessions share (prefix sharing) were stored per session


@dataclass(frozen=True, slots=True)
class RestoreResult:
    num_tokens: int
    num_pages: int
    source_tier: str
    seconds: float
    nbytes: int = 0  # bytes the restored pages hold (a snapshot's last page may be short)
    rel_error: float = 0.0  # worst relative L2 error of a page restored (0: every page exact)


@dataclass(frozen=True, slots=True)
class LookupResult:
    num_tokens: int     # leading tokens of the request the snapshot supplies
    num_pages: int      # the pages that hold them
    stored_tokens: int  # tokens in the snapshot
    tier: str | None    # the slowest tier those pages are read from


@dataclass(frozen=True, slots=True)
class Slot:
    """Pages [first_page, first_page + n_pages) at offset in the shared-memory
    file shm_name (in /dev/shm), one every page_stride bytes."""

    shm_name: str
    offset: int
    first_page: int
    n_pages: int


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    slots: list[Slot]
    page_bytes: int
    page_stride: int
    first_page: int
    num_pages: int
    num_tokens: int
    ttl: float
    nbytes: int = 0  # bytes the leased pages hold (a snapshot's last page may be short)
    rel_error: float = 0.0  # restore: worst relative L2 error of a leased page (0: every page exact)


@dataclass(frozen=True, slots=True)
class BudgetResult:
    tier: str
    old_budget: int
    new_budget: int
    released_bytes: int
    moved_sessions: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Advice:
    restore_seconds: float
    recompute_seconds: float
    source_tier: str
    bandwidth_bytes_per_s: float

    @property
    def restore(self) -> bool:
        """Whether to restore: there are tokens to restore, and moving their bytes takes no longer than computing."""
        return 0 < self.recompute_seconds and self.restore_seconds <= self.recompute_seconds
