"""The campaign's one summary line and its verdict. Runs in the campaign's process."""

from __future__ import annotations

MiB = 1 << 20


def over(campaign) -> int:
    """Daemons whose heap passed its bound at some point."""
    return sum(campaign.heap_peak[i] > campaign.heap_bound(i) for i in range(len(campaign.nodes)))


def failed(campaign, model) -> bool:
    t = model.tally
    return bool(t.wrong_bytes or t.cross_tenant or t.durable_lost or t.resurrected or t.liveness or t.accounting
                or t.unexpected or over(campaign))


def summary(campaign, model) -> str:
    t = model.tally
    faults = ", ".join(f"{k} {n}" for k, n in sorted(t.faults.items()))
    errors = ", ".join(f"{k} {n}" for k, n in sorted(t.errors.items())) or "none"
    heap = "; ".join(f"node {i} {campaign.heap_peak[i] / MiB:.0f} of {campaign.heap_bound(i) / MiB:.0f} MiB"
                     for i in range(len(campaign.nodes)))
    return (f"chaos seed {campaign.seed}, {campaign.seconds / 60:.1f} min: {sum(t.ops.values())} operations; "
            f"faults {sum(t.faults.values())} ({faults}); reads checked {t.reads_checked} ({t.pages_checked} pages); "
            f"clean errors: {errors}; wrong bytes {t.wrong_bytes}; cross-tenant reads {t.cross_tenant}; "
            f"durable sessions lost {t.durable_lost} (asked for at the end: {t.final_checked}; NOT_FOUND "
            f"while the remote tier was down: {t.unserved}); dropped sessions served {t.resurrected}; "
            f"liveness violations {t.liveness}; accounting violations {t.accounting}; "
            f"unexpected errors {t.unexpected}; "
            f"peak heap: {heap}{' OVER' if over(campaign) else ''}")
