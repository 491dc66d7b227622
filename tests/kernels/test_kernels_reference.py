"""The PyTorch twins against dense naive attention, and their own invariants."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels.testing import dense_kv, make_paged_kv

hypothesis = pytest.importorskip("hypothesis")  # a dev dependency: the module skips without it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense SDPA with an explicit mask. q: [T, H, D]; k, v: [S, KVH, D] -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [T, S], True = attend
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
        v.repeat_interleave(group, dim=1).transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,page_size,seqs",
    [
        (4, 4, 16, [(0, 1), (0, 37), (20, 13)]),
        (8, 2, 32, [(45, 17), (3, 1), (7, 0)]),
        (8, 1, 16, [(31, 33)]),
    ],
)
def test_prefill_twin_matches_dense_sdpa(num_heads, num_kv_heads, page_size, seqs):
    head_dim, scale = 64, 0.125
    paged = make_paged_kv([c + n for c, n in seqs], num_kv_heads, head_dim, page_size, torch.float64)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, dtype=torch.float64)
    out = ref.chunked_prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, cu, ctx, scale)
    for b, (c, n) in enumerate(seqs):
        if n == 0:
            continue
        k, v = dense_kv(paged, b)
        want = _sdpa(q[cu[b] : cu[b + 1]], k, v, torch.arange(c, c + n), scale)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], want)


def test_decode_twin_matches_dense_sdpa_and_prefill_twin():
    num_heads, num_kv_heads, head_dim, page_size, scale = 8, 2, 64, 16, 0.1
    lens = [1, 16, 37, 64]
    paged = make_paged_kv(lens, num_kv_heads, head_dim, page_size, torch.float64)
    q = torch.randn(len(lens), num_heads, head_dim, dtype=torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, scale)
    for b, n in enumerate(lens):
        k, v = dense_kv(paged, b)
        torch.testing.assert_close(out[b : b + 1], _sdpa(q[b : b + 1], k, v, torch.tensor([n - 1]), scale))
    # Decode is prefill of a one-token chunk after seq_len - 1 tokens of context.
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    as_prefill = ref.chunked_prefill_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu, seq_lens - 1, scale
    )
    torch.testing.assert_close(out, as_prefill)


@settings(max_examples=25, deadline=None)
@given(
    prompt_len=st.integers(1, 70),
    cuts=st.lists(st.integers(1, 69), max_size=4),
    page_size=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_prefill_twin_chunked_equals_one_shot(prompt_len, cuts, page_size, seed):
    num_heads, num_kv_heads, head_dim, scale = 4, 2, 16, 0.25
    torch.manual_seed(seed)
    paged = make_paged_kv([prompt_len], num_kv_heads, head_dim, page_size, torch.float64, seed=seed)
    q = torch.randn(prompt_len, num_heads, head_dim, dtype=torch.float64)
    args = (paged.k_cache, paged.v_cache, paged.block_tables)
    one_shot = ref.chunked_prefill_attention(
        q, *args, torch.tensor([0, prompt_len], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), scale
    )
    bounds = [0, *sorted({c for c in cuts if c < prompt_len}), prompt_len]
    pieces = [
        ref.chunked_prefill_attention(
            q[s:e], *args, torch.tensor([0, e - s], dtype=torch.int32), torch.tensor([s], dtype=torch.int32), scale
        )
        for s, e in zip(bounds, bounds[1:])
    ]
    torch.testing.assert_close(torch.cat(pieces), one_shot)


@pytest.mark.parametrize("stacked", [False, True])
def test_gather_scatter_twins_are_inverse(stacked):
    layers, num_pages, page_size, kv_heads, head_dim = 3, 12, 16, 2, 32
    ks = torch.randn(layers, num_pages, page_size, kv_heads, head_dim)
    vs = torch.randn(layers, num_pages, page_size, kv_heads, head_dim)
    page_ids = torch.tensor([7, 2, 9], dtype=torch.int32)
    k_in, v_in = (ks, vs) if stacked else (list(ks), list(vs))
    chunk = ref.gather_kv_pages(k_in, v_in, page_ids)
    assert chunk.shape == (layers, 2, kv_heads, 3 * page_size, head_dim)
    # Token t of the chunk is slot t % page_size of page page_ids[t // page_size].
    assert torch.equal(chunk[1, 0, 1, 20], ks[1, 2, 4, 1])
    assert torch.equal(chunk[2, 1, 0, 47], vs[2, 9, 15, 0])
    k2, v2 = torch.zeros_like(ks), torch.zeros_like(vs)
    ref.scatter_kv_pages(chunk, k2 if stacked else list(k2), v2 if stacked else list(v2), page_ids)
    assert torch.equal(k2[:, page_ids.long()], ks[:, page_ids.long()])
    assert torch.equal(v2[:, page_ids.long()], vs[:, page_ids.long()])
    assert k2.count_nonzero() == ks[:, page_ids.long()].count_nonzero()


def test_fp8_twin_error_bound_and_zero_head():
    x = torch.randn(2, 2, 3, 64, 32)
    x[1, 0, 2] = 0.0
    q, scales = ref.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (2, 2, 3)
    assert scales[1, 0, 2] == 1.0
    y = ref.dequantize_kv_fp8(q, scales, torch.float32)
    assert torch.equal(y[1, 0, 2], x[1, 0, 2])
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4 for normals;
    # subnormals (|x / scale| < 2**-6) step by 2**-9 -> absolute 2**-10 * scale.
    bound = torch.maximum(x.abs() * 2**-4, 2**-10 * scales[..., None, None].expand_as(x))
    assert ((y - x).abs() <= bound).all()
    # amax of each head maps to 448 exactly.
    assert torch.equal(q.float().abs().amax(dim=(-2, -1))[0], torch.full((2, 3), 448.0))
