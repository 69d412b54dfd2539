"""Policy: pure decisions over session metadata, with the clock passed in.

Nothing here touches bytes, tiers or locks; the store asks, then acts. Every
call returns a full answer or None, and changes nothing.
"""

from tierd.policy.rules import (
    RECODE,
    Advice,
    Move,
    PolicyConfig,
    SessionView,
    advise,
    budget_moves,
    eviction_order,
    idle_due,
    idle_moves,
    plan_eviction,
    pressure_moves,
    retry_delay,
    under_pressure,
)

__all__ = [
    "RECODE",
    "Advice",
    "Move",
    "PolicyConfig",
    "SessionView",
    "advise",
    "budget_moves",
    "eviction_order",
    "idle_due",
    "idle_moves",
    "plan_eviction",
    "pressure_moves",
    "retry_delay",
    "under_pressure",
]
