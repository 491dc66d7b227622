"""Paged decode attention with split-K (flash-decoding), Triton.

Each sequence has one new query token per head. The key range of a sequence is
cut into ``num_splits`` slices; one program per (sequence, KV head, slice)
streams its slice of K/V once for all the query heads of the GQA group and
writes a partial ``(max, sum, acc)``; a second kernel combines the slices.
With one slice the first kernel writes the output directly.

Twin: :func:`kernels.reference.paged_decode_attention`.
"""

from __future__ import annotations

import functools
import math

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
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per slice of a sequence of ``seq_len``: whole key tiles, at least one.

    NOTE: from the sequence's own length, not the block table's width: every
    sequence spreads over all its slices, so the split count can be chosen once
    for a padded table (a CUDA graph captured for the longest sequence) and a
    short sequence still fills the grid.
    """
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


# NOTE: the split count is a run-time argument (unspecialized), not a constexpr: it follows the
# batch size, so as a constexpr every CUDA-graph bucket and every context length that changed it
# compiled the kernel (and the reduce) anew, seconds each at an engine's start. SPLIT says which
# epilogue: the output itself (one slice) or the partials the reduce combines.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, mid_acc_ptr, mid_m_ptr, mid_l_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb, stride_btp,
    stride_ob, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    # NOTE: the GQA group's query heads form the M side of the dot, so K/V are
    # read once per KV head (decode is bandwidth-bound). tl.dot needs M >= 16,
    # hence BLOCK_H >= 16 with masked padding rows.
    offs_h = tl.arange(0, BLOCK_H)
    head_ok = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if start >= seq_len:
        if not SPLIT:  # seq_len == 0 (batch padding): zeros, as the twin writes
            tl.store(out_ptrs, tl.zeros([BLOCK_H, HEAD_DIM], out_ptr.dtype.element_ty), mask=head_ok[:, None])
        return  # the reduce kernel counts only the non-empty slices
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_ok[:, None],
        other=0.0,
    )  # [BLOCK_H, HEAD_DIM]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh
    bt_row_ptr = bt_ptr + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = offs_n < end
        page = tl.load(bt_row_ptr + (offs_n // PAGE_SIZE) * stride_btp, mask=in_seq, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        kt = tl.load(
            k_head_ptr + page[None, :] * stride_kp + slot[None, :] * stride_ks + offs_d[:, None],
            mask=in_seq[None, :],
            other=0.0,
        )  # [HEAD_DIM, BLOCK_N]
        qk = mma(q, kt, INTERPRET, PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        qk = tl.where(in_seq[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :],
            mask=in_seq[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + mma(cast(p, v.dtype, INTERPRET), v, INTERPRET, PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptrs, cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=head_ok[:, None])
    else:
        # mid_m / mid_l: [B, H, num_splits]; mid_acc: [B, H, num_splits, HEAD_DIM], fp32.
        row = (b * NUM_HEADS + heads) * num_splits + split
        tl.store(mid_m_ptr + row, m_i, mask=head_ok)
        tl.store(mid_l_ptr + row, l_i, mask=head_ok)
        tl.store(mid_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    mid_acc_ptr, mid_m_ptr, mid_l_ptr, seq_lens_ptr, out_ptr,
    stride_ob, stride_oh, stride_od, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    num_valid = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    valid = offs_s < num_valid
    offs_d = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * num_splits + offs_s
    m = tl.load(mid_m_ptr + row, mask=valid, other=float("-inf"))  # [BLOCK_S]
    l = tl.load(mid_l_ptr + row, mask=valid, other=0.0)  # noqa: E741
    acc = tl.load(mid_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
    m_max = tl.where(num_valid > 0, tl.max(m, 0), 0.0)
    w = tl.exp2(m - m_max)  # 0 for the empty slices
    den = tl.where(num_valid > 0, tl.sum(l * w, 0), 1.0)
    out = tl.sum(acc * w[:, None], 0) / den  # [HEAD_DIM]; seq_len 0: no slice, w == 0, zeros
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, cast(out, out_ptr.dtype.element_ty, INTERPRET))


def occupancy_splits(work: int, slots: int, max_splits: int) -> int:
    """Key slices per sequence so that ``work * splits`` programs fill the device in whole waves.

    FlashAttention's ``num_splits`` heuristic over program slots (SMs x programs resident
    per SM): a grid that already fills 80% of the slots is not split (a split only adds the
    partials' write-back and the reduce); otherwise take the fewest splits whose wave
    efficiency (``waves / ceil(waves)``) is within 85% of the best any split count up to
    ``max_splits`` reaches.

    Args:
        work: programs without splitting (sequences x KV heads).
        slots: programs the device runs at once.
        max_splits: most slices worth making.
    """
    if work >= 0.8 * slots or max_splits <= 1:
        return 1

    def efficiency(s: int) -> float:
        waves = work * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if efficiency(s) >= 0.85 * best)


# NOTE: a split program is 4 warps and ~39 KiB of shared memory on sm_90 (sm90_compile.py):
# five fit an SM's 228 KiB, four leave room for the reduce and the next step's kernels.
PROGRAMS_PER_SM = 4


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    if device.type == "cpu":
        return max(1, min(4, triton.cdiv(max_seq_len, 64)))
    # NOTE: at least two key tiles per slice, so each program overlaps two tiles' loads;
    # at most 64 slices, so the reduce's partials stay small next to the K/V stream.
    max_splits = max(1, min(64, max_seq_len // (2 * block_n)))
    # An H200 (132 SMs), 8 KV heads, 4k keys: batch 1 -> 28 slices, batch 8 -> 7, batch 16 -> 4,
    # batch 32 -> 2, batch 64 and up -> 1 (tests/kernels/test_kernels_attention.py).
    return occupancy_splits(batch * num_kv_heads, PROGRAMS_PER_SM * _sm_count(device), max_splits)


def _launch_config(dtype: torch.dtype, device: torch.device, head_dim: int = 128) -> dict[str, int]:
    if device.type == "cpu":
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    measured = tuning.lookup("decode", device, tuning.variant(head_dim, dtype))
    if measured is not None:  # kernels/configs/<this device>.json (bench/kernels_bench.py --sweep)
        return measured
    # NOTE: 64-token K/V tiles, 3 cp.async stages in flight per program: 48 KiB
    # of bf16 K/V, enough outstanding loads to saturate HBM on Hopper.
    # fp32 dots hold K/V tiles in registers: 32 keys at D=256 spill (sm90_compile.py).
    block_n = 64 if dtype != torch.float32 else 32 if head_dim <= 128 else 16
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Paged decode attention; see the twin in ``kernels.reference`` for the semantics.

    Args:
        q: ``[B, H, D]`` fp16/bf16/fp32, any strides.
        k_cache: ``[num_pages, page_size, KVH, D]``, contiguous last dim.
        v_cache: ``[num_pages, page_size, KVH, D]``, contiguous last dim.
        block_tables: ``[B, max_pages]`` int32.
        seq_lens: ``[B]`` int32, each in ``[0, max_pages * page_size]``; 0 (batch
            padding) yields zeros.
        scale: softmax scale.
        out: optional ``[B, H, D]`` buffer of ``q.dtype``, any strides.
        num_splits: key slices per sequence (split-K); chosen from the SM count
            and ``max_pages * page_size`` (no host sync) when None. Each sequence
            cuts its own ``seq_lens[b]`` keys into this many slices of whole tiles.
        block_n: key tile override (power of two >= 16).
        config: the whole launch config (``BLOCK_N``, ``num_warps``, ``num_stages``)
            instead of the device's (the tuning sweep).

    Returns:
        ``[B, H, D]``, ``out`` if given.
    """
    assert q.dim() == 3, f"q must be [B, H, D], got {tuple(q.shape)}"
    assert q.dtype in ATTN_DTYPES, f"unsupported dtype {q.dtype}"
    batch, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    check_paged_cache(k_cache, v_cache, q.dtype, q.device)
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"H={num_heads} is not a multiple of KVH={num_kv_heads}"
    check_index("seq_lens", seq_lens, (batch,), q.device)
    assert block_tables.dim() == 2, f"block_tables must be [B, max_pages], got {tuple(block_tables.shape)}"
    check_index("block_tables", block_tables, (batch, block_tables.shape[1]), q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_out(out, q)
    if batch == 0:
        return out

    cfg = dict(config) if config is not None else _launch_config(q.dtype, q.device, head_dim)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    block_n = cfg["BLOCK_N"]
    max_seq_len = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = _num_splits(batch, num_kv_heads, max_seq_len, block_n, q.device)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    group = num_heads // num_kv_heads

    if num_splits == 1:
        mid_acc = mid_m = mid_l = out  # unused
    else:
        # One allocation for the partials (acc, then max, then sum): fewer host calls per step.
        rows = batch * num_heads * num_splits
        mid = torch.empty(rows * (head_dim + 2), dtype=torch.float32, device=q.device)
        mid_acc, mid_m, mid_l = mid[: rows * head_dim], mid[rows * head_dim : -rows], mid[-rows:]
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_acc, mid_m, mid_l,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, SPLIT=num_splits > 1,
        **cfg, **interpret_flags(q.dtype, q.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            mid_acc, mid_m, mid_l, seq_lens, out,
            out.stride(0), out.stride(1), out.stride(2), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=block_n,
            INTERPRET=q.device.type == "cpu", num_warps=4,
        )  # fmt: skip
    return out


def decode_bytes(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """HBM bytes a decode step must move at least: K and V once, q in, out back."""
    kv = 2 * sum(seq_lens) * num_kv_heads * head_dim * elem_size
    return kv + 2 * len(seq_lens) * num_heads * head_dim * elem_size


__all__ = ["decode_bytes", "paged_decode_attention"]
