"""Pages coded on their way to the remote tier (--codec remote=lossless):
two stores sharing a real Redis Cluster (and a shared directory), as two
nodes would. A session published coded on one is restored bit-exact on the
other, in fewer bytes; its manifest records the codec and each page's
coded size and checksum; damaged coded bytes are DATA_LOSS and nothing of
them is kept; a codec a node does not know is a clear error that changes
nothing; a codec that is not one, or a lossy one, stops the daemon at
start."""

import logging
import shutil

import numpy as np
import pytest

from tests.helpers import SPEC, HostEngine, MiB, kv_like, published
from tierd import codecs
from tierd.config import Config, load
from tierd.core.events import NullEvents
from tierd.codecs.auto import EXPLORE_EVERY, AutoChoice
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument
from tierd.layout import KVSpec
from tierd.machine import RemoteUnavailable, build
from tierd.remote.manifest import Manifest
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
PAGE = SPEC.page_bytes


def manifest(store, key) -> Manifest:
    m, _ = store.remote.store.head(key)
    assert m is not None
    return m


@pytest.mark.parametrize("backend", ["redis", "files"])
def test_a_session_published_lossless_is_restored_bit_exact_on_another_node_in_fewer_bytes(nodes, tmp_path, backend):
    url = f"file://{tmp_path / 'shared'}" if backend == "files" else None
    if url:
        (tmp_path / "shared").mkdir()
    a = nodes("a", remote=url, remote_codec="lossless").store
    b = nodes("b", remote=url).store  # a node that codes nothing reads what another coded
    src = kv_like(HostEngine(seed=1, num_blocks=64), seed=1)
    key = SessionKey("alice", "chat")
    blocks = list(range(40))
    a.save(key, src.memory, SPEC, blocks, 40 * 16)
    published(a, key)

    m = manifest(a, key)
    assert m.codec == "lossless" and m.nbytes == 40 * PAGE and m.stored < 0.85 * m.nbytes
    assert m.coding is not None and int(m.coding.sizes.sum()) == m.stored
    assert b.stat(key).tier_bytes == {"remote": 40 * PAGE}  # what the session holds, not what it takes there
    for store in (a, b):  # (b: from the manifest)
        info = store.stat(key)
        assert (info.codecs, info.coded_bytes) == ({"remote": "lossless"}, {"remote": m.stored})

    dst = HostEngine(seed=2, num_blocks=64)
    r = b.restore(key, dst.memory, SPEC, list(range(63, 23, -1)))
    assert r.num_tokens == 40 * 16 and dst.pages(range(63, 23, -1)) == src.pages(blocks)
    _, reader = b.get(key)
    assert b"".join(bytes(c) for c in reader) == b"".join(src.pages(blocks))
    assert b.stat(key).remote_durable and b.check_accounting() == []


def test_a_restore_of_a_coded_session_scatters_its_pages_as_they_are_decoded(nodes):
    a = nodes("a", host_budget=96 * MiB, remote_codec="lossless").store
    b = nodes("b", window_bytes=4 * PAGE).store
    src = kv_like(HostEngine(seed=11, num_blocks=640), seed=11)
    key = SessionKey("alice", "long")
    a.save(key, src.memory, SPEC, list(range(640)), 640 * 16)  # 20 MiB of pages: several batches of chunks
    published(a, key)
    steps = []
    scatter = b.copier.scatter

    def spy(spans, engine, ids, geom, sums, *rest):
        steps.append(sum(s.n_pages for s in spans))
        return scatter(spans, engine, ids, geom, sums, *rest)

    b.copier.scatter = spy
    dst = HostEngine(seed=12, num_blocks=640)
    blocks = list(range(639, 39, -1))
    r = b.restore(key, dst.memory, SPEC, blocks)
    assert (r.source_tier, r.num_pages) == ("remote", 600) and dst.pages(blocks) == src.pages(range(600))
    assert len(steps) > 1 and sum(steps) == 600  # in steps, as the chunks came and were decoded


def test_an_opaque_session_of_a_short_last_page_round_trips_coded(nodes):
    a = nodes("a", remote_codec="lossless").store
    b = nodes("b").store
    key = SessionKey("alice", "blob")
    data = (b"llama state " * 300_000)[: 3 * MiB + 12345]  # repetitive: codes far smaller
    a.put(key, KVSpec.opaque("llama.cpp/tiny", page_bytes=MiB), 0, len(data), [data])
    published(a, key)
    m = manifest(a, key)
    assert m.codec == "lossless" and m.stored < m.nbytes // 20
    _, reader = b.get(key)
    assert b"".join(bytes(c) for c in reader) == data


@pytest.mark.parametrize("where", ["first", "last"])
def test_damaged_coded_bytes_are_data_loss_and_nothing_of_them_is_kept(nodes, where):
    a = nodes("a", remote_codec="lossless").store
    b = nodes("b").store
    key = SessionKey("alice", "bad")
    src = kv_like(HostEngine(seed=3), seed=3)
    a.save(key, src.memory, SPEC, list(range(48)), 48 * 16)
    published(a, key)
    m, store = manifest(a, key), a.remote.store
    chunk = 0 if where == "first" else (m.stored - 1) // store.chunk_bytes
    name = store.link.key(key, f"w{m.write}", str(chunk))
    value = bytearray(store.client.get(name))
    value[len(value) // 2 if where == "first" else -3] ^= 0x10
    store.client.set(name, bytes(value))
    with pytest.raises(DataLoss, match="remote tier"):
        b.restore(key, HostEngine().memory, SPEC, list(range(48)))
    assert b.keys() == [] and b.check_accounting() == []
    with pytest.raises(DataLoss):
        b.get(key)
    assert a.restore(key, HostEngine().memory, SPEC, list(range(48))).num_pages == 48  # the node's own copy is whole


def test_a_version_coded_with_a_codec_this_node_does_not_know_is_a_clear_error_that_changes_nothing(nodes):
    a = nodes("a", remote_codec="lossless").store
    b = nodes("b").store
    key = SessionKey("alice", "future")
    a.save(key, kv_like(HostEngine(seed=4), seed=4).memory, SPEC, [0, 1, 2], 48)
    published(a, key)
    store = a.remote.store
    name = store.link.key(key, "m")
    raw = store.client.get(name)
    store.client.set(name, raw.replace(b'"codec": "lossless"', b'"codec": "zfuture"', 1))
    with pytest.raises(FailedPrecondition, match="zfuture.*does not know"):
        b.restore(key, HostEngine().memory, SPEC, [0, 1, 2])
    assert b.keys() == [] and b.check_accounting() == [] and store.client.get(name) != raw


@pytest.mark.parametrize("flags, error", [
    ({"codec": ["device=lossless"]}, "not 'device'"),
    ({"codec": ["remote"]}, "TIER=CODEC"),
    ({"codec": ["remote="]}, "names no codec"),
    ({"codec": ["remote=lossless"]}, "needs a remote tier"),
])
def test_a_codec_flag_that_cannot_be_right_is_refused_before_anything_starts(flags, error):
    with pytest.raises(InvalidArgument, match=error):
        load(flags, env={})


def test_the_codec_flag_repeats_and_reads_from_the_environment_and_toml(tmp_path):
    assert load({"codec": ["remote=none", "remote=lossless"], "remote": "redis://h:1"}, env={}).codec == \
        {"remote": "lossless"}
    assert load({}, env={"TIERD_CODEC": "remote=lossless", "TIERD_REMOTE": "redis://h:1"}).codec == \
        {"remote": "lossless"}
    toml = tmp_path / "t.toml"
    toml.write_text('remote = "redis://h:1"\n[codec]\nremote = "lossless"\n')
    assert load({}, env={}, config_file=str(toml)).codec == {"remote": "lossless"}


def test_a_remote_codec_that_is_no_codec_stops_the_start_and_says_why(tmp_path):
    (tmp_path / "shared").mkdir()
    cfg = Config(data_dir=str(tmp_path / "d"), host_budget=64 * MiB, disk_budget=64 * MiB, disk_io="posix",
                 device="none", remote=f"file://{tmp_path / 'shared'}", codec={"remote": "zstd9"})
    with pytest.raises(RemoteUnavailable, match="unknown codec 'zstd9'; codecs are .*lossless"):
        build(cfg)
    assert not (tmp_path / "d" / "index.db").exists()


# -- lossy, by consent ----------------------------------------------------------------


def tokens_of(sid: str, n: int) -> list[int]:
    base = 1000 + 100_000 * sum(map(ord, sid))
    return list(range(base, base + n))


def test_a_consenting_tenant_s_kv_goes_lossy_within_its_bound_and_every_other_goes_lossless(nodes):
    a = nodes("a", remote_codec="fp8", lossy_tenants=frozenset({"alice"})).store
    b = nodes("b").store
    src = kv_like(HostEngine(seed=5, num_blocks=64), seed=5)
    blocks = list(range(32))
    for tenant in ("alice", "bob"):
        key = SessionKey(tenant, "chat")
        a.save(key, src.memory, SPEC, blocks, 32 * 16, token_ids=tokens_of("chat", 32 * 16))
        published(a, key)
    alice, bob = SessionKey("alice", "chat"), SessionKey("bob", "chat")
    m = manifest(a, alice)
    assert m.codec == "fp8" and m.stored < 0.55 * m.nbytes and manifest(a, bob).codec == "lossless"
    worst = float(m.coding.rel_error.max())
    assert 0 < worst <= 0.05 and (m.coding.max_error > 0).all()
    within = float(np.sort(m.coding.rel_error)[15])  # a bound half the pages are within
    toks = tokens_of("chat", 32 * 16)

    def counted(bound):
        return b.lookup(alice, toks, max_error=bound).num_tokens

    def leading(bound):  # the tokens of the leading pages within a bound
        past = np.flatnonzero(m.coding.rel_error > bound)
        return 16 * (int(past[0]) if past.size else 32)

    for bound in (None, 0.0, within, worst):  # from the manifest, and below from the copy fetched
        assert counted(bound) == (512 if bound is None else leading(bound))
    assert counted(0.0) < counted(within) < counted(worst) == 512
    for bad in (-0.1, float("nan")):
        with pytest.raises(InvalidArgument, match="max_error"):
            b.lookup(alice, toks, max_error=bad)
    dst = HostEngine(seed=6, num_blocks=64)
    assert b.restore(alice, dst.memory, SPEC, blocks).rel_error == pytest.approx(worst)  # fetched: what it carries
    for bound in (None, 0.0, within, worst):
        assert counted(bound) == (512 if bound is None else leading(bound))
    exact = b.advise(alice, 100.0, max_error=0.0)  # no page exact: nothing to restore
    assert exact.recompute_seconds == pytest.approx(leading(0.0) / 100.0) and (leading(0.0) or not exact.restore)
    assert b.advise(alice, 100.0, max_error=worst).recompute_seconds == pytest.approx(512 / 100.0)
    assert b.advise(alice, 100.0, max_error=within).recompute_seconds == pytest.approx(leading(within) / 100.0)
    shape = codecs.page_shape(SPEC)
    for i, (got, want) in enumerate(zip(dst.pages(blocks), src.pages(blocks))):  # what it says is what it is
        rel, largest = codecs.error(shape, np.frombuffer(want, np.uint8), np.frombuffer(got, np.uint8))
        assert rel == pytest.approx(float(m.coding.rel_error[i]), rel=1e-4, abs=1e-7)
        assert largest == pytest.approx(float(m.coding.max_error[i]), rel=1e-4, abs=1e-7)
    assert b.stat(alice).rel_error == pytest.approx(worst)  # what this node serves of it
    info = a.stat(alice)  # the node that published it serves its exact copy
    assert (info.rel_error, info.codecs, info.tier_errors) == (0.0, {"remote": "fp8"}, {"remote": pytest.approx(worst)})
    assert b.restore(bob, dst.memory, SPEC, blocks).rel_error == 0
    assert dst.pages(blocks) == src.pages(blocks) and b.stat(bob).rel_error == 0  # bob did not consent


def test_a_save_that_asks_is_published_lossy_within_its_bound_and_its_consent_outlives_a_restart(nodes):
    ha = nodes("a", remote_codec="fp8")  # no tenant allows lossy: only saves that ask
    a = ha.store
    src = kv_like(HostEngine(seed=12, num_blocks=64), seed=12)
    asks, silent, put = SessionKey("bob", "asks"), SessionKey("bob", "silent"), SessionKey("bob", "put")
    a.save(asks, src.memory, SPEC, list(range(16)), 16 * 16, lossy=0.04)
    a.save(silent, src.memory, SPEC, list(range(16)), 16 * 16)
    a.put(put, SPEC, 16 * 16, 16 * PAGE, src.pages(range(16)), lossy=0.04)
    for k in (asks, silent, put):
        published(a, k)
    for k in (asks, put):
        m = manifest(a, k)
        assert m.codec == "fp8" and 0 < m.coding.rel_error.max() <= 0.04
    assert manifest(a, silent).codec == "lossless"

    a = ha.reopen(flush=True)  # the next turn, after a restart, says nothing: the consent stands
    a.save(asks, src.memory, SPEC, [16, 17], 18 * 16, start_token=16 * 16)
    published(a, asks)
    m = manifest(a, asks)
    assert m.codec == "fp8" and (m.coding.rel_error > 0).all() and m.coding.rel_error.max() <= 0.04
    a.save(asks, src.memory, SPEC, [18], 19 * 16, start_token=18 * 16, lossy=0.0)  # and is withdrawn
    published(a, asks)
    assert manifest(a, asks).codec == "lossless" and not manifest(a, asks).coding.rel_error.any()
    dst = HostEngine(seed=13, num_blocks=64)
    nodes("b").store.restore(asks, dst.memory, SPEC, list(range(19)))
    assert dst.pages(range(19)) == src.pages(list(range(19)))


def test_opaque_bytes_and_pages_past_the_bound_are_never_coded_lossily(nodes):
    a = nodes("a", remote_codec="int4", lossy_tenants=frozenset({"*"}), lossy_max_error=1e-4).store
    b = nodes("b").store
    src = kv_like(HostEngine(seed=7), seed=7)
    key, blob = SessionKey("alice", "kv"), SessionKey("alice", "blob")
    a.save(key, src.memory, SPEC, list(range(8)), 8 * 16)
    data = b"state " * 100_000
    a.put(blob, KVSpec.opaque("llama.cpp/tiny", page_bytes=MiB), 0, len(data), [data])
    for k in (key, blob):
        published(a, k)
    assert manifest(a, blob).codec == "lossless"
    m = manifest(a, key)
    assert m.codec == "int4" and not m.coding.rel_error.any()  # every page past a bound of 1e-4: kept as it is
    dst = HostEngine(seed=8)
    b.restore(key, dst.memory, SPEC, list(range(8)))
    assert dst.pages(range(8)) == src.pages(range(8)) and b.stat(key).rel_error == 0
    _, reader = b.get(blob)
    assert b"".join(bytes(c) for c in reader) == data


def test_pages_fetched_lossy_are_lent_to_no_exact_save_and_keep_their_error_across_a_restart(nodes):
    a = nodes("a", remote_codec="fp8", lossy_tenants=frozenset({"alice"})).store
    hb = nodes("b")
    b = hb.store
    src = kv_like(HostEngine(seed=9), seed=9)
    key, again = SessionKey("alice", "chat"), SessionKey("alice", "again")
    tokens = tokens_of("chat", 16 * 16)
    a.save(key, src.memory, SPEC, list(range(16)), 16 * 16, token_ids=tokens)
    published(a, key)
    worst = manifest(a, key).rel_error
    lossy = HostEngine(seed=10)
    b.restore(key, lossy.memory, SPEC, list(range(16)))
    assert lossy.pages(range(16)) != src.pages(range(16))
    # The same tokens saved exactly on b: stored as they are, not taken from the lossy copy's pages.
    b.save(again, src.memory, SPEC, list(range(16)), 16 * 16, token_ids=tokens)
    out = HostEngine(seed=11)
    b.restore(again, out.memory, SPEC, list(range(16)))
    assert out.pages(range(16)) == src.pages(range(16)) and b.stat(again).rel_error == 0

    b = hb.reopen(flush=True)  # onto disk, and read back from the index
    assert b.stat(key).rel_error == pytest.approx(worst) and b.stat(again).rel_error == 0
    b.restore(key, out.memory, SPEC, list(range(16)))
    assert out.pages(range(16)) == lossy.pages(range(16))

    # The next turn, stored onto the lossy pages on b (which codes nothing): its version records their error.
    b.save(key, src.memory, SPEC, list(range(16, 20)), 20 * 16, start_token=16 * 16,
           token_ids=tokens + tokens_of("more", 4 * 16))
    published(b, key)
    m = manifest(b, key)
    assert m.codec == "lossless" and m.coding.rel_error[:16].max() == pytest.approx(worst)
    assert not m.coding.rel_error[16:].any()
    c = nodes("c").store
    assert c.stat(key).rel_error == pytest.approx(worst)
    assert c.lookup(key, tokens + tokens_of("more", 4 * 16), max_error=0.0).num_tokens == 0


# -- auto -----------------------------------------------------------------------------


class Chosen(NullEvents):
    def __init__(self):
        self.chosen = []

    def codec_chosen(self, tier, codec, among):
        self.chosen.append((tier, codec, among))


def test_auto_tries_each_way_then_takes_the_faster_and_now_and_then_the_other(caplog):
    events = Chosen()
    auto = AutoChoice("remote", events.codec_chosen, ("publish", "fetch"))
    assert [auto.choose() for _ in range(3)] == ["lossless", "lossless", "lossless"]  # nothing measured yet
    auto.measured("lossless", "publish", 100 << 20, 0.5)
    assert auto.choose() == "none"  # not yet measured
    auto.measured("none", "publish", 100 << 20, 0.1)
    with caplog.at_level(logging.INFO, logger="tierd.codecs"):
        ways = [auto.choose() for _ in range(2 * EXPLORE_EVERY)]
    assert ways.count("lossless") == 2 and set(ways) == {"none", "lossless"}  # one in EXPLORE_EVERY explores
    assert events.chosen == [("remote", "none", ("lossless", "none"))]  # said once, where it changed
    assert "codec (auto) is none: measured lossless 0.21 GB/s, none 1.05 GB/s, by publishes" in caplog.text
    # Fetches, once both ways have some, decide: lossless fetches faster here (a slow link, say).
    auto.measured("none", "fetch", 100 << 20, 1.0)
    assert auto.choose() == "none"  # lossless not fetched yet: still by publishes
    auto.measured("lossless", "fetch", 100 << 20, 0.3)
    assert auto.choose() == "lossless" and events.chosen[-1][1] == "lossless"
    for bad in (("zstd", "fetch", 1, 1.0), ("none", "fetch", 0, 1.0), ("none", "fetch", 1, 0.0)):
        auto.measured(*bad)  # ignored: no way of auto's, no bytes, no time
    assert auto.choose() == "lossless"


def test_a_node_of_auto_publishes_versions_every_node_reads_and_says_which_way(nodes):
    a = nodes("a", remote_codec="auto").store
    b = nodes("b").store
    src = kv_like(HostEngine(seed=12), seed=12)
    ways = []
    for i in range(3):
        key = SessionKey("alice", f"s{i}")
        a.save(key, src.memory, SPEC, list(range(8 * i, 8 * i + 8)), 8 * 16)
        published(a, key)
        ways.append(manifest(a, key).codec)
        assert a.stat(key).codecs == ({"remote": "lossless"} if ways[-1] == "lossless" else {})
        _, reader = b.get(key)
        assert b"".join(bytes(c) for c in reader) == b"".join(src.pages(range(8 * i, 8 * i + 8)))
    assert ways[:2] == ["lossless", "none"]  # each way tried, then the faster measured
    assert ways[2] == a._remote.publisher.coder.auto.chosen


def test_a_manifest_that_says_lossy_pages_are_exact_is_data_loss(nodes):
    a = nodes("a", remote_codec="fp8", lossy_tenants=frozenset({"*"})).store
    key = SessionKey("alice", "claims")
    a.save(key, kv_like(HostEngine(seed=13), seed=13).memory, SPEC, list(range(4)), 4 * 16)
    published(a, key)
    m, store = manifest(a, key), a.remote.store
    raw = store.client.get(store.link.key(key, "m"))
    errors_at = len(raw) - 8 * m.n_pages  # the relative errors, then the largest absolute ones (float32 each)
    store.client.set(store.link.key(key, "m"), raw[:errors_at] + bytes(4 * m.n_pages) + raw[errors_at + 4 * m.n_pages :])
    b = nodes("b").store
    with pytest.raises(DataLoss, match="manifest"):
        b.stat(key)
    assert b.keys() == []


def test_a_page_that_carries_error_is_recoded_lossily_only_within_the_bound_with_what_it_carries(nodes):
    a = nodes("a", remote_codec="int4", lossy_tenants=frozenset({"*"}), lossy_max_error=0.3).store
    src = kv_like(HostEngine(seed=14), seed=14)
    key = SessionKey("alice", "hops")
    tokens = tokens_of("hops", 8 * 16)
    a.save(key, src.memory, SPEC, list(range(8)), 8 * 16, token_ids=tokens)
    published(a, key)
    carried = manifest(a, key).coding.rel_error.copy()
    bound = float(carried.max()) + 0.01  # room for little more error than the pages carry
    hb = nodes("b", remote_codec="fp8", lossy_tenants=frozenset({"*"}), lossy_max_error=bound)
    b = hb.store
    b.restore(key, HostEngine().memory, SPEC, list(range(8)))
    b.save(key, src.memory, SPEC, [8], 9 * 16, start_token=8 * 16, token_ids=tokens + tokens_of("next", 16))
    published(b, key)
    recorded = manifest(b, key).coding.rel_error
    assert (recorded <= bound + 1e-6).all() and (recorded[:8] >= carried - 1e-6).all()
