import threading

from tierd.tiers.ioqueue import IOClass, IOExecutor, wait_all


def test_most_urgent_work_runs_first():
    ex = IOExecutor(1)
    gate = threading.Event()
    order = []
    blocker = ex.submit(IOClass.WRITEBACK, gate.wait)
    futures = [ex.submit(IOClass.WRITEBACK, order.append, "writeback"),
               ex.submit(IOClass.DEMOTION, order.append, "demotion"),
               ex.submit(IOClass.DEMAND, order.append, "demand"),
               ex.submit(IOClass.PREFETCH, order.append, "prefetch")]
    gate.set()
    wait_all([blocker, *futures])
    assert order == ["demand", "prefetch", "demotion", "writeback"]
    ex.shutdown()


def test_wait_all_raises_after_every_call_finished():
    ex = IOExecutor(2)
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
