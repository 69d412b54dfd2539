"""The tiers' roles as the core asks them (tierd/core/roles.py): built from
the registry, whatever the tiers present are named."""

import pytest

from tierd.core.roles import TierRoles
from tierd.tiers import DEVICE, DISK, HOST, REMOTE


def test_saves_land_in_device_memory_only_where_a_tier_takes_that_role():
    with_device = TierRoles.of([DISK, HOST, DEVICE])
    assert (with_device.saves_land(True), with_device.saves_land(False)) == (DEVICE, HOST)
    host_only = TierRoles.of([HOST, DISK])
    assert (host_only.saves_land(True), host_only.durable, host_only.versions) == (HOST, DISK, REMOTE)
    assert TierRoles.of([HOST]).durable is None


def test_tiers_without_a_landing_tier_are_refused():
    with pytest.raises(ValueError, match="landing role is required"):
        TierRoles.of([DEVICE, DISK])
