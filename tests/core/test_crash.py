"""Kill a saving process with SIGKILL at random moments; after every restart,
each session is in a state the process had reached or was writing, never a
mix, and nothing half-written is left behind."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import Harness, read_all

CYCLES = 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _allowed(log: list[list[str]], durable: dict, pending: dict) -> None:
    """Fold one run's log into: last confirmed durable state per session, and
    the states written since (any of which may be what the disk holds)."""
    for words in log:
        kind, name = words[0], words[1] if len(words) > 1 else None
        if kind == "STATE":  # (a store from token 0 too: the durable state stays until the new one is)
            pending.setdefault(name, set()).add((int(words[2]), words[3]))
        elif kind == "DROP":
            pending.setdefault(name, set()).add(None)
        elif kind == "DURABLE":
            durable[name] = (int(words[2]), words[3])
            pending.pop(name, None)


@pytest.mark.slow
@pytest.mark.parametrize("codec, cycles", [("none", CYCLES), ("lossless", CYCLES // 2)])  # lossless: coded on disk
def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path, codec, cycles):
    rnd = random.Random(1234)
    durable: dict[str, tuple[int, str] | None] = {}
    checked_durable = coded = 0
    for cycle in range(cycles):
        child = subprocess.Popen([sys.executable, "-m", "tests.core.crash_child", str(tmp_path), str(cycle), codec],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "READY"
        time.sleep(rnd.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        pending: dict[str, set] = {}
        _allowed([line.split() for line in out.splitlines() if line.strip()], durable, pending)

        h = Harness(str(tmp_path), host_budget=8 << 20, host_slab=4 << 20, disk_budget=64 << 20, disk_slab=16 << 20,
                    disk_codec=codec)
        store = h.open()
        try:
            found = {}
            for key in store.keys():
                info, chunks = store.get(key)
                assert info.durable
                found[key.session_id] = (info.num_tokens, hashlib.sha256(read_all(chunks)).hexdigest())
            for name in set(durable) | set(pending) | set(found):
                allowed = set(pending.get(name, set()))
                allowed.add(durable.get(name))
                got = found.get(name)
                assert got in allowed, f"cycle {cycle}: {name} recovered as {got}, allowed {allowed}"
                if got is not None and got == durable.get(name):
                    checked_durable += 1
                durable[name] = got  # what is on disk now is the base of the next cycle
            # Nothing half-written: index and allocator hold exactly the sessions' pieces.
            pieces = sum(len(store.pieces(key, "disk")) for key in store.keys())
            coded += sum(p.codes is not None for key in store.keys() for p in store.pieces(key, "disk"))
            assert store.index.count() == (len(found), pieces)
            assert store.check_accounting() == []
        finally:
            h.close()
    assert checked_durable >= cycles  # the test did see acknowledged sessions come back
    assert (coded > 0) == (codec != "none")  # and, with a codec, pieces coded on disk
