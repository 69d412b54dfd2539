"""Restoring a snapshot of several hundred MB from disk never holds a second
full copy: peak RSS, measured in a fresh process, grows by the bounce
buffers, not by the snapshot."""

import json
import os
import subprocess
import sys

import pytest

MiB = 1 << 20
SIZE = 384 * MiB
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(*args) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.core.peak_child", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_on_disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("peak")
    child(root, "make", SIZE)
    return root


@pytest.mark.slow
def test_restore_from_disk_holds_no_second_copy(big_on_disk):
    report = child(big_on_disk, "restore", SIZE)
    # two 64 MiB bounce windows and interpreter noise, against a 384 MiB snapshot
    assert report["delta"] < 160 * MiB, report
    assert report["recovery_delta"] < 64 * MiB, report


@pytest.mark.slow
def test_get_from_disk_streams(big_on_disk):
    report = child(big_on_disk, "get", SIZE)
    assert report["delta"] < 160 * MiB, report
