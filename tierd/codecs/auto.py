"""`auto`: a tier's pages coded lossless or as they are, whichever measured
faster on this node (AutoChoice). Where decoding is slower than the link or
the device it saves bytes on (lossless in front of a fast network or NVMe),
coding costs more time than the bytes it saves. Thread-safe: any thread
that writes or reads the tier's pages (movers, the publisher, RPC threads)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

AUTO = "auto"
EXPLORE_EVERY = 16  # one write in this many takes the way auto did not choose, so that both stay measured
EWMA = 0.3  # weight of the newest measurement in a way's average speed

log = logging.getLogger("tierd.codecs")


def check_codec(name: str) -> str:
    """The codec's name (or auto): InvalidArgument for a name no codec has."""
    from tierd.codecs.base import get

    return AUTO if name == AUTO else get(name).name


class AutoChoice:
    """For each write of a tier's pages, lossless or none, whichever way
    measured faster on this node: the seconds per logical byte its writes
    and reads took (reads of what other nodes wrote too), averaged (EWMA);
    compared on reads where both ways have been read, else on writes. A way
    not yet measured is tried first; after that, one write in EXPLORE_EVERY
    takes the other way. The choice is logged where it changes, and passed
    to on_change(tier, codec, ways). `ops` names the tier's writes and reads
    (the remote tier's: publish, fetch)."""

    WAYS = ("lossless", "none")

    def __init__(self, tier: str, on_change: Callable[[str, str, tuple[str, ...]], None],
                 ops: tuple[str, str] = ("write", "read")) -> None:
        self.tier, self.on_change = tier, on_change
        self.write_op, self.read_op = ops
        self._speeds: dict[tuple[str, str], float] = {}  # (way, op) -> bytes/s
        self._lock = threading.Lock()
        self._writes = 0
        self.chosen = ""

    def measured(self, way: str, op: str, nbytes: int, seconds: float) -> None:
        """A write or read (op) of pages coded `way` took seconds for nbytes of pages."""
        if way not in self.WAYS or op not in (self.write_op, self.read_op) or nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            old = self._speeds.get((way, op))
            rate = nbytes / seconds
            self._speeds[(way, op)] = rate if old is None else (1 - EWMA) * old + EWMA * rate

    def choose(self) -> str:
        """The way the next write takes."""
        with self._lock:
            self._writes += 1
            untried = [w for w in self.WAYS if (w, self.write_op) not in self._speeds]
            if untried:
                return untried[0]
            op = self.read_op if all((w, self.read_op) in self._speeds for w in self.WAYS) else self.write_op
            best = max(self.WAYS, key=lambda w: self._speeds[(w, op)])
            other = next(w for w in self.WAYS if w != best)
            why = ", ".join(f"{w} {self._speeds[(w, op)] / 1e9:.2f} GB/s" for w in self.WAYS)
            changed, self.chosen = best != self.chosen, best
            explore = self._writes % EXPLORE_EVERY == 0
        if changed:
            log.info("the %s tier's codec (auto) is %s: measured %s, by %ses", self.tier, best, why, op)
            self.on_change(self.tier, best, self.WAYS)
        return other if explore else best
