"""The kernels compiled on a GPU (``TRITON_INTERPRET=0 pytest -m gpu``): fp8 bit-exact against its
twin there, decode at the split counts the device's SM count picks, decode inside a CUDA graph."""

import os

import pytest
import torch

from kernels import reference as ref
from kernels.testing import make_paged_kv, reference_error_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels: run with TRITON_INTERPRET=0"),
]
pytest.importorskip("triton")
CUDA = torch.device("cuda")


def test_fp8_twin_scales_are_the_same_on_every_device_and_the_kernel_matches_them():
    from kernels.fp8 import dequantize_kv_fp8, quantize_kv_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 conversions need sm89+")
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 2, 8, 256, 128, generator=gen) * torch.rand(4, 2, 8, 1, 1, generator=gen) * 10).bfloat16()
    want_q, want_s = ref.quantize_kv_fp8(x)  # CPU
    cuda_q, cuda_s = ref.quantize_kv_fp8(x.to(CUDA))
    assert torch.equal(cuda_s.cpu(), want_s)  # torch's scalar division was a reciprocal multiply on CUDA
    assert torch.equal(cuda_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    q, s = quantize_kv_fp8(x.to(CUDA))
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(dequantize_kv_fp8(q, s).cpu(), ref.dequantize_kv_fp8(want_q, want_s))


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_decode_at_the_devices_own_split_counts(batch):
    from kernels.decode_attention import paged_decode_attention

    lens = [(997 * (b + 1)) % 4096 + 1 for b in range(batch)]
    paged = make_paged_kv(lens, 8, 128, 16, torch.bfloat16, CUDA, seed=batch)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).to(CUDA)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, seq_lens, 128**-0.5)
    args = (paged.block_tables, seq_lens, 128**-0.5)
    gold = ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args)
    lowp = ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args, upcast=False)
    ok, err, ref_err = reference_error_rule(out, gold, lowp)
    assert ok, f"kernel error {err:.3e} > 2 x reference error {ref_err:.3e}"


def test_decode_replayed_from_a_cuda_graph_with_a_wide_table():
    from kernels.decode_attention import paged_decode_attention

    lens = [300, 17, 2048]
    paged = make_paged_kv(lens, 8, 128, 16, torch.bfloat16, CUDA, seed=3)
    spare = int(paged.block_tables[1, -1])  # the short sequence's padding: the poisoned spare page
    wide = torch.full((3, 512), spare, dtype=torch.int32, device=CUDA)  # a graph's table: 8k keys
    wide[:, : paged.block_tables.shape[1]] = paged.block_tables
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device=CUDA)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    eager = paged_decode_attention(q, paged.k_cache, paged.v_cache, wide, seq_lens, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = paged_decode_attention(q, paged.k_cache, paged.v_cache, wide, seq_lens, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)
    q.copy_(torch.randn_like(q))  # new inputs in the same buffers: the replay sees them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, paged_decode_attention(q, paged.k_cache, paged.v_cache, wide, seq_lens, 0.1))
