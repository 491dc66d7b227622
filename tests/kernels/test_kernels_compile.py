"""Every kernel compiles for Hopper (sm_90) without a GPU: pipelined, tensor cores, 16-byte accesses.

The interpreter runs the kernels' Python; this runs Triton's real compiler
(down to the cubin, with the ptxas bundled in the wheel) on the launchers' tile
configs, catching what only the compiler rejects. See sm90_compile.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_kernels_compile_for_sm90_pipelined():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = {" ".join(line.split()[:2]): dict(kv.split("=") for kv in line.split()[2:]) for line in result.stdout.splitlines()}
    assert len(lines) == 20, result.stdout
    for name, stats in lines.items():
        if name.startswith(("_chunked_prefill_kernel", "_decode_split_kernel")):
            # NOTE: cp.async stages in the K/V loop: without them a load stalls every tile.
            assert int(stats["async_copies"]) > 0, f"{name}: K/V loop not software-pipelined"
        if name.startswith(("_kv_pages_kernel", "_kv_layer_kernel")):
            # NOTE: the cache base (and the landing kernel's source) comes from a pointer table;
            # without the alignment hint every access is a narrow scalar (a copy kernel at a
            # fraction of HBM speed, or of the bus's).
            assert int(stats["ld16"]) > 0 and int(stats["st16"]) > 0, f"{name}: not vectorized"
    for variant in ("bf16-D64", "bf16-D128"):
        assert int(lines[f"_chunked_prefill_kernel {variant}"]["wgmma"]) > 0, f"prefill {variant}: no wgmma"
