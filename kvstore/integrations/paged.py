"""Moving chunks between a serving engine's paged KV cache and chunk payloads.

A chunk payload is ``[layers, 2 (K,V), kv_heads, chunk_tokens, head_dim]``
(docs/keys.md); a paged cache holds, per layer, blocks of ``block_size``
tokens, and a chunk spans ``chunk_tokens // block_size`` of them, listed in
token order. The functions here copy one layer of one chunk at a time, or, to
write a load, one layer of several chunks (``scatter_chunks``).

Where an element sits inside a block is the attention backend's business: vLLM
0.32 hands a connector each layer as a logical ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` view, but e.g. its CPU backend stores a block's K
transposed (``[head_dim, block_size]`` per head) and its V row-major, its AMX
kernels pack K and V in pairs, and GPU backends differ again. Instead of hard-coding layouts,
``learn_block_layout`` asks the backend's own cache-write function to store
known values into a one-block scratch page and reads back where each K and V
element landed. Any layout that is a permutation of the block's elements is
learned exactly; anything else is refused. FP8 caches (vLLM's ``fp8``,
``fp8_e4m3``, ``fp8_e5m2``) are learned the same way: the probe's values are
small integers (exact in both FP8 formats) times the layer's K/V scale, so the
backend's quantizer stores each of them exactly, and the chunk holds the FP8
codes themselves, byte for byte what the backend wrote.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(key, value, page, slot_mapping)``: the backend's cache update, with
``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` and ``page`` shaped like one
block of the layer's cache."""

_BASE = 256  # NOTE: every 16/32-bit float KV dtype (bf16 has 8 significant bits) holds 0..255 exactly.
_FP8_BASE = 8  # NOTE: e5m2 (3 significant bits) holds 0..7 exactly, e4m3 0..15.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class BlockLayout:
    """Where each K/V element of one block lives in a layer's page."""

    heads: int
    block_size: int
    head_dim: int
    index: torch.Tensor
    """``[2 * heads * block_size * head_dim]`` int64: for canonical element
    ``(kv, head, token, dim)`` (C order), its position in the page's logical view, flattened."""
    page_numel: int
    """Elements of one page's logical view (``index`` may leave some unused: padding)."""

    @property
    def covers_page(self) -> bool:
        return self.index.numel() == self.page_numel

    @functools.cached_property
    def strided(self) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None:
        """Per K and V, ``(offset, head stride, token stride, dim stride)`` when each sits in the page
        as a strided view (vLLM 0.32 CPU's float32, bfloat16 and FP8 pages on this project's CPU
        machine: K transposed, V row-major; GPU backends not yet seen); None for any other
        permutation (e.g. a packed AMX layout). Copies through strided views run at memory speed; an
        element index does not."""
        idx = self.index.view(2, self.heads, self.block_size, self.head_dim).cpu()
        out = []
        for kv in (0, 1):
            a = idx[kv]
            base = int(a[0, 0, 0])
            st = [int(a[1, 0, 0]) - base if self.heads > 1 else 0,
                  int(a[0, 1, 0]) - base if self.block_size > 1 else 0,
                  int(a[0, 0, 1]) - base if self.head_dim > 1 else 0]
            if min(st) < 0:
                return None
            grid = torch.meshgrid(*(torch.arange(n) for n in a.shape), indexing="ij")
            if not torch.equal(a, base + sum(g * s for g, s in zip(grid, st))):
                return None
            out.append((base, *st))
        return out[0], out[1]


def learn_block_layout(write: CacheWrite, page_like: torch.Tensor, heads: int, head_dim: int,
                       input_dtype: torch.dtype | None = None, scales: tuple[float, float] = (1.0, 1.0)) -> BlockLayout:
    """Learns a backend's block layout by letting it write known values.

    Args:
        write: the backend's cache update (see ``CacheWrite``); it receives a page of
            ``page_like``'s dtype (an FP8 cache's page as its FP8 dtype: a backend that
            keeps FP8 in ``uint8`` storage views it back).
        page_like: one block of the layer's cache (``cache[:1]``) in its element dtype
            (FP8 as ``torch.float8_*``); only its shape, strides, dtype and device are used.
        heads: KV heads of the layer.
        head_dim: head size.
        input_dtype: the dtype of the K and V the backend is handed (the model's); default
            the cache's.
        scales: the layer's K and V scales: an FP8 backend stores ``x / scale``.

    Raises:
        ValueError: the backend does not store K and V as a permutation of their elements.
    """
    bs = page_like.shape[2]
    n = 2 * heads * bs * head_dim
    base = _FP8_BASE if page_like.dtype in FP8_DTYPES else _BASE
    codes = torch.arange(n, device=page_like.device).view(2, heads, bs, head_dim)
    slots = torch.arange(bs, device=page_like.device)
    position_code = torch.zeros(page_like.numel(), dtype=torch.long, device=page_like.device)
    written: torch.Tensor | None = None
    for p in range(max(1, math.ceil(math.log(n, base)))):
        digit = (codes // base**p % base).to(torch.float32)
        k, v = ((digit[i] * scales[i]).to(input_dtype or page_like.dtype).transpose(0, 1).contiguous()
                for i in (0, 1))
        page = torch.full_like(page_like, -1)
        write(k, v, page, slots)
        flat = page.reshape(-1).to(torch.float64)
        hit = flat >= 0
        if written is None:
            written = hit
        elif not torch.equal(hit, written):
            raise ValueError("the attention backend's KV block layout is not a fixed permutation")
        position_code += flat.clamp(min=0).long() * base**p
    positions = written.nonzero().flatten()
    found = position_code[positions]
    if positions.numel() != n or not torch.equal(found.sort().values, torch.arange(n, device=found.device)):
        raise ValueError("the attention backend does not store K and V elements as they are, or as "
                         "their FP8 codes (other quantized caches are not supported)")
    index = torch.empty(n, dtype=torch.long, device=page_like.device)
    index[found] = positions
    return BlockLayout(heads, bs, head_dim, index, page_like.numel())


def gather_layer(cache: torch.Tensor, layout: BlockLayout, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copies one chunk's K and V of one layer out of the paged cache.

    Args:
        cache: the layer's cache, ``[num_blocks, ...]`` (one page per block).
        layout: from ``learn_block_layout`` for this layer.
        block_ids: ``[m]`` int64, the chunk's blocks in token order.
        out: ``[2, heads, m * block_size, head_dim]`` contiguous; receives K then V.
    """
    h, bs, d = layout.heads, layout.block_size, layout.head_dim
    m = block_ids.numel()
    assert out.shape == (2, h, m * bs, d) and out.is_contiguous(), (tuple(out.shape), m)
    pages = cache[block_ids].reshape(m, -1)
    canon = pages.index_select(1, layout.index).view(m, 2, h, bs, d)
    out.view(2, h, m, bs, d).copy_(canon.permute(1, 2, 0, 3, 4))


def scatter_layer(src: torch.Tensor, cache: torch.Tensor, layout: BlockLayout, block_ids: torch.Tensor,
                  first_block: int = 0) -> None:
    """Writes one chunk's K and V of one layer into the paged cache.

    Args:
        src: ``[2, heads, m * block_size, head_dim]``, K then V.
        cache: the layer's cache, ``[num_blocks, ...]``, written in place.
        layout: from ``learn_block_layout`` for this layer.
        block_ids: ``[m]`` int64, the chunk's blocks in token order.
        first_block: blocks of the chunk before this index are left untouched
            (the engine already holds them).
    """
    h, bs, d = layout.heads, layout.block_size, layout.head_dim
    m = block_ids.numel()
    assert src.shape == (2, h, m * bs, d), (tuple(src.shape), m)
    dst = block_ids[first_block:]
    k = dst.numel()
    if k == 0:
        return
    canon = src.view(2, h, m, bs, d)[:, :, first_block:].permute(2, 0, 1, 3, 4).reshape(k, -1)
    if layout.covers_page:
        pages = torch.empty((k, layout.page_numel), dtype=cache.dtype, device=cache.device)
    else:
        pages = cache[dst].reshape(k, -1)
    pages[:, layout.index] = canon.to(device=cache.device, dtype=cache.dtype)
    cache[dst] = pages.view(k, *cache.shape[1:])


def scatter_chunks(src: torch.Tensor, cache: torch.Tensor, layout: BlockLayout, block_ids: torch.Tensor,
                   rows: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> None:
    """Writes one layer of several chunks into the paged cache at once (``scatter_layer`` for each
    chunk, in one gather and one indexed write).

    Args:
        src: ``[n, 2, heads, m * block_size, head_dim]``, each chunk's K then V (a view across
            chunks whose strides differ from a contiguous tensor's is fine).
        cache: the layer's cache, ``[num_blocks, ...]``, written in place.
        layout: from ``learn_block_layout`` for this layer.
        block_ids: ``[k]`` int64, the blocks written, in the order of ``rows``.
        rows: ``[k]`` int64, for each block written its row among the ``n * m`` blocks of ``src``
            (chunk ``i``'s block ``b`` is row ``i * m + b``); None: every block, ``k = n * m``.
        scratch: a 1-D buffer of the cache's dtype and device, at least ``k`` pages, reused
            from call to call (a fresh one per call costs page faults); None: allocated here.
    """
    h, bs, d = layout.heads, layout.block_size, layout.head_dim
    n, m = src.shape[0], src.shape[3] // bs
    assert src.shape == (n, 2, h, m * bs, d), (tuple(src.shape), n, m)
    k = block_ids.numel()
    if k == 0:
        return
    blocks = src.reshape(n, 2, h, m, bs, d).permute(0, 3, 1, 2, 4, 5)  # [n, m, 2, h, bs, d]
    pages = _pages(cache, k, layout.page_numel, scratch)
    if not layout.covers_page:
        torch.index_select(cache.reshape(cache.shape[0], -1), 0, block_ids, out=pages)
    strided = layout.strided
    if strided is not None:
        blocks = blocks.reshape(n * m, 2, h, bs, d)
        if rows is not None:
            blocks = blocks.index_select(0, rows.to(blocks.device))
        for kv, (off, sh, st, sd) in enumerate(strided):
            pages.as_strided((k, h, bs, d), (layout.page_numel, sh, st, sd), pages.storage_offset() + off) \
                .copy_(blocks[:, kv])
    else:
        canon = blocks.reshape(n * m, -1)
        if rows is not None:
            canon = canon.index_select(0, rows.to(canon.device))
        pages[:, layout.index] = canon.to(device=cache.device, dtype=cache.dtype)
    cache[block_ids] = pages.view(k, *cache.shape[1:])


def _pages(cache: torch.Tensor, k: int, page_numel: int, scratch: torch.Tensor | None) -> torch.Tensor:
    if (scratch is None or scratch.numel() < k * page_numel or scratch.dtype != cache.dtype
            or scratch.device != cache.device):
        return torch.empty((k, page_numel), dtype=cache.dtype, device=cache.device)
    return scratch[:k * page_numel].view(k, page_numel)


def gather_chunks(cache: torch.Tensor, layout: BlockLayout, block_ids: torch.Tensor, out: torch.Tensor,
                  scratch: torch.Tensor | None = None) -> None:
    """Copies one layer of several chunks out of the paged cache at once (``gather_layer`` for each
    chunk, in one indexed read).

    Args:
        cache: the layer's cache, ``[num_blocks, ...]``.
        layout: from ``learn_block_layout`` for this layer.
        block_ids: ``[n * m]`` int64, the chunks' blocks, chunk after chunk, each in token order.
        out: ``[n, 2, heads, m * block_size, head_dim]`` on the cache's device, each chunk's rows
            contiguous (e.g. one layer of ``[n, layers, 2, heads, tokens, head_dim]``); receives K
            then V.
        scratch: as ``scatter_chunks``'s, at least ``n * m`` pages.
    """
    h, bs, d = layout.heads, layout.block_size, layout.head_dim
    n, m = out.shape[0], out.shape[3] // bs
    assert out.shape == (n, 2, h, m * bs, d) and block_ids.numel() == n * m, (tuple(out.shape), block_ids.numel())
    if n == 0:
        return
    pages = _pages(cache, n * m, layout.page_numel, scratch)
    torch.index_select(cache.reshape(cache.shape[0], -1), 0, block_ids, out=pages)
    dst = out.view(n, 2, h, m, bs, d).permute(0, 3, 1, 2, 4, 5)  # [n, m, 2, h, bs, d]
    strided = layout.strided
    if strided is None:
        dst.copy_(pages.index_select(1, layout.index).view(n, m, 2, h, bs, d))
        return
    for kv, (off, sh, st, sd) in enumerate(strided):
        view = pages.as_strided((n * m, h, bs, d), (layout.page_numel, sh, st, sd), pages.storage_offset() + off)
        dst[:, :, kv].copy_(view.view(n, m, h, bs, d))
