"""Many threads on the same few sessions: saves, appends, restores, drops,
prefetches and demotions race; nothing leaks and every read is a version
that was written."""

import hashlib
import random
import threading


from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key
from tierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tierd.policy import PolicyConfig

KEYS = [make_key("default", k) for k in ("x", "y")]


def test_racing_threads_leave_a_consistent_store(tmp_path):
    h = Harness(str(tmp_path), host_budget=2 << 20, host_slab=2 << 20, policy=PolicyConfig(writeback_idle=0))
    store = h.open()
    written = {k: set() for k in KEYS}  # sha256 of every content a key ever had
    errors = []
    lock = threading.Lock()

    def worker(seed):
        rnd = random.Random(seed)
        eng = HostEngine(num_blocks=16, seed=seed)
        out = HostEngine(num_blocks=16, seed=seed + 100)
        for _ in range(60):
            key = rnd.choice(KEYS)
            op = rnd.choice(["save", "save", "restore", "get", "drop", "prefetch", "demote", "tick"])
            try:
                if op == "save":
                    n = rnd.randint(1, 4)
                    blocks = rnd.sample(range(16), n)
                    # the content (and each prefix a partial restore may read) is recorded before it is visible
                    pages = eng.pages(blocks)
                    with lock:
                        written[key].update(hashlib.sha256(b"".join(pages[:k])).hexdigest() for k in range(1, n + 1))
                    store.save(key, eng.memory, SPEC, blocks, n * 16)
                elif op == "restore":
                    n = store.stat(key).num_pages  # may be stale by the time restore runs
                    try:
                        store.restore(key, out.memory, SPEC, list(range(n)))
                    except InvalidArgument:
                        continue  # the snapshot shrank meanwhile
                    digest = hashlib.sha256(b"".join(out.pages(range(n)))).hexdigest()
                    assert digest in written[key], "restored bytes that were never saved"
                elif op == "get":
                    info, reader = store.get(key, 5000)
                    assert hashlib.sha256(read_all(reader)).hexdigest() in written[key]
                elif op == "drop":
                    store.drop(key)
                elif op == "prefetch":
                    store.prefetch(key)
                elif op == "demote":
                    store.demote(key)
                else:
                    store.tick()
            except (NotFound, ResourceExhausted):
                pass
            except FailedPrecondition:
                pass
            except Exception as exc:  # anything else is a bug
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.drain(30)
    assert errors == []
    assert store.check_accounting() == []
    for key in store.keys():
        info, reader = store.get(key)
        assert hashlib.sha256(read_all(reader)).hexdigest() in written[key]
    h.close()
