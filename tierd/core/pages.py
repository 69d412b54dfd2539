"""Pages by number: runs of them, and how many lead within an error bound.
Pure functions of arrays; they run wherever their caller does."""

from __future__ import annotations

import numpy as np


def pages_within(errors: np.ndarray, n_pages: int, bound: float | None) -> int:
    """How many of n_pages leading pages carry at most `bound` relative error
    (errors: each page's, empty where all are exact; None: no bound)."""
    if bound is None or not errors.size:
        return n_pages
    past = np.flatnonzero(~(errors[:n_pages] <= bound))
    return int(past[0]) if past.size else n_pages


def ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a bool array."""
    if not mask.any():
        return []
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
