"""Launch configurations measured per device, kept beside the kernels.

``bench/kernels_bench.py --sweep`` times a small grid of tile configurations of each
attention kernel on the GPU it runs on and writes the fastest as
``configs/<device name>.json`` (the way vLLM keeps its fused-MoE configs). The
launchers look their device up here first and fall back to their built-in table.
The file is data, not code: a GPU session runs the sweep, reads its table and
commits the file.

    {"prefill": {"D128-bfloat16-large": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
     "decode": {"D128-bfloat16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}}
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
KEYS = {"prefill": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), "decode": ("BLOCK_N", "num_warps", "num_stages")}
# NOTE: the sweep's candidates (D=128, bf16), each compiled for sm_90 without register spills
# (tests/kernels/sm90_compile.py checks them all). Left out after compiling (Triton 3.6 and 3.9):
# 128-row prefill tiles on 4 warps (they spill 250-800 bytes a thread) and 4 stages (the same
# cubin as 3: K/V behind a page-table load get two buffers either way).
GRIDS = {
    "prefill": [dict(BLOCK_M=128, BLOCK_N=bn, num_warps=8, num_stages=s) for bn in (64, 128) for s in (2, 3)]
    + [dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)],
    "decode": [dict(BLOCK_N=bn, num_warps=4, num_stages=s) for bn in (32, 64, 128) for s in (2, 3)]
    + [dict(BLOCK_N=64, num_warps=8, num_stages=3)],
}
"""What ``bench/kernels_bench.py --sweep`` times on a GPU (and writes the fastest of to ``configs/``)."""


def device_key(device: torch.device) -> str:
    """The file name (no suffix) of ``device``'s configs: its name, e.g. ``NVIDIA_H200``."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


def variant(head_dim: int, dtype: torch.dtype, *, long_chunks: bool | None = None) -> str:
    """The shape class a config is chosen for: head dim, dtype and, for prefill, chunks of more
    than 64 queries (``large``) or not (``small``)."""
    name = f"D{head_dim}-{str(dtype).removeprefix('torch.')}"
    return name if long_chunks is None else f"{name}-{'large' if long_chunks else 'small'}"


@functools.cache
def _load(key: str) -> dict:
    path = CONFIG_DIR / f"{key}.json"
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    for kernel, entries in table.items():
        want = KEYS.get(kernel)
        for name, cfg in entries.items():
            if want is None or set(cfg) != set(want) or not all(isinstance(v, int) and v > 0 for v in cfg.values()):
                raise ValueError(f"{path}: bad {kernel} config {name}: {cfg} (want positive ints for {want})")
    return table


def lookup(kernel: str, device: torch.device, name: str) -> dict[str, int] | None:
    """The measured config of ``kernel`` for shape class ``name`` on ``device``, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    cfg = _load(device_key(device)).get(kernel, {}).get(name)
    return dict(cfg) if cfg else None


__all__ = ["CONFIG_DIR", "GRIDS", "KEYS", "device_key", "lookup", "variant"]
