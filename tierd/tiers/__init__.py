"""Tiers: where bytes live (device VRAM, host shared memory, disk slabs).

Mechanism only: a tier allocates, frees and exposes its bytes; it never
decides what to move or why. Every kind of tier is registered here once
(register): its name, its rank in the order (fastest first), its medium and
its role. The rest of tierd asks the registry, never a literal list: where
a session goes when it leaves a tier, which tier is durable (the one the
index records), which tiers a save or a prefetch may target.

Each tier is of one medium, which decides how the copy engine reaches its
bytes (transfer/routes.py): MEMORY tiers hand out views (MemoryTier), FILE
tiers read and write by offset through the I/O threads (FileTier). A new
tier is one module (its Tier class and its register() line), the routes of
its medium if that medium is new, and one builder in machine.TIERS.
Registration happens at import, on the main thread, before anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from tierd.tiers.allocator import Piece

MEMORY = "memory"  # bytes reached as views: the host arena, VRAM
FILE = "file"  # bytes reached by reads and writes at offsets: the disk slabs
VERSIONS = "versions"  # whole sessions by version, in a store every node reaches (tierd/remote)

# Roles a kind of tier may take (one kind each): the core and policy ask for a role, never a name.
LANDING = "landing"  # where Puts, leases, fetches and the saves of engines in host memory land
ENGINE_LANDING = "engine landing"  # where the saves of engines in device memory land (LANDING where absent)


@dataclass(frozen=True, slots=True)
class TierKind:
    name: str
    rank: int  # place in the order, fastest first; leave gaps so a new tier fits between two
    medium: str  # MEMORY or FILE (or a medium of a new tier's own, with routes registered for it)
    durable: bool = False  # survives restarts: holds the pages the disk index records
    bandwidth: float = 1e9  # bytes/s assumed for restore advice until a copy out of it is measured
    role: str = ""  # LANDING, ENGINE_LANDING or none


_KINDS: dict[str, TierKind] = {}
_RANKS: dict[str, int] = {}  # name -> rank: looked up on every placement question, kept flat


def register(kind: TierKind) -> str:
    """Add a kind of tier; returns its name. A name or rank is taken once;
    one kind is durable (the index records one tier's pages)."""
    if kind.name in _KINDS:
        raise ValueError(f"a tier named {kind.name!r} is registered already")
    if any(k.rank == kind.rank for k in _KINDS.values()):
        raise ValueError(f"rank {kind.rank} is taken: {kind.name!r} needs a place of its own in the order")
    if kind.durable and any(k.durable for k in _KINDS.values()):
        raise ValueError(f"{kind.name!r}: one durable tier is registered already")
    if kind.role and any(k.role == kind.role for k in _KINDS.values()):
        raise ValueError(f"{kind.name!r}: the {kind.role} role is taken")
    if kind.medium == VERSIONS and any(k.medium == VERSIONS for k in _KINDS.values()):
        raise ValueError(f"{kind.name!r}: one tier of versions is registered already")
    _KINDS[kind.name] = kind
    _RANKS[kind.name] = kind.rank
    return kind.name


def kind_of(name: str) -> TierKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r} is registered") from None


def is_tier(name: object) -> bool:
    return isinstance(name, str) and name in _KINDS


def tier_rank(name: str) -> int:
    try:
        return _RANKS[name]
    except KeyError:
        raise ValueError(f"no tier named {name!r} is registered") from None


def tier_order(names: Iterable[str] | None = None) -> tuple[str, ...]:
    """The given tier names (default: every registered one), fastest first."""
    try:
        return tuple(sorted(_KINDS if names is None else names, key=_RANKS.__getitem__))
    except KeyError as exc:
        raise ValueError(f"no tier named {exc.args[0]!r} is registered") from None


def durable_tier(names: Iterable[str]) -> str | None:
    """The durable tier among these names, if any."""
    return next((n for n in names if kind_of(n).durable), None)


def with_role(role: str, names: Iterable[str] | None = None) -> str | None:
    """The tier of this role among these names (default: every registered one), if any."""
    return next((n for n in (_KINDS if names is None else names) if kind_of(n).role == role), None)


def versions_tier() -> str | None:
    """The registered tier of whole versions every node reaches (its name labels what it holds)."""
    return next((n for n, k in _KINDS.items() if k.medium == VERSIONS), None)


DEVICE = register(TierKind("device", 10, MEMORY, bandwidth=200e9, role=ENGINE_LANDING))  # VRAM
HOST = register(TierKind("host", 20, MEMORY, bandwidth=10e9, role=LANDING))  # the shared arena
DISK = register(TierKind("disk", 30, FILE, durable=True, bandwidth=1e9))  # slab files under the index
# The store every node reaches (tierd/remote): whole sessions by version, not extents, so it has no
# Tier object and no routes; the core fetches a session from it into the landing tier.
REMOTE = register(TierKind("remote", 40, VERSIONS, bandwidth=0.5e9))


class Tier(Protocol):
    """What the store and the copy engine call on every tier. Pieces are
    extents of the tier's address space (offset, bytes), owned by a tenant."""

    name: str  # a registered kind's
    medium: str  # the kind's: MEMORY or FILE
    budget: int
    backend: str  # the mechanism behind it, for logs and metrics
    out_of_space: bool  # the system refused room the budget allows
    allocator: Any  # the extent allocator: round(nbytes) is what an allocation of nbytes takes
    unusable: int  # bytes of `used` that no session holds: room retired after a fault

    @property
    def used(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def alloc_pages(self, n_pages: int, page_bytes: int, owner: str = "") -> list[Piece] | None:
        """Room for n_pages pages, in as few pieces as it takes, or None (all or nothing)."""
        ...

    def used_by(self, owner: str) -> int: ...

    def free(self, piece: Piece) -> None: ...

    def reserve(self, pieces: list[tuple[Piece, str]]) -> None:
        """Mark (piece, owner) pairs found at recovery as allocated."""
        ...

    def set_budget(self, nbytes: int) -> None: ...

    def maintain(self) -> int:
        """Periodic housekeeping (on the policy tick); returns bytes released."""
        ...

    def close(self) -> None: ...


class MemoryTier(Tier, Protocol):
    def view(self, offset: int, nbytes: int) -> Any:
        """The tier's bytes [offset, offset + nbytes) as a 1-D uint8 array or tensor, uncopied."""
        ...


class FileTier(Tier, Protocol):
    device_io: bool  # reads and writes take GPU memory as well as host arrays
    slab_bytes: int

    def takes(self, buf: Any) -> bool:
        """Whether read and write take buf as it is (else the caller stages it in host memory)."""
        ...

    def read(self, offset: int, buf: Any, io_class: int) -> None: ...

    def read_async(self, offset: int, buf: Any, io_class: int) -> list[Future]: ...

    def write(self, offset: int, buf: Any, io_class: int) -> None: ...


class DurableTier(FileTier, Protocol):
    """The tier the index records: what it holds survives restarts."""

    def open_existing(self, max_slabs: int) -> dict[int, int | None]:
        """Open what a previous run left in slabs below max_slabs (before
        recovery); returns, per slab that is missing or short, the bytes it
        held (None: no file)."""
        ...

    def epoch(self) -> int:
        """A mark to pass to sync() after writing."""
        ...

    def retired(self, offset: int) -> bool:
        """Whether that byte's slab was lost under the daemon (its pieces are not durable any more)."""
        ...

    def sync(self, since: int | None = None) -> None:
        """Make every write so far durable; with since, fail if a sync failed after that mark."""
        ...


__all__ = ["DEVICE", "DISK", "ENGINE_LANDING", "FILE", "HOST", "LANDING", "MEMORY", "REMOTE", "VERSIONS", "DurableTier", "FileTier", "MemoryTier", "Piece",
           "Tier", "TierKind",
           "durable_tier", "is_tier", "kind_of", "register", "tier_order", "tier_rank", "versions_tier", "with_role"]
