"""Triton attention kernels (interpreter on CPU) against their twins, FlashAttention's error rule.

Error rule: max|kernel - ref_fp32| <= 2 * max|ref_lowp - ref_fp32| + 1e-6, where
ref_fp32 is the twin computed in fp32 from the same low-precision inputs (fp64
for fp32 inputs) and ref_lowp the twin computed in the inputs' own dtype.
Caches are poisoned with NaN wherever a kernel must not read, pages shuffled.
For fp32 inputs (gold in fp64) the 1e-6 floor dominates: the kernels' exp2
softmax lands ~3 ulp from fp64, torch's ~1-2 ulp.
"""

import itertools

import pytest
import torch

from kernels import reference as ref
from kernels.testing import check_against_twin, make_paged_kv

pytest.importorskip("triton")
from kernels.decode_attention import paged_decode_attention  # noqa: E402
from kernels.prefill_attention import chunked_prefill_attention  # noqa: E402

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _new_q(total, heads, head_dim, dtype, contiguous, seed):
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    # [H, T, D] transposed: strides (D, T*D, 1), as a q sliced out of a head-major buffer.
    return torch.randn(heads, total, head_dim, generator=gen).to(dtype).transpose(0, 1)


def _new_out(total, heads, head_dim, dtype, mode):
    if mode is None:
        return None
    buf = torch.full((total, heads, head_dim), float("nan"), dtype=dtype)
    if mode == "strided":
        buf = torch.full((heads, total, head_dim), float("nan"), dtype=dtype).transpose(0, 1)
    return buf


# Ragged (context, chunk) sets: chunks of 1, chunks and contexts off the page grid,
# a chunk that starts mid-page, long histories next to short ones.
RAGGED = [
    [(0, 1), (0, 37), (20, 13)],
    [(45, 17), (3, 1), (64, 32)],
    [(31, 33), (0, 50)],
    [(100, 7), (1, 1), (33, 40)],
]
OUT_MODES = [None, "dense", "strided"]

# (H, KVH, D, page_size, dtype, [(context, chunk)...], q_contiguous, out, tiles)
# Full product of page size x head dim x GQA ratio x dtype; the other axes rotate.
PREFILL_CASES = [
    (8, 8 // ratio, head_dim, page_size, dtype, RAGGED[i % 4], i % 2 == 0, OUT_MODES[i % 3], {})
    for i, (page_size, head_dim, ratio, dtype) in enumerate(
        itertools.product((16, 32), (64, 128), (1, 4, 8), (F16, BF16))
    )
] + [
    (4, 1, 64, 16, F32, [(17, 20), (0, 3)], False, None, {}),
    # an empty chunk in the batch; 32-wide tiles spanning two 16-token pages
    (4, 4, 64, 16, BF16, [(16, 16), (0, 32), (10, 5), (7, 0), (0, 9)], True, None, {"block_m": 32, "block_n": 32}),
    # the GPU's 64-wide tiles
    (8, 2, 64, 32, F16, [(50, 30), (0, 70)], True, "dense", {"block_m": 64, "block_n": 64}),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-ps{c[3]}-{str(c[4])[6:]}")
def test_chunked_prefill_matches_reference(case):
    num_heads, num_kv_heads, head_dim, page_size, dtype, seqs, contiguous, out_mode, tiles = case
    paged = make_paged_kv([c + n for c, n in seqs], num_kv_heads, head_dim, page_size, dtype, seed=len(seqs))
    cu = torch.tensor([0] + [sum(n for _, n in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    total = int(cu[-1])
    q = _new_q(total, num_heads, head_dim, dtype, contiguous, seed=head_dim)
    out = _new_out(total, num_heads, head_dim, dtype, out_mode)
    args = (paged.block_tables, cu, ctx, head_dim**-0.5)
    result = chunked_prefill_attention(q, paged.k_cache, paged.v_cache, *args, out, **tiles)
    if out is not None:
        assert result is out
    check_against_twin(result, ref.chunked_prefill_attention, q, paged.k_cache, paged.v_cache, *args)


@pytest.mark.parametrize("dtype,chunks", [(BF16, [16, 16, 13]), (F16, [7, 30, 1, 7])])
def test_chunked_prefill_over_chunks_equals_one_shot(dtype, chunks):
    """Prefill chunk by chunk (each chunk seeing only what is written so far) == one causal pass."""
    num_heads, num_kv_heads, head_dim, page_size = 8, 2, 64, 16
    prompt_len = sum(chunks)
    paged = make_paged_kv([prompt_len], num_kv_heads, head_dim, page_size, dtype, seed=3)
    q = _new_q(prompt_len, num_heads, head_dim, dtype, True, seed=4)
    scale = head_dim**-0.5
    one_shot_args = (paged.block_tables, torch.tensor([0, prompt_len], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), scale)
    pieces, start = [], 0
    for n in chunks:
        # The cache as it is when chunk [start, start+n) runs: later tokens not yet written.
        k, v = paged.k_cache.clone(), paged.v_cache.clone()
        for pos in range(start + n, prompt_len):
            page = paged.block_tables[0, pos // page_size]
            k[page, pos % page_size] = float("nan")
            v[page, pos % page_size] = float("nan")
        cu = torch.tensor([0, n], dtype=torch.int32)
        ctx = torch.tensor([start], dtype=torch.int32)
        pieces.append(chunked_prefill_attention(q[start : start + n], k, v, paged.block_tables, cu, ctx, scale))
        start += n
    check_against_twin(torch.cat(pieces), ref.chunked_prefill_attention, q, paged.k_cache, paged.v_cache,
                       *one_shot_args)


SEQ_LENS = [[1, 17, 40], [33, 1, 64, 90], [70, 5], [100, 31, 1], [48, 16, 1, 47]]
SPLITS = [None, 1, 3, 8]  # 8 slices leave some empty for the short sequences

# (H, KVH, D, page_size, dtype, seq_lens, num_splits, q_contiguous, out)
DECODE_CASES = [
    (8, 8 // ratio, head_dim, page_size, dtype, SEQ_LENS[i % 5], SPLITS[i % 4], i % 2 == 1, OUT_MODES[i % 3])
    for i, (page_size, head_dim, ratio, dtype) in enumerate(
        itertools.product((16, 32), (64, 128), (1, 4, 8), (F16, BF16))
    )
] + [
    (4, 1, 64, 32, F32, [45, 2], 2, False, None),
    (32, 2, 64, 16, BF16, [48, 16, 1, 47], 4, True, None),  # GQA 16
    (8, 2, 64, 16, F16, [0, 30, 0], 1, True, "dense"),  # seq_len 0 = batch padding: zeros
    (8, 2, 64, 16, F16, [0, 30, 0], 3, True, "dense"),
]


@pytest.mark.parametrize(
    "case", DECODE_CASES, ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-ps{c[3]}-{str(c[4])[6:]}-s{c[6]}"
)
def test_paged_decode_matches_reference(case):
    num_heads, num_kv_heads, head_dim, page_size, dtype, lens, num_splits, contiguous, out_mode = case
    paged = make_paged_kv(lens, num_kv_heads, head_dim, page_size, dtype, seed=len(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = _new_q(len(lens), num_heads, head_dim, dtype, contiguous, seed=head_dim)
    out = _new_out(len(lens), num_heads, head_dim, dtype, out_mode)
    args = (paged.block_tables, seq_lens, head_dim**-0.5)
    result = paged_decode_attention(q, paged.k_cache, paged.v_cache, *args, out, num_splits=num_splits)
    if out is not None:
        assert result is out
    check_against_twin(result, ref.paged_decode_attention, q, paged.k_cache, paged.v_cache, *args)


def test_decode_slices_each_sequence_by_its_own_length_in_a_wide_table():
    """A block table much wider than the sequences (a CUDA graph's, sized for the longest
    sequence the engine allows): every sequence still spreads over all the slices."""
    lens = [3, 40, 0, 97]
    paged = make_paged_kv(lens, 2, 64, 16, BF16, seed=9)
    spare = int(paged.block_tables[2, 0])  # the empty sequence's row: the poisoned padding page
    wide = torch.full((len(lens), 64), spare, dtype=torch.int32)  # room for 1,024 keys
    wide[:, : paged.block_tables.shape[1]] = paged.block_tables
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = _new_q(len(lens), 8, 64, BF16, True, seed=2)
    for splits in (1, 5, 16):
        out = paged_decode_attention(q, paged.k_cache, paged.v_cache, wide, seq_lens, 0.125, num_splits=splits)
        check_against_twin(out, ref.paged_decode_attention, q, paged.k_cache, paged.v_cache, paged.block_tables,
                           seq_lens, 0.125)


def test_occupancy_splits_fill_the_device_in_whole_waves():
    from kernels.decode_attention import occupancy_splits

    # An H200: 132 SMs x 4 resident programs; 8 KV heads; 4k keys (<= 32 slices of two 64-key tiles).
    got = {b: occupancy_splits(b * 8, 528, 32) for b in (1, 2, 4, 8, 16, 32, 64)}
    assert got == {1: 28, 2: 28, 4: 14, 8: 7, 16: 4, 32: 2, 64: 1}
    for b, s in got.items():
        assert s == 1 or b * 8 * s <= 528  # split grids stay within one wave here
    assert occupancy_splits(8, 264, 1) == 1  # a short table: no room to split
    assert occupancy_splits(1, 4, 64) == 4  # one program per slot


def test_launchers_reject_bad_inputs():
    paged = make_paged_kv([20], 2, 64, 16, F16)
    q = torch.randn(1, 4, 64, dtype=F16)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables.long(), seq_lens, 0.1)
    with pytest.raises(AssertionError, match="multiple of KVH"):
        paged_decode_attention(torch.randn(1, 3, 64, dtype=F16), paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, 0.1)
    with pytest.raises(AssertionError, match="dtype"):
        paged_decode_attention(q.float(), paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, 0.1)
    with pytest.raises(AssertionError, match="head_dim"):
        bad = make_paged_kv([20], 2, 48, 16, F16)
        paged_decode_attention(torch.randn(1, 4, 48, dtype=F16), bad.k_cache, bad.v_cache, bad.block_tables, seq_lens, 0.1)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="out"):
        chunked_prefill_attention(
            q, paged.k_cache, paged.v_cache, paged.block_tables, cu, seq_lens - 1, 0.1, torch.empty(1, 4, 64)
        )
