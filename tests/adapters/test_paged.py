"""Engine KV tensors as pages: the copies the vLLM connector makes between
its blocks and a lease's rows in the host arena."""

import numpy as np
import pytest
import torch

from tierd.adapters.paged import LayerBlocks
from tierd.transfer.runs import id_runs

LAYERS, BLOCKS, HEADS, TOKENS, C = 3, 12, 2, 4, 16


def page(tensors, block):
    return b"".join(t[block].contiguous().numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("order", ["layer_outermost", "block_outermost"])
def test_gather_then_scatter_moves_whole_pages(order):
    g = torch.Generator().manual_seed(0)
    if order == "layer_outermost":
        tensors = [torch.randn(BLOCKS, HEADS, TOKENS, C, generator=g) for _ in range(LAYERS)]
    else:  # one buffer [blocks, layers, ...]: each layer's view strides over the others
        buf = torch.randn(BLOCKS, LAYERS, HEADS, TOKENS, C, generator=g)
        tensors = [buf[:, layer] for layer in range(LAYERS)]
    kv = LayerBlocks(tensors)
    assert kv.page_bytes == LAYERS * HEADS * TOKENS * C * 4 and kv.num_blocks == BLOCKS
    blocks = [5, 6, 7, 2, 9]
    rows = np.zeros((len(blocks), kv.page_bytes + 512), dtype=np.uint8)[:, : kv.page_bytes]  # strided like a slot
    kv.gather(blocks, rows)
    assert [r.tobytes() for r in rows] == [page(tensors, b) for b in blocks]
    want = [page(tensors, b) for b in blocks]
    for t in tensors:
        t.zero_()
    kv.scatter(rows, [0, 1, 2, 10, 11])
    assert [page(tensors, b) for b in [0, 1, 2, 10, 11]] == want
    assert not any(t[3:10].any() for t in tensors)  # nothing else was written


def test_scatter_of_one_layer_leaves_the_others():
    tensors = [torch.zeros(BLOCKS, HEADS, TOKENS, C) for _ in range(LAYERS)]
    kv = LayerBlocks(tensors)
    rows = np.full((2, kv.page_bytes), 0x3F, dtype=np.uint8)
    kv.scatter(rows, [4, 5], layers=[1])
    assert tensors[1][4:6].all() and not tensors[0].any() and not tensors[2].any()


def test_runs_of_consecutive_blocks():
    assert list(id_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(id_runs([])) == []


def test_bad_shapes_are_refused():
    kv = LayerBlocks([torch.zeros(BLOCKS, HEADS, TOKENS, C) for _ in range(LAYERS)])
    with pytest.raises(ValueError, match="rows"):
        kv.gather([1, 2], np.zeros((3, kv.page_bytes), dtype=np.uint8))
    with pytest.raises(ValueError, match="rows"):
        kv.scatter(np.zeros((1, kv.page_bytes - 1), dtype=np.uint8), [1])
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 12\)"):
        kv.gather([12], np.zeros((1, kv.page_bytes), dtype=np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        LayerBlocks([torch.zeros(HEADS, BLOCKS, TOKENS, C).transpose(0, 1)])  # a block's heads lie apart
    with pytest.raises(ValueError, match="no KV tensors"):
        LayerBlocks([])
