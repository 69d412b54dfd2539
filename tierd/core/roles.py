"""The roles of the tiers present: where engines' saves land, where Puts,
leases and fetches land, which tier is durable, what the remote tier's
versions are labelled. Built once from the tiers' registry (each kind
declares its role, tierd/tiers/__init__.py); the core and policy ask these,
never a tier's name. Plain data: any thread."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tierd.tiers import ENGINE_LANDING, LANDING, durable_tier, tier_order, versions_tier, with_role


@dataclass(frozen=True, slots=True)
class TierRoles:
    landing: str  # Puts, leases, fetches and the saves of engines in host memory
    engine_landing: str  # the saves of engines in device memory (landing where no tier takes that role)
    durable: str | None  # the tier the index records, if one is present
    versions: str  # what a session only the remote tier holds is said to be in

    @classmethod
    def of(cls, present: Iterable[str]) -> TierRoles:
        present = tier_order(present)
        landing = with_role(LANDING, present)
        if landing is None:
            raise ValueError(f"a tier of the {LANDING} role is required (tiers here: {list(present)})")
        return cls(landing, with_role(ENGINE_LANDING, present) or landing, durable_tier(present), versions_tier() or "")

    def saves_land(self, on_device: bool) -> str:
        """Where an engine's save lands: its device memory's tier, or the landing tier."""
        return self.engine_landing if on_device else self.landing
