"""A local save of opaque bytes: a client on the daemon's machine (an
engine holding llama.cpp state, say) writes a snapshot straight into
shared memory the daemon lends for the save (BeginSave with a size), one
run of pages back to back, and commits it; no stream carries it. Against a
real daemon: the bytes read back exactly (the last page short), a save
replaces the snapshot whole and survives kill -9, an aborted or uncommitted
one leaves nothing, and bad sizes, appends, token ids or lossy bounds are
refused and store nothing."""

import numpy as np
import pytest

from tests.helpers import SPEC, metric, wait_for
from tierd.client import Arena, IdentityMismatch, InvalidArgument, KVSpec, NotFound

OPAQUE = KVSpec.opaque("test/state", page_bytes=8192)
OTHER = KVSpec.opaque("test/other-model", page_bytes=8192)


def state(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def save(c, arena, sid, data, num_tokens=0):
    lease = c.begin_save(sid, OPAQUE, num_tokens, size=data.size)
    [(first, rows)] = arena.runs(lease)  # one run: its pages back to back
    assert first == 0 and lease.nbytes == data.size and rows.size >= data.size
    rows.reshape(-1)[: data.size] = data
    return c.commit_save(lease)


def test_an_opaque_snapshot_written_into_a_save_lease_reads_back_exactly_and_survives_kill_9(daemon):
    arena = Arena()
    try:
        data = state(3 * 8192 + 1000)  # the last page short
        with daemon.client() as c:
            info = save(c, arena, "llama", data, num_tokens=700)
            assert (info.size_bytes, info.num_tokens, info.num_pages) == (data.size, 700, 4)
            with c.read_local("llama", spec=OPAQUE) as view:
                assert bytes(view) == data.tobytes()
            again = state(8192 + 1, seed=1)  # a smaller one replaces it whole
            save(c, arena, "llama", again, num_tokens=300)
            assert c.get("llama") == again.tobytes() and c.stat("llama").size_bytes == again.size
            with pytest.raises(IdentityMismatch):
                with c.read_local("llama", spec=OTHER):
                    pass
            c.release("llama")
            wait_for(lambda: c.stat("llama").durable, 20, "the snapshot written back")
        daemon.kill()
        daemon.start()
        with daemon.client() as c:
            assert c.get("llama") == again.tobytes() and c.stat("llama").num_tokens == 300
    finally:
        arena.close()


def test_an_aborted_or_expired_save_lease_leaves_nothing(daemon):
    arena = Arena()
    try:
        with daemon.client() as c:
            lease = c.begin_save("gone", OPAQUE, 0, size=20000)
            arena.pages(lease)[0][:] = 7
            c.abort_save(lease)
            late = c.begin_save("late", OPAQUE, 0, size=20000, ttl=0.2)
            wait_for(lambda: metric(daemon, "tierd_leases_expired_total", 'kind="save"') == 1, 10,
                     "the policy tick to expire the lease")
            with pytest.raises(NotFound, match="expired"):
                c.commit_save(late)
            assert c.list() == [] and {t.name: t.used for t in c.stats()["tiers"]}["host"] == 0
    finally:
        arena.close()


BAD = {
    "no size for an opaque snapshot": (lambda c: c.begin_save("x", OPAQUE, 0), "size must be a positive"),
    "a negative token count": (lambda c: c.begin_save("x", OPAQUE, -1, size=10), "num_tokens"),
    # the wire carries up to 2**64-1; the index holds up to 2**63-1 (past it, the write-back failed for good)
    "a token count past 2**63-1": (lambda c: c.begin_save("x", OPAQUE, 1 << 63, size=10), "num_tokens"),
    "a Put's token count past 2**63-1": (lambda c: c.put("x", b"x", OPAQUE, (1 << 64) - 1), "num_tokens"),
    "a KV lease's token count past 2**63-1": (lambda c: c.begin_save("x", SPEC, 1 << 63), "num_tokens"),
    "an append onto an opaque snapshot": (lambda c: c.begin_save("x", OPAQUE, 10, start_token=1, size=10),
                                          "start_token"),
    "token ids for an opaque snapshot": (lambda c: c.begin_save("x", OPAQUE, 2, token_ids=[1, 2], size=10),
                                         "token"),
    "a lossy bound for an opaque snapshot": (lambda c: c.begin_save("x", OPAQUE, 0, size=10, lossy_max_error=0.1),
                                             "never coded lossily"),
    "a size for a KV lease": (lambda c: c.begin_save("x", SPEC, 16, size=SPEC.page_bytes), "size is an opaque"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_opaque_save_lease_is_refused_and_stores_nothing(daemon, name):
    call, error = BAD[name]
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match=error):
            call(c)
        assert c.list() == [] and {t.name: t.used for t in c.stats()["tiers"]}["host"] == 0
