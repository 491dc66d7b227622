"""Every kernel compiles for Hopper (sm_90) without a GPU: pipelined, tensor cores, 16-byte
accesses, no register spills, in the shared memory a block may have.

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
    from kernels.tuning import GRIDS

    assert len(lines) == 38 + len(GRIDS["prefill"]) + len(GRIDS["decode"]), result.stdout
    for name, stats in lines.items():
        if name.startswith(("_chunked_prefill_kernel", "_decode_split_kernel")):
            # NOTE: cp.async stages in the K/V loop: without them a load stalls every tile.
            assert int(stats["async_copies"]) > 0, f"{name}: K/V loop not software-pipelined"
        if name.startswith(("_kv_pages_kernel", "_kv_layer_kernel")):
            # NOTE: the cache base (and the landing kernel's source) comes from a pointer table;
            # without the alignment hint every access is a narrow scalar (a copy kernel at a
            # fraction of HBM speed, or of the bus's).
            assert int(stats["ld16"]) > 0 and int(stats["st16"]) > 0, f"{name}: not vectorized"
        # Hopper's most shared memory one block may ask for: 227 KiB.
        assert int(stats["shared"]) <= 227 * 1024, f"{name}: {stats['shared']} bytes of shared memory"
    for name, stats in lines.items():
        if name.startswith("_chunked_prefill_kernel bf16"):
            assert int(stats["wgmma"]) > 0, f"{name}: no wgmma"
    if lines["_kv_pages_kernel bf16-gather"]["stack"] == "NA":
        pytest.skip("this Triton wheel has no cuobjdump: register spills unchecked")
    # NOTE: a stack frame is spilled registers: every tile round-trips through local memory
    # (an fp32 prefill tile of 64x32 at D=128 spilled 7 KiB a thread). The sweep's candidates
    # too: a spilling one only costs the GPU run its time.
    spilled = {name: stats["stack"] for name, stats in lines.items() if stats["stack"] != "0"}
    assert not spilled, f"kernels spill registers at their launch configs (stack bytes): {spilled}"
