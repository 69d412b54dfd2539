"""Re-coding as capacity (`--codec host=fp8`, or lossless): when the host
tier is full, idle sessions there are re-coded in place, smaller, before any
of them leaves it. This is the setting and what decides which sessions may be
re-coded (Recoding); the re-code itself is recode.py's.

A tenant of --lossy-tenants has its KV re-coded with the codec; every other
session (and opaque state, and KV a lossy codec does not read) lossless. A
copy re-coded in a memory tier is a serving copy: restores and reads decode
it (checked against what it decodes to), moves never read it, and it is
lent to no other session; its session keeps an exact copy on disk, so the
disk tier is needed. Plain data and checks: any thread, under the store
lock where it reads a session.
"""

from __future__ import annotations

import logging
import threading

from tierd import codecs
from tierd.codecs.auto import AUTO, check_codec
from tierd.core.model import Session
from tierd.core.store.coding import Consent
from tierd.errors import InvalidArgument

log = logging.getLogger("tierd.core.store")
EWMA = 0.3  # weight of the newest re-code in the part of its bytes re-codes keep


class Recoding:
    @classmethod
    def of(cls, codec: str, tier: str, tiers: dict, durable: str | None, lossy_tenants: frozenset[str],
           max_error: float) -> Recoding | None:
        """The tier's re-coding with this codec (`--codec TIER=CODEC`; None for
        "none"), logged; InvalidArgument where it cannot be."""
        if codec == "none":
            return None
        cls.check(codec, tier, tier in tiers, durable is not None and tiers[durable].budget > 0)
        log.info("%s tier: idle sessions re-coded %s in place when it is full%s", tier, codec,
                 Consent(lossy_tenants, max_error).describe(codec))
        return cls(tier, codec, durable, lossy_tenants, max_error)

    @staticmethod
    def check(codec: str, tier: str, present: bool, disk: bool) -> None:
        """InvalidArgument unless the tier (present: there is one) may re-code
        with this codec ("none": nothing to check); disk: a disk tier with a
        budget is there, for the exact copy."""
        if codec != "none" and (check_codec(codec) == AUTO or not present or not disk):
            raise InvalidArgument(f"--codec {tier}={codec}: the {tier} tier re-codes sessions with a codec (lossless, "
                                  "or a lossy one for the tenants of --lossy-tenants), and keeps their exact copy on "
                                  f"disk: it needs a {tier} tier and a disk tier with a budget" +
                                  (", and a codec, not auto" if codec == AUTO else ""), field="codec", value=codec)

    def __init__(self, tier: str, codec: str, durable: str, lossy_tenants: frozenset[str], max_error: float) -> None:
        self.tier, self.durable = tier, durable
        self.codec = codecs.get(codec).name
        self.consent = Consent(lossy_tenants, max_error)
        lossy = codecs.get(codec).lossy
        # The part of its bytes a re-code keeps, until re-codes are measured: what the codec takes of real KV.
        self._kept = 0.5 if lossy else 0.7
        self._lock = threading.Lock()

    def codec_for(self, session: Session) -> tuple[str, float | None]:
        """The codec the session's pages are re-coded with, and the error a
        page may carry (None: lossless). Under the store lock."""
        bound = self.consent.bound(session)
        lossy = codecs.get(self.codec).lossy
        return (self.codec, bound) if not lossy or bound is not None else ("lossless", None)

    def may(self, s: Session) -> bool:
        """Whether the session's copy in the tier may be re-coded now: released,
        neither pinned, damaged, dropped nor read by a stream, and holding pages
        there not coded yet (store lock held)."""
        if s.released_at is None or s.pins or s.damaged or s.dropped or s.readers:
            return False
        return any(p.codes is None for p in s.snap.pieces(self.tier))

    @property
    def shrink(self) -> float:
        """The part of a session's bytes in the tier a re-code frees, as measured so far."""
        with self._lock:
            return 1.0 - self._kept

    def measured(self, nbytes: int, stored: int) -> None:
        """A re-code took nbytes of pages to `stored` bytes."""
        if nbytes > 0:
            with self._lock:
                self._kept = (1 - EWMA) * self._kept + EWMA * min(1.0, stored / nbytes)
