
import numpy as np
import pytest

from tests.helpers import SPEC, HostEngine, host_tier
from tierd.errors import DataLoss, InvalidArgument
from tierd.layout import KVSpec
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import Geometry, Span

MiB = 1 << 20


@pytest.fixture
def host():
    tier = host_tier(32 * MiB, 16 * MiB)
    yield tier
    tier.close()


def _spans(host, n_pages, page_bytes, first_page=0):
    geom = Geometry(page_bytes, first_page + n_pages, page_bytes)
    pieces = host.alloc_pages(n_pages, geom.stride)
    return [Span(p.first_page + first_page, p.n_pages, "host", p.offset) for p in pieces], geom


@pytest.mark.parametrize("kind", ["layer_major", "cross_layer"])
def test_gather_then_scatter_is_byte_exact_with_one_copy_per_run_and_segment(host, kind):
    src = HostEngine(SPEC, 64, kind, seed=1)
    dst = HostEngine(SPEC, 64, kind, seed=2)
    copier = CopyEngine({"host": host})
    blocks = np.array([5, 6, 7, 20, 21, 40])  # 3 runs
    spans, geom = _spans(host, len(blocks), SPEC.page_bytes)
    copier.gather(src.memory, blocks, spans, geom, 0)
    sums = copier.checksums(spans, geom)
    segs = len(src.layout.segments)
    assert copier.copy_ops == 3 * segs
    target = np.array([0, 1, 2, 3, 4, 5])  # 1 run
    copier.scatter(spans, dst.memory, target, geom, sums)
    assert copier.copy_ops == 3 * segs + segs
    assert dst.pages(target) == src.pages(blocks)


@pytest.mark.parametrize("kind", ["layer_major", "cross_layer"])
def test_gather_hashes_each_chunk_as_it_copies_it(host, kind):
    # Chunks of two pages, over three runs (one of them 5 pages long) and the CPU workers:
    # the checksums gather returns are those of the bytes it left in the tier.
    src = HostEngine(SPEC, 64, kind, seed=11)
    copier = CopyEngine({"host": host}, hash_chunk_bytes=2 * SPEC.page_bytes)
    blocks = np.array([30, 31, 32, 33, 34, 3, 9, 10])
    spans, geom = _spans(host, len(blocks), SPEC.page_bytes, first_page=2)
    sums = copier.gather(src.memory, blocks, spans, geom, 2)
    assert copier.copy_ops == (3 + 1 + 1) * len(src.layout.segments)  # chunks [30..31] [32..33] [34] [3] [9..10]
    assert sums.tolist() == copier.checksums(spans, geom).tolist()
    assert len(set(sums.tolist())) == len(blocks)
    dst = HostEngine(SPEC, 64, kind, seed=12)
    copier.scatter([Span(s.first_page - 2, s.n_pages, s.tier, s.offset) for s in spans], dst.memory,
                   np.arange(len(blocks)), geom, sums)
    assert dst.pages(range(len(blocks))) == src.pages(blocks)


def test_layouts_that_split_a_page_differently_agree_on_its_bytes(host):
    # Saved through one K+V segment per layer, restored through separate K and V segments:
    # the page's byte order is the same, so the bytes land where they belong.
    spec = SPEC
    lm = HostEngine(spec, 16, "layer_major", seed=3)
    cl = HostEngine(spec, 16, "cross_layer", seed=4)
    copier = CopyEngine({"host": host})
    spans, geom = _spans(host, 4, spec.page_bytes)
    copier.gather(lm.memory, np.arange(4), spans, geom, 0)
    copier.scatter(spans, cl.memory, np.arange(8, 12), geom, copier.checksums(spans, geom))
    assert cl.pages(range(8, 12)) == lm.pages(range(4))


def test_streams_use_a_byte_cursor_whatever_the_chunking(host):
    spec = KVSpec.opaque("x", page_bytes=10_000)
    data = np.random.default_rng(5).integers(0, 256, 35_001, dtype=np.uint8).tobytes()
    n_pages = 4
    geom = Geometry(spec.page_bytes, n_pages, 35_001 - 3 * 10_000)
    pieces = host.alloc_pages(n_pages, geom.stride)
    spans = [Span(p.first_page, p.n_pages, "host", p.offset) for p in pieces]
    copier = CopyEngine({"host": host})
    writer = copier.page_writer(spans, geom)
    for i in range(0, len(data), 777):
        writer.write(data[i : i + 777])
    assert writer.received == len(data)
    sums = copier.checksums(spans, geom)
    chunks = [c for c, _ in copier.read_stream(spans, geom, sums, 4096)]
    assert b"".join(chunks) == data
    assert all(len(c) == 4096 for c in chunks[:-1])
    # A chunk past what the pages hold is refused, and not written at all.
    writer = copier.page_writer(spans, geom)
    writer.write(data[:-1])
    with pytest.raises(InvalidArgument, match="more than the 35001 bytes"):
        writer.write(b"xx")
    assert writer.received == len(data) - 1
    assert b"".join(c for c, _ in copier.read_stream(spans, geom, sums, 4096)) == data
    # A chunk that is one whole page comes with the checksum the page was stored with.
    whole = list(copier.read_stream(spans, geom, sums, spec.page_bytes))
    assert [d for _, d in whole] == [int(x) for x in sums[:-1]] + [0]  # the last page is short
    assert all(d == 0 for _, d in copier.read_stream(spans, geom, sums, spec.page_bytes - 1))


def test_corrupted_host_page_is_caught_when_host_is_verified(host):
    src = HostEngine(SPEC, 8, seed=6)
    copier = CopyEngine({"host": host}, verify_tiers=("host", "disk"))
    spans, geom = _spans(host, 2, SPEC.page_bytes)
    copier.gather(src.memory, np.array([0, 1]), spans, geom, 0)
    sums = copier.checksums(spans, geom)
    host.view(spans[0].offset + geom.stride + 100, 1)[0] ^= 0xFF  # page 1
    dst = HostEngine(SPEC, 8, seed=7)
    with pytest.raises(DataLoss, match="page 1"):
        copier.scatter(spans, dst.memory, np.array([0, 1]), geom, sums)


def test_bandwidth_is_measured_per_route(host):
    src = HostEngine(SPEC, 8, seed=8)
    copier = CopyEngine({"host": host})
    spans, geom = _spans(host, 4, SPEC.page_bytes)
    copier.gather(src.memory, np.arange(4), spans, geom, 0)
    assert copier.bandwidth["engine->host"] > 0
    assert copier.moved_bytes["engine->host"] == 4 * SPEC.page_bytes
