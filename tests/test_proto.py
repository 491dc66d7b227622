"""The committed gRPC stubs are exactly what `make proto` generates from the .proto files."""

import glob
import os
import shutil
import subprocess
import sys

from tests.helpers import ROOT


def test_committed_stubs_are_fresh(tmp_path):
    protos = sorted(glob.glob(os.path.join(ROOT, "proto/crescent/v1/*.proto")))
    assert protos
    for p in protos:
        dst = tmp_path / os.path.relpath(p, ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    rel = [os.path.relpath(p, ROOT) for p in protos]
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *rel], cwd=tmp_path, check=True, timeout=120)
    generated = sorted(glob.glob(str(tmp_path / "proto/crescent/v1/*_pb2*.py*")))
    assert generated
    for g in generated:
        committed = os.path.join(ROOT, os.path.relpath(g, tmp_path))
        assert os.path.exists(committed), f"{committed} is not committed: run `make proto`"
        with open(g, "rb") as a, open(committed, "rb") as b:
            assert a.read() == b.read(), f"{committed} is stale: run `make proto`"
