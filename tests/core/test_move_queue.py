import threading

from tests.helpers import wait_for
from tierd.core.move_queue import Job, MoveQueue
from tierd.tiers.ioqueue import IOClass
from tierd.types import SessionKey


def _merge(old, new):
    changed = new.priority > old.priority
    old.priority = max(old.priority, new.priority)
    return changed


def test_jobs_run_by_class_then_priority_and_merge_per_session():
    gate, ran = threading.Event(), []

    def run(job):
        if job.key.session_id == "blocker":
            gate.wait()
        ran.append((job.key.session_id, job.priority))

    mover = MoveQueue(run, workers=1)
    key = lambda n: SessionKey("t", n)  # noqa: E731
    mover.submit(Job(key("blocker"), "host", "prefetch", IOClass.PREFETCH), _merge)
    wait_for(lambda: key("blocker") in mover.busy_keys(queued=False), 10, "the only worker to be busy")
    mover.submit(Job(key("wb"), "disk", "writeback", IOClass.WRITEBACK), _merge)
    mover.submit(Job(key("low"), "host", "prefetch", IOClass.PREFETCH, priority=1), _merge)
    mover.submit(Job(key("x"), "host", "prefetch", IOClass.PREFETCH, priority=0), _merge)
    mover.submit(Job(key("x"), "host", "prefetch", IOClass.PREFETCH, priority=9), _merge)  # merged: x jumps ahead
    mover.submit(Job(key("gone"), "host", "prefetch", IOClass.PREFETCH), _merge)
    assert mover.cancel(key("gone")).cancelled
    gate.set()
    assert mover.drain(5)
    assert ran == [("blocker", 0), ("x", 9), ("low", 1), ("wb", 0)]
    mover.close()


def test_one_move_per_session_at_a_time():
    gate, ran = threading.Event(), []
    key = SessionKey("t", "s")

    def run(job):
        if job.reason == "first":
            gate.wait()
        ran.append(job.reason)

    mover = MoveQueue(run, workers=2)
    mover.submit(Job(key, "host", "first", IOClass.PREFETCH), lambda o, n: False)
    wait_for(lambda: key in mover.busy_keys(queued=False), 10, "the first move to run")
    mover.submit(Job(key, "disk", "second", IOClass.DEMOTION), lambda o, n: False)
    assert ran == [] and key in mover.busy_keys(queued=True)  # the second stays queued while the session is busy
    gate.set()
    assert mover.drain(5)
    assert ran == ["first", "second"]
    mover.close()


def test_tenants_take_turns_within_a_class_whatever_their_priority():
    """The queue ran jobs by class, then by priority alone: one tenant's
    prefetches at the highest priority kept every other tenant's waiting
    (a prefetch of bob's missed its 20 s while alice's flooded)."""
    gate, ran = threading.Event(), []

    def run(job):
        if job.key.session_id == "blocker":
            gate.wait()
        ran.append(job.key.session_id)

    queue = MoveQueue(run, workers=1)
    queue.submit(Job(SessionKey("alice", "blocker"), "host", "prefetch", IOClass.PREFETCH), _merge)
    wait_for(lambda: queue.busy_keys(queued=False), 10, "the only worker to be busy")
    # alice: five prefetches at the top priority and a write-back; bob and carol: one each, at 0
    for i in range(5):
        queue.submit(Job(SessionKey("alice", f"a{i}"), "host", "prefetch", IOClass.PREFETCH, priority=1000 - i), _merge)
    queue.submit(Job(SessionKey("alice", "wb"), "disk", "writeback", IOClass.WRITEBACK), _merge)
    queue.submit(Job(SessionKey("bob", "b0"), "host", "prefetch", IOClass.PREFETCH), _merge)
    queue.submit(Job(SessionKey("carol", "c0"), "host", "prefetch", IOClass.PREFETCH), _merge)
    gate.set()
    assert queue.drain(5)
    assert ran == ["blocker", "a0", "b0", "c0", "a1", "a2", "a3", "a4", "wb"]
    queue.close()
