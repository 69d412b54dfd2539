"""No tenant reaches another's KV through engine memory, and no read hands
out bytes that differ from what was saved.

Each case is the attack as a tenant would make it, against a real daemon
process with real /dev/shm files: registering the daemon's own arena (or a
lease segment, or another user's shared memory) as "engine memory", using
another tenant's descriptor ticket, and reading a session whose bytes in the
host tier were changed behind the daemon's back, through every read path.
"""

import fcntl
import glob
import json
import os
import socket

import grpc
import numpy as np
import pytest

from tests.helpers import flip_in_arena
from tierd.client import (
    Arena,
    DataLoss,
    EngineLayout,
    FailedPrecondition,
    InvalidArgument,
    KVSpec,
    ResourceExhausted,
    SharedKVCache,
    Unauthenticated,
)
from tierd.client.shm import sealed_memfd
from tierd.core import engines as engines_module
from tierd.core.engines import EngineRegistry
from tierd.testing import Daemon, tokens_file
from tierd.tiers import shm
from tierd.types import Lease, Slot
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire.convert import spec_to_pb
from tierd.api.intake import FDS_PER_TENANT
from tierd.wire.fds import hand_over, intake_path

SPEC = KVSpec("test/llama-tiny", "r1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
MiB = 1 << 20


@pytest.fixture
def secured(tmp_path):
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS), "--writeback-idle", "off",
               "--host-idle", "600").start()
    yield d
    d.close()


def arena_files(d):
    """The daemon's shared-memory files: its arena slabs, then its lease segments."""
    prefix = shm.read_prefix(d.data_dir)
    files = sorted(glob.glob(f"/dev/shm/{prefix}.*"))
    return [f for f in files if ".lease." not in f], [f for f in files if ".lease." in f]


def random_cache(seed=0):
    kv = SharedKVCache(SPEC, 16)
    for r in kv.regions:
        r[:] = np.random.default_rng(seed).integers(0, 256, r.size, dtype=np.uint8)
    return kv


def test_the_daemons_own_memory_is_never_engine_memory(secured):
    """A tenant that hands over the arena slab (or another tenant's lease
    segment) as its engine memory would Save other tenants' pages into its
    own session and Restore over them: refused, whatever it names or passes."""
    alice, bob = secured.client(token=TOKENS["alice"]), secured.client(token=TOKENS["bob"])
    with random_cache() as kv:
        alice.register_engine(SPEC, kv).save("victim", list(range(3)), 40)
    lease = alice.begin_save("victim-2", SPEC, 32)
    slabs, segments = arena_files(secured)
    assert slabs and segments
    layout = EngineLayout.cross_layer(SPEC, 4)
    for path in slabs + segments:
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(FailedPrecondition, match="the daemon's own memory"):
                bob.register_engine(SPEC, [(fd, 4 * SPEC.page_bytes)], layout)
        finally:
            os.close(fd)
    # Naming it, as clients used to, is refused whatever the name.
    stub = pb_grpc.TierdStub(grpc.insecure_channel("unix:" + secured.socket))
    for path in slabs + segments:
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterEngine(pb.RegisterEngineRequest(
                spec=spec_to_pb(SPEC), regions=[pb.Region(shm_name=os.path.basename(path), size=4 * SPEC.page_bytes)],
                num_blocks=4), metadata=(("authorization", f"Bearer {TOKENS['bob']}"),))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    alice.abort_save(lease)
    assert len(bob.list()) == 0 and [s.session_id for s in alice.list()] == ["victim"]


def test_shared_memory_of_another_user_is_refused(secured, tmp_path):
    """Only memory of the user handing it over: a file another user owns
    (here readable and writable by anyone) is refused."""
    path = f"/dev/shm/tierd-test-foreign-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.ftruncate(fd, 4 * SPEC.page_bytes)
        os.fchown(fd, 65534, 65534)  # nobody's
        os.fchmod(fd, 0o666)
        with pytest.raises(FailedPrecondition, match="owned by another user"):
            secured.client(token=TOKENS["bob"]).register_engine(SPEC, [(fd, 4 * SPEC.page_bytes)],
                                                               EngineLayout.cross_layer(SPEC, 4))
    finally:
        os.close(fd)
        os.unlink(path)


def test_engine_memory_that_could_be_cut_short_is_refused(secured):
    """An engine that cut its memory short under the daemon (ftruncate) made the
    daemon's next copy fault (SIGBUS) and killed it for every tenant: only a
    memfd sealed against shrinking is taken, and that one cannot be cut."""
    bob = secured.client(token=TOKENS["bob"])
    path = f"/dev/shm/tierd-test-unsealed-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4 * SPEC.page_bytes)
        with pytest.raises(FailedPrecondition, match="can be cut short"):
            bob.register_engine(SPEC, [(fd, 4 * SPEC.page_bytes)], EngineLayout.cross_layer(SPEC, 4))
        unsealed = os.memfd_create("unsealed")
        os.ftruncate(unsealed, 4 * SPEC.page_bytes)
        with pytest.raises(FailedPrecondition, match="can be cut short"):
            bob.register_engine(SPEC, [(unsealed, 4 * SPEC.page_bytes)], EngineLayout.cross_layer(SPEC, 4))
        os.close(unsealed)
    finally:
        os.close(fd)
        os.unlink(path)
    with random_cache() as kv:
        engine = bob.register_engine(SPEC, kv)
        with pytest.raises(PermissionError):
            os.ftruncate(kv.fds[0], 0)  # the seal holds
        engine.save("s", [0, 1, 2], 40)
        engine.restore("s", [3, 4, 5])
    assert bob.stat("s").num_tokens == 40 and secured.proc.poll() is None


def test_a_descriptor_ticket_is_its_tenants_alone(secured):
    """Descriptors handed over with alice's token cannot be registered by bob."""
    with random_cache() as kv:
        ticket = hand_over(intake_path(secured.socket), kv.fds, TOKENS["alice"])
        with pytest.raises(Unauthenticated, match="unknown token"):
            hand_over(intake_path(secured.socket), kv.fds, "not-a-token")
        stub = pb_grpc.TierdStub(grpc.insecure_channel("unix:" + secured.socket))
        req = pb.RegisterEngineRequest(spec=spec_to_pb(SPEC), num_blocks=16, fd_ticket=ticket,
                                       regions=[pb.Region(shm_fd=i, size=s) for i, s in enumerate(kv.sizes)])
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterEngine(req, metadata=(("authorization", f"Bearer {TOKENS['bob']}"),))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # alice's own call takes it, once
        assert stub.RegisterEngine(req, metadata=(("authorization", f"Bearer {TOKENS['alice']}"),)).engine_id
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterEngine(req, metadata=(("authorization", f"Bearer {TOKENS['alice']}"),))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def read_get(c, chunk_bytes):
    return c.get("victim", chunk_bytes=chunk_bytes)


def read_restore(c, chunk_bytes):
    with SharedKVCache(SPEC, 16) as out:
        c.register_engine(SPEC, out).restore("victim", [5, 6, 7])
        return out


def read_lease(c, chunk_bytes):
    held = c.begin_restore("victim", SPEC)
    arena = Arena()
    try:
        return b"".join(p.tobytes() for p in arena.pages(held))
    finally:
        arena.close()


@pytest.mark.parametrize("read, chunk_bytes", [
    (read_get, 0),             # one chunk per page: each carries the page's save-time checksum
    (read_get, 8192),          # chunks inside pages: before, hashed from the bytes as read
    (read_get, 3 * 32768 - 1), # chunks across pages
    (read_restore, 0),         # scattered into registered engine memory
    (read_lease, 0),           # copied out through a restore lease
])
def test_no_read_hands_out_bytes_changed_in_host_memory(tmp_path, read, chunk_bytes):
    d = Daemon(tmp_path, "--writeback-idle", "off", "--host-idle", "600").start()
    try:
        c = d.client()
        with random_cache(seed=3) as kv:
            c.register_engine(SPEC, kv).save("victim", [0, 1, 2], 40)
            page1 = kv.block(0, 1).tobytes()  # layer 0's K of page 1, as saved
        flip_in_arena(d.data_dir, page1[100:164])
        with pytest.raises(DataLoss, match="page 1 failed its checksum in the host tier"):
            read(c, chunk_bytes)
        assert c.stat("victim").state == "damaged"
        assert "Traceback" not in d.log()
    finally:
        d.close()


def test_a_lease_segment_cut_short_fails_its_commit_not_the_daemon(secured):
    """An engine must open its lease's segment read-write to fill it, so it can
    also cut it short: the daemon never maps a segment (it reads and writes
    it with system calls), so the commit fails, alone."""
    alice, bob = secured.client(token=TOKENS["alice"]), secured.client(token=TOKENS["bob"])
    bob.put("b", b"kept", KVSpec.opaque("m", page_bytes=4096), 1)
    lease = alice.begin_save("a", SPEC, 64)
    path = f"/dev/shm/{lease.slots[0].shm_name}"
    os.truncate(path, 0)
    with pytest.raises(InvalidArgument, match="cut short"):
        alice.commit_save(lease)
    assert secured.proc.poll() is None and bob.get("b") == b"kept"
    assert alice.list() == [] and "Traceback" not in secured.log()
    held = alice.begin_save("a", SPEC, 64)  # the next lease works
    alice.commit_save(held)
    assert alice.stat("a").num_tokens == 64


def test_a_malformed_line_on_the_descriptor_intake_is_refused_and_the_daemon_serves_on(secured):
    """The intake's line is parsed before any token is checked: a line nested
    too deep for the parser got no answer and a traceback. Every malformed
    line gets its refusal, with its status code (INVALID_ARGUMENT); a missing
    or unknown token is UNAUTHENTICATED at the client."""
    bad, unknown = "INVALID_ARGUMENT", "UNAUTHENTICATED"
    lines = {b"[" * 100_000 + b"\n": bad, b"[" * 4000 + b"\n": bad, b'{"token": ' + b"[" * 4000 + b"]}\n": bad,
             b"\xff\n": bad, b'"token"\n': bad, b'{"token": ["alice-secret"]}\n': bad, b'{"token": "x"}': bad,
             b"{}\n": unknown, b'{"token": "not-a-token"}\n': unknown, b'{"token": "\\ud800"}\n': unknown}
    for line, code in lines.items():
        fd = sealed_memfd("m", 4096)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(intake_path(secured.socket))
                socket.send_fds(s, [line], [fd])
                reply = b""
                while not reply.endswith(b"\n"):
                    part = s.recv(4096)
                    assert part, f"no answer to {line[:40]!r}"
                    reply += part
        finally:
            os.close(fd)
        answer = json.loads(reply)
        assert "ticket" not in answer and answer["error"] and answer.get("code") == code, (line[:40], answer)
    with random_cache() as kv:
        for token in (None, "not-a-token"):
            with pytest.raises(Unauthenticated):
                secured.client(token=token).register_engine(SPEC, kv)
        secured.client(token=TOKENS["alice"]).register_engine(SPEC, kv).save("a", [0], 16)  # the daemon serves on
    assert secured.proc.poll() is None and "Traceback" not in secured.log()


def test_a_tenant_holds_a_few_handed_over_memories_at_most(secured):
    """Each ticket keeps its descriptors open until registered or expired: one
    tenant handing over memory without end ran the daemon out of descriptors."""
    with random_cache() as kv:  # 8 regions
        for _ in range(FDS_PER_TENANT // len(kv.fds)):
            hand_over(intake_path(secured.socket), kv.fds, TOKENS["alice"])
        with pytest.raises(ResourceExhausted, match="wait to be registered"):
            hand_over(intake_path(secured.socket), kv.fds, TOKENS["alice"])
        engine = secured.client(token=TOKENS["bob"]).register_engine(SPEC, kv)  # bob's are his own
        engine.save("b", [0], 16)


def test_huge_page_memory_is_refused(secured):
    """A hugetlb page can be taken away under the daemon however its memfd is
    sealed (punch a hole, let another process take every free huge page):
    only memory of ordinary pages is taken."""
    try:
        fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        pytest.skip(f"no hugetlb memfd here: {exc.strerror}")
    try:
        size = 2 << 20
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            pytest.skip(f"hugetlb memfd cannot be sized here: {exc.strerror}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(FailedPrecondition, match="not plain shared memory"):
            secured.client(token=TOKENS["bob"]).register_engine(SPEC, [(fd, size)], EngineLayout.cross_layer(SPEC, 64))
    finally:
        os.close(fd)


def _open_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.pid()}/fd"))


def test_regions_naming_one_memory_map_it_once(secured):
    """Every region held a descriptor of the daemon's for as long as its engine
    was registered, however many regions named the same memfd: seven engines
    of 581 regions each took all of the daemon's 4,096, and no other tenant
    could register (the descriptor intake stopped accepting). One mapping,
    and one descriptor, per memory handed over."""
    wide = KVSpec("test/wide", "r1", num_layers=500, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    layout = EngineLayout.layer_major(wide, 4)  # 1,000 regions
    size = 4 * layout.segments[0].stride
    fd = sealed_memfd("one", size)
    stub = pb_grpc.TierdStub(grpc.insecure_channel("unix:" + secured.socket))
    auth = (("authorization", f"Bearer {TOKENS['alice']}"),)
    try:
        before = _open_fds(secured)
        for _ in range(8):  # each engine: one descriptor handed over, named by all 1,000 regions
            ticket = hand_over(intake_path(secured.socket), [fd], TOKENS["alice"])
            req = pb.RegisterEngineRequest(spec=spec_to_pb(wide), num_blocks=4, fd_ticket=ticket,
                                           regions=[pb.Region(shm_fd=0, size=size)] * len(layout.segments))
            req.segments.extend(pb.Segment(region=s.region, offset=s.offset, stride=s.stride, nbytes=s.nbytes)
                                for s in layout.segments)
            stub.RegisterEngine(req, metadata=auth)
        assert _open_fds(secured) - before <= 8 + 4  # one each (and a few the calls may hold)
        with random_cache() as kv:
            secured.client(token=TOKENS["bob"]).register_engine(SPEC, kv).save("b", [0], 16)
    finally:
        os.close(fd)


def test_a_tenants_engines_map_a_bounded_number_of_memories(monkeypatch):
    """Past its cap a tenant's next engine is RESOURCE_EXHAUSTED and maps
    nothing; other tenants register as before, and an engine unregistered
    makes room again."""
    monkeypatch.setattr(engines_module, "MAX_MAPPED_PER_TENANT", 4)
    registry = EngineRegistry()
    layout = EngineLayout.cross_layer(SPEC, 4)
    size = 4 * layout.segments[0].stride
    fds = [sealed_memfd(f"m{i}", size) for i in range(6)]
    try:
        mine = [registry.register("alice", SPEC, [(fd, size)], layout) for fd in fds[:4]]
        with pytest.raises(ResourceExhausted, match="may map 4 shared-memory descriptors"):
            registry.register("alice", SPEC, [(fds[4], size)], layout)
        assert len(registry) == 4
        registry.register("bob", SPEC, [(fds[5], size)], layout)
        registry.unregister("alice", mine[0].engine_id)
        registry.register("alice", SPEC, [(fds[4], size)], layout)
    finally:
        registry.close()
        for fd in fds:
            os.close(fd)


def test_the_arena_maps_nothing_planted_under_a_lease_name(tmp_path):
    """Once the daemon has removed a lease's segment, another local user may
    put a link to a file of the engine's user (or a file of their own) under
    its name; an engine that touched the lease again wrote its KV there, or
    handed it to them. Only a regular file of this user, private to it, is mapped."""
    name = f"tierd-test-{os.getpid()}.lease.{os.urandom(4).hex()}"
    lease = Lease(name, [Slot(name, 0, 0, 1)], page_bytes=4096, page_stride=4096, first_page=0, num_pages=1,
                  num_tokens=16, ttl=1.0)
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 4096)
    path = f"/dev/shm/{name}"
    arena = Arena()
    try:
        os.symlink(victim, path)
        with pytest.raises(FailedPrecondition, match="symbolic link"):
            arena.pages(lease)[0][:] = 7
        os.unlink(path)
        with open(path, "wb") as f:  # a plain file others may open (theirs, or one left open to them)
            f.write(b"\0" * 4096)
        os.chmod(path, 0o644)
        with pytest.raises(FailedPrecondition, match="not a lease segment of the daemon"):
            arena.pages(lease)
        assert victim.read_bytes() == b"\0" * 4096
    finally:
        arena.close()
        if os.path.lexists(path):
            os.unlink(path)


def test_a_metrics_port_taken_first_is_a_clear_start_up_error(tmp_path):
    """Another local user may bind the metrics port before the daemon: it
    exited with a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = Daemon(tmp_path, "--metrics", f"127.0.0.1:{port}")
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}: Address already in use"):
            d.start()
        assert d.proc.wait(10) == 1 and "Traceback" not in d.log()


def test_the_descriptors_of_a_ticket_never_taken_are_closed_when_it_expires(tmp_path, monkeypatch):
    """They were closed only at the next hand-over: with no more traffic, a
    daemon held every expired ticket's descriptors (892, 75 s on)."""
    import asyncio

    from tierd.api import intake as intake_module
    from tierd.api.intake import FdIntake
    from tierd.wire.fds import hand_over

    monkeypatch.setattr(intake_module, "TICKET_SECONDS", 0.3)
    intake = FdIntake(str(tmp_path / "d.sock.fds"), identify=lambda token: "alice", own=lambda st: False)
    loop = asyncio.new_event_loop()
    fds = [sealed_memfd(f"r{i}", 1 << 16) for i in range(8)]
    try:
        intake.start(loop)
        before = len(os.listdir("/proc/self/fd"))
        loop.run_until_complete(loop.run_in_executor(None, hand_over, str(tmp_path / "d.sock.fds"), fds, "t"))
        assert len(os.listdir("/proc/self/fd")) >= before + len(fds)  # the ticket holds its copies open

        async def closed():
            end = loop.time() + 10
            while len(os.listdir("/proc/self/fd")) > before and loop.time() < end:
                await asyncio.sleep(0.05)
            return len(os.listdir("/proc/self/fd"))

        assert loop.run_until_complete(closed()) <= before
    finally:
        intake.close()
        loop.close()
        for fd in fds:
            os.close(fd)
