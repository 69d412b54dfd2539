"""Copies between tiers go by medium, not by name: a tier the copy engine has
never heard of moves bytes through the registered routes as it is."""

import numpy as np
import pytest

from tests.helpers import host_tier
from tierd.errors import DataLoss
from tierd.tiers import FILE, MEMORY
from tierd.tiers.disk import DiskTier
from tierd.tiers.fileops import aligned_buffer
from tierd.tiers.ioqueue import IOExecutor
from tierd.transfer import routes
from tierd.transfer.copier import CopyEngine
from tierd.transfer.runs import Geometry, Span

MiB = 1 << 20
PAGE = 64 << 10


class Scratch:
    """A memory tier of this test's own: one numpy buffer, nothing else. Its
    buffer starts one byte off a page, so O_DIRECT cannot take it as it is:
    writes to a disk tier are staged."""

    name, medium, backend = "scratch", MEMORY, "numpy"

    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(nbytes + 1, np.uint8)[1:]

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset : offset + nbytes]


class SecondDisk(DiskTier):
    name, medium = "nvme1", FILE  # unregistered: the copy engine needs only its medium


@pytest.fixture
def world(tmp_path):
    ex = IOExecutor(2)
    host = host_tier(16 * MiB, 16 * MiB)
    tiers = {"host": host, "scratch": Scratch(8 * MiB), "disk": DiskTier(16 * MiB, str(tmp_path / "a"), ex, 8 * MiB),
             "nvme1": SecondDisk(16 * MiB, str(tmp_path / "b"), ex, 8 * MiB)}
    yield tiers, CopyEngine(tiers, window_bytes=2 * PAGE)
    for name in ("host", "disk", "nvme1"):
        tiers[name].close()
    ex.shutdown()


def _spans(tiers, name, n_pages, geom):
    if name == "scratch":  # two pieces, out of order, placed by hand
        half = n_pages // 2
        return [Span(half, n_pages - half, name, 0), Span(0, half, name, (n_pages - half + 1) * geom.stride)]
    return [Span(p.first_page, p.n_pages, name, p.offset) for p in tiers[name].alloc_pages(n_pages, geom.stride)]


def test_a_tier_of_its_own_moves_through_the_routes_of_its_medium(world):
    tiers, copier = world
    n = 11
    geom = Geometry(PAGE, n, PAGE)
    data = np.random.default_rng(3).integers(0, 256, n * PAGE, dtype=np.uint8)
    host = _spans(tiers, "host", n, geom)
    for s in host:
        first = s.first_page * PAGE
        tiers["host"].view(s.offset, s.n_pages * PAGE)[:] = data[first : first + s.n_pages * PAGE]
    sums = copier.checksums(host, geom)
    path = [host] + [_spans(tiers, name, n, geom) for name in ("scratch", "nvme1", "host", "disk", "scratch")]
    for src, dst in zip(path, path[1:]):
        assert copier.move(src, dst, geom, sums) == n * PAGE
    back = _spans(tiers, "host", n, geom)
    copier.move(path[-1], back, geom, sums)
    back.sort(key=lambda s: s.first_page)
    assert b"".join(bytes(tiers["host"].view(s.offset, s.n_pages * PAGE)) for s in back) == data.tobytes()
    routes = {"host->scratch", "scratch->nvme1", "nvme1->host", "host->disk", "disk->scratch", "scratch->host"}
    assert routes <= set(copier.bandwidth)


def test_pages_damaged_in_any_file_tier_are_caught_and_named_by_it(world):
    tiers, copier = world
    n = 6
    geom = Geometry(PAGE, n, PAGE)
    host = _spans(tiers, "host", n, geom)
    for s in host:
        tiers["host"].view(s.offset, s.n_pages * PAGE)[:] = 7
    sums = copier.checksums(host, geom)
    a, b = _spans(tiers, "disk", 3, geom), _spans(tiers, "nvme1", 3, geom)
    mixed = [Span(0, 3, "disk", a[0].offset), Span(3, 3, "nvme1", b[0].offset)]
    copier.move(host, mixed, geom, sums)
    assert [(w.first, w.count, w.tier) for w in copier.windows(mixed, geom, sums)] == \
        [(0, 2, "disk"), (2, 1, "disk"), (3, 2, "nvme1"), (5, 1, "nvme1")]
    page = aligned_buffer(PAGE)
    tiers["nvme1"].read(b[0].offset + PAGE, page)
    page[100] ^= 1
    tiers["nvme1"].write(b[0].offset + PAGE, page)
    with pytest.raises(DataLoss) as err:
        list(copier.windows(mixed, geom, sums))
    assert err.value.details["tier"] == "nvme1" and err.value.details["page"] == 4
    with pytest.raises(DataLoss):
        copier.move(mixed, _spans(tiers, "scratch", n, geom), geom, sums)


def test_a_medium_without_routes_is_refused_by_name_and_nothing_is_copied(world):
    tiers, copier = world
    remote = Scratch(MiB)
    remote.name, remote.medium = "remote", "object-store"
    copier.tiers["remote"] = remote
    geom = Geometry(PAGE, 2, PAGE)
    host = _spans(tiers, "host", 2, geom)
    before = copier.copy_ops
    with pytest.raises(ValueError, match=r"no route copies host \(memory\) into remote \(object-store\)"):
        copier.move(host, [Span(0, 2, "remote", 0)], geom, copier.checksums(host, geom))
    assert copier.copy_ops == before and not remote.buf.any()
    with pytest.raises(ValueError, match=r"no route copies disk \(file\) into nvme1 \(file\)"):
        copier.move([Span(0, 2, "disk", 0)], [Span(0, 2, "nvme1", 0)], geom, copier.checksums(host, geom))


def test_a_route_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        routes.route(MEMORY, MEMORY)(routes.memory_to_memory)
    assert routes.ROUTES[(MEMORY, MEMORY)] is routes.memory_to_memory


def _in_host(tiers, copier, page, seed):
    """Seven pages of random bytes (the last short) in the host tier: (n, geometry, bytes, spans, checksums)."""
    n = 7
    geom = Geometry(page, n, page // 3)
    data = np.random.default_rng(seed).integers(0, 256, geom.nbytes, dtype=np.uint8).tobytes()
    host = _spans(tiers, "host", n, geom)
    for s in host:
        for i in range(s.n_pages):
            p = s.first_page + i
            tiers["host"].view(s.offset + i * geom.stride, geom.size_of(p))[:] = \
                np.frombuffer(data, np.uint8, geom.size_of(p), p * page)
    return n, geom, data, host, copier.checksums(host, geom)


@pytest.mark.parametrize("page", [PAGE, PAGE - 100])  # packed, and pages a stride apart
def test_views_hand_out_every_tier_s_bytes_checked_and_say_which_stay_put(world, page):
    tiers, copier = world
    n, geom, data, host, sums = _in_host(tiers, copier, page, 8)
    disk = _spans(tiers, "disk", n, geom)
    copier.move(host, disk, geom, sums)
    for spans, held in ((host, True), (disk, False)):
        views = list(copier.views(spans, geom, sums))
        assert b"".join(bytes(v) for v, _ in views) == data and {h for _, h in views} == {held}
        if geom.stride != page:
            assert len(views) == n  # a view a page
        elif held:
            assert len(views) == len(spans)  # a view a span: its pages lie end to end
    tiers["host"].view(host[0].offset + 5, 1)[0] ^= 1
    with pytest.raises(DataLoss, match="host"):
        list(copier.views(host, geom, sums))
    # Not a handout: a move to another tier, which checks a memory tier's pages only where it is verified.
    assert b"".join(bytes(v) for v, _ in copier.views(host, geom, sums, handout=False)) != data
    with pytest.raises(DataLoss, match="host"):
        list(CopyEngine(tiers, window_bytes=2 * PAGE, verify_tiers=("host",)).views(host, geom, sums, handout=False))


@pytest.mark.parametrize("page", [PAGE, PAGE - 100])
def test_views_in_pieces_are_cut_where_the_caller_cuts_and_check_each_piece_s_pages_as_it_goes(world, page):
    tiers, copier = world
    n, geom, data, host, sums = _in_host(tiers, copier, page, 9)
    piece = page // 2 + 100  # cuts inside pages and across them
    views = list(copier.views(host, geom, sums, piece_bytes=piece))
    assert b"".join(bytes(v) for v, _ in views) == data and all(h for _, h in views)
    ends = np.cumsum([len(v) for v, _ in views])
    view_ends = {(p + 1) * page for p in range(n)} if geom.stride != page \
        else {(s.first_page + s.n_pages) * page for s in host}  # a view a page, or a view a span
    assert all(e % piece == 0 or e in view_ends or e == len(data) for e in ends)  # cut at a multiple, or a view's end
    assert max(len(v) for v, _ in views) <= piece
    # Page 5 damaged: the pieces before it come out whole, the one that reaches it fails.
    s = next(s for s in host if s.first_page <= 5 < s.first_page + s.n_pages)
    tiers["host"].view(s.offset + (5 - s.first_page) * geom.stride + 7, 1)[0] ^= 1
    got = []
    with pytest.raises(DataLoss, match="page 5 .*host"):
        for v, _ in copier.views(host, geom, sums, piece_bytes=piece):
            got.append(bytes(v))
    out = b"".join(got)
    assert out == data[: len(out)] and 5 * page - piece < len(out) <= 5 * page
