"""A model-based test: random sequences of store operations, restarts and
crashes, checked against a plain model of what was saved."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key
from tierd.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.policy import PolicyConfig
from tierd.tiers import tier_order

KiB = 1 << 10
BT = SPEC.block_tokens
KEYS = [make_key("default", n) for n in ("s0", "s1", "s2", "s3")]
MAX_PAGES = 8


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        # Budgets small enough that sessions get pushed down, disk big enough that none is dropped.
        self.h = Harness(self.dir.name, host_budget=256 * KiB, host_slab=256 * KiB, device_budget=128 * KiB,
                         disk_budget=4096 * KiB, disk_slab=1024 * KiB,
                         policy=PolicyConfig(device_idle=5, host_idle=20, writeback_idle=3))
        self.store = self.h.open()
        self.engine = HostEngine(num_blocks=64, seed=0)
        self.out = HostEngine(num_blocks=64, seed=1)
        self.seed = 0
        self.model = {}  # key -> (pages, tokens)
        self.durable = {}  # key -> (pages, tokens) of the state on disk: whole until a newer one is durable

    def teardown(self):
        if hasattr(self, "h"):
            self.h.close()
            self.dir.cleanup()

    def _blocks(self, n):
        self.seed += 1
        blocks = np.random.default_rng(self.seed).choice(64, size=n, replace=False)
        self.engine.randomize(blocks, self.seed)
        return blocks

    def _refresh_durable(self):
        for key, content in self.model.items():
            if self.store.stat(key).durable:
                self.durable[key] = content

    @rule(key=st.sampled_from(KEYS), tokens=st.integers(1, MAX_PAGES * BT // 2),
          tier=st.sampled_from([None, "device"]))
    def save(self, key, tokens, tier):
        n = -(-tokens // BT)
        blocks = self._blocks(n)
        try:
            self.store.save(key, self.engine.memory, SPEC, blocks, tokens, tier=tier)
        except ResourceExhausted:
            return  # too big for the landing tier right now: nothing changed (the invariants check)
        self.model[key] = (self.engine.pages(blocks), tokens)
        self._refresh_durable()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(1, 3 * BT))
    def append(self, data, extra):
        key = data.draw(st.sampled_from(sorted(self.model)))
        pages, tokens = self.model[key]
        start_page = tokens // BT  # rewrite the partial last block, if any
        new_tokens = min(tokens + extra, MAX_PAGES * BT)
        if new_tokens <= start_page * BT:
            return
        blocks = self._blocks(-(-new_tokens // BT) - start_page)
        try:
            self.store.save(key, self.engine.memory, SPEC, blocks, new_tokens, start_token=start_page * BT)
        except ResourceExhausted:
            return
        self.model[key] = (pages[:start_page] + self.engine.pages(blocks), new_tokens)
        self._refresh_durable()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def restore(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        pages, tokens = self.model[key]
        self.out.clear()
        result = self.store.restore(key, self.out.memory, SPEC, list(range(len(pages))))
        assert result.num_tokens == tokens
        assert self.out.pages(range(len(pages))) == pages

    @precondition(lambda self: self.model)
    @rule(data=st.data(), chunk=st.sampled_from([1000, 4096, 50_000]))
    def get(self, data, chunk):
        key = data.draw(st.sampled_from(sorted(self.model)))
        info, chunks = self.store.get(key, chunk)
        assert read_all(chunks) == b"".join(self.model[key][0])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        self.store.release(data.draw(st.sampled_from(sorted(self.model))))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(["host", "device"]))
    def prefetch(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.prefetch(key, tier)
        assert self.store.drain(30)
        self._refresh_durable()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.drop(key)
        del self.model[key]
        self.durable.pop(key, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), pin=st.booleans())
    def pin(self, data, pin):
        key = data.draw(st.sampled_from(sorted(self.model)))
        if pin:
            self.store.pin(key)
        else:
            try:
                self.store.unpin(key)
            except FailedPrecondition:
                assert self.store.stat(key).pins == 0

    @rule(budget=st.sampled_from([("host", 64), ("host", 128), ("host", 256), ("device", 0), ("device", 64),
                                  ("device", 128)]))
    def set_budget(self, budget):
        tier, kib = budget
        try:
            self.store.set_budget(tier, kib * KiB)
        except FailedPrecondition:
            pass
        self._refresh_durable()

    @rule(seconds=st.sampled_from([1, 4, 6, 25]))
    def idle(self, seconds):
        self.h.clock.advance(seconds)
        self.store.tick()
        assert self.store.drain(30)
        self._refresh_durable()

    @rule(crash=st.booleans())
    def restart(self, crash):
        self.store = self.h.reopen(flush=not crash)
        if not crash:
            self.durable = dict(self.model)
        self.model = dict(self.durable)
        assert sorted(self.store.keys()) == sorted(self.model)
        for key, (pages, tokens) in self.model.items():
            info = self.store.stat(key)
            assert info.durable and info.num_tokens == tokens and info.num_pages == len(pages)

    @invariant()
    def tiers_within_budget_and_no_leaks(self):
        if not hasattr(self, "store"):
            return
        saved = {t.name: t.saved for t in self.store.stats()}  # (a state kept for a store shares its allocations)
        for name, tier in self.store.tiers.items():
            keys = self.store.keys()
            held = sum(self.store.stat(k).tier_bytes.get(name, 0) for k in keys) - saved[name]
            assert held == tier.used, f"{name}: sessions hold {held}, allocator says {tier.used}"
            assert tier.used <= tier.budget or name == "disk"
            spans = sorted((p.offset, p.alloc_bytes) for k in keys for p in self.store.pieces(k, name))
            for (a, n), (b, _) in zip(spans, spans[1:]):
                assert a + n <= b, f"{name}: pieces overlap"
        assert self.store.check_accounting() == []  # per tenant, and with open leases, too

    @invariant()
    def sessions_match_the_model(self):
        if not hasattr(self, "store"):
            return
        assert sorted(self.store.keys()) == sorted(self.model)
        for key, (pages, tokens) in self.model.items():
            info = self.store.stat(key)
            assert (info.num_tokens, info.num_pages) == (tokens, len(pages)) and info.pins >= 0
            assert info.tier in tier_order()


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStore = StoreMachine.TestCase


def test_unknown_session_is_not_found(store):
    try:
        store.stat(make_key("default", "nope"))
    except NotFound as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("stat of an unknown session succeeded")
