"""Clients reach a restarted daemon within about a second, however long it
was down: they keep failing fast while it is down, and keep trying to connect
every half second rather than backing off the way gRPC does by default."""

import asyncio
import threading
import time

import pytest

from tierd.client import AsyncClient, KVSpec, Unavailable
from tierd.testing import Daemon

# After 18 s of failed attempts, gRPC's default backoff waits 4-10 s between
# attempts: a client found the restarted daemon 4.5 to 9.5 s late (3 runs).
OUTAGE = 18.0
LATE = 1.5  # the most a first success may come after the daemon serves again


@pytest.mark.slow
def test_clients_reach_a_restarted_daemon_within_a_second(tmp_path):
    d = Daemon(tmp_path).start()
    down = threading.Event()
    try:
        blocking = d.client(timeout=5)
        blocking.put("s", b"kept", KVSpec.opaque("m", page_bytes=4096), num_tokens=1)
        connected = threading.Event()
        first_ok: dict[str, float] = {}
        failed = {"sync": 0, "async": 0}

        def sync_calls() -> None:
            down.wait()
            while "sync" not in first_ok:
                try:
                    blocking.stat("s")
                except Unavailable:
                    failed["sync"] += 1
                    time.sleep(0.05)
                    continue
                first_ok["sync"] = time.monotonic()

        async def async_calls() -> None:
            async with AsyncClient(d.socket, timeout=5) as c:
                await c.stat("s")  # connected before the outage, as the blocking client is
                connected.set()
                await asyncio.get_running_loop().run_in_executor(None, down.wait)
                while "async" not in first_ok:
                    try:
                        await c.stat("s")
                    except Unavailable:
                        failed["async"] += 1
                        await asyncio.sleep(0.05)
                        continue
                    first_ok["async"] = time.monotonic()

        threads = [threading.Thread(target=sync_calls, daemon=True),
                   threading.Thread(target=asyncio.run, args=(async_calls(),), daemon=True)]
        for t in threads:
            t.start()
        assert connected.wait(30)
        # the daemon goes away; both clients keep calling, and failing, through the outage
        d.stop()
        down.set()
        time.sleep(OUTAGE)
        assert first_ok == {} and min(failed.values()) > 50
        # it comes back: each client's next call within LATE of it serving gets through
        d.start()
        serving = time.monotonic()
        for t in threads:
            t.join(30)
        late = {who: round(at - serving, 2) for who, at in first_ok.items()}
        assert set(late) == {"sync", "async"} and max(late.values()) <= LATE, late
        assert blocking.get("s") == b"kept"
        blocking.close()
    finally:
        down.set()
        d.close()
