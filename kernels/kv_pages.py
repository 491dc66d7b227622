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

import ctypes
import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.host import to_device
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


@triton.jit(do_not_specialize=["offset_words", "wsum_at"])
def _kv_layer_kernel(
    src_table_ptr, cache_table_ptr, page_ids_ptr, shares_ptr,
    offset_words, wsum_at, wsum_k, tokens, num_heads, stride_pn,
    stride_cp, stride_cs, stride_ch,
    PAGE_SIZE: tl.constexpr, ROW_WORDS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
    CHECKSUM: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    # Program (chunk * 2 + kv, page, head) moves one [page_size, D] tile as 8-byte words (the
    # copy is byte for byte, whatever the dtype) from where chunk n's layer is (a table of
    # addresses: device memory, or page-locked host memory read over the bus) into its page.
    nkv = tl.program_id(0)
    p = tl.program_id(1)
    h = tl.program_id(2)
    n = nkv // 2
    kv = nkv % 2
    src = tl.load(src_table_ptr + n).to(tl.pointer_type(tl.int64)) + offset_words
    cache = tl.load(cache_table_ptr + kv).to(tl.pointer_type(tl.int64))
    if ALIGNED:  # (addresses loaded from memory, or offset by an argument not specialized on, carry no
        # alignment: 16-byte accesses need the hint; the launcher checked it holds)
        src = tl.multiple_of(src, 16)
        cache = tl.multiple_of(cache, 16)
    page = tl.load(page_ids_ptr + n * stride_pn + p).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_w = tl.arange(0, BLOCK_W)
    tok = p * PAGE_SIZE + offs_s
    # word of the tile in the chunk's layer, laid out [2, KVH, T, D]
    idx = ((kv * num_heads + h).to(tl.int64) * tokens + tok[:, None]) * ROW_WORDS + offs_w[None, :]
    dst = cache + page * stride_cp + h * stride_ch + offs_s[:, None] * stride_cs + offs_w[None, :]
    if BLOCK_S == PAGE_SIZE and BLOCK_W == ROW_WORDS:
        x = tl.load(src + idx)
        tl.store(dst, x)
    else:
        mask = (offs_s[:, None] < PAGE_SIZE) & (offs_w[None, :] < ROW_WORDS)
        x = tl.load(src + idx, mask=mask, other=0)
        tl.store(dst, x, mask=mask)
    if CHECKSUM:
        # NOTE: the wsum64 share of these words (docs/keys.md), from the registers the copy
        # loaded: the bytes cross the bus once for both. Integer arithmetic wraps mod 2^64.
        m = ((wsum_at + idx) * 2 + 1) * wsum_k
        share = tl.sum(tl.sum(x * m, axis=1), axis=0)
        tl.store(shares_ptr + (nkv * tl.num_programs(1) + p) * tl.num_programs(2) + h, share)


_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 1024
"""Far above what one engine uses (a table per layer and one of every layer: 2L + 1), so that
an engine's tables are never evicted while a kernel on another stream may still read them."""
_TABLES_LOCK = threading.Lock()


def _pointer_table(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """``[2L]`` int64 device tensor of cache addresses, K and V interleaved per layer.

    NOTE: cached by the addresses themselves, so a hit is always right (same
    addresses, same table) and the engine's fixed caches cost no host-to-device
    copy per call. A miss copies synchronously (the table may be read on any
    stream later); ``warm_pointer_tables`` makes an engine's at start. Thread-safe:
    the step, lander and saver threads all launch page kernels.
    """
    ptrs = tuple(t.data_ptr() for pair in zip(ks, vs, strict=True) for t in pair)
    key = (ks[0].device, ptrs)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = torch.tensor(ptrs, dtype=torch.int64).to(ks[0].device)
    with _TABLES_LOCK:
        table = _TABLES.setdefault(key, table)
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return table


def warm_pointer_tables(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
    """Makes the pointer tables the page kernels use for these caches (one per layer, one of
    all layers) now, so no load or save waits for one later."""
    for k, v in zip(ks, vs, strict=True):
        _pointer_table([k], [v])
    _pointer_table(ks, vs)


def _check_caches(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
    assert ks and len(ks) == len(vs), f"need one K and one V cache per layer, got {len(ks)} and {len(vs)}"
    first = ks[0]
    assert first.dim() == 4, f"caches must be [num_pages, page_size, KVH, D], got {tuple(first.shape)}"
    # NOTE: one set over all layers first (a third less host time than the loop below at 32
    # layers: the page kernels are short, and this runs before each launch); the loop names
    # what differs.
    if len({(t.shape, t.stride(), t.dtype, t.device) for t in ks + vs}) == 1:
        return
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


def _check_reachable(t: torch.Tensor, device: torch.device, what: str) -> None:
    """``t`` on ``device``, or in page-locked host memory that a kernel on CUDA ``device`` reads
    and writes over the bus (pinned, or a mapping registered with ``cudaHostRegister``)."""
    if t.device == device:
        return
    if device.type == "cuda" and t.device.type == "cpu":
        assert t.is_pinned(), (f"{what} in pageable host memory: a CUDA kernel reaches host memory "
                               "only when it is page-locked (pin_memory, or cudaHostRegister)")
        return
    raise AssertionError(f"{what} on {t.device}, caches on {device}")


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
        out: optional ``[L, 2, KVH, P * page_size, D]`` buffer, any strides: on the caches'
            device or, with CUDA caches, in page-locked host memory (the kernel writes it
            over the bus: a save straight into registered arena slots).

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
    _check_reachable(out, ks[0].device, "out")
    if page_ids.numel():
        _launch(out, ks, vs, page_ids, scatter=False)
    return out


def scatter_kv_pages(chunk: torch.Tensor, k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor) -> None:
    """Writes a chunk into the pages ``page_ids`` of every layer's K/V cache, in place.

    Args:
        chunk: ``[L, 2, KVH, P * page_size, D]``, any strides: on the caches' device or, with
            CUDA caches, in page-locked host memory (read over the bus, no staging copy).
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
    _check_reachable(chunk, ks[0].device, "chunk")
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
    _check_reachable(chunks, k_cache.device, "chunks")
    if page_ids.numel():
        _launch(chunks, [k_cache], [v_cache], page_ids, scatter=True)


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    return lib


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
_CUDA_ERROR_INVALID_CONTEXT = 201


def _address(t: torch.Tensor, device: torch.device) -> int:
    """Where a kernel on ``device`` reaches ``t``'s first byte."""
    if t.device == device:
        return t.data_ptr()
    if device.type == "cuda" and t.device.type == "cpu":
        # NOTE: the device's alias of page-locked host memory (on UVA systems usually the
        # host address itself; asked, not assumed). Pageable memory has none.
        out = ctypes.c_uint64(0)
        with torch.cuda.device(device):
            rc = _libcuda().cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                                  t.data_ptr())
        if rc == _CUDA_ERROR_INVALID_CONTEXT:
            raise RuntimeError("no CUDA context is current on this thread: make a CUDA call on it first")
        if rc != 0:
            raise ValueError("source in pageable host memory: a CUDA kernel reaches host memory only "
                             f"when it is page-locked (pin_memory, or cudaHostRegister) (CUresult {rc})")
        return out.value
    raise ValueError(f"source on {t.device}, caches on {device}")


def source_table(sources: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[N]`` int64 on ``device``: where a kernel there reads each source (on ``device``, or in
    page-locked host memory). Make it once for sources read many times (every layer of a
    load, the buffers of a ring) and pass it to :func:`scatter_kv_layer`. Its copy to the
    device is queued on the current stream (the host does not wait): use it on that stream,
    or after synchronising with it.

    Raises:
        ValueError: a source a kernel on ``device`` cannot reach (pageable host memory).
    """
    if device.type == "cuda" and device.index is None:  # ("cuda" names the current device; tensors say cuda:N)
        device = torch.device("cuda", torch.cuda.current_device())
    addrs = [_address(s, device) for s in sources]
    return to_device(addrs, torch.int64, device)


def scatter_kv_layer(sources: Sequence[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_ids: torch.Tensor, *, offset_words: int = 0, wsum_at: int | None = None,
                     wsum_k: int = 0, table: torch.Tensor | None = None) -> torch.Tensor | None:
    """One layer of ``N`` chunks, each read where its bytes are, into that layer's pages (one
    launch), with each part's wsum64 share computed from the same loads when ``wsum_at`` is
    given. Twin: :func:`kernels.reference.scatter_kv_layer` (same arguments and result).

    Args:
        sources: ``N`` contiguous tensors: on the caches' device, or in page-locked host memory
            (pinned, or a registered mapping such as the node's arena).
        k_cache: ``[num_pages, page_size, KVH, D]``, written; the rows of ``D`` a multiple of 8 bytes.
        v_cache: the same for V.
        page_ids: ``[N, P]`` int32, row ``n`` the pages of chunk ``n`` (all distinct).
        offset_words: where the layer starts in every source, in 8-byte words.
        wsum_at: the parts' word position in their payload, for their wsum64 shares.
        wsum_k: the wsum64 multiplier.
        table: ``source_table(sources, device)``, made once by the caller (else made here).

    Returns:
        ``[N]`` int64 wsum64 shares on the caches' device when ``wsum_at`` is given, else None.
    """
    _check_caches([k_cache], [v_cache])
    dev = k_cache.device
    assert page_ids.dtype == torch.int32 and page_ids.dim() == 2, "page_ids must be a 2-D int32 tensor"
    assert page_ids.device == dev, f"page_ids on {page_ids.device}, caches on {dev}"
    assert page_ids.stride(1) == 1, "page_ids rows must be contiguous"
    n, p = page_ids.shape
    assert len(sources) == n, f"{len(sources)} sources for {n} rows of page ids"
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    es = k_cache.element_size()
    strides = [st * es for st in k_cache.stride()]
    assert head_dim * es % 8 == 0 and k_cache.stride(-1) == 1 and all(st % 8 == 0 for st in strides[:3]), (
        "cache rows must be contiguous and 8-byte aligned (moved as 8-byte words)")
    row_words = head_dim * es // 8
    layer_words = 2 * num_kv_heads * p * page_size * row_words
    for s in sources:
        assert s.is_contiguous(), "every source must be contiguous"
        assert s.numel() * s.element_size() >= (offset_words + layer_words) * 8, (
            f"a source of {s.numel() * s.element_size()} bytes has no layer of {layer_words * 8} bytes "
            f"at word {offset_words}")
    if table is None:
        table = source_table(sources, dev)
    assert table.dtype == torch.int64 and tuple(table.shape) == (n,) and table.device == dev, (
        f"table must be [{n}] int64 on {dev}")
    shares = torch.empty((n, 2, p, num_kv_heads), dtype=torch.int64, device=dev) if wsum_at is not None else None
    if n and p:
        caches = _pointer_table([k_cache], [v_cache])
        aligned = (all(t.data_ptr() % 16 == 0 for t in (k_cache, v_cache)) and offset_words % 2 == 0
                   and row_words % 2 == 0 and all(st % 16 == 0 for st in strides[:3])
                   and all(s.data_ptr() % 16 == 0 for s in sources))
        ws = [st // 8 for st in strides[:3]]
        wk = wsum_k - (1 << 64) if wsum_k >= 1 << 63 else wsum_k
        _kv_layer_kernel[(2 * n, p, num_kv_heads)](
            table, caches, page_ids, shares if shares is not None else table,
            offset_words, wsum_at or 0, wk, p * page_size, num_kv_heads, page_ids.stride(0),
            ws[0], ws[1], ws[2],
            PAGE_SIZE=page_size, ROW_WORDS=row_words,
            BLOCK_S=triton.next_power_of_2(page_size), BLOCK_W=triton.next_power_of_2(row_words),
            CHECKSUM=shares is not None, ALIGNED=aligned, num_warps=4,
        )  # fmt: skip
    if shares is None:
        return None
    return shares.view(n, -1).sum(-1)


__all__ = ["gather_kv_pages", "scatter_kv_chunks", "scatter_kv_layer", "scatter_kv_pages", "source_table"]
