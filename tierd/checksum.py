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

