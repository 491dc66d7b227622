"""Helpers shared by the Triton launchers: the one matmul primitive and input checks.

Imported only by the kernel modules, i.e. only when Triton is in use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def mma(a, b, INTERPRET: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` with fp32 accumulation (``a``: ``[M, K]``, ``b``: ``[K, N]``).

    NOTE: the Triton interpreter multiplies the raw bit patterns of bfloat16
    operands in ``tl.dot`` (triton-lang/triton#11584, "not supported yet"), so
    under INTERPRET the operands go to fp32 first. That is exact: a bf16/fp16
    value is an fp32 value, and tensor-core MMA also forms exact products and
    accumulates in fp32, so the CPU run checks the arithmetic the GPU does.
    """
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even as the GPU does.

    NOTE: the interpreter truncates fp32 -> bfloat16 (Triton 3.9; the GPU's
    cvt.rn rounds to nearest even), so under INTERPRET the rounding is done
    here on the bits and the cast that follows is exact. Compiled kernels take
    the plain cast: the branch is pruned at compile time.
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def interpret_flags(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Constexprs for :func:`mma` and :func:`cast` for inputs of ``dtype`` on ``device``."""
    return {
        # Triton runs on CPU tensors only in the interpreter.
        "INTERPRET": device.type == "cpu",
        # NOTE: fp32 inputs get IEEE products; the default TF32 would make fp32
        # results worse than the fp16 ones.
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """Asserts the invariants the attention kernels rely on.

    Args:
        k_cache: ``[num_pages, page_size, KVH, D]``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        dtype: the query dtype the caches must match.
        device: the query device the caches must live on.
    """
    assert k_cache.dim() == 4, f"k_cache must be [num_pages, page_size, KVH, D], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.dtype == v_cache.dtype == dtype, f"cache dtypes {k_cache.dtype}/{v_cache.dtype} != {dtype}"
    assert k_cache.device == v_cache.device == device, "caches and q must be on the same device"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a contiguous head_dim"


def check_head_dim(head_dim: int) -> None:
    """``tl.arange`` and ``tl.dot`` need a power of two of at least 16."""
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """Asserts an int32 index tensor of ``shape`` on ``device``."""
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    assert tuple(t.shape) == shape, f"{name} must be {shape}, got {tuple(t.shape)}"
    assert t.device == device, f"{name} must be on {device}, got {t.device}"


def check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    """Asserts an ``out=`` buffer matches ``like`` in shape, dtype and device."""
    assert out.shape == like.shape, f"out {tuple(out.shape)} != {tuple(like.shape)}"
    assert out.dtype == like.dtype, f"out dtype {out.dtype} != {like.dtype}"
    assert out.device == like.device, f"out device {out.device} != {like.device}"
