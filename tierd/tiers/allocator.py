"""Extent allocator shared by every tier: byte ranges inside fixed-size slabs.

Segregated free lists by power-of-two size class with a bitmap of non-empty
classes: alloc and free are O(1) (a bounded look into the size's own class, a
bit scan, a dict pop, two dict lookups to coalesce neighbours). Extents never cross a slab boundary, so a slab maps to
one file or one VRAM allocation. A request that no single free extent can
hold is served as several pieces (alloc_pages), so fragmentation costs a
failure only when the free space left is in fragments smaller than one page.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.codecs.stored import PageCodes


@dataclass(frozen=True, slots=True)
class Piece:
    """Pages [first_page, first_page + n_pages) stored at offset, a page's
    stride apart; or, with codes, coded and back to back (codes: how)."""

    offset: int
    alloc_bytes: int
    first_page: int
    n_pages: int
    codes: PageCodes | None = None

    def head(self, n_pages: int) -> Piece:
        """The piece cut to its first n_pages pages (its allocation unchanged)."""
        if n_pages == self.n_pages:
            return self
        codes = self.codes.part(0, n_pages) if self.codes is not None else None
        return Piece(self.offset, self.alloc_bytes, self.first_page, n_pages, codes)

    def bytes_before(self, k: int, stride: int) -> int:
        """Where the piece's page k starts, from its offset."""
        return self.codes.offset_of(k) if self.codes is not None else k * stride

    def held_bytes(self, stride: int) -> int:
        """The bytes its pages take from its offset on."""
        return self.codes.stored if self.codes is not None else self.n_pages * stride


class ExtentAllocator:
    def __init__(self, slab_bytes: int, granule: int = 4096) -> None:
        if slab_bytes <= 0 or slab_bytes % granule:
            raise ValueError(f"slab size {slab_bytes} must be a positive multiple of {granule}")
        self.slab_bytes = slab_bytes
        self.granule = granule
        self.num_slabs = 0
        self.used = 0
        self._by_start: dict[int, int] = {}  # free extent start -> size
        self._by_end: dict[int, int] = {}  # free extent end -> start
        self._classes: list[dict[int, None]] = [{} for _ in range(64)]
        self._bitmap = 0

    # -- slabs ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.num_slabs * self.slab_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def add_slab(self) -> int:
        """Append one slab of free space; returns its index."""
        index = self.num_slabs
        self.num_slabs += 1
        self._insert(index * self.slab_bytes, self.slab_bytes)
        return index

    def free_extents(self) -> list[tuple[int, int]]:
        """(start, size) of every free extent."""
        return list(self._by_start.items())

    def slab_is_free(self, index: int) -> bool:
        return self._by_start.get(index * self.slab_bytes) == self.slab_bytes

    def take_free(self, index: int) -> int:
        """Mark every free extent of slab `index` used (a slab that must not
        be allocated from any more); returns the bytes taken."""
        base, end = index * self.slab_bytes, (index + 1) * self.slab_bytes
        taken = 0
        for start, size in [(s, n) for s, n in self._by_start.items() if base <= s < end]:
            self._remove(start, size)
            taken += size
        self.used += taken
        return taken

    def remove_last_slab(self) -> bool:
        """Drop the last slab if nothing in it is allocated."""
        index = self.num_slabs - 1
        if index < 0 or not self.slab_is_free(index):
            return False
        self._remove(index * self.slab_bytes, self.slab_bytes)
        self.num_slabs -= 1
        return True

    def reserve_all(self, ranges: list[tuple[int, int]]) -> None:
        """Mark (offset, nbytes) ranges used, on an allocator with nothing
        allocated yet (recovery). Raises ValueError on overlap or out of range."""
        if self.used:
            raise ValueError("reserve_all needs an allocator with nothing allocated")
        spans = sorted((off, off + self.round(n)) for off, n in ranges)
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ValueError(f"ranges [{s0}, {e0}) and [{s1}, ...) overlap")
        for start in list(self._by_start):
            self._remove(start, self._by_start[start])
        cursor, i = 0, 0
        for slab in range(self.num_slabs):
            base, end = slab * self.slab_bytes, (slab + 1) * self.slab_bytes
            cursor = base
            while i < len(spans) and spans[i][0] < end:
                s, e = spans[i]
                if s % self.granule or e > end or s < base:
                    raise ValueError(f"range [{s}, {e}) is unaligned or crosses slab {slab}")
                if s > cursor:
                    self._insert(cursor, s - cursor)
                self.used += e - s
                cursor = e
                i += 1
            if cursor < end:
                self._insert(cursor, end - cursor)
        if i < len(spans):
            raise ValueError(f"range at {spans[i][0]} lies past the last slab")

    # -- alloc / free --------------------------------------------------------

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.granule) * self.granule

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free extent of at least nbytes (rounded to the granule), or None."""
        size = self.round(max(nbytes, 1))
        if size > self.slab_bytes:
            return None
        start = self._find(size)
        if start is None:
            return None
        length = self._by_start[start]
        self._remove(start, length)
        if length > size:
            self._insert(start + size, length - size)
        self.used += size
        return start

    def free(self, offset: int, nbytes: int) -> None:
        size = self.round(max(nbytes, 1))
        if offset % self.granule or offset < 0 or offset + size > self.capacity:
            raise ValueError(f"free of [{offset}, {offset + size}) outside the allocator")
        if offset in self._by_start or (offset + size) in self._by_end:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        self.used -= size
        start, end = offset, offset + size
        slab_start = (offset // self.slab_bytes) * self.slab_bytes
        # Coalesce with free neighbours in the same slab.
        if start != slab_start and start in self._by_end:
            prev = self._by_end[start]
            self._remove(prev, start - prev)
            start = prev
        if end != slab_start + self.slab_bytes and end in self._by_start:
            nxt = self._by_start[end]
            self._remove(end, nxt)
            end += nxt
        self._insert(start, end - start)

    def alloc_pages(self, n_pages: int, page_bytes: int) -> list[Piece] | None:
        """Room for n_pages pages: one piece when a free extent holds them all,
        else several, largest first. All or nothing."""
        whole = self.alloc(n_pages * page_bytes)
        if whole is not None:
            return [Piece(whole, self.round(n_pages * page_bytes), 0, n_pages)]
        pieces: list[Piece] = []
        first = 0
        while first < n_pages:
            start = self._largest()
            if start is None or self._by_start[start] < page_bytes:
                for p in pieces:
                    self.free(p.offset, p.alloc_bytes)
                return None
            count = min(n_pages - first, self._by_start[start] // page_bytes)
            size = self.round(count * page_bytes)
            offset = self.alloc(size)
            assert offset is not None
            pieces.append(Piece(offset, size, first, count))
            first += count
        return pieces

    # -- internals -----------------------------------------------------------

    @staticmethod
    def _class_of(size: int) -> int:
        return size.bit_length() - 1

    def _insert(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        c = self._class_of(size)
        self._classes[c][start] = None
        self._bitmap |= 1 << c

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        c = self._class_of(size)
        del self._classes[c][start]
        if not self._classes[c]:
            self._bitmap &= ~(1 << c)

    def _find(self, size: int) -> int | None:
        # Good fit: a few extents of the size's own class first (an extent just
        # freed by a snapshot of the same size is reused, still resident), then
        # any extent of a higher class, which always fits.
        c = self._class_of(size)
        for i, start in enumerate(self._classes[c]):
            if self._by_start[start] >= size:
                return start
            if i == 8:
                break
        above = self._bitmap >> (c + 1)
        if above:
            cls = c + 1 + (above & -above).bit_length() - 1
            return next(iter(self._classes[cls]))
        for start in self._classes[c]:  # the rest of the own class, rarely reached
            if self._by_start[start] >= size:
                return start
        return None

    def _largest(self) -> int | None:
        if not self._bitmap:
            return None
        cls = self._bitmap.bit_length() - 1
        return max(self._classes[cls], key=self._by_start.__getitem__)
