"""Every bad input gets its precise status and changes nothing: after each
case the sessions, their bytes and the tiers' usage are what they were."""

import hashlib
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import xxhash

from tierd.client import (
    FailedPrecondition,
    IdentityMismatch,
    InvalidArgument,
    KVSpec,
    NotFound,
    ResourceExhausted,
    SharedKVCache,
)
from tierd.errors import TierdError
from tierd.layout import EngineLayout
from tierd.testing import ROOT, Daemon
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.chunks import GET_METHOD, PUT_METHOD, _varint, chunk_message
from tierd.wire.convert import spec_to_pb

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OTHER = KVSpec("test/llama-tiny", "r2", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
OPAQUE = KVSpec.opaque("llama.cpp/test")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("bad"), "--writeback-idle", "off", "--max-message-bytes", "4MiB",
               "--chunk-bytes", "1MiB").start()
    c = d.client()
    kv = SharedKVCache(SPEC, 16)
    for r in kv.regions:
        r[:] = np.random.default_rng(0).integers(0, 256, r.size, dtype=np.uint8)
    engine = c.register_engine(SPEC, kv)
    other_kv = SharedKVCache(OTHER, 16)
    other = c.register_engine(OTHER, other_kv)
    engine.save("kv", [0, 1, 2], 40)
    c.put("blob", b"z" * 100_000, OPAQUE, num_tokens=3)
    channel = grpc.insecure_channel("unix:" + d.socket)
    yield d, c, engine, other, pb_grpc.TierdStub(channel)
    channel.close()
    c.close()
    kv.close()
    other_kv.close()
    d.close()


def snapshot(c):
    sessions = sorted((s.session_id, s.num_tokens, s.size_bytes, s.fingerprint, s.tier) for s in c.list())
    contents = {s[0]: hashlib.sha256(c.get(s[0])).hexdigest() for s in sessions}
    used = {t.name: t.used for t in c.stats()["tiers"]}
    return sessions, contents, used


def _raw_put(put, messages):
    try:
        put(iter(messages), timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _raw_unary(c, method, raw):
    """A unary call whose request is raw bytes, whatever they are."""
    with grpc.insecure_channel(c.address) as channel:
        try:
            channel.unary_unary(f"/tierd.v1.Tierd/{method}", request_serializer=None)(raw, timeout=30)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _raw_get(c, raw):
    with grpc.insecure_channel(c.address) as channel:
        try:
            list(channel.unary_stream(GET_METHOD, request_serializer=None)(raw, timeout=30))
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _wire_put(c, messages):
    """A Put stream of messages as raw bytes, each as given."""
    with grpc.insecure_channel(c.address) as channel:
        return _raw_put(channel.stream_unary(PUT_METHOD, request_serializer=None, response_deserializer=None),
                        messages)


def _damaged(data):
    raw = bytearray(chunk_message(data))
    raw[len(raw) // 2] ^= 0x10
    return bytes(raw)


def _opaque_header(session_id, size):
    return pb.PutRequest(header=pb.PutHeader(session_id=session_id, size=size, spec=pb.KVSpec(
        model_id="x", kind="opaque", opaque_page_bytes=4096))).SerializeToString()


def _interrupted():
    yield pb.PutRequest(header=pb.PutHeader(session_id="cut", spec=pb.KVSpec(model_id="x", kind="opaque",
                                                                               opaque_page_bytes=4096), size=10_000))
    yield pb.PutRequest(chunk=pb.Chunk(data=b"a" * 5000))
    raise RuntimeError("client went away")


CASES = {
    # name: (call(client, engine, other_engine, stub), expected error class or grpc status)
    "unknown session stat": (lambda c, e, o, s: c.stat("nope"), NotFound),
    "unknown session restore": (lambda c, e, o, s: e.restore("nope", [0]), NotFound),
    "unknown session prefetch": (lambda c, e, o, s: c.prefetch("nope"), NotFound),
    "unknown session drop": (lambda c, e, o, s: c.drop("nope"), NotFound),
    "unknown engine": (lambda c, e, o, s: s.Save(pb.SaveRequest(engine_id="f" * 32, session_id="kv", block_ids=[0],
                                                                num_tokens=16)), grpc.StatusCode.NOT_FOUND),
    "wrong spec on restore": (lambda c, e, o, s: o.restore("kv", [0, 1, 2]), IdentityMismatch),
    "append with another identity": (lambda c, e, o, s: o.save("kv", [3], 48, start_token=32), IdentityMismatch),
    "block id out of range on save": (lambda c, e, o, s: e.save("new", [16], 16), InvalidArgument),
    "block id out of range on restore": (lambda c, e, o, s: e.restore("kv", [0, 1, 99]), InvalidArgument),
    "negative block id": (lambda c, e, o, s: e.restore("kv", [-1]), InvalidArgument),
    "repeated block id": (lambda c, e, o, s: e.restore("kv", [4, 4]), InvalidArgument),
    "more blocks than pages": (lambda c, e, o, s: e.restore("kv", [0, 1, 2, 3]), InvalidArgument),
    "block count does not match tokens": (lambda c, e, o, s: e.save("new", [0, 1], 16), InvalidArgument),
    "start token not on a block": (lambda c, e, o, s: e.save("kv", [5], 48, start_token=33), InvalidArgument),
    "start token past the end": (lambda c, e, o, s: e.save("kv", [5], 80, start_token=64), FailedPrecondition),
    "byte count does not match the spec": (lambda c, e, o, s: c.put("new", b"x" * 1000, SPEC, 16), InvalidArgument),
    "empty id": (lambda c, e, o, s: c.stat(""), InvalidArgument),
    "id with a slash": (lambda c, e, o, s: c.put("a/b", b"x", OPAQUE, 1), InvalidArgument),
    "id with dot-dot": (lambda c, e, o, s: e.save("..", [0], 16), InvalidArgument),
    "id with NUL": (lambda c, e, o, s: c.stat("a\x00b"), InvalidArgument),
    "id too long": (lambda c, e, o, s: c.stat("x" * 300), InvalidArgument),
    # a 100 KB id echoed whole in the error made it RESOURCE_EXHAUSTED (over gRPC's metadata limit)
    "id of 100 KB": (lambda c, e, o, s: c.stat("x" * 100_000), InvalidArgument),
    # re's `$` matches before a trailing newline: ids, names and engine memory names are matched whole
    "id with a trailing newline": (lambda c, e, o, s: c.put("abc\n", b"x", OPAQUE, 1), InvalidArgument),
    "model id with a trailing newline": (lambda c, e, o, s: _raw_put(s.Put, [
        pb.PutRequest(header=pb.PutHeader(session_id="nl", spec=pb.KVSpec(model_id="m\n", kind="opaque",
                                                                          opaque_page_bytes=4096), size=1)),
        pb.PutRequest(chunk=pb.Chunk(data=b"x"))]), grpc.StatusCode.INVALID_ARGUMENT),
    "region name with a trailing newline": (lambda c, e, o, s: c.register_engine(
        SPEC, [("region\n", 1 << 20)], EngineLayout.cross_layer(SPEC, 4)), InvalidArgument),
    "huge put size": (lambda c, e, o, s: _raw_put(s.Put, [pb.PutRequest(header=pb.PutHeader(
        session_id="huge", spec=pb.KVSpec(model_id="x", kind="opaque", opaque_page_bytes=1 << 20), size=1 << 62))]),
        grpc.StatusCode.RESOURCE_EXHAUSTED),
    "zero put size": (lambda c, e, o, s: c.put("new", b"", OPAQUE, 1), InvalidArgument),
    "oversize message": (lambda c, e, o, s: c.put("new", b"x" * (5 << 20), OPAQUE, 1, chunk_bytes=5 << 20),
                         ResourceExhausted),
    "put without a header": (lambda c, e, o, s: _raw_put(s.Put, [pb.PutRequest(chunk=pb.Chunk(data=b"x"))]),
                             grpc.StatusCode.INVALID_ARGUMENT),
    "put with two headers": (lambda c, e, o, s: _raw_put(s.Put, [pb.PutRequest(header=pb.PutHeader(
        session_id="two", spec=pb.KVSpec(model_id="x", kind="opaque", opaque_page_bytes=4096), size=1))] * 2),
        grpc.StatusCode.INVALID_ARGUMENT),
    "put chunk damaged in transit": (lambda c, e, o, s: _raw_put(s.Put, [
        pb.PutRequest(header=pb.PutHeader(session_id="bad", spec=pb.KVSpec(model_id="x", kind="opaque",
                                                                           opaque_page_bytes=4096), size=3)),
        pb.PutRequest(chunk=pb.Chunk(data=b"abc", xxh3=12345))]), grpc.StatusCode.DATA_LOSS),
    # grpc reports a client-side iterator failure as UNKNOWN; the daemon sees the stream cancelled
    "put message that is not a PutRequest": (lambda c, e, o, s: _wire_put(c, [
        _opaque_header("junk", 3), b"\xff\xff\xff\xff"]), grpc.StatusCode.INVALID_ARGUMENT),
    "put chunk damaged after it was built": (lambda c, e, o, s: _wire_put(c, [
        _opaque_header("bad", 5000), _damaged(b"q" * 5000)]), grpc.StatusCode.DATA_LOSS),
    "put header after a chunk": (lambda c, e, o, s: _wire_put(c, [
        _opaque_header("late", 6), chunk_message(b"abc"), _opaque_header("late", 6)]), grpc.StatusCode.INVALID_ARGUMENT),
    "put cut short": (lambda c, e, o, s: _raw_put(s.Put, _interrupted()), grpc.StatusCode.UNKNOWN),
    "put with too few bytes": (lambda c, e, o, s: _raw_put(s.Put, [
        pb.PutRequest(header=pb.PutHeader(session_id="short", spec=pb.KVSpec(model_id="x", kind="opaque",
                                                                             opaque_page_bytes=4096), size=10)),
        pb.PutRequest(chunk=pb.Chunk(data=b"abc"))]), grpc.StatusCode.INVALID_ARGUMENT),
    "malformed protobuf": (lambda c, e, o, s: _raw_unary(c, "Stat", b"\xff\xff\xff\xff"),
                           grpc.StatusCode.INVALID_ARGUMENT),
    "a session id that is not UTF-8": (lambda c, e, o, s: _raw_unary(c, "Stat", b"\x0a\x02\xff\xfe"),
                                       grpc.StatusCode.INVALID_ARGUMENT),
    "a Get request that is not UTF-8": (lambda c, e, o, s: _raw_get(c, b"\x0a\x02\xc3\x28"),
                                        grpc.StatusCode.INVALID_ARGUMENT),
    "token ids sent unpacked": (lambda c, e, o, s: _raw_unary(c, "Lookup", b"\x0a\x02kv\x10\x01\x10\x02"),
                                grpc.StatusCode.INVALID_ARGUMENT),
    "opaque pages of 1 byte": (lambda c, e, o, s: _raw_put(s.Put, [
        pb.PutRequest(header=pb.PutHeader(session_id="tiny", spec=pb.KVSpec(model_id="x", kind="opaque",
                                                                            opaque_page_bytes=1), size=16384))]),
        grpc.StatusCode.INVALID_ARGUMENT),
    "spec without a model": (lambda c, e, o, s: _raw_put(s.Put, [
        pb.PutRequest(header=pb.PutHeader(session_id="n", spec=pb.KVSpec(kind="opaque"), size=1))]),
        grpc.StatusCode.INVALID_ARGUMENT),
    "spec with a bad dtype": (lambda c, e, o, s: s.RegisterEngine(pb.RegisterEngineRequest(
        spec=pb.KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float64", block_tokens=16),
        regions=[pb.Region(shm_name="none", size=4096)], num_blocks=1)), grpc.StatusCode.INVALID_ARGUMENT),
    "region that does not exist": (lambda c, e, o, s: c.register_engine(SPEC, [("no-such-region", 1 << 20)],
                                                                        EngineLayout.cross_layer(SPEC, 4)),
                                   InvalidArgument),
    "region named, not handed over": (lambda c, e, o, s: s.RegisterEngine(pb.RegisterEngineRequest(
        spec=spec_to_pb(SPEC), regions=[pb.Region(shm_name="anything", size=1 << 20)], num_blocks=4)),
        grpc.StatusCode.FAILED_PRECONDITION),
    "region with an unknown descriptor ticket": (lambda c, e, o, s: s.RegisterEngine(pb.RegisterEngineRequest(
        spec=spec_to_pb(SPEC), regions=[pb.Region(shm_fd=0, size=1 << 20)], num_blocks=4, fd_ticket="0" * 32)),
        grpc.StatusCode.NOT_FOUND),
    "region name with a path": (lambda c, e, o, s: c.register_engine(SPEC, [("../etc/passwd", 1 << 20)],
                                                                     EngineLayout.cross_layer(SPEC, 4)),
                                InvalidArgument),
    "unknown tier on prefetch": (lambda c, e, o, s: c.prefetch("kv", "moon"), InvalidArgument),
    "device prefetch without a device": (lambda c, e, o, s: c.prefetch("kv", "device"), FailedPrecondition),
    "unknown tier on set_budget": (lambda c, e, o, s: c.set_budget("moon", 10), InvalidArgument),
    "negative budget": (lambda c, e, o, s: c.set_budget("host", -1), InvalidArgument),
    "unpin of an unpinned session": (lambda c, e, o, s: c.unpin("kv"), FailedPrecondition),
    "wait with a huge timeout": (lambda c, e, o, s: c.wait_ready("kv", timeout=1e9), InvalidArgument),
    "negative prefetch deadline": (lambda c, e, o, s: c.prefetch("kv", deadline_seconds=-1), InvalidArgument),
    "list with a huge limit": (lambda c, e, o, s: c.list_page(limit=1_000_000), InvalidArgument),
    "advise with no rate": (lambda c, e, o, s: c.advise("kv", 0), InvalidArgument),
    "save with the wrong number of token ids": (lambda c, e, o, s: e.save("new", [0], 16, token_ids=[1, 2]),
                                                InvalidArgument),
    "token ids for an opaque put": (lambda c, e, o, s: c.put("new", b"x", OPAQUE, 1, token_ids=[1]), InvalidArgument),
    "lookup of an unknown session": (lambda c, e, o, s: c.lookup("nope", [1, 2]), NotFound),
    "lookup with another identity": (lambda c, e, o, s: c.lookup("kv", [1, 2], OTHER), IdentityMismatch),
    "lookup with negative token ids": (lambda c, e, o, s: c.lookup("kv", [-5]), InvalidArgument),
    "save lease with a negative ttl": (lambda c, e, o, s: c.begin_save("new", SPEC, 16, ttl=-1), InvalidArgument),
    "save lease with too few token ids": (lambda c, e, o, s: c.begin_save("new", SPEC, 16, token_ids=[1]),
                                          InvalidArgument),
    "save lease appending to nothing": (lambda c, e, o, s: c.begin_save("new", SPEC, 48, start_token=32), NotFound),
    "commit of an unknown lease": (lambda c, e, o, s: c.commit_save("f" * 32), NotFound),
    "abort of an unknown lease": (lambda c, e, o, s: c.abort_save("f" * 32), NotFound),
    "end of an unknown lease": (lambda c, e, o, s: c.end_restore("f" * 32), NotFound),
    "restore lease of more pages than stored": (lambda c, e, o, s: c.begin_restore("kv", num_pages=9),
                                                InvalidArgument),
    "restore lease with another identity": (lambda c, e, o, s: c.begin_restore("kv", OTHER), IdentityMismatch),
    "restore lease of an opaque blob's missing session": (lambda c, e, o, s: c.begin_restore("nope"), NotFound),
    # values protobuf refuses are the client's InvalidArgument, in a Put's stream as in a unary call
    "put with a negative token count": (lambda c, e, o, s: c.put("new", b"x", OPAQUE, num_tokens=-1), InvalidArgument),
    "put with a priority past int32": (lambda c, e, o, s: c.put("new", b"x", OPAQUE, 1, priority=2**40),
                                       InvalidArgument),
    "put from a negative token": (lambda c, e, o, s: c.put("new", b"x" * 16384, SPEC, 32, start_token=-16),
                                  InvalidArgument),
    "put of a str": (lambda c, e, o, s: c.put("new", "not bytes", OPAQUE, 1), InvalidArgument),
    "put in chunks of 0 bytes": (lambda c, e, o, s: c.put("new", b"x", OPAQUE, 1, chunk_bytes=0), InvalidArgument),
    "put with a session id that is not text": (lambda c, e, o, s: c.put(7, b"x", OPAQUE, 1), InvalidArgument),
    "stat with a session id that is not text": (lambda c, e, o, s: c.stat(7), InvalidArgument),
    "get in chunks of -1 bytes": (lambda c, e, o, s: c.get("kv", chunk_bytes=-1), InvalidArgument),
    "prefetch with a priority past int32": (lambda c, e, o, s: c.prefetch("kv", priority=2**40), InvalidArgument),
    "wait with a timeout that is not a number": (lambda c, e, o, s: c.wait_ready("kv", timeout="soon"),
                                                 InvalidArgument),
    "save lease with a negative token count": (lambda c, e, o, s: c.begin_save("new", SPEC, -16), InvalidArgument),
    "save with a negative token count": (lambda c, e, o, s: e.save("new", [0], -16), InvalidArgument),
    "list with a negative limit": (lambda c, e, o, s: c.list_page(limit=-1), InvalidArgument),
    "lookup with a token id past int64": (lambda c, e, o, s: c.lookup("kv", [2**70]), InvalidArgument),
    "save with a lossy bound past 1": (lambda c, e, o, s: e.save("new", [0], 16, lossy_max_error=1.5),
                                       InvalidArgument),
    "put with a negative lossy bound": (lambda c, e, o, s: c.put("new", b"x" * SPEC.page_bytes, SPEC, 16,
                                                                 lossy_max_error=-0.1), InvalidArgument),
    "save lease with a lossy bound of NaN": (lambda c, e, o, s: c.begin_save("new", SPEC, 16,
                                                                             lossy_max_error=float("nan")),
                                             InvalidArgument),
    "lossy codes asked for an opaque put": (lambda c, e, o, s: c.put("new", b"x", OPAQUE, 1, lossy_max_error=0.05),
                                            InvalidArgument),
    "raw save with a lossy bound past 1": (lambda c, e, o, s: s.Save(pb.SaveRequest(
        engine_id=e.engine_id, session_id="new", block_ids=[0], num_tokens=16, lossy_max_error=2.0)),
        grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_changes_nothing(world, name):
    d, c, engine, other, stub = world
    before = snapshot(c)
    call, expected = CASES[name]
    if isinstance(expected, grpc.StatusCode):
        try:
            got = call(c, engine, other, stub)
        except grpc.RpcError as err:
            got = err.code()
        assert got == expected, f"{name}: got {got}"
    else:
        with pytest.raises(expected) as info:
            call(c, engine, other, stub)
        assert str(info.value), "the error carries a message"
        assert isinstance(info.value, TierdError)
    # A cancelled stream is cleaned up on the daemon's side just after the client hears of it.
    deadline = time.monotonic() + 5
    while snapshot(c) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snapshot(c) == before
    assert "Traceback" not in d.log(), d.log()


def test_put_chunks_in_any_valid_layout_are_stored(world):
    """Other clients' protobuf may lay a chunk out otherwise: checksum first,
    unknown fields, no checksum. Each is read as protobuf reads it."""
    d, c, engine, other, stub = world
    parts = [b"first-", b"second-", b"third"]
    digest = [xxhash.xxh3_64_intdigest(p).to_bytes(8, "little") for p in parts]
    data_field = [b"\x0a" + _varint(len(p)) + p for p in parts]
    chunks = [b"\x11" + digest[0] + data_field[0], data_field[1] + b"\x11" + digest[1] + b"\x78\x01", data_field[2]]
    messages = [_opaque_header("layouts", sum(map(len, parts)))] + [b"\x12" + _varint(len(x)) + x for x in chunks]
    assert _wire_put(c, messages) == grpc.StatusCode.OK
    assert c.get("layouts") == b"".join(parts)
    c.drop("layouts")


def test_second_daemon_on_the_same_socket_is_refused(world, tmp_path):
    d = world[0]
    second = subprocess.run([sys.executable, "-m", "tierd", "serve", "--socket", d.socket, "--data-dir",
                             str(tmp_path / "other"), "--metrics", "off", "--device", "none"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert f"socket {d.socket} is in use by another tierd (pid {d.pid()})" in second.stderr
    assert snapshot(world[1])[0]  # the first daemon still serves


def test_second_daemon_on_the_same_data_dir_is_refused(world, tmp_path):
    d = world[0]
    second = subprocess.run([sys.executable, "-m", "tierd", "serve", "--socket", str(tmp_path / "s.sock"),
                             "--data-dir", d.data_dir, "--metrics", "off", "--device", "none"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "is in use by another tierd" in second.stderr


def test_bad_config_is_refused_before_anything_starts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--host-budget", "lots", "--data-dir",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "host_budget" in out.stderr and "cannot read size" in out.stderr


@pytest.mark.parametrize("flags, error", [
    (["--codec", "host=auto"], "not auto"), (["--codec", "host=fp8", "--disk-budget", "0"], "disk tier with a budget"),
    (["--codec", "disk=fp8"], "lossless only"), (["--codec", "host=zstd9"], "unknown codec 'zstd9'"),
])
def test_a_codec_no_tier_can_take_is_refused_before_the_data_dir_is_touched(tmp_path, flags, error):
    data = tmp_path / "data"
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--data-dir", str(data), "--socket",
                          str(tmp_path / "run" / "s.sock"), "--metrics", "off", "--device", "none", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and error in out.stderr
    assert not data.exists() and not (tmp_path / "run").exists()  # nothing made, nothing of another run removed


def test_lossy_tenants_that_no_tenant_can_be_are_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--lossy-tenants", "alice,bad tenant",
                          "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "'bad tenant' is no tenant's name" in out.stderr


LONG = "y" * 100_000


ECHOES = {
    # name: (call(stub), status); each request holds a 100 KB value where the message names it
    "session id": (lambda s: s.Stat(pb.SessionRequest(session_id=LONG)), grpc.StatusCode.INVALID_ARGUMENT),
    "tier": (lambda s: s.Prefetch(pb.PrefetchRequest(session_id="kv", tier=LONG)), grpc.StatusCode.INVALID_ARGUMENT),
    "tier to wait for": (lambda s: s.WaitReady(pb.WaitReadyRequest(session_id="kv", tier=LONG)),
                         grpc.StatusCode.INVALID_ARGUMENT),
    "tier of a budget": (lambda s: s.SetBudget(pb.SetBudgetRequest(tier=LONG, budget=1)),
                         grpc.StatusCode.INVALID_ARGUMENT),
    "lease id": (lambda s: s.CommitSave(pb.LeaseRequest(lease_id=LONG)), grpc.StatusCode.NOT_FOUND),
    "engine id": (lambda s: s.Restore(pb.RestoreRequest(engine_id=LONG, session_id="kv", block_ids=[0])),
                  grpc.StatusCode.NOT_FOUND),
    "model id": (lambda s: s.Lookup(pb.LookupRequest(session_id="kv", token_ids=[1], spec=pb.KVSpec(model_id=LONG))),
                 grpc.StatusCode.INVALID_ARGUMENT),
    "dtype": (lambda s: s.Lookup(pb.LookupRequest(session_id="kv", token_ids=[1], spec=pb.KVSpec(
        model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype=LONG, block_tokens=16))),
        grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("name", list(ECHOES))
def test_errors_echo_only_a_prefix_of_what_was_sent(world, name):
    """Whatever a request holds, its error names a short prefix of it: a
    100 KB value echoed whole went past gRPC's metadata limit and came back
    as RESOURCE_EXHAUSTED instead of the call's own status."""
    call, code = ECHOES[name]
    with pytest.raises(grpc.RpcError) as info:
        call(world[4])
    assert info.value.code() == code, (info.value.code(), info.value.details()[:200])
    assert "yyyy" in info.value.details() and len(info.value.details()) < 400, info.value.details()
