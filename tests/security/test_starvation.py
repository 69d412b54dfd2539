"""No client freezes the others: stalled, slow, cancelling and flooding
clients hold no shared thread, lock or room beyond their own limits.

Each case is the hostile client first, against a real daemon process, then
what the others (another tenant, the policy tick, a clean stop) still get.
Waits are on conditions with deadlines.
"""

import threading
import time

import grpc
import numpy as np
import pytest

from tests.helpers import metric
from tierd.client import KVSpec, ResourceExhausted
from tierd.errors import DeadlineExceeded
from tierd.testing import Daemon, tokens_file as tokens_file_of
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.convert import spec_to_pb

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("m", page_bytes=1 << 20)
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
MiB = 1 << 20


def tokens_file(root):
    return tokens_file_of(root, TOKENS)


def until(predicate, timeout=20.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def host_used(c):
    return next(t.used for t in c.stats()["tiers"] if t.name == "host")


def in_flight(d, method):
    """Calls of `method` the daemon is serving now (its tierd_rpc_in_flight gauge)."""
    return metric(d, "tierd_rpc_in_flight", f'method="{method}"')


def retry(call, timeout=10.0):
    """call(), again while it is refused for bytes still in flight (a cancelled
    stream lets its bytes go just after its client hears of it)."""
    result = []

    def attempt():
        try:
            result.append(call())
            return True
        except ResourceExhausted:
            return False

    until(attempt, timeout, "the call to be admitted")
    return result[0]


class Stalled:
    """Raw calls that hold the daemon's attention and then do nothing."""

    def __init__(self, d, token):
        self.channel = grpc.insecure_channel("unix:" + d.socket)
        self.stub = pb_grpc.TierdStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),) if token else ()
        self.results: list = []
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def _run(self, call):
        try:
            self.results.append(call())
        except grpc.RpcError as err:
            self.results.append(err.code())

    def put(self, session_id, size=MiB):
        """A Put that sends its header, then nothing until released."""
        def messages():
            yield pb.PutRequest(header=pb.PutHeader(session_id=session_id, spec=spec_to_pb(OPAQUE), size=size))
            self.release.wait(60)
        self._start(lambda: self.stub.Put(messages(), metadata=self.md, timeout=120))

    def wait_ready(self, session_id):
        """A WaitReady for a tier the session never reaches."""
        req = pb.WaitReadyRequest(session_id=session_id, tier="device", timeout_seconds=600)
        self._start(lambda: self.stub.WaitReady(req, metadata=self.md, timeout=120))

    def _start(self, call):
        t = threading.Thread(target=self._run, args=(call,), daemon=True)
        t.start()
        self.threads.append(t)

    def close(self):
        self.release.set()
        self.channel.close()
        for t in self.threads:
            t.join(30)


def test_stalled_puts_and_long_waits_freeze_no_other_tenant(tmp_path):
    """8 Puts that send a header and then nothing, and 8 WaitReady calls on a
    session that is not coming, used to hold all 8 RPC threads: every other
    tenant's calls timed out and idle demotion stopped."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--rpc-workers", "8", "--host-idle", "0.5",
               "--writeback-idle", "0.2", "--stream-idle-seconds", "60").start()
    alice = Stalled(d, TOKENS["alice"])
    try:
        bob = d.client(token=TOKENS["bob"], timeout=5)
        d.client(token=TOKENS["alice"]).put("waited-for", b"a" * 1000, OPAQUE, 1)
        for i in range(8):
            alice.put(f"stalled-{i}")
            alice.wait_ready("waited-for")
        until(lambda: in_flight(d, "Put") == 8 and in_flight(d, "WaitReady") == 8, what="alice's calls to be held")
        data = np.random.default_rng(1).integers(0, 256, 3 * MiB, dtype=np.uint8).tobytes()
        for i in range(10):  # each call has 5 s before the client gives up
            bob.put(f"b{i}", data, OPAQUE, 1)
            assert bob.get(f"b{i}") == data
            bob.drop(f"b{i}")
        bob.put("idle", data, OPAQUE, 1)
        bob.release("idle")
        until(lambda: bob.stat("idle").tier == "disk", what="bob's idle session to reach disk")
        assert alice.results == [] and in_flight(d, "WaitReady") == 8  # still held: they froze nothing
    finally:
        alice.close()
        d.close()


def test_a_stalled_put_ends_at_the_idle_deadline_and_gives_its_room_back(tmp_path):
    d = Daemon(tmp_path, "--writeback-idle", "off", "--stream-idle-seconds", "1").start()
    stalled = Stalled(d, None)
    try:
        c = d.client()
        stalled.put("never", size=32 * MiB)
        until(lambda: host_used(c) >= 32 * MiB, what="the Put's room to be taken")
        until(lambda: stalled.results == [grpc.StatusCode.DEADLINE_EXCEEDED], what="the Put to be ended")
        until(lambda: host_used(c) == 0, what="its room to come back")
        assert c.list() == []
        assert "Traceback" not in d.log()
    finally:
        stalled.close()
        d.close()


def test_a_reader_that_stops_reading_holds_nothing(tmp_path):
    """A Get whose client stops reading holds no lock (a Drop goes through at
    once) and, past the idle deadline, no pages."""
    d = Daemon(tmp_path, "--writeback-idle", "off", "--stream-idle-seconds", "1").start()
    try:
        c = d.client()
        data = np.random.default_rng(2).integers(0, 256, 24 * MiB, dtype=np.uint8).tobytes()
        c.put("s", data, OPAQUE, 1)
        _, chunks = c.get_stream("s")
        next(chunks)  # then nothing more is read
        t0 = time.monotonic()
        c.drop("s")
        assert time.monotonic() - t0 < 2
        until(lambda: host_used(c) == 0, what="the reader's pages to be freed")
        with pytest.raises(DeadlineExceeded, match="took nothing for 1 s"):
            for _ in chunks:
                pass
    finally:
        d.close()


def test_cancelling_gets_of_disk_sessions_leaves_no_session_stuck(tmp_path):
    """A Get cancelled while an RPC thread read the session from disk used to
    keep the session's lock for good: Drop hung, and SIGTERM no longer
    stopped the daemon."""
    d = Daemon(tmp_path, "--host-idle", "0.2", "--writeback-idle", "0.1").start()
    try:
        c = d.client()
        data = np.random.default_rng(3).integers(0, 256, 24 * MiB, dtype=np.uint8).tobytes()
        c.put("s", data, OPAQUE, 1)
        c.release("s")
        until(lambda: c.stat("s").tier == "disk", what="the session to reach disk")
        for i in range(60):
            _, chunks = retry(lambda: c.get_stream("s"))
            for k, _ in enumerate(chunks):
                if k == i % 12:
                    break
            chunks.close()
        assert c.get("s") == data
        c.drop("s")
        t0 = time.monotonic()
        assert d.stop(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_open_leases_cannot_take_the_host_tier_from_other_tenants(tmp_path):
    """Uncommitted save leases (TTL up to an hour) used to hold the whole
    host budget against everyone: a tenant's open leases are capped, by
    default at a quarter of the host budget. (Puts in progress are capped
    apart, by default at half: not here, where bob's Put takes the rest.)"""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--writeback-idle", "off",
               "--tenant-put-bytes", "0").start()
    try:
        alice, bob = d.client(token=TOKENS["alice"]), d.client(token=TOKENS["bob"])
        held = 0
        with pytest.raises(ResourceExhausted, match="bytes in open leases"):
            for i in range(100):
                alice.begin_save(f"a{i}", SPEC, 1024, ttl=3600)  # 64 pages, 2 MiB
                held += 64 * SPEC.page_bytes
        assert held == 16 * MiB  # a quarter of the daemon's 64 MiB host budget
        data = b"b" * (40 * MiB)  # bob still finds room for most of the rest
        bob.put("b", data, OPAQUE, 1)
        assert bob.stat("b").tier == "host"
    finally:
        d.close()


def test_a_tenants_open_streams_are_capped(tmp_path):
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--writeback-idle", "off",
               "--tenant-streams", "2").start()
    try:
        alice, bob = d.client(token=TOKENS["alice"]), d.client(token=TOKENS["bob"])
        alice.put("a", b"a" * (32 * MiB), OPAQUE, 1)  # more than gRPC buffers: the streams stay open
        bob.put("b", b"b" * (4 * MiB), OPAQUE, 1)
        streams = [alice.get_stream("a") for _ in range(2)]
        for _, chunks in streams:
            next(chunks)
        until(lambda: in_flight(d, "Get") == 2, what="both streams to be open")
        with pytest.raises(ResourceExhausted, match="2 Put and Get streams open"):
            alice.get("a")
        assert bob.get("b") == b"b" * (4 * MiB)  # bob's are his own
        for _, chunks in streams:
            chunks.close()
        assert retry(lambda: alice.get("a")) == b"a" * (32 * MiB)  # once they are let go
    finally:
        d.close()


def test_puts_cancelled_as_they_commit_leave_no_room_held(tmp_path):
    """Puts cancelled just after their last chunk, while their commit waited
    for one of the tenant's threads, left their pages held by no session:
    repeated, they filled the host tier for everyone."""
    d = Daemon(tmp_path, "--writeback-idle", "off", "--tenant-workers", "1").start()
    try:
        c = d.client()
        channel = grpc.insecure_channel("unix:" + d.socket)
        put = channel.stream_unary("/tierd.v1.Tierd/Put", request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.SessionInfo.FromString)
        data = b"p" * (2 * MiB)
        spec = spec_to_pb(OPAQUE)

        def messages(i, sent):
            yield pb.PutRequest(header=pb.PutHeader(session_id=f"p{i}", spec=spec, size=len(data), num_tokens=1))
            for k in range(0, len(data), MiB):
                yield pb.PutRequest(chunk=pb.Chunk(data=data[k : k + MiB]))
            sent.set()  # gRPC asked past the last chunk: it is sent, the commit comes next

        for round_ in range(3):
            sent = [threading.Event() for _ in range(12)]
            calls = [put.future(messages(i, sent[i]), timeout=30) for i in range(12)]
            for i, call in enumerate(calls):
                if i % 2:  # cancelled as its commit waits for the tenant's only thread
                    sent[i].wait(30)
                    call.cancel()
            for call in calls:
                try:
                    call.result()
                except grpc.FutureCancelledError:
                    pass
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
            until(lambda: in_flight(d, "Put") == 0, what="every Put to be over")
            for s in c.list():
                c.drop(s.session_id)
            until(lambda: host_used(c) == 0, what=f"round {round_}: no room held by no session")
        channel.close()
    finally:
        d.close()


def test_calls_without_a_token_are_refused_before_they_hold_anything(tmp_path):
    """A call opened with no token and no message held one of the daemon's
    --max-concurrent-rpcs until the message came, which it never did: a few
    such calls shut every tenant out. The token is checked as a call starts."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--max-concurrent-rpcs", "8").start()
    channel = grpc.insecure_channel("unix:" + d.socket)
    release = threading.Event()
    try:
        stat = channel.stream_unary("/tierd.v1.Tierd/Stat", request_serializer=None, response_deserializer=None)

        def nothing():  # sends no message until the test ends
            release.wait(60)
            yield from ()

        calls = [stat.future(nothing(), timeout=60) for _ in range(16)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bob = d.client(token=TOKENS["bob"], timeout=5)
        bob.put("b", b"b", OPAQUE, 1)
        assert bob.stat("b").num_tokens == 1
    finally:
        release.set()
        channel.close()
        d.close()


def test_a_tenants_open_calls_are_capped(tmp_path):
    """One tenant's WaitReady calls (600 s each) took every call gRPC admits."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--max-concurrent-rpcs", "16",
               "--tenant-calls", "4").start()
    alice = Stalled(d, TOKENS["alice"])
    try:
        d.client(token=TOKENS["alice"]).put("waited-for", b"a", OPAQUE, 1)
        for _ in range(8):
            alice.wait_ready("waited-for")
        until(lambda: len(alice.results) == 4, what="the calls past alice's 4 to be refused")
        assert alice.results == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4 and in_flight(d, "WaitReady") == 4
        bob = d.client(token=TOKENS["bob"], timeout=5)
        bob.put("b", b"b", OPAQUE, 1)
        assert bob.stat("b").num_tokens == 1
    finally:
        alice.close()
        d.close()


def test_health_and_reflection_calls_are_few_and_bounded(tmp_path):
    """Health and reflection answer without a token, so calls to them that sent
    nothing held every one of --max-concurrent-rpcs: at most 16 run at once."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path), "--max-concurrent-rpcs", "32").start()
    channel = grpc.insecure_channel("unix:" + d.socket)
    release = threading.Event()
    try:
        check = channel.stream_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                     response_deserializer=None)

        def nothing():
            release.wait(60)
            yield from ()

        calls = [check.future(nothing(), timeout=60) for _ in range(40)]
        until(lambda: sum(c.done() for c in calls) >= 24, what="the calls past 16 to be refused")
        assert {c.exception().code() for c in calls if c.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        bob = d.client(token=TOKENS["bob"], timeout=5)
        bob.put("b", b"b", OPAQUE, 1)
        assert bob.stat("b").num_tokens == 1
    finally:
        release.set()
        channel.close()
        d.close()
