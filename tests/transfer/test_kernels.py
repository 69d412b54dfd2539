"""The GPU kernels' own source, checked without a GPU.

kernels.cu uses no shared memory and no barriers, so compiled as C++ with a
few CUDA names defined, running every thread of the grid in turn computes
what the GPU computes. The results are compared with xxhash and numpy; nvcc,
where installed, also compiles the file for the H100/H200 architecture.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import xxhash

from tests.transfer.emulated_gpu import compile_kernels, hash_pages
from tierd.transfer import gpu


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return compile_kernels(tmp_path_factory.mktemp("kernels"))


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _hash_on_emulated_gpu(so, buf: np.ndarray, pages: list[tuple[int, int]]) -> list[int]:
    return hash_pages(so, [(buf.ctypes.data + off, n) for off, n in pages]).tolist()


def test_device_checksum_agrees_with_the_cpu_on_random_pages(emulated):
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, 1 << 23, dtype=np.uint8)
    # Lengths around every boundary of the long hash: 241, stripe and block edges, a real KV page.
    lengths = [241, 255, 256, 1023, 1024, 1025, 1087, 1088, 1089, 4096, 16384, 16385, 65536 + 7, 917_504]
    lengths += rng.integers(241, 300_000, 10).tolist()
    pages, off = [], 0
    for n in lengths:
        pages.append((off, n))
        off = -(-(off + n) // 4096) * 4096  # pages start 4 KiB-aligned, as in every tier
    pages.append((3, 5000))  # and an unaligned start still hashes right
    assert off <= buf.nbytes
    got = _hash_on_emulated_gpu(emulated, buf, pages)
    want = [xxhash.xxh3_64_intdigest(buf[o : o + n]) for o, n in pages]
    assert got == want


def test_device_checksum_sees_a_flipped_byte(emulated):
    buf = np.random.default_rng(2).integers(0, 256, 8192, dtype=np.uint8)
    before = _hash_on_emulated_gpu(emulated, buf, [(0, 8192)])
    buf[5000] ^= 1
    after = _hash_on_emulated_gpu(emulated, buf, [(0, 8192)])
    assert before != after and after == [xxhash.xxh3_64_intdigest(buf)]


@pytest.mark.parametrize("align", [16, 1])
def test_batched_copy_moves_every_planned_row_and_nothing_else(emulated, align):
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    want = dst.copy()
    # Three 2-D copies: K/V-like rows of 512 bytes 4 KiB apart, one wide row, odd sizes.
    entries = [(0, 65536, 4096, 1024, 512, 9), (200_000, 300_000, 0, 0, 70_000, 1),
               (align, 500_000 + align, 1000, 3000, 48 * align + 5, 7)]
    for so, do, sp, dp, w, r in entries:
        for i in range(r):
            want[do + i * dp : do + i * dp + w] = src[so + i * sp : so + i * sp + w]
    plan = gpu.plan_copies([(_ptr(src) + so, _ptr(dst) + do, sp, dp, w, r) for so, do, sp, dp, w, r in entries],
                           piece_bytes=8192)
    assert len(plan) > len(entries)  # the wide row and the 9 rows were cut into pieces
    emulated.run_copy2d(_ptr(plan), len(plan), 7, 32)
    assert np.array_equal(dst, want)


def test_plan_pieces_cover_each_copy_exactly_once():
    copies = [(1 << 20, 2 << 20, 4096, 8192, 3000, 10), (5 << 20, 6 << 20, 0, 0, 100_000, 1), (0, 0, 64, 64, 0, 3)]
    plan = gpu.plan_copies(copies, piece_bytes=16384)
    assert plan.dtype == np.uint64 and plan.shape[1] == 6
    got = {}
    for src, dst, sp, dp, w, rows in plan.tolist():
        assert w * rows <= 16384
        for r in range(rows):
            for col in range(w):
                assert src + r * sp + col not in got
                got[src + r * sp + col] = dst + r * dp + col
    want = {src + r * sp + col: dst + r * dp + col
            for src, dst, sp, dp, w, rows in copies for r in range(rows) for col in range(w)}
    assert got == want


def test_plan_refuses_a_piece_size_that_breaks_vector_alignment():
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu.plan_copies([(0, 0, 0, 0, 64, 1)], piece_bytes=1000)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for the GPU")
def test_kernels_compile_for_hopper(tmp_path):
    out = tmp_path / "kernels.ptx"
    subprocess.run(["nvcc", "--ptx", "-arch=sm_90", gpu.KERNELS_PATH, "-o", str(out)], check=True,
                   capture_output=True, env={**os.environ})
    ptx = out.read_text()
    for name in ("tierd_copy2d", "tierd_xxh3_lanes", "tierd_xxh3_merge"):
        assert f".entry {name}" in ptx


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_kernels_on_the_gpu_agree_with_the_cpu():
    import torch

    from tierd.tiers.ioqueue import IOClass

    kernels = gpu.Kernels(0)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device="cuda")
    pages = [(i * 1_000_000, n) for i, n in enumerate([241, 1024, 1025, 65536 + 7, 917_504, 917_504 + 64])]
    got = kernels.checksums([(src.data_ptr() + off, n) for off, n in pages])
    host = src.cpu().numpy()
    assert got.tolist() == [xxhash.xxh3_64_intdigest(host[off : off + n]) for off, n in pages]

    dst = torch.zeros_like(src)
    entries = [(0, 65536, 4096, 1024, 512, 9), (200_000, 300_000, 0, 0, 3_000_000, 1),
               (1, 8_000_001, 1000, 3000, 53, 7)]
    want = np.zeros_like(host)
    for so, do, sp, dp, w, r in entries:
        for i in range(r):
            want[do + i * dp : do + i * dp + w] = host[so + i * sp : so + i * sp + w]
    kernels.copy([(src.data_ptr() + so, dst.data_ptr() + do, sp, dp, w, r) for so, do, sp, dp, w, r in entries],
                 IOClass.DEMAND)
    assert np.array_equal(dst.cpu().numpy(), want) and kernels.launches == 3
