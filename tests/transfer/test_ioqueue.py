import threading

from tierd.tiers.ioqueue import Priority, PriorityExecutor, wait_all


def test_most_urgent_work_runs_first():
    ex = PriorityExecutor(1)
    gate = threading.Event()
    order = []
    blocker = ex.submit(Priority.WRITEBACK, gate.wait)
    futures = [ex.submit(Priority.WRITEBACK, order.append, "writeback"),
               ex.submit(Priority.DEMOTION, order.append, "demotion"),
               ex.submit(Priority.DEMAND, order.append, "demand"),
               ex.submit(Priority.PREFETCH, order.append, "prefetch")]
    gate.set()
    wait_all([blocker, *futures])
    assert order == ["demand", "prefetch", "demotion", "writeback"]
    ex.shutdown()


def test_wait_all_raises_after_every_call_finished():
    ex = PriorityExecutor(2)
    done = []

    def boom():
        raise OSError(5, "EIO")

    futures = [ex.submit(0, boom), ex.submit(0, done.append, 1)]
    try:
        wait_all(futures)
    except OSError as exc:
        assert exc.errno == 5
    else:
        raise AssertionError("no error raised")
    assert done == [1]
    ex.shutdown()
