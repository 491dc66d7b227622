"""Triton page gather/scatter and fp8 kernels (interpreter on CPU): exact against their twins."""

import pytest
import torch

from kernels import reference as ref

pytest.importorskip("triton")
from kernels.fp8 import dequantize_kv_fp8, quantize_kv_fp8  # noqa: E402
from kernels.kv_pages import gather_kv_pages, scatter_kv_chunks, scatter_kv_pages  # noqa: E402


def _caches(layers, num_pages, page_size, kv_heads, head_dim, dtype, layout):
    """K and V caches of every layer, as the engine may hold them.

    layout: "list" (separate tensors), "stacked" ([L, pages, ...] tensors) or
    "fused" (views into one [L, pages, page_size, 2, KVH, D] buffer: strided).
    """
    gen = torch.Generator().manual_seed(layers * 100 + page_size)
    if layout == "fused":
        kv = torch.randn(layers, num_pages, page_size, 2, kv_heads, head_dim, generator=gen).to(dtype)
        return [kv[i, :, :, 0] for i in range(layers)], [kv[i, :, :, 1] for i in range(layers)]
    shape = (layers, num_pages, page_size, kv_heads, head_dim)
    ks = torch.randn(shape, generator=gen).to(dtype)
    vs = torch.randn(shape, generator=gen).to(dtype)
    return (ks, vs) if layout == "stacked" else (list(ks), list(vs))


def _layers(caches):
    return list(caches) if isinstance(caches, list) else list(caches.unbind(0))


# (layers, page_size, kv_heads, head_dim, dtype, layout)
PAGE_CASES = [
    (2, 16, 2, 64, torch.bfloat16, "list"),
    (3, 32, 1, 128, torch.float16, "stacked"),
    (2, 16, 4, 64, torch.float32, "fused"),
    (2, 12, 2, 48, torch.float16, "list"),  # page size / head dim not powers of two
]


@pytest.mark.parametrize("case", PAGE_CASES, ids=lambda c: f"L{c[0]}-ps{c[1]}-KV{c[2]}-D{c[3]}-{c[5]}")
def test_gather_matches_twin_and_scatter_inverts_it(case):
    layers, page_size, kv_heads, head_dim, dtype, layout = case
    num_pages = 10
    ks, vs = _caches(layers, num_pages, page_size, kv_heads, head_dim, dtype, layout)
    page_ids = torch.tensor([6, 1, 8, 3], dtype=torch.int32)

    chunk = gather_kv_pages(ks, vs, page_ids)
    assert chunk.shape == (layers, 2, kv_heads, 4 * page_size, head_dim)
    assert torch.equal(chunk, ref.gather_kv_pages(ks, vs, page_ids))

    # scatter into fresh caches: exactly the chunk's pages change.
    fresh_k = [torch.zeros_like(t) for t in _layers(ks)]
    fresh_v = [torch.zeros_like(t) for t in _layers(vs)]
    scatter_kv_pages(chunk, fresh_k, fresh_v, page_ids)
    untouched = [p for p in range(num_pages) if p not in page_ids.tolist()]
    for got, want in zip(fresh_k + fresh_v, _layers(ks) + _layers(vs)):
        assert torch.equal(got[page_ids.long()], want[page_ids.long()])
        assert not got[untouched].any()
    # gather . scatter = identity on chunks, scatter . gather = identity on caches.
    assert torch.equal(gather_kv_pages(fresh_k, fresh_v, page_ids), chunk)
    before = [t.clone() for t in _layers(ks) + _layers(vs)]
    scatter_kv_pages(chunk, ks, vs, page_ids)
    assert all(torch.equal(a, b) for a, b in zip(before, _layers(ks) + _layers(vs)))


def test_gather_into_strided_out_and_scatter_from_strided_chunk():
    ks, vs = _caches(2, 8, 16, 2, 64, torch.bfloat16, "list")
    page_ids = torch.tensor([5, 0], dtype=torch.int32)
    want = ref.gather_kv_pages(ks, vs, page_ids)
    out = torch.empty(2, 2, 32, 2, 64, dtype=torch.bfloat16).transpose(2, 3)  # [L, 2, KVH, T, D], strided
    assert gather_kv_pages(ks, vs, page_ids, out) is out
    assert torch.equal(out, want)
    fresh_k, fresh_v = [torch.zeros_like(t) for t in ks], [torch.zeros_like(t) for t in vs]
    scatter_kv_pages(out, fresh_k, fresh_v, page_ids)
    assert torch.equal(ref.gather_kv_pages(fresh_k, fresh_v, page_ids), want)


@pytest.mark.parametrize("case", PAGE_CASES[:2] + PAGE_CASES[3:], ids=lambda c: f"ps{c[1]}-KV{c[2]}-D{c[3]}")
def test_one_layer_of_many_chunks_lands_where_the_twin_puts_it(case):
    """A layer-by-layer load's scatter: layer l of N chunks, each into its own pages, one launch;
    the chunks' layer l as scatter_kv_pages would have written it, no other page touched."""
    _, page_size, kv_heads, head_dim, dtype, _ = case
    gen = torch.Generator().manual_seed(page_size)
    chunks = torch.randn(3, 2, kv_heads, 2 * page_size, head_dim, generator=gen).to(dtype)
    page_ids = torch.tensor([[7, 2], [0, 9], [4, 5]], dtype=torch.int32)
    k, v = (torch.zeros(11, page_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    scatter_kv_chunks(chunks, k, v, page_ids)
    want_k, want_v = torch.zeros_like(k), torch.zeros_like(v)
    ref.scatter_kv_chunks(chunks, want_k, want_v, page_ids)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    for n in range(3):  # each chunk reads back from its pages as itself
        assert torch.equal(ref.gather_kv_pages([k], [v], page_ids[n])[0], chunks[n])
    assert not k[[1, 3, 6, 8, 10]].any() and not v[[1, 3, 6, 8, 10]].any()
    strided = chunks.transpose(2, 3).contiguous().transpose(2, 3)  # [N, 2, KVH, T, D] with other strides
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    scatter_kv_chunks(strided, k2, v2, page_ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_pages_reject_mismatched_caches():
    ks, vs = _caches(2, 8, 16, 2, 64, torch.float16, "list")
    page_ids = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="one K and one V"):
        gather_kv_pages(ks, vs[:1], page_ids)
    with pytest.raises(AssertionError, match="dtype"):
        gather_kv_pages([ks[0], ks[1].float()], vs, page_ids)
    with pytest.raises(AssertionError, match="int32"):
        gather_kv_pages(ks, vs, page_ids.long())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_bit_identical_to_twin(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 2, 3, 40, 64, generator=gen)
    x[0, 1, 2] = 0.0  # all-zero head: scale 1
    x[1, 0, 0, 5, 7] = 300.0  # outlier head
    x[1, 1, 1] *= 1e-3  # small head: deep into the subnormals of e4m3 after scaling? no: scaled up
    x = x.to(dtype)
    q, scales = quantize_kv_fp8(x)
    want_q, want_scales = ref.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, want_scales)
    assert torch.equal(_bits(q), _bits(want_q))
    for out_dtype in (torch.float32, dtype):
        got = dequantize_kv_fp8(q, scales, out_dtype)
        assert torch.equal(got, ref.dequantize_kv_fp8(want_q, want_scales, out_dtype))


def test_quantize_rounds_every_e4m3_interval_like_torch():
    """Every positive e4m3 value, every midpoint (ties) and points beside them, scale 1."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    eps = (grid[1:] - grid[:-1]) / 64
    vals = torch.cat([grid, mids, mids - eps, mids + eps, -grid, -mids])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 64)])
    x = vals.view(1, 2, 1, -1, 32)  # amax 448 in both heads -> scale exactly 1
    q, scales = quantize_kv_fp8(x)
    assert torch.equal(scales, torch.ones(1, 2, 1))
    want = (x / scales[..., None, None]).to(torch.float8_e4m3fn)
    assert torch.equal(_bits(q), _bits(want))


def test_fp8_round_trip_error_bound_strided_input():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 2, 2, 96, 64, generator=gen).to(torch.bfloat16)[:, 1]  # [L, 2, KVH, T, D] strided
    assert not x.is_contiguous()
    q, scales = quantize_kv_fp8(x)
    out = torch.empty(2, 2, 96, 2, 64).transpose(2, 3)  # strided out
    y = dequantize_kv_fp8(q, scales, out=out)
    assert y is out
    xf = x.float()
    # Half an e4m3 ulp: 2**-4 relative for normals, 2**-10 * scale absolute for subnormals.
    bound = torch.maximum(xf.abs() * 2**-4, 2**-10 * scales[..., None, None].expand_as(xf))
    assert ((y - xf).abs() <= bound).all()
    rel = ((y - xf).abs() / xf.abs().clamp_min(1e-30))[xf.abs() >= scales[..., None, None] * 2**-6]
    assert rel.max() <= 2**-4 and rel.mean() < 0.03


# (page_size, kv_heads, head_dim, dtype): rows of 8-byte words; the last not powers of two
LAYER_CASES = [
    (16, 2, 64, torch.bfloat16),
    (32, 1, 128, torch.float32),
    (12, 2, 48, torch.float16),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"ps{c[0]}-KV{c[1]}-D{c[2]}-{c[3]}")
def test_layer_from_where_each_chunk_is_lands_and_sums_like_the_twin(case):
    """scatter_kv_layer reads layer l of every chunk where its bytes are (here: payloads at
    scattered places in one arena-like buffer, after a header) and writes it into its pages;
    its fused wsum64 shares add up, layer by layer, to kvstore's wsum64 of each whole payload."""
    from kernels.kv_pages import scatter_kv_layer, source_table
    from kvstore.chunk import WSUM_K, wsum64

    page_size, kv_heads, head_dim, dtype = case
    layers, p, n = 3, 2, 3
    shape = (layers, 2, kv_heads, p * page_size, head_dim)
    gen = torch.Generator().manual_seed(page_size + head_dim)
    chunks = [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]
    nbytes = chunks[0].numel() * chunks[0].element_size()
    head, slot = 64, nbytes + 64 + 128
    arena = torch.zeros(n * slot + 4096, dtype=torch.uint8)
    sources = []
    for j, at in enumerate([2, 0, 1]):  # out of order in the arena, each after a 64-byte "header"
        start = at * slot + head
        arena[start : start + nbytes] = chunks[j].reshape(-1).view(torch.uint8)
        sources.append(arena[start : start + nbytes])
    page_ids = torch.tensor([[7, 2], [0, 9], [4, 5]], dtype=torch.int32)
    layer_words = nbytes // 8 // layers
    table = source_table(sources, torch.device("cpu"))
    sums = torch.zeros(n, dtype=torch.int64)
    for layer in range(layers):
        k, v = (torch.zeros(11, page_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        want_k, want_v = torch.zeros_like(k), torch.zeros_like(v)
        got = scatter_kv_layer(sources, k, v, page_ids, offset_words=layer * layer_words,
                               wsum_at=layer * layer_words, wsum_k=WSUM_K, table=table)
        want = ref.scatter_kv_layer(sources, want_k, want_v, page_ids, offset_words=layer * layer_words,
                                    wsum_at=layer * layer_words, wsum_k=WSUM_K)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert torch.equal(got, want)
        for j in range(n):  # the pages hold exactly chunk j's layer
            assert torch.equal(ref.gather_kv_pages([k], [v], page_ids[j])[0], chunks[j][layer])
        assert not k[[1, 3, 6, 8, 10]].any()
        sums += got
        # without wsum_at: the same pages, no shares
        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        assert scatter_kv_layer(sources, k2, v2, page_ids, offset_words=layer * layer_words) is None
        assert torch.equal(k2, k) and torch.equal(v2, v)
    assert sums.tolist() == [int(wsum64(c)) for c in chunks]


def test_layer_scatter_refuses_what_it_cannot_read():
    from kernels.kv_pages import scatter_kv_layer

    k, v = (torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    short = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="has no layer"):
        scatter_kv_layer([short], k, v, ids)
    with pytest.raises(AssertionError, match="contiguous"):
        scatter_kv_layer([torch.zeros(64, 2, 1, 32, 64).transpose(0, 1)], k, v, ids)
    with pytest.raises(AssertionError, match="1 sources for 2"):
        scatter_kv_layer([torch.zeros(8192)], k, v, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    odd_k, odd_v = (torch.zeros(4, 16, 1, 3, dtype=torch.float16) for _ in range(2))  # 6-byte rows
    with pytest.raises(AssertionError, match="8-byte"):
        scatter_kv_layer([torch.zeros(8192)], odd_k, odd_v, ids)


def test_pointer_tables_are_shared_by_threads_and_kept_for_every_layer(monkeypatch):
    """The step, lander and saver threads launch page kernels at once: lookups and evictions of
    the table cache must not race (a KeyError escaped a step before it took a lock), and an
    engine's tables (one per layer, one of all layers) stay cached once warmed."""
    import threading

    from kernels import kv_pages

    monkeypatch.setattr(kv_pages, "_TABLES", type(kv_pages._TABLES)())
    monkeypatch.setattr(kv_pages, "_TABLES_MAX", 3)  # constant eviction: the race's worst case
    caches = [torch.empty(2, 4, 1, 8) for _ in range(16)]
    errors = []

    def hammer(seed):
        import random

        rnd = random.Random(seed)
        try:
            for _ in range(3000):
                k, v = rnd.sample(caches, 2)
                table = kv_pages._pointer_table([k], [v])
                assert table.tolist() == [k.data_ptr(), v.data_ptr()]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    old = __import__("sys").getswitchinterval()
    __import__("sys").setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        __import__("sys").setswitchinterval(old)
    assert errors == [] and len(kv_pages._TABLES) <= 3
    monkeypatch.setattr(kv_pages, "_TABLES_MAX", 1024)
    ks, vs = caches[:8], caches[8:]
    kv_pages.warm_pointer_tables(ks, vs)
    before = dict(kv_pages._TABLES)
    for k, v in zip(ks, vs):
        assert kv_pages._pointer_table([k], [v]) is before[(k.device, (k.data_ptr(), v.data_ptr()))]
    assert len(before) >= 8 + 1 and kv_pages._pointer_table(ks, vs).numel() == 16
