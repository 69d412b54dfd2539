"""llama.cpp's shape: a 42,603-token, 28-layer snapshot restored into a block
table of 4 runs costs runs x layers x 2 copies, not one per block."""

import numpy as np
import pytest

from tests.helpers import Harness, HostEngine
from tierd.core.store import make_key
from tierd.layout import KVSpec

MiB = 1 << 20
# 28 layers like Qwen2.5-7B, with 1 head of 8 dims so the test stays small: 896 bytes per token.
SPEC = KVSpec("test/qwen-shape", num_layers=28, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)
TOKENS = 42_603
PAGES = SPEC.pages_for_tokens(TOKENS)  # 2663
RUNS = [range(0, 700), range(1000, 1700), range(2000, 2600), range(3000, 3663)]
K = make_key("default", "long")


def _same_blocks(out: HostEngine, out_blocks, src: HostEngine, src_blocks) -> bool:
    for seg in src.layout.segments:
        a = out.regions[seg.region].reshape(-1, seg.stride)[out_blocks, : seg.nbytes]
        b = src.regions[seg.region].reshape(-1, seg.stride)[src_blocks, : seg.nbytes]
        if not np.array_equal(a, b):
            return False
    return True


@pytest.fixture
def saved(tmp_path):
    h = Harness(str(tmp_path), host_budget=128 * MiB, host_slab=64 * MiB, disk_budget=128 * MiB, disk_slab=64 * MiB)
    store = h.open()
    src = HostEngine(SPEC, num_blocks=3700, seed=1)
    store.save(K, src.memory, SPEC, np.arange(PAGES), TOKENS)
    yield h, store, src
    h.close()


def test_fragmented_restore_costs_runs_times_layers_times_two(saved):
    _, store, src = saved
    table = np.concatenate([np.arange(r.start, r.stop) for r in RUNS])
    assert table.size == PAGES
    out = HostEngine(SPEC, num_blocks=3700, seed=2)
    ops = store.copier.copy_ops
    result = store.restore(K, out.memory, SPEC, table)
    assert store.copier.copy_ops - ops == len(RUNS) * SPEC.num_layers * 2 == 224
    assert result.num_tokens == TOKENS
    assert _same_blocks(out, table, src, np.arange(PAGES))


def test_contiguous_restore_is_one_copy_per_segment(saved):
    _, store, src = saved
    out = HostEngine(SPEC, num_blocks=3700, seed=3)
    ops = store.copier.copy_ops
    store.restore(K, out.memory, SPEC, np.arange(500, 500 + PAGES))
    assert store.copier.copy_ops - ops == SPEC.num_layers * 2
    assert _same_blocks(out, np.arange(500, 500 + PAGES), src, np.arange(PAGES))


def test_from_disk_each_bounce_window_adds_at_most_one_split(saved):
    _, store, src = saved
    store.demote(K)
    table = np.concatenate([np.arange(r.start, r.stop) for r in RUNS])
    out = HostEngine(SPEC, num_blocks=3700, seed=4)
    ops = store.copier.copy_ops
    store.restore(K, out.memory, SPEC, table)
    windows = -(-PAGES * SPEC.page_bytes // store.copier.window_bytes)
    assert store.copier.copy_ops - ops <= (len(RUNS) + windows) * SPEC.num_layers * 2
    assert _same_blocks(out, table, src, np.arange(PAGES))


def test_restore_through_a_differently_split_layout_uses_a_byte_cursor(saved):
    # Saved through 56 per-layer K/V segments, restored through one cross-layer
    # segment: the partition differs, the bytes are the same.
    _, store, src = saved
    cross = HostEngine(SPEC, num_blocks=PAGES, kind="cross_layer", seed=5)
    store.restore(K, cross.memory, SPEC, np.arange(PAGES))
    pages = cross.regions[0].reshape(PAGES, SPEC.page_bytes)
    for i in (0, 1, 1234, PAGES - 1):
        assert pages[i].tobytes() == src.page(i)
