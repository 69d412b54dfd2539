"""The 64-bit page checksum (XXH3-64, seed 0).

One function for every tier, so the same bytes give the same checksum
wherever they were hashed. xxhash releases the GIL, so pages can be hashed
from worker threads.
"""

from __future__ import annotations

import numpy as np
import xxhash


def page_checksum(data: memoryview | bytes | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def page_checksums(buf: np.ndarray, page_bytes: int, n_pages: int, last_bytes: int) -> np.ndarray:
    """Checksums of n_pages pages laid out at page_bytes stride in buf.

    The last page holds last_bytes (opaque snapshots end in a short page).
    """
    out = np.empty(n_pages, dtype=np.uint64)
    for i in range(n_pages):
        size = last_bytes if i == n_pages - 1 else page_bytes
        out[i] = xxhash.xxh3_64_intdigest(buf[i * page_bytes : i * page_bytes + size])
    return out
