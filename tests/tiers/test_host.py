import glob
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import arena_name, host_tier
from tierd.tiers import shm
from tierd.tiers.host import HostTier

MiB = 1 << 20


@pytest.fixture
def host():
    tier = host_tier(8 * MiB, 4 * MiB)
    yield tier
    tier.close()


def test_slabs_are_private_shared_memory_files(host):
    pieces = host.alloc_pages(1, 4096)
    path = host.slab_path(0)
    assert os.path.exists(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    host.free(pieces[0])
    host.close()
    assert not os.path.exists(path)


def test_another_process_sees_the_bytes_by_name(host):
    (piece,) = host.alloc_pages(4, 4096)
    host.view(piece.offset, 4 * 4096)[:] = np.arange(4 * 4096, dtype=np.uint64).astype(np.uint8)
    slab, off = host.locate(piece.offset)
    code = (
        "import mmap,os,sys,hashlib\n"
        f"fd=os.open('/dev/shm/{host.slab_name(slab)}', os.O_RDONLY)\n"
        f"m=mmap.mmap(fd, {host.slab_bytes}, prot=mmap.PROT_READ)\n"
        f"sys.stdout.write(hashlib.sha256(m[{off}:{off + 4 * 4096}]).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    import hashlib

    assert out == hashlib.sha256(host.view(piece.offset, 4 * 4096).tobytes()).hexdigest()


def test_budget_is_enforced_and_quiet_free_memory_goes_back(host):
    a = host.alloc_pages(1, 6 * MiB // 2)
    b = host.alloc_pages(1, 6 * MiB // 2)
    assert a and b and host.used == 6 * MiB
    assert host.alloc_pages(1, 4 * MiB) is None  # 6 + 4 > 8 MiB budget
    host.view(a[0].offset, 3 * MiB)[:] = 7
    blocks_before = os.stat(host.slab_path(host.locate(a[0].offset)[0])).st_blocks
    host.free(a[0])
    path = host.slab_path(host.locate(a[0].offset)[0])
    assert os.stat(path).st_blocks == blocks_before  # kept for reuse while the arena is busy
    assert host.maintain(quiet_seconds=60) == 0
    assert host.maintain(quiet_seconds=0) >= 3 * MiB
    assert os.stat(path).st_blocks < blocks_before  # punched out of /dev/shm once quiet
    assert host.alloc_pages(1, 4 * MiB) is not None


def test_shrinking_the_budget_closes_empty_slabs(host):
    a = host.alloc_pages(1, 4 * MiB)
    b = host.alloc_pages(1, 4 * MiB)
    assert host.capacity == 8 * MiB
    host.free(b[0])
    host.set_budget(4 * MiB)
    assert host.capacity == 4 * MiB and len(glob.glob(f"/dev/shm/{host.prefix}.*")) == 1
    host.free(a[0])


def test_a_restart_removes_what_a_killed_run_left_and_only_its_own(tmp_path):
    data = str(tmp_path)
    first = shm.claim_prefix(data)
    names = [shm.create(first, 4096)[0] for _ in range(2)]
    foreign = f"/dev/shm/{first}.not-ours"
    open(foreign, "wb").close()
    os.chown(foreign, 65534, 65534)  # another user's file under the same prefix stays
    try:
        second = shm.claim_prefix(data)
        assert second != first and shm.read_prefix(data) == second
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
        assert os.path.exists(foreign)
        assert stat.S_IMODE(os.stat(tmp_path / shm.PREFIX_FILE).st_mode) == 0o600
    finally:
        os.unlink(foreign)


def test_slab_names_are_unpredictable_and_a_squatted_name_is_skipped(monkeypatch, caplog):
    prefix = arena_name()
    taken = f"{prefix}.{'0' * 16}"
    open(f"/dev/shm/{taken}", "wb").close()  # somebody created the first name we will draw
    draws = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(shm.secrets, "token_hex", lambda n: next(draws))
    tier = HostTier(4 * MiB, prefix, slab_bytes=4 * MiB)
    try:
        with caplog.at_level("WARNING", logger="tierd.tiers.shm"):
            assert tier.alloc_pages(1, 4096) is not None
        assert tier.slab_name(0) == f"{prefix}.{'1' * 16}"
        assert "not ours: skipped" in caplog.text
        assert os.path.getsize(f"/dev/shm/{taken}") == 0  # the squatter's file is untouched
    finally:
        tier.close()
        os.unlink(f"/dev/shm/{taken}")


def test_failed_pinning_falls_back_to_pageable_and_says_so(caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("pinning works here; this checks the fallback")
    tier = HostTier(4 * MiB, arena_name(), slab_bytes=4 * MiB, pin=True)
    try:
        with caplog.at_level("WARNING", logger="tierd.tiers.host"):
            assert tier.alloc_pages(1, 4096) is not None
        assert not tier.pinned and tier.backend == "shm-pageable"
        assert "cudaHostRegister failed" in caplog.text
    finally:
        tier.close()


def test_views_never_cross_a_slab(host):
    host.alloc_pages(2, 4 * MiB)  # both slabs
    assert host.view(4 * MiB - 4096, 4096).nbytes == 4096
    with pytest.raises(ValueError, match="cross a slab boundary"):
        host.view(4 * MiB - 4096, 8192)  # would have been cut short at the slab's end
