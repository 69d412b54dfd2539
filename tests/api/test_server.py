"""What stock gRPC tools see: health, reflection, limits."""

import platform
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers import metric, wait_for
from tierd.testing import ROOT, Daemon
from tierd.client import KVSpec, ResourceExhausted
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc


def test_health_and_reflection(daemon):
    with grpc.insecure_channel("unix:" + daemon.socket) as ch:
        for service in ("", "tierd.v1.Tierd"):
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"tierd.v1.Tierd", "grpc.health.v1.Health"} <= names


def test_calls_past_the_concurrency_cap_are_resource_exhausted(tmp_path):
    d = Daemon(tmp_path, "--max-concurrent-rpcs", "2").start()
    try:
        with d.client() as c:
            c.put("s", b"x" * 1000, KVSpec.opaque("m"), num_tokens=1)
            c.prefetch("s")  # ready; the session exists
        # two long WaitReady calls occupy both slots (the session never reaches the device tier)
        stub_channel = grpc.insecure_channel("unix:" + d.socket)
        stub = pb_grpc.TierdStub(stub_channel)
        waits = [stub.WaitReady.future(pb.WaitReadyRequest(session_id="s", tier="device", timeout_seconds=3))
                 for _ in range(2)]
        wait_for(lambda: metric(d, "tierd_rpc_in_flight", 'method="WaitReady"') == 2, 10, "both waits to be held")
        with d.client() as c:
            try:
                c.stat("s")
            except ResourceExhausted:
                pass
            else:
                raise AssertionError("a third call was served past the cap of 2")
        assert all(not w.result(timeout=10).ready for w in waits)
        with d.client() as c:
            assert c.stat("s").num_tokens == 1  # served again once the slots are free
        stub_channel.close()
    finally:
        d.close()


def test_prefetch_outcomes_are_counted(daemon):
    import urllib.request

    with daemon.client() as c:
        c.put("late", b"x" * 100_000, KVSpec.opaque("m"), num_tokens=1)
        c.release("late")
        wait_for(lambda: c.stat("late").tier == "disk", 20, "the demotion to disk")
        assert c.prefetch("late", deadline_seconds=30) == "queued"
        assert c.wait_ready("late", timeout=10) == (True, "host")
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert 'tierd_prefetch_total{outcome="in_time"} 1.0' in text


def test_an_emulated_device_tier_serves_through_the_daemon(tmp_path):
    # --device cpu builds the device tier on host memory: the GPU tier's policy runs without a GPU.
    d = Daemon(tmp_path, "--device", "cpu", "--device-budget", "8MiB", "--device-idle", "0.3",
               "--writeback-idle", "off").start()
    try:
        assert "device tier: emulated in host memory" in d.log()
        with d.client() as c:
            tiers = {t.name: t for t in c.stats()["tiers"]}
            assert tiers["device"].budget == 8 << 20 and tiers["device"].backend == "torch-cpu"
            c.put("s", b"d" * 100_000, KVSpec.opaque("m"), num_tokens=1)
            assert c.prefetch("s", "device") == "queued"
            assert c.wait_ready("s", tier="device", timeout=10) == (True, "device")
            assert c.wait_ready("s", tier="host", timeout=1) == (True, "device")  # faster than asked is ready
            c.release("s")
            # idle past --device-idle: back to host
            wait_for(lambda: "device" not in c.stat("s").tier_bytes, 10, "the demotion from device")
            assert c.get("s") == b"d" * 100_000
    finally:
        d.close()


TRIM_CHILD = """
import threading
from tierd.process import tune_malloc

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) << 10

trim = tune_malloc()
if trim is None:
    print("none")
    raise SystemExit
kept = []

def serve_messages():  # as an RPC worker thread does: MiB-sized buffers beside small long-lived ones
    big = []  # from the thread's heap (tune_malloc's mmap threshold), kept there once freed (its trim threshold)
    for _ in range(60):
        big.append(bytearray(1 << 20))
        kept.append(bytearray(2048))

worker = threading.Thread(target=serve_messages)
worker.start()
worker.join()
before = anon()  # the thread's heap keeps the freed MiB buffers
trim()
print(before - anon())
"""


def test_freed_heap_memory_goes_back_to_the_system_on_glibc():
    """The daemon's tick hands free heap pages back (see tune_malloc)."""
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if platform.libc_ver()[0] != "glibc":
        assert out.stdout.strip() == "none"
        return
    assert int(out.stdout) > 40 << 20  # most of the 60 MiB the worker's heap kept
