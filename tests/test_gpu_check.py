"""bench/gpu_check.py runs its whole flow on the CPU (the device tier emulated
in host memory), so the script a GPU machine runs is known to work."""

import json
import subprocess
import sys

import pytest

from tierd.testing import ROOT


def test_the_gpu_check_runs_its_steps_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tokens", "1000", "--heads", "1",
                          "--head-dim", "64", "--repeat", "1", "--json", str(tmp_path / "g.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    restores = [r for r in rows if r[0].startswith("restore from")]
    assert [r[0] for r in restores] == [f"restore from {t}, {n}" for t in ("device", "host", "disk")
                                        for n in ("contiguous", "4 runs")]
    assert all("bytes ok" in r[3] for r in restores)
    # one copy per run per layer and K/V: 56 into a contiguous table, 224 into 4 runs
    assert [r[3].split("; ")[1] for r in restores[:4]] == ["56 copies", "224 copies"] * 2
    assert out.stdout.rstrip().splitlines()[-1].startswith("| restore from disk, 4 runs |")


def test_without_a_gpu_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    out = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "no CUDA device here" in out.stdout
