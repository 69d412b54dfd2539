import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd.tiers.allocator import ExtentAllocator

G = 4096


def test_alloc_free_coalesces_back_to_one_extent():
    a = ExtentAllocator(64 * G)
    a.add_slab()
    offs = [a.alloc(G * 3) for _ in range(5)]
    assert offs == sorted(offs) and len(set(offs)) == 5
    assert a.used == 15 * G
    for o in offs[::2] + offs[1::2]:
        a.free(o, G * 3)
    assert a.used == 0
    assert a.alloc(64 * G) == 0  # whole slab again: neighbours were merged


def test_extents_never_cross_slabs():
    a = ExtentAllocator(8 * G)
    a.add_slab()
    a.add_slab()
    assert a.alloc(8 * G) == 0
    assert a.alloc(8 * G) == 8 * G
    a.free(0, 8 * G)
    a.free(8 * G, 8 * G)
    assert a.alloc(9 * G) is None  # 16 pages free, but in two slabs


def test_double_free_and_foreign_free_are_refused():
    a = ExtentAllocator(8 * G)
    a.add_slab()
    o = a.alloc(G)
    a.free(o, G)
    with pytest.raises(ValueError, match="double free"):
        a.free(o, G)
    with pytest.raises(ValueError, match="outside"):
        a.free(100 * G, G)


def test_alloc_pages_splits_when_fragmented_and_is_all_or_nothing():
    a = ExtentAllocator(16 * G)
    a.add_slab()
    held = [a.alloc(G) for _ in range(16)]
    for o in held[::2]:  # free every other page: 8 holes of one page
        a.free(o, G)
    assert a.alloc(2 * G) is None
    pieces = a.alloc_pages(8, G)
    assert pieces is not None and len(pieces) == 8
    assert sum(p.n_pages for p in pieces) == 8
    assert sorted(p.first_page for p in pieces) == list(range(8))
    for p in pieces:
        a.free(p.offset, p.alloc_bytes)
    used = a.used
    assert a.alloc_pages(9, G) is None  # only 8 pages free: nothing taken
    assert a.used == used


def test_reserve_all_rebuilds_free_space_from_used_ranges():
    a = ExtentAllocator(16 * G)
    a.add_slab()
    a.add_slab()
    a.reserve_all([(0, G), (5 * G, 2 * G), (16 * G, 16 * G)])
    assert a.used == 19 * G
    assert a.alloc(4 * G) == G  # the gap between 1 and 5
    with pytest.raises(ValueError, match="overlap"):
        ExtentAllocator(16 * G).reserve_all([(0, 2 * G), (G, G)])


def test_remove_last_slab_only_when_empty():
    a = ExtentAllocator(4 * G)
    a.add_slab()
    a.add_slab()
    o = a.alloc(4 * G)
    o2 = a.alloc(4 * G)
    assert not a.remove_last_slab()
    a.free(o2, 4 * G)
    assert a.remove_last_slab() and a.num_slabs == 1
    a.free(o, 4 * G)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=120), st.integers(0, 2**32))
def test_random_alloc_free_keeps_extents_disjoint_and_accounted(ops, seed):
    rnd = random.Random(seed)
    a = ExtentAllocator(64 * G)
    for _ in range(3):
        a.add_slab()
    live: dict[int, int] = {}
    for is_alloc, pages in ops:
        if is_alloc or not live:
            o = a.alloc(pages * G)
            if o is not None:
                assert o % G == 0 and (o // (64 * G)) == ((o + pages * G - 1) // (64 * G))
                live[o] = pages * G
        else:
            o = rnd.choice(list(live))
            a.free(o, live.pop(o))
        spans = sorted(live.items())
        for (s0, n0), (s1, _) in zip(spans, spans[1:]):
            assert s0 + n0 <= s1
        assert a.used == sum(live.values())
        assert a.free_bytes == a.capacity - a.used
    for o, n in list(live.items()):
        a.free(o, n)
    for slab in range(3):
        assert a.slab_is_free(slab)
