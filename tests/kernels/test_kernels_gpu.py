"""The kernels compiled on a GPU (``TRITON_INTERPRET=0 pytest -m gpu``): fp8 bit-exact against its
twin there, decode at the split counts the device's SM count picks, decode inside a CUDA graph."""

import os

import pytest
import torch

from kernels import reference as ref
from kernels.host import register_host_memory, unregister_host_memory
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


def _registered(nbytes: int):
    """A /dev/shm mapping page-locked with cudaHostRegister, as the engine maps the node's arena;
    returns (uint8 tensor over it, cleanup)."""
    import mmap
    import tempfile

    f = tempfile.NamedTemporaryFile(dir="/dev/shm")
    f.truncate(nbytes)
    m = mmap.mmap(f.fileno(), nbytes)
    host = torch.frombuffer(m, dtype=torch.uint8)
    why = register_host_memory(host.data_ptr(), nbytes)
    assert why is None, why

    def cleanup():
        unregister_host_memory(host.data_ptr())
        f.close()

    return host, cleanup


def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """Registering a range twice fails (cudaErrorHostMemoryAlreadyRegistered); the runtime keeps that
    as the thread's last error, which torch's check after the next kernel launch would raise."""
    host, cleanup = _registered(1 << 20)
    try:
        why = register_host_memory(host.data_ptr(), 1 << 20)
        assert why is not None and "cudaHostRegister failed" in why
        assert torch.arange(4, device=CUDA).sum().item() == 6
    finally:
        cleanup()


def test_a_host_slab_is_registered_at_its_own_size_and_copies_through_it_are_dma():
    """A staging pool's slab: page-locked by registration (exactly its size, where pin_memory would
    round 32 MiB and a header up to 64), seen as pinned by torch, so its copies are asynchronous."""
    from engine.kv_transfer import StagingPool
    from kernels.host import HostSlab

    slab = HostSlab((32 << 20) + 4096, pin=True, device=torch.device(CUDA))
    try:
        assert slab.pinned and slab.why_not_registered is None and slab.tensor.is_pinned()
        assert slab.tensor.numel() == (32 << 20) + 4096
        src = torch.randint(0, 256, (slab.nbytes,), dtype=torch.uint8, device=CUDA)
        slab.tensor.copy_(src, non_blocking=True)
        back = slab.tensor.to(CUDA, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
    finally:
        slab.close()
    pool = StagingPool((32 << 20) + 64, 2, pin=True)
    try:
        assert pool.pinned and pool.tensor(1).is_pinned() and pool.slab.nbytes == 2 * ((32 << 20) + 4096)
    finally:
        pool.close()


def test_page_moves_read_and_write_page_locked_host_memory():
    """scatter_kv_pages from a pinned host chunk and gather_kv_pages into one: the kernel reaches
    the host bytes over the bus (no staging copy); the same pages as from a device chunk."""
    from kernels.kv_pages import gather_kv_pages, scatter_kv_chunks, scatter_kv_pages

    gen = torch.Generator().manual_seed(3)
    chunk = torch.randn(4, 2, 8, 256, 128, generator=gen).bfloat16()
    ids = torch.tensor([9, 3, 30, 17, 0, 12, 5, 21, 40, 33, 2, 8, 1, 4, 6, 7], dtype=torch.int32, device=CUDA)
    ks = [torch.zeros(48, 16, 8, 128, dtype=torch.bfloat16, device=CUDA) for _ in range(4)]
    vs = [torch.zeros_like(k) for k in ks]
    scatter_kv_pages(chunk.pin_memory(), ks, vs, ids)
    want_k = [torch.zeros_like(k) for k in ks]
    want_v = [torch.zeros_like(k) for k in ks]
    scatter_kv_pages(chunk.to(CUDA), want_k, want_v, ids)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, want_k + want_v))
    out = torch.empty(chunk.shape, dtype=chunk.dtype).pin_memory()
    gather_kv_pages(ks, vs, ids, out)
    torch.cuda.synchronize()
    assert torch.equal(out, chunk)
    k, v = torch.zeros_like(ks[0]), torch.zeros_like(vs[0])
    scatter_kv_chunks(chunk[:2, :, :, :128].contiguous().pin_memory(), k, v, ids.view(2, 8).contiguous())
    assert torch.equal(k[ids[:8].long()], want_k[0][ids[:8].long()])
    with pytest.raises(AssertionError, match="pageable"):
        scatter_kv_pages(chunk, ks, vs, ids)


def test_layer_landing_straight_from_a_registered_mapping_with_its_checksum():
    """scatter_kv_layer reads each chunk's layer in place in a registered /dev/shm mapping (the
    node's arena, as the engine maps it) and computes its wsum64 share from the same loads:
    pages equal to the twin's, shares summing to kvstore's wsum64. Pageable memory is refused."""
    import kernels
    from kvstore.chunk import WSUM_K, wsum64

    shape = (8, 2, 8, 256, 128)
    gen = torch.Generator().manual_seed(4)
    chunks = [torch.randn(shape, generator=gen).bfloat16() for _ in range(5)]
    nbytes = chunks[0].numel() * 2
    slot = nbytes + 4096
    host, cleanup = _registered(5 * slot)
    try:
        sources = []
        for j, at in enumerate([3, 0, 4, 1, 2]):
            start = at * slot + 4096
            host[start : start + nbytes] = chunks[j].reshape(-1).view(torch.uint8)
            sources.append(host[start : start + nbytes])
        table = kernels.source_table(sources, CUDA)
        pages = torch.randperm(200, generator=gen)[:5 * 16].view(5, 16).to(torch.int32).to(CUDA)
        layer_words = nbytes // 8 // 8
        sums = torch.zeros(5, dtype=torch.int64, device=CUDA)
        for layer in range(8):
            k = torch.zeros(200, 16, 8, 128, dtype=torch.bfloat16, device=CUDA)
            v = torch.zeros_like(k)
            sums += kernels.scatter_kv_layer(sources, k, v, pages, offset_words=layer * layer_words,
                                             wsum_at=layer * layer_words, wsum_k=WSUM_K, table=table)
            want_k, want_v = torch.zeros_like(k), torch.zeros_like(v)
            ref.scatter_kv_chunks(torch.stack([c[layer] for c in chunks]).to(CUDA), want_k, want_v, pages)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert sums.cpu().tolist() == [int(wsum64(c)) for c in chunks]
        with pytest.raises(ValueError, match="pageable"):
            kernels.source_table([chunks[0]], CUDA)
    finally:
        cleanup()
