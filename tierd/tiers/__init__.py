"""Tiers: where bytes live (device VRAM, host shared memory, disk slabs).

Mechanism only: a tier allocates, frees and exposes its bytes; it never
decides what to move or why. Names are ordered fastest first.

Each tier is of one medium, which decides how the copy engine reaches its
bytes (transfer/routes.py): MEMORY tiers hand out views (MemoryTier), FILE
tiers read and write by offset through the I/O threads (FileTier).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from tierd.tiers.allocator import Piece

TIER_ORDER = ("device", "host", "disk")
MEMORY = "memory"  # bytes reached as views: the host arena, VRAM
FILE = "file"  # bytes reached by reads and writes at offsets: the disk slabs


def tier_rank(name: str) -> int:
    return TIER_ORDER.index(name)


class Tier(Protocol):
    name: str
    medium: str  # MEMORY or FILE
    budget: int
    backend: str  # the mechanism behind it, for logs and metrics
    out_of_space: bool  # the system refused room the budget allows

    @property
    def used(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def alloc_pages(self, n_pages: int, page_bytes: int, owner: str = "") -> list[Piece] | None: ...

    def used_by(self, owner: str) -> int: ...

    def free(self, piece: Piece) -> None: ...

    def set_budget(self, nbytes: int) -> None: ...

    def maintain(self) -> int: ...

    def close(self) -> None: ...


class MemoryTier(Tier, Protocol):
    def view(self, offset: int, nbytes: int) -> Any:
        """The tier's bytes [offset, offset + nbytes) as a 1-D uint8 array or tensor, uncopied."""
        ...


class FileTier(Tier, Protocol):
    device_io: bool  # reads and writes take GPU memory as well as host arrays

    def takes(self, buf: Any) -> bool:
        """Whether read and write take buf as it is (else the caller stages it in host memory)."""
        ...

    def read(self, offset: int, buf: Any, priority: int) -> None: ...

    def read_async(self, offset: int, buf: Any, priority: int) -> list[Future]: ...

    def write(self, offset: int, buf: Any, priority: int) -> None: ...


__all__ = ["FILE", "MEMORY", "TIER_ORDER", "FileTier", "MemoryTier", "Piece", "Tier", "tier_rank"]
