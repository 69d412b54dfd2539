"""End to end against a real daemon process: engine memory in shared memory,
demotion to disk, prefetch, restore, put/get, and kill -9 recovery."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import flip_in_arena, metric, wait_for
from tierd.client import (
    Arena,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    KVSpec,
    NotFound,
    SharedKVCache,
)
from tierd.testing import Daemon
from tierd.wire.convert import spec_to_pb

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)


def _fill(kv, seed):
    rng = np.random.default_rng(seed)
    for r in kv.regions:
        r[:] = rng.integers(0, 256, r.size, dtype=np.uint8)


def _blocks(kv, ids):
    return [kv.block(seg, b).tobytes() for b in ids for seg in range(len(kv.layout.segments))]


def _wait_tier(client, sid, tier, timeout=20.0):
    def there():
        info = client.stat(sid)
        return info if info.tier == tier and set(info.tier_bytes) == {tier} else None

    return wait_for(there, timeout, f"{sid} reaching {tier} alone")


def test_save_release_demote_prefetch_restore_through_shared_memory(daemon):
    with daemon.client() as c, SharedKVCache(SPEC, 64) as kv:
        _fill(kv, 1)
        engine = c.register_engine(SPEC, kv)
        info = engine.save("chat-1", [3, 4, 5, 9], 60)
        assert (info.tier, info.num_tokens, info.num_pages) == ("host", 60, 4)
        saved = _blocks(kv, [3, 4, 5, 9])
        c.release("chat-1")
        # idle past --host-idle: the daemon demotes host -> disk by itself
        info = _wait_tier(c, "chat-1", "disk")
        assert info.durable and info.state == "idle"
        assert c.prefetch("chat-1", "host") == "queued"
        assert c.wait_ready("chat-1", timeout=20) == (True, "host")
        for r in kv.regions:
            r[:] = 0
        result = engine.restore("chat-1", [10, 11, 12, 13])
        assert result.num_tokens == 60 and result.source_tier == "host"
        assert _blocks(kv, [10, 11, 12, 13]) == saved
        engine.close()


def test_put_get_roundtrip_with_any_data_type(daemon):
    spec = KVSpec.opaque("llama.cpp/test")
    data = np.random.default_rng(2).integers(0, 256, 3_000_001, dtype=np.uint8)
    with daemon.client() as c:
        c.put("blob", data, spec, num_tokens=77, chunk_bytes=100_000)
        assert c.get("blob", chunk_bytes=333_333) == data.tobytes()
        import torch

        c.put("tensor", torch.arange(1000, dtype=torch.float32), spec, num_tokens=1)
        assert np.frombuffer(c.get("tensor"), dtype=np.float32).tolist() == list(range(1000))
        c.put("view", memoryview(b"abc" * 1000), spec, num_tokens=1)
        assert c.get("view") == b"abc" * 1000
        c.release("blob")
        _wait_tier(c, "blob", "disk")
        assert c.get("blob") == data.tobytes()  # straight from disk, checksums verified


def test_kill_9_and_restart_keeps_every_durable_session(daemon):
    spec = KVSpec.opaque("llama.cpp/test", page_bytes=64 * 1024)
    payloads = {f"s{i}": np.random.default_rng(i).integers(0, 256, 200_000 + i, dtype=np.uint8).tobytes()
                for i in range(5)}
    with daemon.client() as c:
        for sid, data in payloads.items():
            c.put(sid, data, spec, num_tokens=len(data))
            c.release(sid)
        for sid in payloads:
            wait_for(lambda sid=sid: c.stat(sid).durable, 20, f"{sid} written back")
        c.put("not-yet", b"x" * 1000, spec, num_tokens=1)  # active: not written back
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        for sid, data in payloads.items():
            info = c.stat(sid)
            assert info.durable and info.tier == "disk"
            assert c.get(sid) == data
        assert sorted(s.session_id for s in c.list()) == sorted(payloads)


def test_graceful_stop_flushes_and_exits_zero(daemon):
    spec = KVSpec.opaque("llama.cpp/test")
    with daemon.client() as c:
        c.put("active", b"y" * 5000, spec, num_tokens=1)
        assert not c.stat("active").durable
    assert daemon.stop() == 0
    assert "flushing" in daemon.log()
    daemon.start()
    with daemon.client() as c:
        assert c.get("active") == b"y" * 5000 and c.stat("active").durable


@pytest.mark.parametrize("kind", ["layer_major", "cross_layer"])
def test_append_saves_only_new_blocks(daemon, kind):
    with daemon.client() as c, SharedKVCache(SPEC, 32, kind=kind) as kv:
        _fill(kv, 3)
        engine = c.register_engine(SPEC, kv)
        engine.save("conv", [0, 1], 32)
        ops = c.stats()["copy_ops"]
        engine.save("conv", [7], 48, start_token=32)
        assert c.stats()["copy_ops"] - ops == len(kv.layout.segments)
        expect = _blocks(kv, [0, 1, 7])
        for r in kv.regions:
            r[:] = 0
        assert engine.restore("conv", [20, 21, 22]).num_tokens == 48
        assert _blocks(kv, [20, 21, 22]) == expect


def test_priority_is_kept_and_checked(daemon):
    from tierd.client import InvalidArgument

    spec = KVSpec.opaque("m")
    with daemon.client() as c:
        assert c.put("vip", b"v" * 100, spec, num_tokens=1, priority=5).priority == 5
        assert c.put("vip", b"w" * 100, spec, num_tokens=1).priority == 5  # unchanged when not given
        with pytest.raises(InvalidArgument, match="priority"):
            c.put("vip", b"x", spec, num_tokens=1, priority=10_000)
        assert c.get("vip") == b"w" * 100


def test_leases_save_and_restore_through_the_arena_across_kill_9(daemon):
    """An engine with private KV memory: it copies pages into leased arena
    slots itself, the daemon demotes them, and a restore lease brings them back
    after the daemon was killed and restarted. Lookup matches the prompt."""
    ids = np.random.default_rng(3).integers(0, 50_000, 70)
    rng = np.random.default_rng(4)
    arena = Arena()
    with daemon.client() as c:
        lease = c.begin_save("chat", SPEC, 70, token_ids=ids)
        pages = arena.pages(lease)
        for page in pages:
            page[:] = rng.integers(0, 256, page.size, dtype=np.uint8)
        want = [p.tobytes() for p in pages]
        info = c.commit_save(lease)
        assert (info.num_tokens, info.num_pages) == (70, 5)
        c.release("chat")
        _wait_tier(c, "chat", "disk")
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        edited = np.concatenate([ids[:40], [7, 7, 7], ids[43:]])
        r = c.lookup("chat", edited, SPEC)
        assert (r.num_tokens, r.num_pages, r.stored_tokens, r.tier) == (32, 2, 70, "disk")
        held = c.begin_restore("chat", SPEC, num_pages=r.num_pages)
        assert held.num_tokens == 32 and [p.tobytes() for p in arena.pages(held)] == want[:2]
        c.end_restore(held)
        with pytest.raises(NotFound):
            c.end_restore(held)
        # a lease left open expires: its slots return, the commit is refused, operators see it
        late = c.begin_save("late", SPEC, 16, ttl=0.2)
        wait_for(lambda: metric(daemon, "tierd_leases_expired_total", 'kind="save"') == 1, 10,
                 "the policy tick to expire the lease")
        with pytest.raises(NotFound, match="expired"):
            c.commit_save(late)
    arena.close()


def test_engine_of_an_exited_process_is_unregistered_by_the_daemon(daemon):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with daemon.client() as c, SharedKVCache(SPEC, 16) as kv:
            _fill(kv, 7)
            engine = c.register_engine(SPEC, kv, pid=child.pid)
            engine.save("kept", [1], 16)
            child.kill()
            child.wait()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    engine.save("after", [2], 16)
                except NotFound as exc:
                    assert "is not registered" in str(exc)
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the engine of the exited process is still registered")
            assert c.stat("kept").num_tokens == 16  # sessions outlive the engine that saved them
    finally:
        child.kill()


def test_gpu_memory_and_invisible_processes_get_clear_errors(daemon):
    from tierd.v1 import tierd_pb2 as pb

    with daemon.client() as c, SharedKVCache(SPEC, 16) as kv:
        with pytest.raises(InvalidArgument, match="process 2147483647 is not visible to the daemon"):
            c.register_engine(SPEC, kv, pid=2**31 - 1)
        regions = [pb.Region(cuda_ipc=pb.CudaIpcMemory(handle=b"h" * 64, offset=0, device_uuid="GPU-x"), size=size)
                   for size in kv.sizes]
        req = pb.RegisterEngineRequest(spec=spec_to_pb(SPEC), regions=regions, num_blocks=16)
        req.segments.extend(pb.Segment(region=s.region, offset=s.offset, stride=s.stride, nbytes=s.nbytes)
                            for s in kv.layout.segments)
        with pytest.raises(FailedPrecondition, match="CUDA IPC regions need a daemon running on a GPU machine"):
            c._call("RegisterEngine", req, lambda r: r)

        class OnTheGpu:
            is_cuda = True

        with pytest.raises(InvalidArgument, match="all CUDA tensors or all"):
            c.register_engine(SPEC, [OnTheGpu(), *zip(kv.fds[1:], kv.sizes[1:])], kv.layout)


def test_a_page_damaged_in_host_memory_is_not_served(tmp_path):
    """Every page a Get reads is checked against the checksum it was saved
    with, whatever the tier: bytes damaged in the host tier after the save
    reach no client, and the session is marked damaged."""
    d = Daemon(tmp_path, "--writeback-idle", "off", "--host-idle", "600").start()
    try:
        data = os.urandom(3 << 20)
        with d.client() as c:
            c.put("hurt", data, KVSpec.opaque("test/blob"), 1)
            assert c.get("hurt") == data
            flip_in_arena(d.data_dir, data[(1 << 20) + 4096 : (1 << 20) + 4160])  # inside page 1
            with pytest.raises(DataLoss, match="page 1 failed its checksum in the host tier"):
                c.get("hurt")
            assert c.stat("hurt").state == "damaged"
    finally:
        d.close()
