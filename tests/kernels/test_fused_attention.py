"""The engine's CPU attention (``reference.fused_causal_attention``, torch's fused SDPA) against the
dense twins, by FlashAttention's error rule (tests/kernels/test_kernels_attention.py says it)."""

import itertools

import pytest
import torch

from kernels import dispatch
from kernels import reference as ref
from kernels.testing import check_against_twin, make_paged_kv

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
RAGGED = [
    [(0, 1), (0, 37), (20, 13)],
    [(45, 17), (3, 1), (64, 32)],
    [(31, 33), (0, 50), (7, 0)],
    [(100, 7), (1, 1), (33, 40)],
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page_size", "dtype", "seqs"), [
    (8, 8 // ratio, head_dim, page_size, dtype, RAGGED[i % 4])
    for i, (ratio, head_dim, page_size, dtype) in enumerate(itertools.product((1, 4), (16, 64), (16, 32),
                                                                              (F32, BF16, F16)))
])
def test_chunked_prefill_fused_matches_the_dense_twin(heads, kv_heads, head_dim, page_size, dtype, seqs):
    paged = make_paged_kv([c + n for c, n in seqs], kv_heads, head_dim, page_size, dtype)
    gen = torch.Generator().manual_seed(len(seqs) * head_dim + page_size)
    total = sum(n for _, n in seqs)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in seqs)], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    args = (paged.block_tables, cu, ctx, head_dim**-0.5)
    out = ref.chunked_prefill_attention(q, paged.k_cache, paged.v_cache, *args, fused=True)
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    check_against_twin(out, ref.chunked_prefill_attention, q, paged.k_cache, paged.v_cache, *args)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_paged_decode_fused_matches_the_dense_twin(dtype, kv_heads):
    seq_lens = [1, 15, 16, 17, 130, 0]  # 0: batch padding, zeros
    paged = make_paged_kv([max(n, 1) for n in seq_lens], kv_heads, 32, 16, dtype)
    q = torch.randn(len(seq_lens), 8, 32, generator=torch.Generator().manual_seed(kv_heads)).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, lens, 0.17, fused=True)
    assert out[-1].eq(0).all()
    check_against_twin(out, ref.paged_decode_attention, q, paged.k_cache, paged.v_cache, paged.block_tables, lens, 0.17)


def test_the_engine_on_cpu_attends_through_the_fused_path(monkeypatch):
    """What dispatch runs for CPU tensors under the torch backend is the fused path, and a decode
    token equals the same query as a one-token prefill chunk."""
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    calls = []
    fused = ref.fused_causal_attention
    monkeypatch.setattr(ref, "fused_causal_attention", lambda *a: calls.append(a[0].shape) or fused(*a))
    paged = make_paged_kv([5, 20], 2, 32, 16, F32)
    q = torch.randn(2, 4, 32)
    seq_lens = torch.tensor([5, 20], dtype=torch.int32)
    decode = dispatch.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, 0.2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = dispatch.chunked_prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, cu,
                                                 seq_lens - 1, 0.2)
    assert len(calls) == 4
    torch.testing.assert_close(prefill, decode, rtol=0, atol=0)
