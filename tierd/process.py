"""The daemon process's own settings, made once at start on the main thread,
before any other thread runs: how malloc keeps and returns memory, and how
many descriptors the process may hold."""

from __future__ import annotations

import ctypes
import logging
import resource
from collections.abc import Callable

log = logging.getLogger("tierd")
TRIM_SECONDS = 10.0  # how often freed heap memory goes back to the system
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
ARENAS = 2
HEAP_BUFFERS = 32 << 20  # buffers up to this size come from the heap (glibc's largest mmap threshold)
TRIM_AT = 64 << 20  # free bytes at a heap's top that glibc hands back on free(); the tick trims the rest


def tune_malloc() -> Callable[[], object] | None:
    """Keep the daemon's memory flat under a steady stream of MiB-sized
    messages without faulting in fresh pages for each: at most ARENAS heaps
    (one per thread, by default); buffers up to HEAP_BUFFERS from the heap,
    which keeps them once freed (glibc's default returns a buffer over its
    mmap or trim threshold to the system, and every page of the next one
    faults: 0.8 ms per MiB on a virtual machine, more than streaming it); and
    the returned malloc_trim hands all free heap pages back (the policy loop
    calls it every TRIM_SECONDS). None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt(M_ARENA_MAX, ARENAS)
    mallopt(M_MMAP_THRESHOLD, HEAP_BUFFERS)
    mallopt(M_TRIM_THRESHOLD, TRIM_AT)
    return lambda: trim(0)


def raise_fd_limit() -> None:
    """Take the hard limit on open descriptors as the soft one: engines'
    mappings, leases' segments, slab files and connections all hold
    descriptors, each tenant's within its own caps (core/engines.py,
    api/intake.py), and the sum of them must not meet a default of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    log.info("open descriptors: up to %s", "no limit" if soft == resource.RLIM_INFINITY else soft)
