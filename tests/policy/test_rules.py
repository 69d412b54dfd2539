import pytest

from tierd.policy import (
    PolicyConfig,
    SessionView,
    advise,
    budget_moves,
    eviction_order,
    idle_due,
    idle_moves,
    plan_eviction,
    pressure_moves,
)
from tierd.types import SessionKey

CFG = PolicyConfig(device_idle=30, host_idle=600, writeback_idle=10, priority_weight=60)
ALL = ("device", "host", "disk")


def view(name, tiers, last=0.0, released=0.0, **kw):
    return SessionView(SessionKey("t", name), tiers, last, released, **kw)


def test_idle_demotion_steps_down_one_threshold_at_a_time():
    s = view("a", {"device": 100}, released=1000.0)
    # released at 1000: idle 5 s -> nothing; 11 s -> write a disk copy; 31 s -> host; 601 s -> disk
    assert idle_moves([s], 1005, CFG, ALL) == []
    assert [(m.target, m.reason, m.keep) for m in idle_moves([s], 1011, CFG, ALL)] == [("disk", "writeback", True)]
    assert [(m.target, m.reason) for m in idle_moves([s], 1031, CFG, ALL)] == [("host", "idle")]
    assert [(m.target, m.reason) for m in idle_moves([s], 1601, CFG, ALL)] == [("disk", "idle")]


def test_active_pinned_busy_and_durable_sessions_stay():
    now = 10_000.0
    views = [view("active", {"host": 1}, released=None), view("pinned", {"host": 1}, pinned=True),
             view("busy", {"host": 1}, busy=True), view("durable", {"host": 1}, released=now - 20, durable=True)]
    assert idle_moves(views, now, CFG, ALL) == []


def test_no_disk_tier_means_no_disk_moves():
    s = view("a", {"host": 100}, released=0.0)
    assert idle_moves([s], 10_000, CFG, ("host",)) == []


def test_ttl_drops():
    cfg = PolicyConfig(disk_ttl=3600)
    s = view("a", {"disk": 100}, released=0.0, durable=True)
    assert [m.target for m in idle_moves([s], 3600, cfg, ALL)] == ["drop"]


def test_eviction_order_is_lru_weighted_by_priority_and_never_pinned():
    views = [view("old", {"host": 1}, last=100), view("new", {"host": 1}, last=200),
             view("old-important", {"host": 1}, last=50, priority=3),  # 50 + 3 * 60 = 230
             view("pinned", {"host": 1}, last=0, pinned=True), view("elsewhere", {"disk": 1}, last=0)]
    assert [v.key.session_id for v in eviction_order(views, "host", CFG)] == ["old", "new", "old-important"]


def test_plan_eviction_is_all_or_nothing():
    views = [view("a", {"host": 40}, last=1), view("b", {"host": 40}, last=2), view("p", {"host": 100}, pinned=True)]
    plan = plan_eviction(views, "host", 60, ALL, CFG)
    assert [(m.key.session_id, m.target) for m in plan] == [("a", "disk"), ("b", "disk")]
    assert plan_eviction(views, "host", 81, ALL, CFG) is None
    assert [m.target for m in plan_eviction(views, "disk", 0, ALL, CFG)] == []
    d = [view("a", {"disk": 40})]
    assert [m.target for m in plan_eviction(d, "disk", 10, ALL, CFG)] == ["drop"]


def test_a_tier_that_recodes_recodes_its_recodable_sessions_before_any_leaves_it():
    views = [view("a", {"host": 40}, last=1, recodable=("host",)), view("b", {"host": 40}, last=2),
             view("c", {"host": 40}, last=3, recodable=("host",)), view("p", {"host": 40}, pinned=True,
                                                                     recodable=("host",))]
    plan = plan_eviction(views, "host", 40, ALL, CFG, shrink=0.5)  # a re-code frees half: a and c, no eviction
    assert [(m.key.session_id, m.target, m.reason) for m in plan] == [("a", "host", "recode"), ("c", "host", "recode")]
    plan = plan_eviction(views, "host", 60, ALL, CFG, shrink=0.5)  # more: then b leaves, never a re-coded one
    assert [(m.key.session_id, m.reason) for m in plan] == [("a", "recode"), ("c", "recode"), ("b", "capacity")]
    assert plan_eviction(views, "host", 81, ALL, CFG, shrink=0.5) is None  # 20 + 20 + 40 is all it can
    assert [m.reason for m in plan_eviction(views, "host", 40, ALL, CFG)] == ["capacity"]  # no shrink: no re-code
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.5)
    moves = pressure_moves(views, "host", 160, 160, cfg, ALL, 0, shrink=0.5)
    assert [(m.key.session_id, m.reason) for m in moves] == [("a", "recode"), ("c", "recode"), ("b", "pressure")]


def test_budget_shrink_plans_demotions_or_refuses():
    views = [view("a", {"device": 50}, last=1), view("b", {"device": 50}, last=2, pinned=True)]
    assert budget_moves(views, "device", 100, 200, CFG, ALL) == []
    assert [(m.key.session_id, m.target) for m in budget_moves(views, "device", 100, 50, CFG, ALL)] == [("a", "host")]
    assert budget_moves(views, "device", 100, 40, CFG, ALL) is None


def test_pressure_demotes_from_high_to_low_watermark():
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.5)
    views = [view(str(i), {"host": 10}, last=i) for i in range(10)]
    assert pressure_moves(views, "host", 90, 100, cfg, ALL, 0) == []
    moves = pressure_moves(views, "host", 95, 100, cfg, ALL, 0)
    assert [m.key.session_id for m in moves] == ["0", "1", "2", "3", "4"]  # 95 - 50 = 45 bytes: five sessions
    assert all(m.evict for m in moves)  # evictions: room in the disk tier may be made for them


def test_pressure_on_the_lowest_tier_drops_only_what_is_over_its_budget():
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.5)
    views = [view(str(i), {"disk": 10}, last=i) for i in range(12)]
    assert pressure_moves(views, "disk", 100, 100, cfg, ALL, 0) == []  # full, but nothing needs its room
    moves = pressure_moves(views, "disk", 120, 100, cfg, ALL, 0)  # over a budget lowered across a restart
    assert [(m.key.session_id, m.target) for m in moves] == [("0", "drop"), ("1", "drop")]


def test_room_made_for_a_move_that_evicts_nothing_drops_nothing():
    views = [view("a", {"host": 40}, last=1), view("d", {"disk": 40})]
    assert [(m.target, m.evict) for m in plan_eviction(views, "host", 10, ALL, CFG, drop=False)] == [("disk", False)]
    assert plan_eviction(views, "disk", 10, ALL, CFG, drop=False) is None
    assert plan_eviction(views, "disk", 0, ALL, CFG, drop=False) == []
    assert [(m.target, m.evict) for m in plan_eviction(views, "disk", 10, ALL, CFG)] == [("drop", True)]


def test_advise_compares_transfer_with_prefill():
    a = advise(10 << 30, "disk", 2e9, 40_000, 8_000)
    assert a.restore_seconds == pytest.approx(5.37, rel=0.01) and a.recompute_seconds == 5.0 and not a.restore
    assert advise(10 << 30, "host", 20e9, 40_000, 8_000).restore
    with pytest.raises(ValueError):
        advise(1, "host", 1, 1, 0)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        PolicyConfig(host_idle=-1)
    with pytest.raises(ValueError):
        PolicyConfig(low_watermark=0.9, high_watermark=0.5)


def test_sessions_awaited_after_a_prefetch_are_evicted_last():
    views = [view("awaited-old", {"host": 1}, last=10, awaited=True), view("recent", {"host": 1}, last=500),
             view("old", {"host": 1}, last=20)]
    assert [v.key.session_id for v in eviction_order(views, "host", CFG)] == ["old", "recent", "awaited-old"]


@pytest.mark.parametrize("cfg", [CFG, PolicyConfig(disk_ttl=300, writeback_idle=None)])
@pytest.mark.parametrize("present", [ALL, ("host", "disk"), ("host",)])
def test_idle_due_is_when_idle_moves_first_moves(cfg, present):
    """The store looks at a released session only when idle_due says: it must
    never be later than the first move idle_moves would make."""
    views = [view(f"{tiers}-{durable}-{pinned}", {t: 1 for t in tiers}, released=1000.0, durable=durable,
                  pinned=pinned)
             for tiers in (("device",), ("host",), ("disk",), ("device", "disk"), ("host", "disk"))
             for durable in (False, True) for pinned in (False, True)]
    views.append(view("active", {"host": 1}, released=None))
    views += [view(f"retry-{at}", {"host": 1}, released=1000.0, retry_at=at) for at in (1005.0, 1500.0, 1700.0)]
    for v in views:
        due = idle_due(v, cfg, present)
        moves_at = [t for t in (1000.0 + s for s in range(0, 2000, 1)) if idle_moves([v], t, cfg, present)]
        assert due == (moves_at[0] if moves_at else None), v


def test_a_session_whose_move_failed_is_not_moved_again_before_its_retry_time():
    s = view("a", {"host": 100}, released=0.0, retry_at=700.0)
    assert idle_moves([s], 650, CFG, ALL) == []  # idle past host_idle (600 s), but held off
    assert [(m.target, m.reason) for m in idle_moves([s], 700, CFG, ALL)] == [("disk", "idle")]
    assert idle_due(s, CFG, ALL) == 700.0
    # under pressure, the sessions held off are left, and more valuable ones do not take their place
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.5)
    views = [view(str(i), {"host": 10}, last=i, retry_at=700.0 if i < 2 else None) for i in range(10)]
    def pressed(now):
        return [m.key.session_id for m in pressure_moves(views, "host", 95, 100, cfg, ALL, now)]
    assert pressed(650) == ["2", "3", "4"]
    assert pressed(700) == ["0", "1", "2", "3", "4"]
    # eviction for room takes them as any other
    assert [m.key.session_id for m in plan_eviction(views, "host", 20, ALL, cfg)] == ["0", "1"]
