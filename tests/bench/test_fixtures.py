"""The benchmarks build some of their fixtures straight into tierd's formats;
these keep them in step with the code (a schema change breaks them here, not
in the middle of a benchmark run)."""

import os

from bench.index import build_data_dir
from tierd.core import tokens
from tierd.core.index import DiskIndex


def test_the_index_fixture_recovers_whole(tmp_path):
    data_dir = str(tmp_path / "data")
    build_data_dir(data_dir, sessions=5, pages=3)
    recs, problems = DiskIndex(os.path.join(data_dir, "index.db")).recover()
    assert problems == [] and len(recs) == 5
    assert all(r.row.num_pages == 3 and tokens.known(r.token_hashes) for r in recs)
