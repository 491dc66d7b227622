"""Backend choice: the Triton kernels on CUDA, their PyTorch twins elsewhere.

The engine and the store call only these functions. ``CRESCENT_KERNELS``
forces a backend:

* unset or ``auto``: Triton for CUDA tensors when Triton is installed, else torch;
* ``torch``: the twins in :mod:`kernels.reference`, everywhere (on CPU tensors the attention
  twins attend through torch's fused ``scaled_dot_product_attention``, which never holds the
  score matrix: ``reference.fused_causal_attention``);
* ``triton``: the Triton kernels, also on CPU tensors, where they run in the
  Triton interpreter (``TRITON_INTERPRET=1`` must be set before Triton is
  imported; the tests do this in ``tests/kernels/conftest.py``).

Triton is imported lazily, on the first Triton call: this module and the twins
work without it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Literal

import torch

from kernels import reference
from kernels.reference import Caches

Backend = Literal["triton", "torch"]
ENV_VAR = "CRESCENT_KERNELS"
_CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` imports (tried once; only asked for CUDA tensors or when forced)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def select_backend(device: torch.device, *, needs_fp8: bool = False) -> Backend:
    """Chooses the backend for tensors on ``device``.

    Args:
        device: where the kernel's tensors live.
        needs_fp8: the kernel converts to fp8, which the GPU does in hardware
            only from sm89 (Ada, Hopper) on; older GPUs get the twin.

    Raises:
        ValueError: ``CRESCENT_KERNELS`` holds something other than auto/triton/torch.
        RuntimeError: ``CRESCENT_KERNELS=triton`` cannot be honoured (Triton is
            missing, or CPU tensors without ``TRITON_INTERPRET=1``).
    """
    forced = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if forced not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={forced!r}: set it to one of {', '.join(_CHOICES)} (or unset it)")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed: pip install 'crescent[kernels]'")
        if device.type == "cpu" and not _interpreting():
            raise RuntimeError(
                f"{ENV_VAR}=triton on CPU tensors runs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before Triton is first imported"
            )
        return "triton"
    if device.type != "cuda" or not triton_available():
        return "torch"
    if needs_fp8 and torch.cuda.get_device_capability(device) < (8, 9):
        return "torch"
    return "triton"


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
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Chunk of queries per sequence over its paged history plus itself, causal.

    Query ``t`` of sequence ``b`` sits at position ``context_lens[b] + t`` and
    sees every position ``<=`` its own; the chunk's K/V are already in the cache.

    Args:
        q: ``[total_q_tokens, H, D]``, sequence ``b`` owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``.
        k_cache: ``[num_pages, page_size, KVH, D]``, ``H % KVH == 0``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        block_tables: ``[B, max_pages]`` int32.
        cu_q_lens: ``[B + 1]`` int32.
        context_lens: ``[B]`` int32.
        scale: softmax scale.
        out: optional ``[total_q_tokens, H, D]`` buffer.
        max_q_len: longest chunk, spares the Triton path a host sync.

    Returns:
        ``[total_q_tokens, H, D]`` in ``q.dtype``.
    """
    if select_backend(q.device) == "torch":
        return reference.chunked_prefill_attention(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale,
                                                   out, fused=q.device.type == "cpu")
    from kernels import prefill_attention

    return prefill_attention.chunked_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale, out, max_q_len=max_q_len
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its ``seq_lens[b]`` cached tokens.

    Args:
        q: ``[B, H, D]``.
        k_cache: ``[num_pages, page_size, KVH, D]``.
        v_cache: ``[num_pages, page_size, KVH, D]``.
        block_tables: ``[B, max_pages]`` int32.
        seq_lens: ``[B]`` int32; 0 (batch padding) yields zeros.
        scale: softmax scale.
        out: optional ``[B, H, D]`` buffer.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    if select_backend(q.device) == "torch":
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                                                fused=q.device.type == "cpu")
    from kernels import decode_attention

    return decode_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out)


def _device_of(caches: Caches) -> torch.device:
    return caches.device if isinstance(caches, torch.Tensor) else caches[0].device


def gather_kv_pages(
    k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copies one chunk's pages of every layer into ``[L, 2, KVH, P * page_size, D]``.

    Args:
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` or stacked ``[L, num_pages, page_size, KVH, D]``.
        v_caches: same shapes as ``k_caches``.
        page_ids: ``[P]`` int32, the chunk's pages in token order.
        out: optional ``[L, 2, KVH, P * page_size, D]`` buffer.

    Returns:
        ``[L, 2, KVH, P * page_size, D]``.
    """
    if select_backend(_device_of(k_caches)) == "torch":
        return reference.gather_kv_pages(k_caches, v_caches, page_ids, out)
    from kernels import kv_pages

    return kv_pages.gather_kv_pages(k_caches, v_caches, page_ids, out)


def scatter_kv_pages(chunk: torch.Tensor, k_caches: Caches, v_caches: Caches, page_ids: torch.Tensor) -> None:
    """Writes ``chunk`` ``[L, 2, KVH, P * page_size, D]`` into pages ``page_ids`` of every layer, in place.

    Args:
        chunk: ``[L, 2, KVH, P * page_size, D]``.
        k_caches: ``L`` x ``[num_pages, page_size, KVH, D]`` or stacked, written.
        v_caches: same shapes as ``k_caches``, written.
        page_ids: ``[P]`` int32 distinct page ids.
    """
    if select_backend(_device_of(k_caches)) == "torch":
        reference.scatter_kv_pages(chunk, k_caches, v_caches, page_ids)
        return
    from kernels import kv_pages

    kv_pages.scatter_kv_pages(chunk, k_caches, v_caches, page_ids)


def scatter_kv_chunks(chunks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_ids: torch.Tensor) -> None:
    """Writes layer ``l`` of ``N`` chunks, ``[N, 2, KVH, P * page_size, D]``, into layer ``l``'s
    caches at ``page_ids`` ``[N, P]`` int32 (row ``n``: chunk ``n``'s pages), in place."""
    if select_backend(k_cache.device) == "torch":
        reference.scatter_kv_chunks(chunks, k_cache, v_cache, page_ids)
        return
    from kernels import kv_pages

    kv_pages.scatter_kv_chunks(chunks, k_cache, v_cache, page_ids)


def warm_pointer_tables(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
    """Makes the device tables of cache addresses the page kernels read for these caches now
    (Triton on CUDA; nothing to make for the twin), so that no load or save waits for one."""
    if not k_caches or select_backend(k_caches[0].device) == "torch":
        return
    from kernels import kv_pages

    kv_pages.warm_pointer_tables(list(k_caches), list(v_caches))


def source_table(sources: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """Where a kernel on ``device`` reads each of ``sources`` (``[N]`` int64 addresses), for
    :func:`scatter_kv_layer` calls that read the same sources again; None where the twin runs
    (it needs none).

    Raises:
        ValueError: a source that kernel cannot reach (pageable host memory with CUDA caches).
    """
    if select_backend(device) == "torch":
        return None
    from kernels import kv_pages

    return kv_pages.source_table(sources, device)


def scatter_kv_layer(sources: Sequence[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_ids: torch.Tensor, *, offset_words: int = 0, wsum_at: int | None = None,
                     wsum_k: int = 0, table: torch.Tensor | None = None) -> torch.Tensor | None:
    """Writes one layer of ``N`` chunks, each read where it is (the caches' device, or page-locked
    host memory such as the node's registered arena), into pages ``page_ids`` ``[N, P]``, in
    place, in one launch; returns each part's wsum64 share (``[N]`` int64) when ``wsum_at`` is
    given. Chunk ``n``'s layer is the ``[2, KVH, P * page_size, D]`` whose bytes start
    ``offset_words`` 8-byte words into ``sources[n]``. See :func:`kernels.kv_pages.scatter_kv_layer`."""
    if select_backend(k_cache.device) == "torch":
        return reference.scatter_kv_layer(sources, k_cache, v_cache, page_ids, offset_words=offset_words,
                                          wsum_at=wsum_at, wsum_k=wsum_k)
    from kernels import kv_pages

    return kv_pages.scatter_kv_layer(sources, k_cache, v_cache, page_ids, offset_words=offset_words,
                                     wsum_at=wsum_at, wsum_k=wsum_k, table=table)


def quantize_kv_fp8(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``[L, 2, KVH, T, D]`` to e4m3 with ``[L, 2, KVH]`` float32 scales.

    Returns:
        ``(q, scales)`` with ``x ~= q.float() * scales[..., None, None]``.
    """
    if select_backend(chunk.device, needs_fp8=True) == "torch":
        return reference.quantize_kv_fp8(chunk)
    from kernels import fp8

    return fp8.quantize_kv_fp8(chunk)


def dequantize_kv_fp8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`.

    Args:
        q: ``[L, 2, KVH, T, D]`` ``torch.float8_e4m3fn``.
        scales: ``[L, 2, KVH]`` float32.
        dtype: output dtype when ``out`` is None.
        out: optional ``[L, 2, KVH, T, D]`` buffer.

    Returns:
        ``[L, 2, KVH, T, D]``.
    """
    if select_backend(q.device, needs_fp8=True) == "torch":
        return reference.dequantize_kv_fp8(q, scales, dtype, out)
    from kernels import fp8

    return fp8.dequantize_kv_fp8(q, scales, dtype, out)
