"""The daemon's memory stays bounded whatever a client sends: token ids cost
bytes, not Python objects; an unauthenticated request is refused before it
is parsed; a flood of Puts costs each stream a bounded buffer.

Peaks are read from the daemon's own counters: /proc/PID/clear_refs resets
its peak resident set (VmHWM) to what it holds now, so VmHWM after a call
is the call's peak; its heap alone (RssAnon) is sampled.
"""

import hashlib
import threading
import time

import grpc
import numpy as np
import pytest

from tierd.client import KVSpec, ResourceExhausted
from tierd.testing import Daemon
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.packed import encode, field

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("m", page_bytes=1 << 20)
MiB = 1 << 20
TOKEN = "alice-secret"


def _status(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(d, run):
    """What run() added to the daemon's resident set at its peak."""
    with open(f"/proc/{d.pid()}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status(d.pid(), "VmRSS")
    run()
    return _status(d.pid(), "VmHWM") - before


def settle(d, still: float = 1.0, timeout: float = 15.0) -> None:
    """Until the daemon's resident set has grown by less than 1 MiB over `still`
    seconds, or timeout (memory that keeps growing never settles)."""
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.monotonic()
        samples.append((now, _status(d.pid(), "VmRSS")))
        past = [rss for t, rss in samples if t <= now - still]
        if past and samples[-1][1] - past[-1] < MiB:
            return
        time.sleep(0.1)


def lookup(d, ids, token):
    raw = pb.LookupRequest(session_id="s").SerializeToString() + field(2, ids)
    with grpc.insecure_channel("unix:" + d.socket) as ch:
        call = ch.unary_unary("/tierd.v1.Tierd/Lookup", request_serializer=None,
                              response_deserializer=pb.LookupResponse.FromString)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            return call(raw, metadata=md, timeout=60).num_tokens
        except grpc.RpcError as err:
            return err.code()


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    (root / "tokens").write_text(f"alice:{hashlib.sha256(TOKEN.encode()).hexdigest()}\n")
    d = Daemon(root, "--auth-tokens", str(root / "tokens"), "--writeback-idle", "off").start()
    with d.client(token=TOKEN) as c:
        ids = np.arange(64)
        c.put("s", np.zeros(4 * SPEC.page_bytes, dtype=np.uint8), SPEC, 64, token_ids=ids)
    yield d
    d.close()


def test_a_long_prompt_costs_bytes_not_python_objects(secured):
    """Token ids used to cost ~26 times their wire size (a Python int each):
    three 57 MiB Lookups took 4.5 GiB. A Lookup now decodes no more ids than
    the snapshot holds tokens."""
    ids = encode(np.concatenate([np.arange(64), np.random.default_rng(0).integers(0, 150_000, 4_000_000)]))
    got = []
    growth = peak_growth(secured, lambda: got.append(lookup(secured, ids, TOKEN)))
    assert got == [64]  # the stored pages match the prompt's first 64 tokens
    assert growth < 3 * len(ids) + 16 * MiB, f"{growth / MiB:.0f} MiB for {len(ids) / MiB:.0f} MiB of ids"


def test_a_request_without_a_valid_token_is_refused_unparsed(secured):
    """Before, a request was parsed in full, then refused (about 1 GiB for 57 MiB of ids)."""
    ids = encode(np.random.default_rng(1).integers(0, 150_000, 4_000_000))
    for token in (None, "wrong"):
        got = []
        growth = peak_growth(secured, lambda: got.append(lookup(secured, ids, token)))
        assert got == [grpc.StatusCode.UNAUTHENTICATED]
        assert growth < 2 * len(ids) + 16 * MiB, f"{growth / MiB:.0f} MiB for {len(ids) / MiB:.0f} MiB refused"


def test_concurrent_puts_cost_each_stream_a_bounded_buffer(tmp_path):
    """Each Put used to queue up to 16 chunks of its own in the daemon (200
    Puts: 7.7 GiB beside the arena); a Put's chunks now go straight into the
    host tier as they arrive. (Puts in progress may hold the whole host tier
    here: by default a tenant's may hold half.)"""
    d = Daemon(tmp_path, "--writeback-idle", "off", "--host-budget", "256MiB", "--host-slab", "auto",
               "--tenant-put-bytes", "256MiB").start()
    try:
        data = np.zeros(16 * MiB, dtype=np.uint8)
        stored = []

        def put(i):
            with d.client(timeout=120) as c:
                try:
                    c.put(f"p{i}", data, OPAQUE, 1)
                    stored.append(i)
                except ResourceExhausted:
                    pass

        def flood():
            threads = [threading.Thread(target=put, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        # The host tier's pages are shared memory and come and go with its housekeeping: the
        # heap is read apart (RssAnon), sampled, since the kernel keeps no peak of it alone.
        before, peak, done = _status(d.pid(), "RssAnon"), [0], threading.Event()

        def sample():
            while not done.wait(0.002):
                peak[0] = max(peak[0], _status(d.pid(), "RssAnon"))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            flood()
        finally:
            done.set()
            sampler.join()
        heap = peak[0] - before
        assert len(stored) >= 8  # what fits the host tier was stored
        assert heap < 24 * 4 * MiB + 64 * MiB, f"{heap / MiB:.0f} MiB of heap for 24 streams"
    finally:
        d.close()


def test_a_get_asking_for_huge_chunks_holds_a_few_mib(tmp_path):
    """A Get of 64 MiB chunks that its client stopped reading held about
    260 MiB of heap: a chunk is at most 4 MiB."""
    d = Daemon(tmp_path, "--writeback-idle", "off", "--host-budget", "128MiB", "--host-slab", "auto").start()
    try:
        with d.client() as c:
            c.put("s", np.random.default_rng(4).integers(0, 256, 60 * MiB, dtype=np.uint8), OPAQUE, 1)
            before = _status(d.pid(), "RssAnon")
            _, chunks = c.get_stream("s", chunk_bytes=64 * MiB)  # the header only, then nothing is read
            first = next(chunks)
            assert len(first) <= 4 * MiB
            deadline = time.monotonic() + 2  # the daemon fills what gRPC will take, then waits
            peak = 0
            while time.monotonic() < deadline:
                peak = max(peak, _status(d.pid(), "RssAnon") - before)
                time.sleep(0.01)
            assert peak < 48 * MiB, f"{peak / MiB:.0f} MiB for one stalled Get"
            chunks.close()
    finally:
        d.close()
