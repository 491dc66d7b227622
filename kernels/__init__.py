"""Attention and KV-page kernels: Triton on CUDA, PyTorch twins elsewhere.

Import the public functions from here; :mod:`kernels.dispatch` picks the
backend per call (``CRESCENT_KERNELS=auto|triton|torch``). Importing this
package never imports Triton. See docs/kernels.md.
"""

from kernels.dispatch import (
    Backend,
    chunked_prefill_attention,
    dequantize_kv_fp8,
    gather_kv_pages,
    paged_decode_attention,
    quantize_kv_fp8,
    scatter_kv_chunks,
    scatter_kv_layer,
    scatter_kv_pages,
    select_backend,
    source_table,
    triton_available,
    warm_pointer_tables,
)

__all__ = [
    "Backend",
    "chunked_prefill_attention",
    "dequantize_kv_fp8",
    "gather_kv_pages",
    "paged_decode_attention",
    "quantize_kv_fp8",
    "scatter_kv_chunks",
    "scatter_kv_layer",
    "scatter_kv_pages",
    "select_backend",
    "source_table",
    "triton_available",
    "warm_pointer_tables",
]
