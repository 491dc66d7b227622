"""Block layouts learned from a backend's own cache write (kvstore/integrations/paged.py), without
vLLM: backends written here the way vLLM's CPU backend lays out a block (K transposed per head, V
row-major, in one ``[heads, block, 2 * head_dim]`` page), plain and FP8 (codes in uint8 storage,
``x / scale`` rounded toward zero, as vLLM's CPU kernel does). tests/integrations/test_vllm.py
runs the real backends."""

import math

import pytest
import torch

from kvstore.integrations.paged import (gather_chunks, gather_layer, learn_block_layout, scatter_chunks,
                                        scatter_layer)

H, BS, D = 2, 8, 16


def _toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    near = x.to(dtype)
    code = near.view(torch.uint8).int()
    return torch.where(near.float().abs() > x.abs(), code - 1, code).to(torch.uint8).view(dtype)


class Backend:
    """A paged cache ``[blocks, H, BS, 2 * D]`` whose pages keep per head K transposed
    (``[D, BS]``) then V (``[BS, D]``); an FP8 one stores ``x / scale`` in uint8 storage."""

    def __init__(self, blocks: int, dtype: torch.dtype, fp8: torch.dtype | None = None,
                 scales: tuple[float, float] = (1.0, 1.0)) -> None:
        self.fp8, self.scales, self.dtype = fp8, scales, dtype
        self.cache = torch.zeros(blocks, H, BS, 2 * D, dtype=torch.uint8 if fp8 else dtype)

    def write(self, key: torch.Tensor, value: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
        """vLLM's ``do_kv_cache_update``: ``key``/``value`` ``[tokens, H, D]`` into ``slots``."""
        if self.fp8 is not None:
            key, value = (_toward_zero(x.float() / s, self.fp8).view(torch.uint8)
                          for x, s in ((key, self.scales[0]), (value, self.scales[1])))
        flat = page.view(page.shape[0], H, 2 * BS * D)
        for t, slot in enumerate(slots.tolist()):
            b, i = divmod(slot, BS)
            for h in range(H):
                flat[b, h, i:BS * D:BS] = key[t, h]  # K transposed: element (d, i) at d * BS + i
                flat[b, h, BS * D + i * D:BS * D + (i + 1) * D] = value[t, h]

    def element_view(self) -> torch.Tensor:
        return self.cache.view(self.fp8) if self.fp8 is not None else self.cache

    def layout(self, scales: tuple[float, float] | None = None):
        def write(key, value, page, slots):
            self.write(key, value, page.view(torch.uint8) if self.fp8 is not None else page, slots)
        return learn_block_layout(write, self.element_view()[:1], H, D, self.dtype,
                                  self.scales if scales is None else scales)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.0125, 3.5)])
def test_a_learned_layout_reads_what_the_backend_wrote(cache, scales):
    """Tokens the backend writes into blocks 3 and 1 read back, through the learned layout, as the
    canonical ``[2, H, tokens, D]`` of what it stored: the values, or their FP8 codes."""
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(cache)
    dtype = torch.float32 if fp8 else getattr(torch, cache)
    be = Backend(5, dtype, fp8, scales if fp8 else (1.0, 1.0))
    layout = be.layout()
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2 * BS, H, D, generator=g) * s * 40 for s in be.scales)
    ids = torch.tensor([3, 1])
    slots = torch.cat([ids[0] * BS + torch.arange(BS), ids[1] * BS + torch.arange(BS)])
    be.write(k.to(dtype), v.to(dtype), be.cache, slots)
    out = torch.empty(2, H, 2 * BS, D, dtype=fp8 or dtype)
    gather_layer(be.element_view(), layout, ids, out)
    if fp8 is None:
        want = torch.stack([k.to(dtype).transpose(0, 1), v.to(dtype).transpose(0, 1)])
    else:
        want = torch.stack([_toward_zero(x.float() / s, fp8).transpose(0, 1) for x, s in ((k, be.scales[0]),
                                                                                        (v, be.scales[1]))])
    assert torch.equal(out.view(torch.uint8), want.contiguous().view(torch.uint8))


def _layout(padded: bool):
    """The test backend's layout and page shape; ``padded``: each row of 2*D elements gets one more,
    unused (the page is then no strided view of K and V)."""
    be = Backend(9, torch.float32)
    layout = be.layout()
    shape = be.element_view().shape
    if padded:
        row = shape[-1]
        index = layout.index // row * (row + 1) + layout.index % row
        shape = (*shape[:-1], row + 1)
        layout = type(layout)(layout.heads, layout.block_size, layout.head_dim, index, math.prod(shape[1:]))
        assert not layout.covers_page
    assert (layout.strided is None) == padded  # (a strided page is copied through views, any other by index)
    return layout, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("padded", [False, True])
def test_scatter_chunks_writes_what_scatter_layer_writes_chunk_by_chunk(padded, dtype):
    """Three chunks of two blocks at once, from a strided view across them (as the connector's
    staging buffer holds them, headers in between), the first from its second block: the cache
    equals that of ``scatter_layer`` called per chunk, untouched blocks included; with pages that
    have elements no K or V uses (padded rows), those keep their values."""
    layout, shape = _layout(padded)
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(3, 7 + 2 * H * 2 * BS * D, generator=g).to(dtype)  # (7 of "header" before each payload)
    src = raw[:, 7:].view(3, 2, H, 2 * BS, D)
    blocks = [(5, 2), (7, 0), (1, 8)]
    firsts = [1, 0, 0]
    want = torch.randn(shape, generator=g).to(dtype)
    got = want.clone()
    for i, (ids, first) in enumerate(zip(blocks, firsts)):
        scatter_layer(src[i], want, layout, torch.tensor(ids), first)
    assert not torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    rows = torch.tensor([i * 2 + b for i, f in enumerate(firsts) for b in range(f, 2)])
    ids = torch.tensor([blocks[i][b] for i, f in enumerate(firsts) for b in range(f, 2)])
    scratch = torch.full((9 * layout.page_numel,), 7.0).to(dtype)  # (reused pages: more than needed, not zero)
    scatter_chunks(src, got, layout, ids, rows, scratch)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    every = torch.tensor([b for ids_ in blocks for b in ids_])
    scatter_chunks(src, got, layout, every)  # rows=None: every block of every chunk
    for i, ids_ in enumerate(blocks):
        scatter_layer(src[i], want, layout, torch.tensor(ids_))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("padded", [False, True])
def test_gather_chunks_reads_what_gather_layer_reads_chunk_by_chunk(padded, dtype):
    """One layer of three chunks out of a cache at once, into one layer of a ``[n, layers, ...]``
    buffer (strided per chunk), equals ``gather_layer`` per chunk; the other layer is untouched."""
    layout, shape = _layout(padded)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(shape, generator=g).to(dtype)
    blocks = [5, 2, 7, 0, 1, 8]
    buf = torch.zeros(3, 2, 2, H, 2 * BS, D).to(dtype)  # [chunks, layers, K/V, heads, tokens, dim]
    gather_chunks(cache, layout, torch.tensor(blocks), buf[:, 1])
    for i in range(3):
        want = torch.empty(2, H, 2 * BS, D, dtype=dtype)
        gather_layer(cache, layout, torch.tensor(blocks[2 * i:2 * i + 2]), want)
        assert torch.equal(buf[i, 1].view(torch.uint8), want.view(torch.uint8))
    assert not buf[:, 0].view(torch.uint8).any()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_chunks_scatter_and_gather_byte_for_byte(fp8):
    """A chunk of FP8 codes scattered into other blocks (its first block left alone, as for a
    prefix the engine holds) gathers back bit for bit, NaN codes and all."""
    be = Backend(6, torch.float32, fp8, (0.5, 2.0))
    layout = be.layout()
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, H, 3 * BS, D), generator=g, dtype=torch.uint8)
    ids = torch.tensor([4, 0, 2])
    before = be.cache[4].clone()
    scatter_layer(codes.view(fp8), be.element_view(), layout, ids, first_block=1)
    assert torch.equal(be.cache[4], before)
    out = torch.empty(2, H, 3 * BS, D, dtype=fp8)
    gather_layer(be.element_view(), layout, ids, out)
    assert torch.equal(out.view(torch.uint8)[:, :, BS:], codes[:, :, BS:])


def test_fp8_probe_uses_the_layers_scales():
    """Probed without the layer's scale (0.01), its values saturate the format and collide: refused,
    never a wrong layout."""
    be = Backend(2, torch.float32, torch.float8_e4m3fn, (0.01, 0.01))
    with pytest.raises(ValueError, match="FP8 codes"):
        be.layout(scales=(1.0, 1.0))
    be.layout()


def test_caches_that_are_not_a_permutation_are_refused():
    """A backend that keeps V at half resolution (two tokens share a slot) is refused by name;
    one that drops V altogether as well."""
    be = Backend(2, torch.float32)

    def halved(key, value, page, slots):
        be.write(key, torch.zeros_like(value), page, slots)
        flat = page.view(page.shape[0], H, 2 * BS * D)
        for t, slot in enumerate(slots.tolist()):
            b, i = divmod(slot, BS)
            flat[b, :, BS * D + (i // 2) * D:BS * D + (i // 2 + 1) * D] = value[t]

    with pytest.raises(ValueError, match="K and V"):
        learn_block_layout(halved, be.cache[:1], H, D)

    def k_only(key, value, page, slots):
        flat = page.view(page.shape[0], H, 2 * BS * D)
        for t, slot in enumerate(slots.tolist()):
            b, i = divmod(slot, BS)
            flat[b, :, i:BS * D:BS] = key[t]

    with pytest.raises(ValueError, match="K and V"):
        learn_block_layout(k_only, be.cache[:1], H, D)
