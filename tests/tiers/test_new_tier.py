"""A fourth tier added the way the tiers' docstring says: one module (its class
and its register() line), one builder in the machine's list. Nothing else
of tierd learns its name, and yet sessions demote into it and out of it,
are served from it, make room in it and count in its stats, and the copy
routes of its medium carry its bytes."""

import numpy as np
import pytest

from tests.helpers import SPEC as ENGINE_SPEC
from tests.helpers import HostEngine, MiB, wait_for
from tierd.clock import FakeClock
from tierd.config import Config
from tierd.core.store import make_key
from tierd.errors import InvalidArgument
from tierd.layout import KVSpec
from tierd.machine import TIERS, build
from tierd.policy import PolicyConfig
from tierd.tiers import MEMORY, TierKind, kind_of, register, tier_order
from tierd.tiers.slabs import SlabTier

# -- the tier's module: a memory tier of plain numpy slabs between host and disk --

CXL = register(TierKind("cxl", 25, MEMORY, bandwidth=20e9))


class CxlTier(SlabTier):
    name = CXL
    backend = "numpy"

    def __init__(self, budget: int, slab_bytes: int) -> None:
        super().__init__(budget, slab_bytes)
        self._slabs: dict[int, np.ndarray] = {}

    def _open_slab(self, index: int) -> None:
        self._slabs[index] = np.zeros(self.slab_bytes, np.uint8)

    def _close_slab(self, index: int) -> None:
        self._slabs.pop(index, None)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        slab, off = self.locate(offset, nbytes)
        return self._slabs[slab][off : off + nbytes]


def cxl_tier(site):
    return CxlTier(32 * MiB, 8 * MiB), "32MiB of numpy slabs"


# -- the tests ----------------------------------------------------------------

SPEC = KVSpec.opaque("test/opaque", page_bytes=64 << 10)
HOST_IDLE, CXL_IDLE = 10.0, 100.0


@pytest.fixture
def machine(tmp_path):
    cfg = Config(data_dir=str(tmp_path), host_budget=16 * MiB, host_slab=8 * MiB, disk_budget=64 * MiB,
                 disk_slab=16 * MiB, disk_io="posix", device="none", io_workers=2, movers=1)
    policy = PolicyConfig(host_idle=HOST_IDLE, writeback_idle=None, tier_idle=((CXL, CXL_IDLE),))
    m = build(cfg, policy=policy, clock=FakeClock(), tiers=(*TIERS, cxl_tier))
    yield m
    m.close(flush=False)


def _put(store, name: str, nbytes: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    store.put(make_key("t", name), SPEC, 0, nbytes, [data])
    return data


def _read(store, name: str) -> bytes:
    _, reader = store.get(make_key("t", name))
    return b"".join(bytes(c) for c in reader)


def _idle(store, seconds: float) -> None:
    store.clock.advance(seconds)
    store.tick()
    assert store.drain(30)


def test_the_new_tier_takes_its_place_in_the_order(machine):
    store = machine.store
    assert tier_order(machine.tiers) == ("host", CXL, "disk")
    assert [t.name for t in store.stats()] == ["host", CXL, "disk"]
    assert kind_of(CXL).medium == MEMORY and machine.tiers[CXL].medium == MEMORY


def test_sessions_go_down_through_the_new_tier_and_come_back_byte_exact(machine):
    store = machine.store
    key = make_key("t", "a")
    data = _put(store, "a", 3 * MiB + 123, seed=1)
    store.release(key)
    # host -> cxl once the session has been idle for host_idle ...
    _idle(store, HOST_IDLE + 1)
    info = store.stat(key)
    assert info.tier == CXL and set(info.tier_bytes) == {CXL}
    assert _read(store, "a") == data
    store.release(key)
    # ... and cxl -> disk after cxl's own idle time (the Get reset the clock)
    _idle(store, HOST_IDLE + 1)
    assert store.stat(key).tier == CXL
    _idle(store, CXL_IDLE)
    info = store.stat(key)
    assert info.tier == "disk" and info.durable and set(info.tier_bytes) == {"disk"}
    # a prefetch into the new tier promotes from disk through its routes
    assert store.prefetch(key, CXL) == "queued"
    wait_for(lambda: store.ready(key, CXL)[0], what="the prefetch into cxl")
    assert store.stat(key).tier_bytes.keys() == {CXL, "disk"}
    assert _read(store, "a") == data
    assert not store.check_accounting()


def test_room_made_in_host_goes_to_the_new_tier_first(machine):
    store = machine.store
    datas = {f"s{i}": _put(store, f"s{i}", 4 * MiB, seed=i) for i in range(3)}
    for name in datas:
        store.release(make_key("t", name))
    result = store.set_budget("host", 4 * MiB)
    assert result.moved_sessions >= 2
    tiers = {name: store.stat(make_key("t", name)).tier for name in datas}
    assert sorted(tiers.values()) == [CXL, CXL, "host"]
    for name, data in datas.items():
        assert _read(store, name) == data
    assert not store.check_accounting()


def test_a_save_may_land_in_the_new_tier_and_prefetch_may_target_it_not_the_disk(machine):
    store = machine.store
    engine = HostEngine(num_blocks=16, seed=5)
    key = make_key("t", "b")
    store.save(key, engine.memory, ENGINE_SPEC, [3, 4, 5], num_tokens=40, tier=CXL)
    assert store.stat(key).tier == CXL
    store.restore(key, engine.memory, ENGINE_SPEC, [9, 1, 12])
    assert engine.pages([9, 1, 12]) == engine.pages([3, 4, 5])
    with pytest.raises(InvalidArgument, match=r"a memory tier of this machine \('host', 'cxl'\), not 'disk'"):
        store.save(key, engine.memory, ENGINE_SPEC, [3, 4, 5], num_tokens=40, tier="disk")
    with pytest.raises(InvalidArgument, match=r"prefetch goes to a memory tier \(.*'cxl'.*\), not 'disk'"):
        store.prefetch(key, "disk")
    assert store.stat(key).tier == CXL and not store.check_accounting()
