"""The committed generated code matches proto/ (regenerate with `make proto`)."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tierd.v1 import tierd_pb2, tierd_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"),
                          f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                          str(ROOT / "proto" / "tierd" / "v1" / "tierd.proto")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fresh = (tmp_path / "tierd" / "v1" / "tierd_pb2.py").read_text()
    # The serialized descriptor is the whole contract: messages, fields, services.
    start = fresh.index("AddSerializedFile(") + len("AddSerializedFile(")
    fresh_descriptor = ast.literal_eval(fresh[start : fresh.index(")\n", start)])
    assert fresh_descriptor == tierd_pb2.DESCRIPTOR.serialized_pb, "tierd/v1 is stale: run `make proto`"
    fresh_grpc = (tmp_path / "tierd" / "v1" / "tierd_pb2_grpc.py").read_text()
    committed_grpc = Path(tierd_pb2_grpc.__file__).read_text()
    methods = [m.name for m in tierd_pb2.DESCRIPTOR.services_by_name["Tierd"].methods]
    for m in methods:
        assert f"/tierd.v1.Tierd/{m}" in fresh_grpc and f"/tierd.v1.Tierd/{m}" in committed_grpc
    assert importlib.util.find_spec("tierd.v1.tierd_pb2") is not None
