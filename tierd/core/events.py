"""What the store reports as it works; the metrics module listens.

The store calls these from any thread; implementations must be cheap and
thread-safe. NullEvents ignores everything.
"""

from __future__ import annotations

from typing import Any, Protocol


class StoreEvents(Protocol):
    def moved(self, src: str, dst: str, reason: str, nbytes: int, seconds: float) -> None: ...

    def saved(self, tier: str, nbytes: int, seconds: float) -> None: ...

    def restored(self, source: str, nbytes: int, seconds: float) -> None: ...

    def checksum_failed(self, tier: str) -> None: ...

    def evicted(self, tier: str, reason: str) -> None: ...

    def prefetch_outcome(self, outcome: str) -> None: ...

    def disk_error(self, op: str) -> None: ...

    def lease_expired(self, kind: str) -> None: ...

    def quarantined(self, reason: str) -> None: ...

    def remote_op(self, op: str, outcome: str) -> None: ...

    def remote_up(self, up: bool) -> None: ...

    def coded(self, codec: str, op: str, nbytes: int, coded: int, seconds: float) -> None:
        """Pages of nbytes coded into (op "encode") or decoded from ("decode") coded bytes, taking seconds."""
        ...

    def coding_errors(self, codec: str, rel_errors: Any) -> None:
        """Pages a lossy codec coded, with the relative error each carries (an array)."""
        ...

    def codec_chosen(self, tier: str, codec: str, among: tuple[str, ...]) -> None:
        """`auto` now codes the tier's pages with `codec`, among these."""
        ...

    def shared(self, call: str, pages: int, nbytes: int) -> None:
        """A call answered from pages other sessions of the tenant hold: a
        save that stored `pages` of them no more, a restore that started a
        session from them, a lookup that found them (no pages counted)."""
        ...


class NullEvents:
    def moved(self, src: str, dst: str, reason: str, nbytes: int, seconds: float) -> None:
        pass

    def saved(self, tier: str, nbytes: int, seconds: float) -> None:
        pass

    def restored(self, source: str, nbytes: int, seconds: float) -> None:
        pass

    def checksum_failed(self, tier: str) -> None:
        pass

    def evicted(self, tier: str, reason: str) -> None:
        pass

    def prefetch_outcome(self, outcome: str) -> None:
        pass

    def disk_error(self, op: str) -> None:
        pass

    def lease_expired(self, kind: str) -> None:
        pass

    def quarantined(self, reason: str) -> None:
        pass

    def remote_op(self, op: str, outcome: str) -> None:
        pass

    def remote_up(self, up: bool) -> None:
        pass

    def coded(self, codec: str, op: str, nbytes: int, coded: int, seconds: float) -> None:
        pass

    def coding_errors(self, codec: str, rel_errors: Any) -> None:
        pass

    def codec_chosen(self, tier: str, codec: str, among: tuple[str, ...]) -> None:
        pass

    def shared(self, call: str, pages: int, nbytes: int) -> None:
        pass
