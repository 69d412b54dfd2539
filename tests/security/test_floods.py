"""Requests shaped to cost the daemon far more than their size, floods of
one tenant's moves, and calls that end just as the daemon answers them.

Each case is the hostile client first, against a real daemon process, then
what the daemon and the other tenants still get: memory near the message's
own size, their calls answered, their room and their leases given back.
"""

import random
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from tests.helpers import metric, wait_for
from tests.security.test_memory import peak_growth, settle
from tierd.client import FailedPrecondition, InvalidArgument, KVSpec, ResourceExhausted, SharedKVCache
from tierd.daemon import HANDSHAKE_SECONDS
from tierd.testing import Daemon, tokens_file
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.convert import spec_to_pb

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("m", page_bytes=4096)
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
MiB = 1 << 20


@pytest.fixture
def two(tmp_path):
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS), "--writeback-idle", "off",
               "--host-budget", "256MiB").start()
    yield d
    d.close()


def at_once(fn, n):
    """fn(0) ... fn(n - 1), each on a thread of its own, all at once; returns when all are done."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def raw_call(d, method, raw, token="alice", timeout=60.0):
    """The status (or reply) of one call whose request is the bytes given."""
    with grpc.insecure_channel("unix:" + d.socket) as ch:
        call = ch.unary_unary(f"/tierd.v1.Tierd/{method}", request_serializer=None, response_deserializer=None)
        try:
            return call(raw, metadata=(("authorization", f"Bearer {TOKENS[token]}"),), timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details()


def test_a_request_of_millions_of_tiny_fields_is_refused_at_once(two):
    """A 2 MB Lookup of a million 2-byte unknown fields held the event loop
    10 s (every tenant's calls and the policy tick waited) and took 540 MiB:
    its fields were walked one by one in Python. This one is 8 MB."""
    raw = pb.LookupRequest(session_id="s").SerializeToString() + b"\x78\x00" * (4 << 20)  # field 15, varint 0
    got = []
    t0 = time.monotonic()
    growth = peak_growth(two, lambda: got.append(raw_call(two, "Lookup", raw)))
    assert got[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "not a valid LookupRequest" in got[0][1]
    assert time.monotonic() - t0 < 10
    assert growth < 4 * len(raw) + 32 * MiB, f"{growth / MiB:.0f} MiB for {len(raw) / MiB:.0f} MiB refused"
    with two.client(token=TOKENS["bob"]) as bob:
        assert bob.stats()["sessions"] == 0


def test_a_register_engine_of_millions_of_empty_segments_is_refused_unparsed(two):
    """60 MB of empty Segment entries were parsed on the event loop: 4 s, and
    1.7 GB of the daemon's memory. A request without id lists is small."""
    raw = pb.RegisterEngineRequest(spec=spec_to_pb(SPEC), num_blocks=4).SerializeToString() + b"\x22\x00" * (6 << 20)
    got = []
    growth = peak_growth(two, lambda: got.append(raw_call(two, "RegisterEngine", raw)))
    assert got[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "at most 1048576 bytes" in got[0][1]
    assert growth < 2 * len(raw) + 32 * MiB, f"{growth / MiB:.0f} MiB for {len(raw) / MiB:.0f} MiB refused"


def test_put_chunks_past_the_message_limit_are_refused_as_they_arrive(two):
    """Puts declaring 4 KiB, then sending a 60 MiB chunk each: every chunk was
    taken in whole before the size check refused it (2.4 GiB for 32 streams)."""
    def hostile(_):
        with grpc.insecure_channel("unix:" + two.socket, options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
            stub = pb_grpc.TierdStub(ch)
            header = pb.PutRequest(header=pb.PutHeader(session_id="p", spec=spec_to_pb(OPAQUE), num_tokens=1,
                                                       size=4096))
            try:
                stub.Put(iter([header, pb.PutRequest(chunk=pb.Chunk(data=bytes(60 * MiB)))]),
                         metadata=(("authorization", f"Bearer {TOKENS['alice']}"),), timeout=60)
            except grpc.RpcError as err:
                codes.append(err.code())

    codes: list = []

    growth = peak_growth(two, lambda: at_once(hostile, 16))
    assert len(codes) == 16 and set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}
    assert growth < 16 * 16 * MiB, f"{growth / MiB:.0f} MiB for 16 refused chunks of 60 MiB"
    with two.client(token=TOKENS["alice"]) as alice:
        assert alice.list() == []


def test_list_runs_off_the_event_loop(two):
    """List sorted every session and described a page of up to 10,000 on the
    event loop: four Lists of alice's 10,000 sessions at a time let bob's Stat
    through 10 times in 8 s. (3,000 here: enough to hold the loop that long.)"""
    with two.client(token=TOKENS["alice"]) as alice:
        def fill(part):
            with two.client(token=TOKENS["alice"]) as c:
                for i in range(part, 3000, 3):
                    c.put(f"s{i:05d}", b"x" * 4096, OPAQUE, num_tokens=1)

        fillers = [threading.Thread(target=fill, args=(p,)) for p in range(3)]
        for t in fillers:
            t.start()
        for t in fillers:
            t.join()
        page, token = alice.list_page(limit=10_000)
        assert len(page) == 3000 and token == ""
        half, token = alice.list_page(limit=1500)
        rest, end = alice.list_page(limit=10_000, page_token=token)
        assert [i.session_id for i in half + rest] == [i.session_id for i in page] and end == ""
    with two.client(token=TOKENS["bob"]) as bob:
        bob.put("b", b"y" * 4096, OPAQUE, num_tokens=1)
        stop = threading.Event()

        def lists():
            with two.client(token=TOKENS["alice"]) as c:
                while not stop.is_set():
                    c.list_page(limit=10_000)

        listers = [threading.Thread(target=lists) for _ in range(4)]
        for t in listers:
            t.start()
        try:
            stats, end = 0, time.monotonic() + 4
            while time.monotonic() < end:
                bob.stat("b")
                stats += 1
        finally:
            stop.set()
            for t in listers:
                t.join()
    assert stats >= 40, f"bob's Stat went through {stats} times in 4 s"
    two.kill()  # (3,000 sessions in host alone: a clean stop writes each back, which is not this test's subject)


@pytest.mark.parametrize("kind", ["BeginSave", "BeginRestore"])
def test_lease_calls_that_end_as_the_daemon_answers_give_their_leases_back(two, kind):
    """A BeginSave or BeginRestore whose deadline passed as the daemon answered
    left its lease open for its TTL (an hour): a client that only used
    deadlines soon had none of its 64 leases left, and host room was held by
    no session."""
    md = (("authorization", f"Bearer {TOKENS['alice']}"),)
    spec = spec_to_pb(SPEC)
    with two.client(token=TOKENS["alice"]) as alice, grpc.insecure_channel("unix:" + two.socket) as ch:
        stub = pb_grpc.TierdStub(ch)
        alice.put("r", np.zeros(4 * SPEC.page_bytes, dtype=np.uint8), SPEC, 64)
        begin = (lambda **kw: stub.BeginSave(pb.BeginSaveRequest(session_id="x", spec=spec, num_tokens=64,
                                                                 ttl_seconds=3600), metadata=md, **kw)) \
            if kind == "BeginSave" else \
            (lambda **kw: stub.BeginRestore(pb.BeginRestoreRequest(session_id="r", ttl_seconds=3600), metadata=md,
                                            **kw))
        end = stub.AbortSave if kind == "BeginSave" else stub.EndRestore
        rnd, missed = random.Random(1), 0
        stop = time.monotonic() + 5
        while time.monotonic() < stop:
            try:
                lease = begin(timeout=rnd.uniform(0.0005, 0.006))
                end(pb.LeaseRequest(lease_id=lease.lease_id), metadata=md)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                missed += 1
        assert missed
        held = 4 * SPEC.page_bytes  # r's pages, and no lease's
        wait_for(lambda: next(t.used for t in alice.stats()["tiers"] if t.name == "host") == held, 10,
                 "the leases of the missed answers to be given back")
        leases = [begin() for _ in range(64)]  # every one of the tenant's leases is free again
        for lease in leases:
            end(pb.LeaseRequest(lease_id=lease.lease_id), metadata=md)


def test_a_prefetch_priority_past_the_range_is_refused(two):
    """Prefetch took any int32 as its priority (Save and Put: -1000 to 1000),
    so one tenant's prefetches could always run before everyone else's."""
    with two.client(token=TOKENS["alice"]) as alice:
        alice.put("p", b"z" * 4096, OPAQUE, num_tokens=1)
        with pytest.raises(InvalidArgument, match=r"priority must be an integer in \[-1000, 1000\]"):
            alice.prefetch("p", priority=2**31 - 1)


def test_clients_that_give_up_mid_call_leave_no_traceback_and_no_internal_error(two):
    """Clients whose deadlines passed at every point of Put, Get and Release
    left tracebacks at ERROR in the daemon's log (gRPC's, for answers it could
    not send; the daemon's, for a Put cancelled as it was accepted, counted
    INTERNAL)."""
    data = bytes(64 << 10)

    def worker(seed):
        rnd = random.Random(seed)
        end = time.monotonic() + 8
        while time.monotonic() < end:
            with two.client(token=TOKENS["alice"], timeout=rnd.uniform(0.001, 0.01)) as c:
                try:
                    op = rnd.randrange(3)
                    if op == 0:
                        c.put(f"s{rnd.randrange(4)}", data, OPAQUE, num_tokens=1)
                    elif op == 1:
                        c.get(f"s{rnd.randrange(4)}")
                    else:
                        c.release(f"s{rnd.randrange(4)}")
                except Exception:
                    pass  # a deadline, or not there yet

    at_once(worker, 4)
    assert "Traceback" not in two.log() and "internal error" not in two.log()
    assert metric(two, "tierd_rpc_errors_total", 'code="INTERNAL",method="Put"') == 0


def test_a_connection_that_never_speaks_is_closed(two):
    """Each connection holds one of the daemon's descriptors; gRPC let one that
    sent nothing hold it for 120 s: 1,010 of them left no descriptor for a
    lease segment or a slab."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(two.socket)
        s.settimeout(HANDSHAKE_SECONDS + 20)  # (gRPC's own default was 120 s)
        while s.recv(1 << 16):  # what the daemon says first (its settings, say), then the end
            pass


@pytest.fixture
def on_disk(tmp_path):
    """alice with a 16 MiB session on disk only, bob with a small one in host."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS), "--writeback-idle", "0",
               "--host-idle", "0.2", "--host-budget", "256MiB").start()
    with d.client(token=TOKENS["alice"]) as alice, d.client(token=TOKENS["bob"]) as bob:
        alice.put("big", np.random.default_rng(5).integers(0, 256, 16 * MiB, dtype=np.uint8), KVSpec.opaque("m"), 1)
        alice.release("big")
        bob.put("b", b"b" * 4096, OPAQUE, num_tokens=1)
        wait_for(lambda: alice.stat("big").tier_bytes.keys() == {"disk"}, 30, "big on disk alone")
    yield d
    d.close()


def test_gets_cancelled_while_their_thread_reads_keep_their_tenants_slots(on_disk):
    """A cancelled Get gave its tenant's RPC-thread slot back while its batch
    (8 million 1-byte messages) still ran: twelve of them, one at a time,
    took every thread, and bob's Stat waited past 15 s."""
    md = (("authorization", f"Bearer {TOKENS['alice']}"),)
    with grpc.insecure_channel("unix:" + on_disk.socket) as ch, on_disk.client(token=TOKENS["bob"]) as bob:
        stub = pb_grpc.TierdStub(ch)
        worst = 0.0
        for _ in range(12):
            stream = stub.Get(pb.GetRequest(session_id="big", chunk_bytes=1), metadata=md)
            next(stream)  # the header
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.5:
                s0 = time.monotonic()
                bob.stat("b")
                worst = max(worst, time.monotonic() - s0)
            stream.cancel()
        assert worst < 5, f"bob's Stat took {worst:.1f} s"
        wait_for(lambda: bob.stat("b"), 10)
    assert on_disk.stop(timeout=30) == 0  # and a clean stop within its grace


def test_gets_of_one_byte_chunks_hold_a_bounded_heap(on_disk):
    """Gets asking for 1-byte chunks of a disk session, then not reading:
    +250 MiB of heap in 30 s for two (and growing), and SIGTERM took 85 s.
    A chunk is at least 4 KiB and a batch at most 128 messages."""
    md = (("authorization", f"Bearer {TOKENS['alice']}"),)
    channels = [grpc.insecure_channel("unix:" + on_disk.socket) for _ in range(2)]
    try:
        def stalled():
            for ch in channels:
                next(pb_grpc.TierdStub(ch).Get(pb.GetRequest(session_id="big", chunk_bytes=1), metadata=md))
            settle(on_disk)  # they stall: the daemon's reads wait on the streams' flow control, its heap stops growing

        growth = peak_growth(on_disk, stalled)
        assert growth < 96 * MiB, f"{growth / MiB:.0f} MiB for two stalled Gets"
        t0 = time.monotonic()
        assert on_disk.stop(timeout=30) == 0 and time.monotonic() - t0 < 15
    finally:
        for ch in channels:
            ch.close()


def test_put_header_token_ids_are_decoded_only_once_the_put_is_checked(two):
    """Puts whose header carried 15 million token ids, for an opaque spec
    that holds none: each was decoded on the event loop (10x its bytes,
    bob's Stat blocked 3 s) before being refused."""
    from tierd.wire.packed import encode, field

    ids = encode(np.ones(15_000_000, dtype=np.int64))  # 1 byte each
    header = pb.PutHeader(session_id="p", spec=spec_to_pb(KVSpec.opaque("m")), num_tokens=15_000_000, size=4096)
    head = header.SerializeToString() + field(pb.PutHeader.DESCRIPTOR.fields_by_name["token_ids"].number, ids)
    message = field(pb.PutRequest.DESCRIPTOR.fields_by_name["header"].number, head)
    codes = []

    def put():
        with grpc.insecure_channel("unix:" + two.socket) as ch:
            call = ch.stream_unary("/tierd.v1.Tierd/Put", request_serializer=None, response_deserializer=None)
            try:
                call(iter([message]), metadata=(("authorization", f"Bearer {TOKENS['alice']}"),), timeout=60)
            except grpc.RpcError as err:
                codes.append((err.code(), err.details()))

    growth = peak_growth(two, lambda: at_once(lambda _: put(), 6))
    assert len(codes) == 6 and all(c == grpc.StatusCode.INVALID_ARGUMENT and "opaque snapshots have no tokens" in m
                                   for c, m in codes), codes
    assert growth < 6 * 2 * len(message) + 32 * MiB, f"{growth / MiB:.0f} MiB for 6 refused Puts"


def test_a_tenants_puts_in_progress_hold_half_the_host_tier(tmp_path):
    """One Put of the whole host budget that sent 4 KiB every 5 s held the
    tier: every other tenant's Put was refused for room."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS), "--writeback-idle", "off",
               "--host-budget", "64MiB", "--host-slab", "auto").start()
    done = threading.Event()
    try:
        with d.client(token=TOKENS["alice"]) as alice, d.client(token=TOKENS["bob"]) as bob:
            with pytest.raises(ResourceExhausted, match="Puts in progress may hold 33554432 bytes"):
                alice.put("whole", bytes(64 * MiB), KVSpec.opaque("m"), 1)
            with grpc.insecure_channel("unix:" + d.socket) as ch:
                trickle = pb_grpc.TierdStub(ch).Put.future(iter(_trickle(32 * MiB, done)), metadata=(
                    ("authorization", f"Bearer {TOKENS['alice']}"),), timeout=60)
                wait_for(lambda: next(t.used for t in alice.stats()["tiers"] if t.name == "host") == 32 * MiB, 10,
                         "the trickling Put's room taken")
                for i in range(24):  # 24 MiB of bob's fit beside it (the watermarks keep some room free)
                    bob.put(f"b{i}", bytes(MiB), KVSpec.opaque("m"), 1)
                trickle.cancel()
            assert bob.list_page(limit=100)[0] and len(bob.list()) == 24 and alice.list() == []
    finally:
        done.set()
        d.close()


def _trickle(nbytes, done):
    yield pb.PutRequest(header=pb.PutHeader(session_id="slow", spec=spec_to_pb(KVSpec.opaque("m")), num_tokens=1,
                                            size=nbytes))
    yield pb.PutRequest(chunk=pb.Chunk(data=bytes(4096)))
    done.wait(30)  # then nothing more, until the test is done with it


def test_silent_connections_to_the_descriptor_intake_turn_no_other_engine_away(two):
    """80 connections to SOCKET.fds that sent nothing, reopened as they were
    dropped, took every one of its 64 places: other engines' RegisterEngine
    failed 39 times in 40. One process may hold four places at once."""
    hog = subprocess.Popen([sys.executable, "-c", f"""
import select, socket, time
conns = []
ready = False
end = time.monotonic() + 15
while time.monotonic() < end:
    conns = [c for c in conns if c.fileno() >= 0]
    while len(conns) < 80:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({two.socket + '.fds'!r})
        except OSError:
            s.close()
            break
        conns.append(s)
    if not ready:
        print("ready", flush=True)
        ready = True
    select.select(conns, [], [], 0.2)  # until the daemon drops one (it reads as closed), at most 0.2 s
    for c in conns:
        c.setblocking(False)
        try:
            if c.recv(1) == b'':
                c.close()
        except BlockingIOError:
            pass
        except OSError:
            c.close()
"""], stdout=subprocess.PIPE)
    try:
        assert hog.stdout.readline() == b"ready\n"  # the hog's connections made
        failed = 0
        with two.client(token=TOKENS["bob"]) as bob:
            for _ in range(20):
                with SharedKVCache(SPEC, 16) as kv:
                    try:
                        bob.register_engine(SPEC, kv).close()
                    except FailedPrecondition:
                        failed += 1
        assert failed == 0, f"{failed} of 20 registrations turned away"
    finally:
        hog.kill()
        hog.wait(10)
