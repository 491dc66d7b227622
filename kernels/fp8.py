"""fp8 (e4m3) quantization of KV chunks for transfers, Triton.

One scale per (layer, K/V, head) over the chunk layout ``[L, 2, KVH, T, D]``:
``scale = amax / 448`` and ``q = rne(clamp(x / scale, -448, 448))``. Halves the
bytes of a bf16 chunk on the wire and in the store; the error is measured in
docs/kernels.md. Needs fp8 conversions in hardware (sm89+) on the GPU.

Twins: :func:`kernels.reference.quantize_kv_fp8`, :func:`kernels.reference.dequantize_kv_fp8`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import cast
from kernels.reference import FP8_DTYPE, FP8_MAX

_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_to_e4m3(y):
    """Rounds fp32 ``y`` in ``[-448, 448]`` to the nearest e4m3 value, ties to even.

    NOTE: the result is exactly representable, so the cast to fp8 that follows
    is exact. The hardware cast (cvt.rn.satfinite) would round the same way,
    but the interpreter's cast mis-rounds when rounding carries into the
    exponent (31.7 -> 16 instead of 32 on Triton 3.9; cf. triton-lang/triton#8322).
    Rounding here keeps CPU and GPU bit-identical to torch's RNE cast.
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2**-6 the e4m3 grid is the subnormal step 2**-9
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exp - 3)
    inv_ulp = ((3 - exp + 127) << 23).to(tl.float32, bitcast=True)
    # |y| * inv_ulp < 16: adding and removing 1.5 * 2**23 rounds it to an integer, ties to even.
    r = ((tl.abs(y) * inv_ulp + 12582912.0) - 12582912.0) * ulp
    # Put the sign back by its bit, so that tiny negatives round to -0 as in torch.
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, num_tokens,
    stride_xl, stride_xkv, stride_xh, stride_xt, stride_xd,
    stride_ql, stride_qkv, stride_qh, stride_qt, stride_qd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # = (layer * 2 + kv) * NUM_KV_HEADS + head = flat index into scales
    layer = pid // (2 * NUM_KV_HEADS)
    kv = (pid // NUM_KV_HEADS) % 2
    h = pid % NUM_KV_HEADS
    x_base = x_ptr + layer.to(tl.int64) * stride_xl + kv * stride_xkv + h * stride_xh
    q_base = q_ptr + layer.to(tl.int64) * stride_ql + kv * stride_qkv + h * stride_qh
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # Pass 1: the head's amax (the [T, D] slice is ~64 KiB, it stays in L2 for pass 2).
    amax = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for t0 in range(0, num_tokens, BLOCK_T):
        tok = t0 + offs_t
        mask = (tok[:, None] < num_tokens) & d_ok[None, :]
        x = tl.load(x_base + tok[:, None] * stride_xt + offs_d[None, :] * stride_xd, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    head_amax = tl.max(tl.max(amax, 1), 0)
    # NOTE: an all-zero head gets scale 1 (not 0) so that dequantizing is plain q * scale.
    scale = tl.where(head_amax > 0, tl.math.div_rn(head_amax, FP8_MAX), 1.0)
    tl.store(scale_ptr + pid, scale)

    # Pass 2: scale, saturate (e4m3fn has no inf; out-of-range would become NaN), round.
    for t0 in range(0, num_tokens, BLOCK_T):
        tok = t0 + offs_t
        mask = (tok[:, None] < num_tokens) & d_ok[None, :]
        x = tl.load(x_base + tok[:, None] * stride_xt + offs_d[None, :] * stride_xd, mask=mask, other=0.0)
        # NOTE: IEEE division (div_rn), as torch divides: bit-identical to the twin.
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX)
        y = _round_to_e4m3(y)
        tl.store(q_base + tok[:, None] * stride_qt + offs_d[None, :] * stride_qd, y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, num_tokens,
    stride_ql, stride_qkv, stride_qh, stride_qt, stride_qd,
    stride_ol, stride_okv, stride_oh, stride_ot, stride_od,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t_block = tl.program_id(1)
    layer = pid // (2 * NUM_KV_HEADS)
    kv = (pid // NUM_KV_HEADS) % 2
    h = pid % NUM_KV_HEADS
    scale = tl.load(scale_ptr + pid)
    tok = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (tok[:, None] < num_tokens) & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = (
        q_ptr + layer.to(tl.int64) * stride_ql + kv * stride_qkv + h * stride_qh
        + tok[:, None] * stride_qt + offs_d[None, :] * stride_qd
    )  # fmt: skip
    o_ptrs = (
        out_ptr + layer.to(tl.int64) * stride_ol + kv * stride_okv + h * stride_oh
        + tok[:, None] * stride_ot + offs_d[None, :] * stride_od
    )  # fmt: skip
    x = tl.load(q_ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(o_ptrs, cast(x, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _check_chunk(name: str, t: torch.Tensor) -> None:
    assert t.dim() == 5 and t.shape[1] == 2, f"{name} must be [L, 2, KVH, T, D], got {tuple(t.shape)}"


def _block_t(head_dim: int) -> int:
    # NOTE: ~4K elements per tile: 16 KiB of fp32 in flight per program.
    return max(1, 4096 // triton.next_power_of_2(head_dim))


def quantize_kv_fp8(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a chunk to e4m3 with per-(layer, K/V, head) scales.

    Args:
        chunk: ``[L, 2, KVH, T, D]`` fp16/bf16/fp32, any strides.

    Returns:
        ``(q, scales)``: ``q`` ``[L, 2, KVH, T, D]`` ``torch.float8_e4m3fn``
        (contiguous); ``scales`` ``[L, 2, KVH]`` float32.
    """
    _check_chunk("chunk", chunk)
    assert chunk.dtype in _IN_DTYPES, f"unsupported dtype {chunk.dtype}"
    num_layers, _, num_kv_heads, num_tokens, head_dim = chunk.shape
    q = torch.empty(chunk.shape, dtype=FP8_DTYPE, device=chunk.device)
    scales = torch.empty(num_layers, 2, num_kv_heads, dtype=torch.float32, device=chunk.device)
    if q.numel() == 0:
        return q, scales.fill_(1.0)
    block_d = triton.next_power_of_2(head_dim)
    _quantize_kernel[(num_layers * 2 * num_kv_heads,)](
        chunk, q, scales, num_tokens, *chunk.stride(), *q.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, FP8_MAX=FP8_MAX,
        BLOCK_T=_block_t(head_dim), BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return q, scales


def dequantize_kv_fp8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`: ``x = q * scale``.

    Args:
        q: ``[L, 2, KVH, T, D]`` ``torch.float8_e4m3fn``, any strides.
        scales: ``[L, 2, KVH]`` float32, contiguous.
        dtype: output dtype when ``out`` is None.
        out: optional ``[L, 2, KVH, T, D]`` buffer, any strides.

    Returns:
        ``[L, 2, KVH, T, D]``, ``out`` if given.
    """
    _check_chunk("q", q)
    assert q.dtype == FP8_DTYPE, f"q must be {FP8_DTYPE}, got {q.dtype}"
    num_layers, _, num_kv_heads, num_tokens, head_dim = q.shape
    assert tuple(scales.shape) == (num_layers, 2, num_kv_heads), f"scales must be [L, 2, KVH], got {tuple(scales.shape)}"
    assert scales.dtype == torch.float32 and scales.is_contiguous(), "scales must be contiguous float32"
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    assert out.shape == q.shape and out.dtype in _IN_DTYPES, f"bad out buffer {tuple(out.shape)} {out.dtype}"
    assert out.device == q.device == scales.device, "q, scales and out must share a device"
    if q.numel() == 0:
        return out
    block_t = _block_t(head_dim)
    _dequantize_kernel[(num_layers * 2 * num_kv_heads, triton.cdiv(num_tokens, block_t))](
        q, scales, out, num_tokens, *q.stride(), *out.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim), INTERPRET=q.device.type == "cpu", num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["dequantize_kv_fp8", "quantize_kv_fp8"]
