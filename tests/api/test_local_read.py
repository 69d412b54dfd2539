"""A local read: a client on the daemon's machine reads a session's bytes
through shared memory the daemon lends for the read (read_local: one copy,
in the daemon, every page checked), has them copied into a buffer of its
own (get_into), or has the daemon read them into memory of its own that it
registered (LocalBuffer). Bounds, tenants, identities, damaged pages and a
reader that dies with the lease open, against a real daemon."""

import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import SPEC, flip_in_arena, metric, wait_for
from tests.security.test_isolation import TOKENS
from tierd.client import (
    Arena,
    DataLoss,
    IdentityMismatch,
    InvalidArgument,
    KVSpec,
    NotFound,
    ResourceExhausted,
    SharedKVCache,
)
from tierd.testing import Daemon, tokens_file

OPAQUE = KVSpec.opaque("test/state", page_bytes=8192)


def state(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_a_local_read_gives_exactly_the_bytes_stored(daemon):
    data = state(3 * 8192 + 1000)  # the last page short
    with daemon.client() as c:
        c.put("llama", data, OPAQUE, 0)
        with c.read_local("llama") as view:
            assert view.readonly and len(view) == len(data) and bytes(view) == data
        out = bytearray(len(data) + 10)
        assert c.get_into("llama", out) == len(data)
        assert bytes(out[: len(data)]) == data and out[len(data) :] == bytes(10)
        kv = state(4 * SPEC.page_bytes, seed=1)
        c.put("kv", kv, SPEC, 64)
        with c.read_local("kv") as view:
            assert bytes(view) == kv
        with pytest.raises(NotFound):
            with c.read_local("nowhere"):
                pass


def test_a_buffer_too_small_is_refused_and_holds_no_lease(tmp_path):
    d = Daemon(tmp_path, "--tenant-leases", "1").start()
    try:
        with d.client() as c:
            c.put("llama", state(20000), OPAQUE, 0)
            for _ in range(3):  # a lease left open would make the next one RESOURCE_EXHAUSTED
                with pytest.raises(InvalidArgument, match="20000 bytes"):
                    c.get_into("llama", bytearray(19999))
            with pytest.raises(InvalidArgument, match="writable"):
                c.get_into("llama", bytes(20000))
            out = np.zeros(20000, dtype=np.uint8)
            assert c.get_into("llama", out) == 20000 and out.tobytes() == state(20000)
    finally:
        d.close()


def test_a_tenant_reads_only_its_own_sessions(tmp_path):
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS)).start()
    try:
        with d.client(token=TOKENS["alice"]) as alice, d.client(token=TOKENS["bob"]) as bob:
            alice.put("mine", state(9000), OPAQUE, 0)
            with pytest.raises(NotFound):
                with bob.read_local("mine"):
                    pass
            with pytest.raises(NotFound):
                bob.get_into("mine", bytearray(9000))
            assert alice.get_into("mine", bytearray(9000)) == 9000
    finally:
        d.close()


def test_a_damaged_page_is_data_loss_never_bytes(daemon):
    data = state(4 * 8192, seed=2)
    with daemon.client() as c:
        c.put("damaged", data, OPAQUE, 0)
        flip_in_arena(daemon.data_dir, data[8192 + 100 : 8192 + 132])
        with pytest.raises(DataLoss):
            with c.read_local("damaged"):
                pass
        with pytest.raises(DataLoss):
            c.get_into("damaged", bytearray(len(data)))


READER = """
import os, sys
from tierd.client import Client
c = Client(sys.argv[1])
with c.read_local("held", ttl=0.5) as view:
    print(len(view), flush=True)
    os.kill(os.getpid(), 9)  # dies with the lease open
"""


def test_a_lease_its_reader_never_ended_is_returned(daemon):
    with daemon.client() as c:
        c.put("held", state(8192 * 2), OPAQUE, 0)
        child = subprocess.run([sys.executable, "-c", READER, daemon.socket], capture_output=True, text=True,
                               timeout=60)
        assert child.returncode == -9 and child.stdout.strip() == str(8192 * 2)
        wait_for(lambda: metric(daemon, "tierd_leases_expired_total", 'kind="restore"') == 1, 20,
                 "the daemon to expire the lease")
        assert c.get_into("held", bytearray(8192 * 2)) == 8192 * 2


def test_a_local_buffer_holds_what_the_daemon_reads_into_it(daemon):
    data, kv = state(2 * 8192 + 5), state(3 * SPEC.page_bytes, seed=3)
    with daemon.client() as c:
        c.put("llama", data, OPAQUE, 0)
        c.put("kv", kv, SPEC, 48)
        with c.local_buffer(OPAQUE, 4 * 8192) as buf:
            view = buf.read("llama")
            assert view.readonly and bytes(view) == data
            c.put("llama", data[:100], OPAQUE, 0)  # stored again, smaller: the next read says so
            assert bytes(buf.read("llama")) == data[:100]
            c.put("big", state(4 * 8192 + 1), OPAQUE, 0)
            with pytest.raises(InvalidArgument, match="this buffer takes 32768"):
                buf.read("big")
            with pytest.raises(IdentityMismatch):
                buf.read("kv")
            with pytest.raises(NotFound):
                buf.read("nowhere")
        with c.local_buffer(SPEC, 3 * SPEC.page_bytes) as buf:
            assert bytes(buf.read("kv")) == kv


def test_engine_memory_of_an_opaque_spec_is_only_read_into(daemon):
    with daemon.client() as c, SharedKVCache(OPAQUE, 4, kind="cross_layer") as memory:
        engine = c.register_engine(OPAQUE, memory)
        with pytest.raises(InvalidArgument, match="no blocks: use put"):
            engine.save("llama", [0, 1], 2)
        engine.close()


def test_a_local_buffer_reads_only_its_tenants_sessions_and_never_damaged_bytes(tmp_path):
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS)).start()
    try:
        data = state(3 * 8192, seed=4)
        with d.client(token=TOKENS["alice"]) as alice, d.client(token=TOKENS["bob"]) as bob, \
                bob.local_buffer(OPAQUE, len(data)) as theirs, alice.local_buffer(OPAQUE, len(data)) as mine:
            alice.put("mine", data, OPAQUE, 0)
            with pytest.raises(NotFound):
                theirs.read("mine")
            assert bytes(mine.read("mine")) == data
            flip_in_arena(d.data_dir, data[8192 + 64 : 8192 + 96])
            with pytest.raises(DataLoss):
                mine.read("mine")
    finally:
        d.close()


def test_a_short_last_page_hands_out_nothing_past_the_sessions_end(tmp_path):
    """The rest of an opaque session's last page is never another session's
    bytes: not in memory the daemon reads into, not in a lent segment."""
    d = Daemon(tmp_path, "--auth-tokens", tokens_file(tmp_path, TOKENS)).start()
    try:
        with d.client(token=TOKENS["alice"]) as alice, d.client(token=TOKENS["bob"]) as bob:
            alice.put("secret", b"ALICE-SECRET-" * 5042, OPAQUE, 0)  # 8 pages of it, then its place freed
            alice.drop("secret")
            with bob.local_buffer(OPAQUE, 8192) as buf:
                for i in range(8):  # into the room alice's pages had
                    bob.put(f"tiny{i}", b"x", OPAQUE, 0)
                    assert bytes(buf.read(f"tiny{i}")) == b"x"
                    assert bytes(buf.memory.regions[0][1:]) == bytes(8191)
            arena = Arena()
            try:
                bob.put("big", state(4 * 8192, seed=5), OPAQUE, 0)
                bob.put("small", state(2 * 8192 + 100, seed=6), OPAQUE, 0)
                for name in ("big", "small"):  # small's lease takes the segment big's had
                    lease = bob.begin_restore(name)
                    segment = arena._slab(lease.slots[0].shm_name)
                    assert bytes(segment[lease.nbytes :]) == bytes(segment.size - lease.nbytes)
                    bob.end_restore(lease)
            finally:
                arena.close()
    finally:
        d.close()


def test_a_local_buffer_never_returns_part_of_a_version_stored_while_it_reads(daemon):
    two, three, shorter = state(2 * 8192, seed=7), state(3 * 8192, seed=8), state(8192 + 5, seed=9)
    with daemon.client() as c, c.local_buffer(OPAQUE, 4 * 8192) as buf:
        for then in (three, shorter, state(100, seed=11)):  # grown, shrunk, to one page: as the read goes out
            c.put("racing", two, OPAQUE, 0)
            restore, once = buf.engine.restore, []

            def store_then_restore(*args, then=then, restore=restore, once=once, **kw):
                if not once:
                    once.append(c.put("racing", then, OPAQUE, 0))
                return restore(*args, **kw)

            buf.engine.restore = store_then_restore
            try:
                assert bytes(buf.read("racing")) == then
            finally:
                buf.engine.restore = restore


DIES = """
import os, sys
from tierd.client import Client, KVSpec
c = Client(sys.argv[1])
held = [c.local_buffer(KVSpec.opaque("test/state", page_bytes=8192), 8192) for _ in range(64)]
print(len(held), flush=True)
os.kill(os.getpid(), 9)
"""


def test_the_local_buffers_of_a_process_that_died_are_let_go(daemon):
    child = subprocess.run([sys.executable, "-c", DIES, daemon.socket], capture_output=True, text=True, timeout=60)
    assert child.returncode == -9 and child.stdout.strip() == "64", child.stderr
    with daemon.client() as c:
        c.put("after", b"y" * 10, OPAQUE, 0)

        def registers():
            try:
                with c.local_buffer(OPAQUE, 8192) as buf:
                    return bytes(buf.read("after")) == b"y" * 10
            except ResourceExhausted:  # the dead process's 64 engines, until the daemon lets them go
                return False

        wait_for(registers, 30, "the daemon to unregister the dead process's buffers")
        with pytest.raises(InvalidArgument, match="positive"):
            c.local_buffer(OPAQUE, 0)


def test_the_asyncio_client_reads_locally_too(daemon):
    import asyncio

    from tierd.client import AsyncClient

    data = state(2 * 8192 + 77, seed=10)

    async def main():
        async with AsyncClient(daemon.socket) as c:
            await c.put("llama", data, OPAQUE, 0)
            async with c.read_local("llama") as view:
                assert view.readonly and bytes(view) == data
            out = np.zeros(len(data), dtype=np.uint8)
            assert await c.get_into("llama", out) == len(data) and out.tobytes() == data
            with pytest.raises(InvalidArgument, match="bytes; the buffer takes"):
                await c.get_into("llama", bytearray(10))
            with pytest.raises(NotFound):
                async with c.read_local("nowhere"):
                    pass

    asyncio.run(main())
