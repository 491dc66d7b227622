"""Chunked-prefill attention over a paged KV history (Triton).

One chunk of new queries per sequence attends causally to the sequence's whole
history in the paged cache plus the chunk itself (whose K/V the engine has
already written into the cache). FlashAttention-2 style: one program per
(query block, sequence, query head), online softmax in fp32, exact.

Twin: :func:`kernels.reference.chunked_prefill_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels._triton_common import (
    ATTN_DTYPES,
    cast,
    check_head_dim,
    check_index,
    check_out,
    check_paged_cache,
    interpret_flags,
    mma,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, pos_m, n0, kv_end,
    k_head_ptr, v_head_ptr, bt_row_ptr,
    stride_kp, stride_ks, stride_vp, stride_vs, stride_btp,
    qk_scale,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``n0 .. n0+BLOCK_N-1`` (absolute positions).

    ``acc``: ``[BLOCK_M, HEAD_DIM]`` fp32; ``l_i``/``m_i``: ``[BLOCK_M]`` fp32
    (sum and running max, log2 domain); ``q``: ``[BLOCK_M, HEAD_DIM]``;
    ``pos_m``: ``[BLOCK_M]`` absolute query positions.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_seq = offs_n < kv_end
        page = tl.load(bt_row_ptr + (offs_n // PAGE_SIZE) * stride_btp, mask=in_seq, other=0)
    else:
        page = tl.load(bt_row_ptr + (offs_n // PAGE_SIZE) * stride_btp)
    # NOTE: int64 page offsets: a real cache holds more than 2**31 elements.
    page = page.to(tl.int64)
    slot = offs_n % PAGE_SIZE
    kt_ptrs = k_head_ptr + page[None, :] * stride_kp + slot[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = v_head_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        kt = tl.load(kt_ptrs, mask=in_seq[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
    else:
        kt = tl.load(kt_ptrs)
    qk = mma(q, kt, INTERPRET, PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (offs_n[None, :] <= pos_m[:, None]) & in_seq[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + mma(cast(p, v.dtype, INTERPRET), v, INTERPRET, PRECISION)
    return acc, l_i, m_new


@triton.jit
def _chunked_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, ctx_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb, stride_btp,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # NOTE: launch the last (longest, causal) query blocks first: fewer idle SMs at the tail.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    kvh = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    # NOTE: queries sit at absolute positions ctx + t. Masking in chunk-local
    # coordinates, or iterating over the chunk's own keys only, drops the history.
    pos_m = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh
    bt_row_ptr = bt_ptr + b * stride_btb
    # Keys below the block's first query are visible to all its rows: no mask.
    # Every row of the first masked tile sees key `full_end`, so m_i is finite
    # after it and fully masked later tiles contribute exp2(-inf) = 0.
    full_end = ((ctx + m_block * BLOCK_M) // BLOCK_N) * BLOCK_N
    kv_end = ctx + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos_m, n0, kv_end, k_head_ptr, v_head_ptr, bt_row_ptr,
            stride_kp, stride_ks, stride_vp, stride_vs, stride_btp, qk_scale,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, False, INTERPRET, PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos_m, n0, kv_end, k_head_ptr, v_head_ptr, bt_row_ptr,
            stride_kp, stride_ks, stride_vp, stride_vs, stride_btp, qk_scale,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, True, INTERPRET, PRECISION,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        cast(acc, out_ptr.dtype.element_ty, INTERPRET),
        mask=row_ok[:, None],
    )


def _launch_config(head_dim: int, dtype: torch.dtype, device: torch.device, max_q_len: int) -> dict[str, int]:
    if device.type == "cpu":
        # NOTE: interpreter: small tiles exercise the multi-tile paths at test shapes.
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    measured = tuning.lookup("prefill", device, tuning.variant(head_dim, dtype, long_chunks=max_q_len > 64))
    if measured is not None:  # kernels/configs/<this device>.json (bench/kernels_bench.py --sweep)
        return measured
    # NOTE: every built-in tile compiles for sm_90 without register spills
    # (tests/kernels/sm90_compile.py checks the cubins' local memory).
    if dtype == torch.float32:
        # fp32 ("ieee") dots run on CUDA cores with both operands in registers: a 64x32
        # tile at D=128 spills 7 KiB per thread to local memory.
        if head_dim <= 128:
            return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    # FA2 tiles for Hopper: 128x64, 8 warps for D=128, 3 cp.async stages of K/V:
    # ~97 KiB of shared memory. D=256 halves the key tile (a 64-wide one spills).
    block_m = 64 if max_q_len <= 64 else 128
    block_n = 64 if head_dim <= 128 else 32
    num_warps = 8 if head_dim >= 128 and block_m == 128 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 3}


def chunked_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Chunked-prefill attention; see the twin in ``kernels.reference`` for the semantics.

    Args:
        q: ``[total_q_tokens, H, D]`` fp16/bf16/fp32, any strides.
        k_cache: ``[num_pages, page_size, KVH, D]``, contiguous last dim.
        v_cache: ``[num_pages, page_size, KVH, D]``, contiguous last dim.
        block_tables: ``[B, max_pages]`` int32, covering ``context_lens[b] + q_len[b]``.
        cu_q_lens: ``[B + 1]`` int32 cumulative query counts.
        context_lens: ``[B]`` int32.
        scale: softmax scale.
        out: optional ``[total_q_tokens, H, D]`` buffer of ``q.dtype``, any strides.
        max_q_len: the longest chunk (must not be less); pass it to avoid a
            device-to-host sync.
        block_m: query tile override (power of two >= 16).
        block_n: key tile override (power of two >= 16).
        config: the whole launch config (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
            ``num_stages``) instead of the device's (the tuning sweep).

    Returns:
        ``[total_q_tokens, H, D]``, ``out`` if given.
    """
    assert q.dim() == 3, f"q must be [total_q_tokens, H, D], got {tuple(q.shape)}"
    assert q.dtype in ATTN_DTYPES, f"unsupported dtype {q.dtype}"
    total_q, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    check_paged_cache(k_cache, v_cache, q.dtype, q.device)
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"H={num_heads} is not a multiple of KVH={num_kv_heads}"
    batch = context_lens.shape[0]
    check_index("context_lens", context_lens, (batch,), q.device)
    check_index("cu_q_lens", cu_q_lens, (batch + 1,), q.device)
    assert block_tables.dim() == 2, f"block_tables must be [B, max_pages], got {tuple(block_tables.shape)}"
    check_index("block_tables", block_tables, (batch, block_tables.shape[1]), q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_out(out, q)
    if total_q == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max().item())

    cfg = dict(config) if config is not None else _launch_config(head_dim, q.dtype, q.device, max_q_len)
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    grid = (triton.cdiv(max_q_len, cfg["BLOCK_M"]), batch, num_heads)
    _chunked_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        **cfg, **interpret_flags(q.dtype, q.device),
    )  # fmt: skip
    return out


def prefill_flops(cu_q_lens: list[int], context_lens: list[int], num_heads: int, head_dim: int) -> int:
    """FLOPs of the two matmuls (causal part only), for throughput figures."""
    total = 0
    for b, ctx in enumerate(context_lens):
        q_len = cu_q_lens[b + 1] - cu_q_lens[b]
        visible = q_len * ctx + q_len * (q_len + 1) // 2  # sum over queries of keys seen
        total += 4 * num_heads * head_dim * visible
    return total


__all__ = ["chunked_prefill_attention", "prefill_flops"]
