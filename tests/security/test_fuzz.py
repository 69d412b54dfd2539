"""Hypothesis throws random requests at a live daemon: it never crashes,
never answers INTERNAL (or UNKNOWN) to bad input, and a rejected call changes
nothing."""

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierd.client import KVSpec, SharedKVCache
from tierd.testing import Daemon
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SPEC = KVSpec("fuzz/model", num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)

ids = st.one_of(st.sampled_from(["s1", "s2", "missing", "", "..", "a/b", "a\x00b", "x" * 300, "ü", " "]),
                st.text(max_size=40))
u64 = st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32 + 1, 2**63, 2**64 - 1]))
i64 = st.one_of(st.integers(-5, 70), st.sampled_from([-(2**63), 2**63 - 1, 2**40]))
ttls = st.one_of(st.floats(0.05, 2), st.floats(allow_nan=True, allow_infinity=True))
tiers = st.one_of(st.sampled_from(["", "host", "disk", "device", "moon"]), st.text(max_size=8))
specs = st.builds(pb.KVSpec, model_id=st.one_of(st.just("fuzz/model"), st.text(max_size=20)),
                  num_layers=st.integers(0, 5000), num_kv_heads=st.integers(0, 8), head_dim=st.integers(0, 300),
                  dtype=st.sampled_from(["float16", "bfloat16", "int8", "float64", ""]),
                  block_tokens=st.integers(0, 64), kind=st.sampled_from(["", "kv", "opaque", "weird"]),
                  opaque_page_bytes=u64, layout_version=st.integers(0, 3))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("fuzz"), "--writeback-idle", "off", "--max-message-bytes", "4MiB").start()
    client = d.client()
    kv = SharedKVCache(SPEC, 8)
    kv.regions[0][:] = np.arange(kv.regions[0].size, dtype=np.uint64).astype(np.uint8)
    engine = client.register_engine(SPEC, kv)
    engine.save("s1", [0, 1], 20)
    client.put("s2", b"z" * 5000, KVSpec.opaque("fuzz/blob"), num_tokens=3)
    channel = grpc.insecure_channel("unix:" + d.socket)
    yield d, client, engine.engine_id, pb_grpc.TierdStub(channel)
    channel.close()
    client.close()
    kv.close()
    d.close()


def requests(name, engine_id):
    engines = st.one_of(st.just(engine_id), st.text(max_size=40))
    chunk = st.builds(pb.Chunk, data=st.binary(max_size=300), xxh3=st.integers(0, 2**64 - 1))
    header = st.builds(pb.PutHeader, session_id=ids, spec=specs, num_tokens=u64, size=u64, start_token=u64)
    return {
        "Stat": st.builds(pb.SessionRequest, session_id=ids),
        "Release": st.builds(pb.SessionRequest, session_id=ids),
        "Unpin": st.builds(pb.SessionRequest, session_id=ids),
        "Drop": st.builds(pb.SessionRequest, session_id=ids),
        "Prefetch": st.builds(pb.PrefetchRequest, session_id=ids, tier=tiers,
                              priority=st.integers(-(2**31), 2**31 - 1), deadline_seconds=st.floats(allow_nan=True)),
        "WaitReady": st.builds(pb.WaitReadyRequest, session_id=ids, tier=tiers,
                               timeout_seconds=st.floats(-1, 0.05) | st.floats(allow_nan=True)),
        "Advise": st.builds(pb.AdviseRequest, session_id=ids, prefill_tokens_per_s=st.floats(allow_nan=True)),
        "List": st.builds(pb.ListRequest, limit=st.integers(0, 2**32 - 1), page_token=st.text(max_size=10),
                          all_tenants=st.booleans()),
        "SetBudget": st.builds(pb.SetBudgetRequest, tier=tiers, budget=u64),
        "Save": st.builds(pb.SaveRequest, engine_id=engines, session_id=ids, block_ids=st.lists(i64, max_size=6),
                          num_tokens=u64, start_token=u64, tier=tiers),
        "Restore": st.builds(pb.RestoreRequest, engine_id=engines, session_id=ids,
                             block_ids=st.lists(i64, max_size=6)),
        "RegisterEngine": st.builds(
            pb.RegisterEngineRequest, spec=specs, num_blocks=u64,
            regions=st.lists(st.builds(pb.Region, shm_name=st.text(max_size=20), size=u64), max_size=2),
            segments=st.lists(st.builds(pb.Segment, region=st.integers(0, 3), offset=u64, stride=u64, nbytes=u64),
                              max_size=3)),
        "Get": st.builds(pb.GetRequest, session_id=ids, chunk_bytes=u64),
        "Lookup": st.builds(pb.LookupRequest, session_id=ids, token_ids=st.lists(i64, max_size=40),
                            spec=st.one_of(st.none(), specs)),
        "BeginSave": st.builds(pb.BeginSaveRequest, session_id=ids, spec=specs, num_tokens=u64, start_token=u64,
                               token_ids=st.lists(i64, max_size=40), ttl_seconds=ttls),
        "BeginRestore": st.builds(pb.BeginRestoreRequest, session_id=ids, spec=st.one_of(st.none(), specs),
                                  num_pages=u64, ttl_seconds=ttls),
        "CommitSave": st.builds(pb.LeaseRequest, lease_id=st.text(max_size=40)),
        "AbortSave": st.builds(pb.LeaseRequest, lease_id=st.text(max_size=40)),
        "EndRestore": st.builds(pb.LeaseRequest, lease_id=st.text(max_size=40)),
        # a stream: header and chunks in any order and number, often cut short
        "Put": st.lists(st.one_of(st.builds(pb.PutRequest, header=header), st.builds(pb.PutRequest, chunk=chunk)),
                        max_size=4),
    }[name]


RPCS = ["Stat", "Release", "Unpin", "Drop", "Prefetch", "WaitReady", "Advise", "List", "SetBudget", "Save",
        "Restore", "RegisterEngine", "Get", "Put", "Lookup", "BeginSave", "CommitSave", "AbortSave", "BeginRestore",
        "EndRestore"]


def state(client):
    sessions = sorted((s.session_id, s.num_tokens, s.size_bytes, s.fingerprint, s.pins) for s in client.list())
    return sessions, {s[0]: client.get(s[0]) for s in sessions}


@pytest.mark.parametrize("name", RPCS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_requests_never_crash_the_daemon_or_change_it_when_refused(world, name, data):
    d, client, engine_id, stub = world
    request = data.draw(requests(name, engine_id))
    if name == "SetBudget" and request.tier == "host" and request.budget < 16 << 20:
        request.budget = 64 << 20  # a valid shrink that evicts is not what this test is about
    before = state(client)
    try:
        if name == "Put":
            stub.Put(iter(request), timeout=10)
        elif name == "Get":
            list(stub.Get(request, timeout=10))
        else:
            reply = getattr(stub, name)(request, timeout=10)
            # a lease granted holds space or a session: end it, as an engine would
            if name == "BeginSave":
                stub.AbortSave(pb.LeaseRequest(lease_id=reply.lease_id), timeout=10)
            elif name == "BeginRestore":
                stub.EndRestore(pb.LeaseRequest(lease_id=reply.lease_id), timeout=10)
    except grpc.RpcError as err:
        assert err.code() not in BAD_CODES, f"{name}: {err.code()} {err.details()}"
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            assert state(client) == before, f"{name} was refused ({err.code().name}) but changed the store"
    assert d.proc.poll() is None
    assert "Traceback" not in d.log()
