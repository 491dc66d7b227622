"""PyTorch twins of the Triton kernels: the executable specification.

Every kernel in this package has a twin here with the same signature (plus an
``upcast`` knob on the attention twins). The twins are what the dispatch layer
runs on CPU, and what the tests hold the Triton kernels to.

Shapes used throughout (names match the kernels' docstrings):

* ``B``: batch (number of sequences); ``H``: query heads; ``KVH``: KV heads,
  ``H % KVH == 0`` (GQA: query head ``h`` reads KV head ``h // (H // KVH)``);
  ``D``: head dim.
* Paged cache: ``k_cache``/``v_cache`` ``[num_pages, page_size, KVH, D]``;
  ``block_tables`` ``[B, max_pages]`` int32 maps a sequence's logical page
  ``i`` (token positions ``i*page_size .. (i+1)*page_size-1``) to a physical
  page. Pages may appear in any order.
* Chunk layout (the store's payload, see DESIGN.md):
  ``[L, 2 (K, V), KVH, chunk_tokens, D]``, layer-major.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
# NOTE: largest finite e4m3fn value; a scale maps each head's amax onto it.
FP8_MAX = 448.0

Caches = torch.Tensor | Sequence[torch.Tensor]


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if upcast else dtype


def _gather_seq_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers one sequence's first ``num_tokens`` K/V rows from the paged cache.

    Args:
        k_cache: ``[num_pages, page_size, KVH, D]``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        block_table: ``[max_pages]`` int32 physical page ids.
        num_tokens: tokens to gather, ``<= max_pages * page_size``.

    Returns:
        ``(k, v)``, each ``[num_tokens, KVH, D]``.
    """
    page_size = k_cache.shape[1]
    num_pages = -(-num_tokens // page_size)
    pages = block_table[:num_pages].long()
    k = k_cache.index_select(0, pages).flatten(0, 1)[:num_tokens]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:num_tokens]
    return k, v


def _visible(q_pos: torch.Tensor, num_keys: int, device: torch.device) -> torch.Tensor:
    """``[T, S]`` bool: key ``s`` is visible to the query at ``q_pos[t]`` when ``s <= q_pos[t]``."""
    key_pos = torch.arange(num_keys, device=device)
    return key_pos[None, :] <= q_pos[:, None].to(device)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, upcast: bool
) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``q_pos`` over dense keys ``0..S-1``.

    Args:
        q: ``[T, H, D]``.
        k: ``[S, KVH, D]``, key ``s`` sits at position ``s``.
        v: ``[S, KVH, D]``.
        q_pos: ``[T]`` int, position of each query; it sees keys ``<= q_pos``.
        scale: softmax scale.
        upcast: compute in at least fp32 (True; fp64 stays fp64) or in the
            input dtype (False), the low-precision baseline of the tests' error rule.

    Returns:
        ``[T, H, D]`` in ``q.dtype``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    cdt = _compute_dtype(q.dtype, upcast)
    # NOTE: GQA by viewing the query heads as [KVH, group] (query head h reads KV
    # head h // group) and broadcasting K/V over the group: the same dot products
    # as repeating K/V per query head, without materialising the copies.
    qh = q.to(cdt).view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    kh = k.to(cdt).transpose(0, 1)[:, None]  # [KVH, 1, S, D]
    vh = v.to(cdt).transpose(0, 1)[:, None]  # [KVH, 1, S, D]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [KVH, G, T, S]
    scores = scores.masked_fill(~_visible(q_pos, k.shape[0], q.device), float("-inf"))
    # NOTE: softmax in at least fp32 (as FlashAttention's low-precision reference
    # does); only the two matmuls run in the input dtype when upcast=False.
    probs = torch.softmax(scores.to(torch.promote_types(cdt, torch.float32)), dim=-1).to(cdt)
    out = torch.matmul(probs, vh)  # [KVH, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim).to(q.dtype)  # [T, H, D]


def fused_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, upcast: bool
) -> torch.Tensor:
    """:func:`dense_causal_attention` through torch's fused ``scaled_dot_product_attention``.

    On a CPU that is a FlashAttention-style kernel: it walks the keys in blocks with an online
    softmax, on every core, and never holds the ``[H, T, S]`` scores. The dense twin does, three
    times over (scores, mask, probabilities): a 512-token chunk over a 32k-token history with 8
    heads is 1.5 GiB of fresh pages per layer per step. The engine's CPU path runs this; the tests
    hold it to the dense twin. ``upcast`` is the twin's; the kernel accumulates in fp32 anyway.
    """
    cdt = _compute_dtype(q.dtype, upcast)
    qh = q.to(cdt).transpose(0, 1)[None]  # [1, H, T, D]
    kh = k.to(cdt).transpose(0, 1)[None]  # [1, KVH, S, D]
    vh = v.to(cdt).transpose(0, 1)[None]
    mask = None  # one query at the last position (a decode token) sees every key
    if q.shape[0] > 1 or int(q_pos[0]) != k.shape[0] - 1:
        mask = _visible(q_pos, k.shape[0], q.device)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(q.dtype)  # [T, H, D]


def chunked_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    upcast: bool = True,
    fused: bool = False,
) -> torch.Tensor:
    """Attention of one chunk of queries per sequence over its paged history and itself.

    Query ``t`` of sequence ``b`` sits at position ``context_lens[b] + t`` and
    attends to every position ``<=`` its own. The chunk's own K/V are already in
    the paged cache, at positions ``context_lens[b] .. context_lens[b]+q_len-1``.

    Args:
        q: ``[total_q_tokens, H, D]``; sequence ``b`` owns rows
            ``cu_q_lens[b]:cu_q_lens[b+1]``.
        k_cache: ``[num_pages, page_size, KVH, D]``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        block_tables: ``[B, max_pages]`` int32.
        cu_q_lens: ``[B + 1]`` int32 cumulative query counts, ``cu_q_lens[0] == 0``.
        context_lens: ``[B]`` int32 tokens already in the cache before the chunk.
        scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[total_q_tokens, H, D]`` buffer, written and returned.
        upcast: compute in at least fp32 (default) or in the input dtype.
        fused: attend with :func:`fused_causal_attention` (the engine's CPU path) instead of
            the dense twin.

    Returns:
        ``[total_q_tokens, H, D]`` in ``q.dtype``.
    """
    result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    attend = fused_causal_attention if fused else dense_causal_attention
    cu = cu_q_lens.tolist()
    ctx = context_lens.tolist()
    for b in range(len(ctx)):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k, v = _gather_seq_kv(k_cache, v_cache, block_tables[b], ctx[b] + end - start)
        q_pos = torch.arange(ctx[b], ctx[b] + end - start, device=q.device)
        result[start:end] = attend(q[start:end], k, v, q_pos, scale, upcast)
    return result


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    upcast: bool = True,
    fused: bool = False,
) -> torch.Tensor:
    """One new query token per sequence attending to all its ``seq_lens[b]`` cached tokens.

    Args:
        q: ``[B, H, D]``.
        k_cache: ``[num_pages, page_size, KVH, D]``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        block_tables: ``[B, max_pages]`` int32.
        seq_lens: ``[B]`` int32, the current token's K/V included; 0 marks batch
            padding and yields zeros.
        scale: softmax scale.
        out: optional ``[B, H, D]`` buffer, written and returned.
        upcast: compute in at least fp32 (default) or in the input dtype.
        fused: attend with :func:`fused_causal_attention` instead of the dense twin.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    attend = fused_causal_attention if fused else dense_causal_attention
    # NOTE: one fused call per sequence, on purpose. The whole batch padded to its longest sequence
    # in one masked SDPA call was measured slower on this project's CPU (torch 2.13, 2 cores) at every
    # head_dim of 32 and above: 8 x 1,024 tokens 6.7 ms vs 1.4, 32 x 1,024 50 vs 6.2, 64 x 2,048 178
    # vs 28 (16 query heads, 4 KV heads, head_dim 64); likewise an einsum over the padded batch. It
    # won only with random:tiny's 16-wide heads (64 x 256: 0.4 ms vs 2.5).
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:  # batch padding
            result[b] = 0
            continue
        k, v = _gather_seq_kv(k_cache, v_cache, block_tables[b], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        result[b] = attend(q[b : b + 1], k, v, q_pos, scale, upcast)[0]
    return result


def as_layer_list(caches: Caches) -> list[torch.Tensor]:
    """Normalizes per-layer caches to a list of ``[num_pages, page_size, KVH, D]`` tensors.

    Args:
        caches: a sequence of ``L`` tensors ``[num_pages, page_size, KVH, D]`` or
            one stacked tensor ``[L, num_pages, page_size, KVH, D]``.
    """
    if isinstance(caches, torch.Tensor):
        assert caches.dim() == 5, f"stacked cache must be [L, pages, page_size, KVH, D], got {tuple(caches.shape)}"
        return list(caches.unbind(0))
    return list(caches)


def gather_kv_pages(
    k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copies one chunk's pages, for all layers, into the contiguous chunk layout.

    Args:
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` (or stacked
            ``[L, num_pages, page_size, KVH, D]``).
        v_caches: same shapes as ``k_caches``.
        page_ids: ``[P]`` int32, the chunk's pages in token order.
        out: optional ``[L, 2, KVH, P * page_size, D]`` buffer.

    Returns:
        ``[L, 2, KVH, P * page_size, D]``: ``out[l, 0, h, t]`` is the K of token
        ``t`` of the chunk at layer ``l``, head ``h``; ``out[l, 1]`` the V.
    """
    ks, vs = as_layer_list(k_caches), as_layer_list(v_caches)
    _, page_size, num_kv_heads, head_dim = ks[0].shape
    chunk_tokens = page_ids.numel() * page_size
    if out is None:
        out = torch.empty(
            len(ks), 2, num_kv_heads, chunk_tokens, head_dim, dtype=ks[0].dtype, device=ks[0].device
        )
    pages = page_ids.long()
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        # [P, page_size, KVH, D] -> [P * page_size, KVH, D] -> [KVH, T, D]
        out[layer, 0] = k[pages].flatten(0, 1).transpose(0, 1)
        out[layer, 1] = v[pages].flatten(0, 1).transpose(0, 1)
    return out


def scatter_kv_pages(chunk: torch.Tensor, k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor) -> None:
    """Writes a contiguous chunk into the pages ``page_ids`` of every layer's cache, in place.

    Inverse of :func:`gather_kv_pages`.

    Args:
        chunk: ``[L, 2, KVH, P * page_size, D]``.
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` (or stacked), written.
        v_caches: same shapes as ``k_caches``, written.
        page_ids: ``[P]`` int32 distinct page ids, in token order.
    """
    ks, vs = as_layer_list(k_caches), as_layer_list(v_caches)
    _, page_size, num_kv_heads, head_dim = ks[0].shape
    num_pages = page_ids.numel()
    pages = page_ids.long()
    chunk = chunk.to(ks[0].device)  # (a page-locked host chunk for device caches)
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        # [KVH, T, D] -> [T, KVH, D] -> [P, page_size, KVH, D]
        k[pages] = chunk[layer, 0].transpose(0, 1).reshape(num_pages, page_size, num_kv_heads, head_dim)
        v[pages] = chunk[layer, 1].transpose(0, 1).reshape(num_pages, page_size, num_kv_heads, head_dim)


def scatter_kv_chunks(chunks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_ids: torch.Tensor) -> None:
    """Writes one layer of many chunks into that layer's caches, in place.

    Args:
        chunks: ``[N, 2, KVH, P * page_size, D]``: chunk ``n``'s K and V at this layer.
        k_cache: ``[num_pages, page_size, KVH, D]``, written.
        v_cache: the same for V.
        page_ids: ``[N, P]`` int32, row ``n`` the pages of chunk ``n`` (all distinct).
    """
    n, _, num_kv_heads, _, head_dim = chunks.shape
    page_size = k_cache.shape[1]
    pages = page_ids.long().flatten()  # chunk-major: chunk n's pages in token order
    chunks = chunks.to(k_cache.device)  # (page-locked host chunks for device caches)
    # [N, KVH, T, D] -> [N, T, KVH, D] -> [N * P, page_size, KVH, D]: one write per cache
    k_cache[pages] = chunks[:, 0].transpose(1, 2).reshape(pages.numel(), page_size, num_kv_heads, head_dim)
    v_cache[pages] = chunks[:, 1].transpose(1, 2).reshape(pages.numel(), page_size, num_kv_heads, head_dim)


def layer_part(source: torch.Tensor, offset_words: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` tensor of ``dtype`` whose bytes start ``offset_words`` 8-byte words into a
    contiguous ``source`` (a view, no copy)."""
    words = source.reshape(-1).view(torch.uint8).view(torch.int64)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size() // 8
    assert offset_words + n <= words.numel(), (
        f"source of {words.numel()} words has no {n} words at word {offset_words}")
    return words[offset_words : offset_words + n].view(torch.uint8).view(dtype).view(shape)


def wsum64_share(part: torch.Tensor, position_words: int, k: int) -> torch.Tensor:
    """0-dim int64: ``sum_i word_i * ((2 (position_words + i) + 1) * k)`` mod 2^64 over the
    8-byte words of a contiguous ``part``: its share of the wsum64 of a payload in which it
    starts at word ``position_words`` (kvstore.chunk.wsum64 with multiplier ``k``)."""
    w = part.reshape(-1).view(torch.uint8).view(torch.int64)
    k = k - (1 << 64) if k >= 1 << 63 else k  # the same 64 bits as a signed integer
    m = (torch.arange(position_words, position_words + w.numel(), dtype=torch.int64, device=w.device) * 2 + 1) * k
    return (w * m).sum()


def scatter_kv_layer(sources: Sequence[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_ids: torch.Tensor, *, offset_words: int = 0, wsum_at: int | None = None,
                     wsum_k: int = 0) -> torch.Tensor | None:
    """Writes one layer of ``N`` chunks, each where its bytes are, into that layer's caches.

    Chunk ``n``'s layer is the ``[2, KVH, P * page_size, D]`` of the caches' dtype whose bytes
    start ``offset_words`` 8-byte words into the contiguous ``sources[n]`` (any shape, on the
    caches' device or in page-locked host memory); it goes to pages ``page_ids[n]``.

    Args:
        sources: ``N`` contiguous tensors.
        k_cache: ``[num_pages, page_size, KVH, D]``, written.
        v_cache: the same for V.
        page_ids: ``[N, P]`` int32, row ``n`` the pages of chunk ``n`` (all distinct).
        offset_words: where the layer starts in every source.
        wsum_at: when given, also each part's wsum64 share (:func:`wsum64_share`) at this word
            position of its payload, with multiplier ``wsum_k``.

    Returns:
        ``[N]`` int64 shares on the caches' device when ``wsum_at`` is given, else None.
    """
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    p = page_ids.shape[1]
    shape = (2, num_kv_heads, p * page_size, head_dim)
    parts = [layer_part(s, offset_words, shape, k_cache.dtype).to(k_cache.device) for s in sources]
    if parts:
        scatter_kv_chunks(torch.stack(parts), k_cache, v_cache, page_ids)
    if wsum_at is None:
        return None
    shares = [wsum64_share(part, wsum_at, wsum_k) for part in parts]
    return torch.stack(shares) if shares else torch.zeros(0, dtype=torch.int64, device=k_cache.device)


def quantize_kv_fp8(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a chunk to fp8 e4m3 with one scale per (layer, K/V, head).

    ``scale = amax / 448`` (1.0 for an all-zero head) and
    ``q = round_to_nearest_even(clamp(x / scale, -448, 448))``.

    Args:
        chunk: ``[L, 2, KVH, T, D]`` fp16/bf16/fp32.

    Returns:
        ``(q, scales)``: ``q`` ``[L, 2, KVH, T, D]`` ``torch.float8_e4m3fn``;
        ``scales`` ``[L, 2, KVH]`` float32 such that ``x ~= q * scale``.
    """
    x = chunk.float()
    amax = x.abs().amax(dim=(-2, -1))  # [L, 2, KVH]
    # NOTE: divide by a tensor, not the Python float: on CUDA, torch divides by a CPU scalar as
    # a multiplication by its reciprocal (BinaryDivTrueKernel.cu, "may lose one bit"), which
    # made the twin's scales 1 ulp off the kernel's IEEE division on the GPU (and with them
    # ~0.02% of the codes). A tensor divisor is a true division on every device.
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (x / scales[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_kv_fp8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`: ``x = q * scale`` in ``dtype``.

    Args:
        q: ``[L, 2, KVH, T, D]`` ``torch.float8_e4m3fn``.
        scales: ``[L, 2, KVH]`` float32.
        dtype: output dtype (ignored when ``out`` is given).
        out: optional ``[L, 2, KVH, T, D]`` buffer.

    Returns:
        ``[L, 2, KVH, T, D]``.
    """
    x = q.float() * scales.float()[..., None, None]
    if out is None:
        return x.to(dtype)
    out.copy_(x)
    return out
