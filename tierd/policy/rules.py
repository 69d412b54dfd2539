"""What to move and when: idle demotion (and when it is next due),
watermarks, eviction order, budget changes, TTL, when a move that failed is
tried again, and the restore-or-recompute estimate.

Pure functions over what policy may know of sessions (SessionView) and the
tiers present, called by the store from the policy tick and from the calls
that need room. Tiers are known by their registered order (tiers.tier_order):
a session leaving a tier goes to the next lower tier present; write-backs go
to the durable one. Idle demotions and write-backs take only room a tier
has free; evictions (pressure, room for a store: plan_eviction) may drop the
least valuable sessions to make more, never while their tier has room. A
move that failed (a full disk, say) leaves the session where it was; policy
moves it again after retry_delay, doubling with each failure in a row: only
eviction for room takes it sooner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tierd.tiers import ENGINE_LANDING, LANDING, durable_tier, is_tier, kind_of, tier_order
from tierd.types import Advice, SessionKey

DROP = "drop"
RECODE = "recode"  # a Move's reason: re-code the session's copy in its tier (target) smaller, in place
RETRY_FIRST = 1.0  # seconds before a session whose move failed is moved again...
RETRY_MOST = 30.0  # ... doubling with each failure in a row, up to this


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    device_idle: float = 30.0  # seconds idle before device -> host
    host_idle: float = 600.0  # seconds idle before host -> disk
    writeback_idle: float | None = 10.0  # seconds idle before a disk copy is written (None: never)
    disk_ttl: float | None = None  # seconds idle before a session is dropped (None: never)
    high_watermark: float = 0.95  # demote when a tier is fuller than this
    low_watermark: float = 0.85  # ... until it is this full
    priority_weight: float = 60.0  # one priority step counts as this many seconds of recency
    tenant_quota: tuple[tuple[str, int], ...] = ()  # (tier, bytes) that each tenant may hold there
    tenant_sessions: int = 0  # sessions each tenant may hold (0: no limit)
    tenant_leases: int = 0  # leases each tenant may hold open (0: no limit)
    tenant_lease_bytes: int = 0  # bytes of open leases each tenant may hold (0: no limit)
    tenant_put_bytes: int = 0  # host bytes each tenant's Puts in progress may hold (0: no limit)
    tier_idle: tuple[tuple[str, float], ...] = ()  # (tier, seconds idle before leaving it) for tiers besides
    #                                                 device and host, whose thresholds are the fields above

    def idle(self, tier: str) -> float | None:
        """Seconds idle before a session leaves `tier` for the next lower one
        (None: it leaves only to make room). The engine landing tier (VRAM)
        and the landing tier (host) have fields of their own."""
        role = kind_of(tier).role if is_tier(tier) else ""
        if role == ENGINE_LANDING:
            return self.device_idle
        if role == LANDING:
            return self.host_idle
        return next((seconds for name, seconds in self.tier_idle if name == tier), None)

    def quota(self, tier: str) -> int | None:
        """Bytes of `tier` each tenant may hold, or None for no limit."""
        return dict(self.tenant_quota).get(tier)

    def __post_init__(self) -> None:
        for name in ("device_idle", "host_idle", "writeback_idle", "disk_ttl"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        for tier, value in self.tier_idle:
            if value < 0:
                raise ValueError(f"the idle time of the {tier} tier must not be negative, got {value}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")


@dataclass(frozen=True, slots=True)
class SessionView:
    """What policy may know of a session."""

    key: SessionKey
    tier_bytes: Mapping[str, int]  # bytes held in each tier
    last_access: float
    released_at: float | None  # None: in use by the engine
    priority: int = 0
    pinned: bool = False
    busy: bool = False  # a move or a data call holds it
    durable: bool = False
    awaited: bool = False  # prefetched and not yet used: the engine is about to come
    retry_at: float | None = None  # a move of it failed: no idle or pressure move before this time
    recodable: tuple[str, ...] = ()  # tiers whose copy of it may be re-coded smaller in place (RECODE)


@dataclass(frozen=True, slots=True)
class Move:
    """Make `key` live no faster than `target` (a tier name), keep a copy in
    the durable tier (target that tier with keep=True), or drop it (target
    DROP). An eviction (evict=True) may make room in the target by evicting
    its least valuable sessions, down to dropping them; any other move takes
    only room the target has free, or stays where it is."""

    key: SessionKey
    target: str
    reason: str
    keep: bool = False
    evict: bool = False


def retry_delay(failures: int) -> float:
    """Seconds before a session whose moves failed `failures` (1 or more) times in a row is moved again."""
    return min(RETRY_MOST, RETRY_FIRST * 2.0 ** min(failures - 1, 16))


def _held_off(v: SessionView, now: float) -> bool:
    return v.retry_at is not None and now < v.retry_at


def _value(v: SessionView, cfg: PolicyConfig) -> float:
    return v.last_access + v.priority * cfg.priority_weight


def _next_lower(tier: str, present: Iterable[str]) -> str:
    order = tier_order(present)
    lower = order[order.index(tier) + 1 :] if tier in order else ()
    return lower[0] if lower else DROP


def eviction_order(views: Iterable[SessionView], tier: str, cfg: PolicyConfig) -> list[SessionView]:
    """Sessions holding bytes in `tier` that may leave it, least valuable first:
    least recently used, each priority step worth priority_weight seconds;
    sessions prefetched and not yet used after all the others; pinned and busy
    sessions never."""
    movable = [v for v in views if v.tier_bytes.get(tier) and not v.pinned and not v.busy]
    return sorted(movable, key=lambda v: (v.awaited, _value(v, cfg), v.key))


def _recodes(order: list[SessionView], tier: str, need: int, shrink: float) -> tuple[list[Move], int]:
    """Re-codes in place, least valuable first, of the sessions whose copy in
    `tier` may be re-coded, each freeing `shrink` of its bytes there, until
    `need` bytes would be free: before any session leaves the tier."""
    moves, freed = [], 0
    for v in order if shrink > 0 else ():
        if freed >= need:
            break
        if tier in v.recodable:
            moves.append(Move(v.key, tier, RECODE))
            freed += int(shrink * v.tier_bytes[tier])
    return moves, freed


def plan_eviction(views: Iterable[SessionView], tier: str, need: int, present: Iterable[str],
                  cfg: PolicyConfig, reason: str = "capacity", drop: bool = True,
                  shrink: float = 0.0) -> list[Move] | None:
    """Moves that free at least `need` bytes of `tier`, or None if no set
    can: re-codes in place first, where the tier re-codes (shrink: the part
    of a session's bytes a re-code frees); then evictions, or with drop
    False, moves that evict nothing (none out of the lowest tier: its
    sessions would be dropped)."""
    target = _next_lower(tier, present)
    order = eviction_order(views, tier, cfg)
    moves, freed = _recodes(order, tier, need, shrink)
    recoded = {mv.key for mv in moves}
    for v in order if drop or target != DROP else ():
        if freed >= need:
            break
        if v.key not in recoded:
            moves.append(Move(v.key, target, reason, evict=drop))
            freed += v.tier_bytes[tier]
    return moves if freed >= need else None


def _idle_rules(v: SessionView, cfg: PolicyConfig, order: tuple[str, ...]) -> list[tuple[float, Move]]:
    """The idle moves that apply to a released session, first to last in
    precedence (a drop, then the deepest demotion first), each with the
    seconds idle it waits for. Demotion into order[i] waits for the idle time
    of order[i - 1], the tier it leaves, and applies while the session holds
    pages faster than order[i]."""
    rules = []
    if cfg.disk_ttl is not None:
        rules.append((cfg.disk_ttl, Move(v.key, DROP, "ttl")))
    fastest = next((i for i, t in enumerate(order) if v.tier_bytes.get(t)), len(order))
    for i in range(len(order) - 1, fastest, -1):
        after = cfg.idle(order[i - 1])
        if after is not None:
            rules.append((after, Move(v.key, order[i], "idle")))
    durable = durable_tier(order)
    if durable is not None and not v.durable and cfg.writeback_idle is not None:
        rules.append((cfg.writeback_idle, Move(v.key, durable, "writeback", keep=True)))
    return rules


def idle_moves(views: Iterable[SessionView], now: float, cfg: PolicyConfig, present: Iterable[str]) -> list[Move]:
    """Demotions, write-backs and TTL drops due for released sessions (none
    for a session held off after a failed move)."""
    order = tier_order(present)
    moves = []
    for v in views:
        if v.released_at is None or v.pinned or v.busy or _held_off(v, now):
            continue
        idle = now - v.released_at
        moves += [move for after, move in _idle_rules(v, cfg, order) if idle >= after][:1]
    return moves


def idle_due(v: SessionView, cfg: PolicyConfig, present: Iterable[str]) -> float | None:
    """When idle_moves first has a move for this session if nothing about it
    changes but the clock; None if it never will (in use, pinned, or where
    nothing applies: durable, on disk only, no TTL); not before its retry
    time. Busy is not looked at: a busy session is due again as soon as it is not."""
    if v.released_at is None or v.pinned:
        return None
    rules = _idle_rules(v, cfg, tier_order(present))
    if not rules:
        return None
    due = v.released_at + min(after for after, _ in rules)
    return due if v.retry_at is None else max(due, v.retry_at)


def under_pressure(tier: str, used: int, budget: int, cfg: PolicyConfig, present: Iterable[str]) -> bool:
    """Whether pressure_moves has anything to say of the tier: it holds more
    than the high watermark of its budget, or, the lowest tier, more than its
    budget (what leaves it is dropped)."""
    high = 1.0 if _next_lower(tier, present) == DROP else cfg.high_watermark
    return budget > 0 and used > high * budget


def pressure_moves(views: Iterable[SessionView], tier: str, used: int, budget: int, cfg: PolicyConfig,
                   present: Iterable[str], now: float, shrink: float = 0.0) -> list[Move]:
    """Above the high watermark, re-code sessions in place where the tier
    re-codes (shrink, as plan_eviction), then demote least valuable sessions
    until the tier would be at the low watermark (as far as movable sessions
    allow). Out of the lowest tier they would be dropped: there, only what is
    over the budget goes (a budget lowered across a restart), never while the
    tier has room. A session held off after a failed move is left, its bytes
    counted as if moved: more valuable sessions do not go in its place."""
    if not under_pressure(tier, used, budget, cfg, present):
        return []
    target = _next_lower(tier, present)
    need = used - (budget if target == DROP else int(cfg.low_watermark * budget))
    order = [v for v in eviction_order(views, tier, cfg) if not _held_off(v, now)]
    moves, freed = _recodes(order, tier, need, shrink)
    recoded = {mv.key for mv in moves}
    for v in eviction_order(views, tier, cfg):
        if freed >= need:
            break
        if v.key in recoded:
            continue
        if not _held_off(v, now):
            moves.append(Move(v.key, target, "pressure", evict=True))
        freed += v.tier_bytes[tier]
    return moves


def budget_moves(views: Iterable[SessionView], tier: str, used: int, new_budget: int, cfg: PolicyConfig,
                 present: Iterable[str]) -> list[Move] | None:
    """Moves that bring `tier` within a new budget, or None if pinned or busy
    sessions hold more than it allows."""
    if used <= new_budget:
        return []
    return plan_eviction(views, tier, used - new_budget, present, cfg, reason="budget")


def advise(nbytes: int, source_tier: str, bandwidth: float, num_tokens: int, prefill_tokens_per_s: float) -> Advice:
    """Restore when moving the bytes from where they are beats recomputing the tokens."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be positive")
    restore = nbytes / bandwidth if bandwidth > 0 else float("inf")
    return Advice(restore, num_tokens / prefill_tokens_per_s, source_tier, bandwidth)
