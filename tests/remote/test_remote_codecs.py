"""Pages coded on their way to the remote tier (--codec remote=lossless):
two stores sharing a real Redis Cluster (and a shared directory), as two
nodes would. A session published coded on one is restored bit-exact on the
other, in fewer bytes; its manifest records the codec and each page's
coded size and checksum; damaged coded bytes are DATA_LOSS and nothing of
them is kept; a codec a node does not know is a clear error that changes
nothing; a codec that is not one, or a lossy one, stops the daemon at
start."""

import shutil
import time

import numpy as np
import pytest

from tests.helpers import SPEC, Harness, HostEngine, MiB, wait_for
from tierd.config import Config, load
from tierd.errors import DataLoss, FailedPrecondition, InvalidArgument
from tierd.layout import KVSpec
from tierd.machine import RemoteUnavailable, build
from tierd.remote.manifest import Manifest
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
PAGE = SPEC.page_bytes


@pytest.fixture
def nodes(cluster, tmp_path):
    prefix = f"c{time.monotonic_ns()}"
    made = []

    def node(name, remote=None, **kw):
        h = Harness(str(tmp_path / name), remote=remote or cluster.url, remote_prefix=prefix, **kw)
        h.open()
        made.append(h)
        return h

    yield node
    for h in made:
        h.close()


def kv_like(engine: HostEngine, seed: int) -> HostEngine:
    """Engine memory holding float16 values with a scale per channel, as KV has, of few significant bits (an
    8-bit cache's values widened): they code much smaller than random bytes."""
    rng = np.random.default_rng(seed)
    for region in engine.regions:
        values = region.view(np.float16).reshape(-1, SPEC.head_dim)
        scale = rng.choice([0.05, 1.0, 8.0], SPEC.head_dim)
        values[:] = (np.round(rng.standard_normal(values.shape) * 8) / 8 * scale).astype(np.float16)
    return engine


def published(store, key):
    wait_for(lambda: store.stat(key).remote_durable, what=f"{key} published")


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
    ({"codec": ["disk=lossless"]}, "not 'disk'"),
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


@pytest.mark.parametrize("codec, error", [("zstd9", "unknown codec"), ("fp8", "lossy")])
def test_a_remote_codec_that_is_no_codec_or_is_lossy_stops_the_start_and_says_why(tmp_path, codec, error):
    (tmp_path / "shared").mkdir()
    cfg = Config(data_dir=str(tmp_path / "d"), host_budget=64 * MiB, disk_budget=64 * MiB, disk_io="posix",
                 device="none", remote=f"file://{tmp_path / 'shared'}", codec={"remote": codec})
    with pytest.raises(RemoteUnavailable, match=error):
        build(cfg)
    assert not (tmp_path / "d" / "index.db").exists()
