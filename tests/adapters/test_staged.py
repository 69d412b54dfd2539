"""A restore lease staged ahead (tierd.adapters.staged), against a real
daemon allowing one lease per tenant: the staged lease holds the session's
bytes and is handed to the restore of that session, and ended off its path
once read (a read past the lease's deadline does not count); one another
session's restore does not take, or a drop, is ended (the next lease is
granted); what begin_restore raised is raised by take."""

import numpy as np
import pytest

from tierd.adapters.staged import StagedRestore
from tests.helpers import wait_for
from tierd.client import Arena, IdentityMismatch, KVSpec, NotFound, ResourceExhausted
from tierd.testing import Daemon

SPEC = KVSpec.opaque("test/state", page_bytes=8192)


@pytest.fixture
def one_lease(tmp_path):
    d = Daemon(tmp_path, "--tenant-leases", "1").start()
    yield d
    d.close()


def _free(c, sid):
    """Whether the tenant's one lease is free: a restore lease is granted (and ended)."""
    try:
        lease = c.begin_restore(sid)
    except ResourceExhausted:
        return False
    c.end_restore(lease)
    return True


def test_a_staged_lease_is_handed_to_its_session_s_restore_and_ended_for_any_other(one_lease):
    data = np.random.default_rng(0).integers(0, 256, 3 * 8192 + 5, dtype=np.uint8).tobytes()
    arena = Arena()
    prepared = []
    with one_lease.client() as c:
        c.put("a", data, SPEC, 0)
        c.put("b", b"b" * 100, SPEC, 0)
        staged = StagedRestore(c, SPEC, prepared.append)
        staged.begin("a")
        assert staged.wait(30)
        held = staged.take("a")
        lease = held.lease
        assert prepared == [lease] and lease.nbytes == len(data)
        [(_, rows)] = arena.runs(lease)
        assert rows.reshape(-1)[: len(data)].tobytes() == data
        assert staged.end(held)  # read in time; ended on a thread of its own
        wait_for(lambda: _free(c, "b"), 10, "the lease ended")
        staged.begin("a")
        assert staged.take("b") is None  # another session's: ended, so the one lease left is free again
        assert _free(c, "b")
        staged.begin("b")
        staged.drop()
        assert _free(c, "a")
        late = staged.hold("a")
        late.deadline = 0.0  # as if read past its time
        assert not staged.end(late)
        wait_for(lambda: _free(c, "a"), 10, "the lease ended")
        staged.begin("nope")
        with pytest.raises(NotFound):
            staged.take("nope")
        other = StagedRestore(c, KVSpec.opaque("test/other-model", page_bytes=8192))
        other.begin("a")
        with pytest.raises(IdentityMismatch):
            other.take("a")
        assert _free(c, "a")  # nothing of the refused ones left held
    arena.close()


def test_a_stage_whose_preparation_fails_ends_its_lease_and_take_raises_why(one_lease):
    """prepare (placing the bytes where the engine reads them, say) fails:
    the lease it had is ended there, as no take will have it (the tenant's
    one lease is free again), and take raises the error."""

    def full(lease):
        raise OSError(28, "No space left on device")

    with one_lease.client() as c:
        c.put("a", b"a" * 100, SPEC, 0)
        staged = StagedRestore(c, SPEC, full)
        staged.begin("a")
        assert staged.wait(30)
        assert _free(c, "a")
        with pytest.raises(OSError, match="No space left"):
            staged.take("a")
