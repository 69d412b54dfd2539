"""A short chaos campaign with a fixed seed (`make chaos` runs long ones):
two daemons on a Redis Cluster behind a faulty network, three tenants'
workers, every kind of fault at random, every read checked against the
model. Nothing wrong is served, no tenant sees another's, nothing reported
durable is lost, the daemons answer after each fault, their accounting and
memory hold."""

import shutil

import pytest

from bench.chaos.campaign import run
from bench.chaos.report import failed, summary

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
SECONDS = 60.0


@pytest.mark.timeout(600)
def test_a_seeded_campaign_serves_nothing_wrong_and_loses_nothing_durable(tmp_path):
    campaign, model = run(seed=6, seconds=SECONDS, root=str(tmp_path), log=lambda line: None)
    t = model.tally
    line = summary(campaign, model)
    assert not failed(campaign, model), line + "\n" + "\n".join(t.findings)
    # It ran: reads were checked and faults of several kinds injected.
    assert t.reads_checked > 200 and t.pages_checked > t.reads_checked, line
    assert len({kind.split()[0] for kind in t.faults}) >= 5 and sum(t.faults.values()) >= 15, line
