import numpy as np
import pytest

from tierd.transfer.runs import Span, block_runs, overlap_runs


def test_contiguous_blocks_from_one_extent_are_one_run():
    runs = block_runs([Span(0, 10, "host", 0)], np.arange(100, 110), 4096)
    assert [(r.page, r.count, r.block, r.offset) for r in runs] == [(0, 10, 100, 0)]


def test_runs_break_at_block_gaps_and_extent_edges():
    # pages 0-5 in one extent, 6-9 in another; blocks jump after page 3
    spans = [Span(0, 6, "host", 0), Span(6, 4, "disk", 40960)]
    ids = np.array([10, 11, 12, 13, 50, 51, 52, 53, 54, 55])
    runs = block_runs(spans, ids, 4096)
    assert [(r.page, r.count, r.tier, r.block) for r in runs] == [
        (0, 4, "host", 10), (4, 2, "host", 50), (6, 4, "disk", 52)]
    assert runs[2].offset == 40960


def test_first_page_offsets_an_append():
    runs = block_runs([Span(0, 8, "host", 0)], np.array([7, 8, 9]), 8192, first_page=5)
    assert [(r.page, r.count, r.offset, r.block) for r in runs] == [(5, 3, 5 * 8192, 7)]


def test_uncovered_pages_are_an_error():
    with pytest.raises(ValueError, match="cover 2 of 3"):
        block_runs([Span(0, 2, "host", 0)], np.array([1, 2, 3]), 4096)


def test_overlap_runs_pair_source_and_destination_extents():
    src = [Span(0, 3, "disk", 0), Span(3, 5, "disk", 100 * 4096)]
    dst = [Span(0, 5, "host", 0), Span(5, 3, "host", 50 * 4096)]
    runs = overlap_runs(src, dst, 4096)
    assert [(r.page, r.count, r.src_offset, r.dst_offset) for r in runs] == [
        (0, 3, 0, 0), (3, 2, 100 * 4096, 3 * 4096), (5, 3, 102 * 4096, 50 * 4096)]
