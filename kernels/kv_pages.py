"""Page gather/scatter between per-layer paged caches and the chunk layout (Triton).

A stored chunk is ``[L, 2 (K, V), KVH, chunk_tokens, D]`` (layer-major, see
DESIGN.md); in the engine its tokens live in ``P = chunk_tokens / page_size``
pages of every layer's ``[num_pages, page_size, KVH, D]`` cache. One launch
moves all layers: program ``(layer * 2 + kv, page, head)`` copies one
``[page_size, D]`` tile. The same kernel moves one layer of many chunks
(``scatter_kv_chunks``, a layer-by-layer load): program ``(chunk * 2 + kv,
page, head)``, every chunk with pages of its own, into one layer's caches.

Twins: :func:`kernels.reference.gather_kv_pages`, :func:`kernels.reference.scatter_kv_pages`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from kernels.reference import Caches, as_layer_list


@triton.jit
def _kv_pages_kernel(
    table_ptr, page_ids_ptr, chunk_ptr, stride_tl, stride_pl,
    stride_cp, stride_cs, stride_ch, stride_cd,
    stride_xl, stride_xkv, stride_xh, stride_xt, stride_xd,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SCATTER: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    lkv = tl.program_id(0)
    p = tl.program_id(1)
    h = tl.program_id(2)
    layer = lkv // 2
    kv = lkv % 2
    # NOTE: table[2*l + kv] is the address of layer l's K (kv=0) or V cache: the
    # caches are separate allocations, so one launch reaches them all through a
    # pointer table instead of 2*L launches. With stride_tl 0 every "layer" (then a
    # chunk) goes to the same pair of caches, each through its own row of page ids
    # (stride_pl; 0: one row of page ids for every layer).
    cache_ptr = tl.load(table_ptr + layer * stride_tl + kv).to(tl.pointer_type(chunk_ptr.dtype.element_ty))
    if ALIGNED:
        # NOTE: a pointer loaded from memory has no known alignment; without the
        # hint every cache access is a 2-byte load/store instead of 16 bytes.
        cache_ptr = tl.multiple_of(cache_ptr, 16)
    page = tl.load(page_ids_ptr + layer * stride_pl + p).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    cache_ptrs = cache_ptr + page * stride_cp + h * stride_ch + offs_s[:, None] * stride_cs + offs_d[None, :] * stride_cd
    tok = p * PAGE_SIZE + offs_s
    chunk_ptrs = (
        chunk_ptr
        + layer.to(tl.int64) * stride_xl
        + kv * stride_xkv
        + h * stride_xh
        + tok[:, None] * stride_xt
        + offs_d[None, :] * stride_xd
    )
    src_ptrs = chunk_ptrs if SCATTER else cache_ptrs
    dst_ptrs = cache_ptrs if SCATTER else chunk_ptrs
    if BLOCK_S == PAGE_SIZE and BLOCK_D == HEAD_DIM:
        tl.store(dst_ptrs, tl.load(src_ptrs))
    else:
        mask = (offs_s[:, None] < PAGE_SIZE) & (offs_d[None, :] < HEAD_DIM)
        tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 16


def _pointer_table(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """``[2L]`` int64 device tensor of cache addresses, K and V interleaved per layer.

    NOTE: cached by the addresses themselves, so a hit is always right (same
    addresses, same table) and the engine's fixed caches cost no host-to-device
    copy per call.
    """
    ptrs = tuple(t.data_ptr() for pair in zip(ks, vs, strict=True) for t in pair)
    key = (ks[0].device, ptrs)
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(ptrs, dtype=torch.int64).to(ks[0].device)
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def _check_caches(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
    assert ks and len(ks) == len(vs), f"need one K and one V cache per layer, got {len(ks)} and {len(vs)}"
    first = ks[0]
    assert first.dim() == 4, f"caches must be [num_pages, page_size, KVH, D], got {tuple(first.shape)}"
    for t in ks + vs:
        # NOTE: one set of strides serves every layer in the kernel.
        assert t.shape == first.shape, f"cache shape {tuple(t.shape)} != {tuple(first.shape)}"
        assert t.stride() == first.stride(), f"cache strides {t.stride()} != {first.stride()}"
        assert t.dtype == first.dtype, f"cache dtype {t.dtype} != {first.dtype}"
        assert t.device == first.device, f"cache device {t.device} != {first.device}"


def _launch(
    chunk: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], page_ids: torch.Tensor, scatter: bool
) -> None:
    """One launch over ``chunk.shape[0]`` groups: the layers of one chunk (``len(ks)`` layers,
    1-D ``page_ids``), or the chunks of one layer (one K/V pair, ``page_ids`` ``[chunks, P]``)."""
    groups = chunk.shape[0]
    table = _pointer_table(ks, vs)
    aligned = all(t.data_ptr() % 16 == 0 for t in ks + vs)
    _, page_size, num_kv_heads, head_dim = ks[0].shape
    num_pages = page_ids.shape[-1]
    stride_tl = 2 if len(ks) == groups else 0
    stride_pl = page_ids.stride(0) if page_ids.dim() == 2 else 0
    _kv_pages_kernel[(2 * groups, num_pages, num_kv_heads)](
        table, page_ids, chunk, stride_tl, stride_pl,
        *ks[0].stride(), *chunk.stride(),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(page_size), BLOCK_D=triton.next_power_of_2(head_dim),
        SCATTER=scatter, ALIGNED=aligned, num_warps=4,
    )  # fmt: skip


def _check_page_ids(page_ids: torch.Tensor, device: torch.device) -> None:
    assert page_ids.dtype == torch.int32 and page_ids.dim() == 1, "page_ids must be a 1-D int32 tensor"
    assert page_ids.device == device, f"page_ids on {page_ids.device}, caches on {device}"


def gather_kv_pages(
    k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copies one chunk's pages, for all layers, into the contiguous chunk layout.

    Args:
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` with equal strides,
            or a stacked ``[L, num_pages, page_size, KVH, D]``.
        v_caches: same shapes as ``k_caches``.
        page_ids: ``[P]`` int32, the chunk's pages in token order.
        out: optional ``[L, 2, KVH, P * page_size, D]`` buffer, any strides.

    Returns:
        ``[L, 2, KVH, P * page_size, D]``, ``out`` if given.
    """
    ks, vs = as_layer_list(k_caches), as_layer_list(v_caches)
    _check_caches(ks, vs)
    _check_page_ids(page_ids, ks[0].device)
    _, page_size, num_kv_heads, head_dim = ks[0].shape
    shape = (len(ks), 2, num_kv_heads, page_ids.numel() * page_size, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=ks[0].dtype, device=ks[0].device)
    assert tuple(out.shape) == shape, f"out must be {shape}, got {tuple(out.shape)}"
    assert out.dtype == ks[0].dtype, f"out dtype {out.dtype} != cache dtype {ks[0].dtype}"
    assert out.device == ks[0].device, f"out on {out.device}, caches on {ks[0].device}"
    if page_ids.numel():
        _launch(out, ks, vs, page_ids, scatter=False)
    return out


def scatter_kv_pages(chunk: torch.Tensor, k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor) -> None:
    """Writes a chunk into the pages ``page_ids`` of every layer's K/V cache, in place.

    Args:
        chunk: ``[L, 2, KVH, P * page_size, D]``, any strides.
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` (or stacked), written.
        v_caches: same shapes as ``k_caches``, written.
        page_ids: ``[P]`` int32 distinct page ids (duplicates race).
    """
    ks, vs = as_layer_list(k_caches), as_layer_list(v_caches)
    _check_caches(ks, vs)
    _check_page_ids(page_ids, ks[0].device)
    _, page_size, num_kv_heads, head_dim = ks[0].shape
    shape = (len(ks), 2, num_kv_heads, page_ids.numel() * page_size, head_dim)
    assert tuple(chunk.shape) == shape, f"chunk must be {shape}, got {tuple(chunk.shape)}"
    assert chunk.dtype == ks[0].dtype, f"chunk dtype {chunk.dtype} != cache dtype {ks[0].dtype}"
    assert chunk.device == ks[0].device, f"chunk on {chunk.device}, caches on {ks[0].device}"
    if page_ids.numel():
        _launch(chunk, ks, vs, page_ids, scatter=True)


def scatter_kv_chunks(chunks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_ids: torch.Tensor) -> None:
    """Writes one layer of many chunks into that layer's caches, in place (one launch): a
    layer-by-layer load lands layer ``l`` of every chunk before layer ``l`` computes.

    Args:
        chunks: ``[N, 2, KVH, P * page_size, D]``, layer ``l`` of ``N`` chunks, any strides.
        k_cache: ``[num_pages, page_size, KVH, D]``, layer ``l``'s K cache, written.
        v_cache: the same for V.
        page_ids: ``[N, P]`` int32, row ``n`` the pages of chunk ``n`` (all distinct).
    """
    _check_caches([k_cache], [v_cache])
    assert page_ids.dtype == torch.int32 and page_ids.dim() == 2, "page_ids must be a 2-D int32 tensor"
    assert page_ids.device == k_cache.device, f"page_ids on {page_ids.device}, caches on {k_cache.device}"
    assert page_ids.stride(1) == 1, "page_ids rows must be contiguous"
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    n, p = page_ids.shape
    shape = (n, 2, num_kv_heads, p * page_size, head_dim)
    assert tuple(chunks.shape) == shape, f"chunks must be {shape}, got {tuple(chunks.shape)}"
    assert chunks.dtype == k_cache.dtype, f"chunks dtype {chunks.dtype} != cache dtype {k_cache.dtype}"
    assert chunks.device == k_cache.device, f"chunks on {chunks.device}, caches on {k_cache.device}"
    if page_ids.numel():
        _launch(chunks, [k_cache], [v_cache], page_ids, scatter=True)


__all__ = ["gather_kv_pages", "scatter_kv_chunks", "scatter_kv_pages"]
