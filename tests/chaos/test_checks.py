"""The campaign's checks can fail: a page is identified from its own bytes,
and the model counts wrong bytes, another tenant's pages, a version older
than one reported durable, a durable session gone, and a dropped one
served again."""

from bench.chaos import content
from bench.chaos.content import Label
from bench.chaos.model import Model


def test_a_page_names_itself_and_any_changed_byte_unnames_it():
    label = Label("alice", "put-0-1", 7, 3)
    page = content.page(label, 4096)
    assert content.identify(page) == label
    for at in (0, 10, 63, 64, 4095):
        bad = bytearray(page)
        bad[at] ^= 1
        assert content.identify(bytes(bad)) is None
    assert content.identify(page[:2048]) is None  # cut short: its rest no longer follows
    assert content.identify(b"\0" * 4096) is None


def written(model, tenant="alice", session="s", versions=2):
    k = model.key(tenant, session)
    for _ in range(versions):
        model.new_version(k, lambda v: v, 1)
    return k


def test_the_model_counts_each_kind_of_wrong_read():
    m = Model(nodes=2)
    k = written(m)
    ok = [Label("alice", "s", 2, 0)]
    assert m.read(k, 0, ok) == 2 and m.tally.wrong_bytes == 0
    m.read(k, 0, [None])
    m.read(k, 0, [Label("alice", "other", 1, 0)])
    m.read(k, 0, [Label("alice", "s", 9, 0)])  # a version never written
    m.read(k, 0, ok + [Label("alice", "s", 2, 1)])  # more pages than the version has
    assert m.tally.wrong_bytes == 4
    m.read(k, 0, [Label("bob", "s", 2, 0)])
    assert m.tally.cross_tenant == 1


def test_a_floor_binds_its_node_and_the_remote_one_every_node():
    m = Model(nodes=2)
    k = written(m)
    m.observed(k, 0, num_tokens=2, num_pages=1, durable=True, remote=False)
    m.read(k, 0, [Label("alice", "s", 1, 0)])  # older than reported durable there
    assert m.tally.durable_lost == 1
    m.read(k, 1, [Label("alice", "s", 1, 0)])  # another node holds no disk copy of it
    m.missing(k, 0)
    assert m.tally.durable_lost == 2
    m.damage[0] += 1  # the node's files damaged since: its disk's floor no longer binds
    m.missing(k, 0)
    assert m.tally.durable_lost == 2
    m.observed(k, 1, num_tokens=2, num_pages=1, durable=False, remote=True)
    m.missing(k, 1)  # while the remote tier may be down: unserved, decided at the end
    assert (m.tally.unserved, m.tally.durable_lost) == (1, 2)
    m.missing(k, 1, final=True)
    assert m.tally.durable_lost == 3


def test_a_dropped_session_served_again_is_counted():
    m = Model(nodes=1)
    k = written(m)
    m.dropping(k, acknowledged=True)
    m.read(k, 0, [Label("alice", "s", 2, 0)])
    assert m.tally.resurrected == 1
    v = m.new_version(k, lambda v: v, 1)
    m.read(k, 0, [Label("alice", "s", v, 0)])
    assert m.tally.resurrected == 1
