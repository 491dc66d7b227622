"""Test helpers shared by tests/kernels and bench/kernels_bench.py (torch only).

* :func:`make_paged_kv` builds a paged cache with shuffled pages and poisoned
  (NaN) slots everywhere a kernel must not read.
* :func:`reference_error_rule` is FlashAttention's accuracy rule: the kernel's
  error against an fp32 reference may be at most ``factor`` times the error of
  the same reference computed in the input's low precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedKV:
    """A paged K/V cache holding ``B`` sequences.

    Attributes:
        k_cache: ``[num_pages, page_size, KVH, D]``; unused pages and the slots
            past each sequence's end are NaN.
        v_cache: ``[num_pages, page_size, KVH, D]``, poisoned like ``k_cache``.
        block_tables: ``[B, max_pages]`` int32; entries past a sequence's last
            page point at a poisoned page.
        kv_lens: tokens of each sequence, ``len(kv_lens) == B``.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: tuple[int, ...]


def make_paged_kv(
    kv_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
    poison: bool = True,
) -> PagedKV:
    """Random N(0, 1) K/V for sequences of ``kv_lens`` tokens in shuffled pages.

    Args:
        kv_lens: tokens per sequence.
        num_kv_heads: KVH.
        head_dim: D.
        page_size: tokens per page.
        dtype: cache dtype.
        device: cache device.
        seed: RNG seed (a CPU generator: the same data on every device).
        poison: fill every slot no sequence owns with NaN (costs a full pass
            over the cache; benchmarks turn it off).
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    max_pages = max(max(pages_per_seq, default=1), 1)
    num_pages = sum(pages_per_seq) + 1  # +1: a spare poisoned page for table padding
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    if poison:
        k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    else:
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_pages, generator=gen)
    spare = int(perm[-1])
    block_tables = torch.full((len(kv_lens), max_pages), spare, dtype=torch.int32)
    cursor = 0
    for b, (n, p) in enumerate(zip(kv_lens, pages_per_seq, strict=True)):
        block_tables[b, :p] = perm[cursor : cursor + p]
        cursor += p
    if poison:
        owned = torch.zeros(num_pages, page_size, dtype=torch.bool)
        for b, n in enumerate(kv_lens):
            pos = torch.arange(n)
            owned[block_tables[b, pos // page_size].long(), pos % page_size] = True
        owned = owned.to(device)[:, :, None, None]
        k_cache.masked_fill_(~owned, float("nan"))
        v_cache.masked_fill_(~owned, float("nan"))
    return PagedKV(k_cache, v_cache, block_tables.to(device), tuple(kv_lens))


def dense_kv(paged: PagedKV, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s K and V as ``[kv_lens[b], KVH, D]`` each, in position order."""
    page_size = paged.k_cache.shape[1]
    n = paged.kv_lens[b]
    pages = paged.block_tables[b, : -(-n // page_size)].long()
    return paged.k_cache[pages].flatten(0, 1)[:n], paged.v_cache[pages].flatten(0, 1)[:n]


def reference_error_rule(
    out: torch.Tensor, gold: torch.Tensor, lowp: torch.Tensor, factor: float = 2.0, floor: float = 1e-6
) -> tuple[bool, float, float]:
    """FlashAttention's rule: ``max|out - gold| <= factor * max|lowp - gold| + floor``.

    Args:
        out: kernel output, any float dtype.
        gold: the reference computed in fp32 from the same (low-precision) inputs.
        lowp: the reference computed in the inputs' own dtype.
        factor: allowed ratio of the two errors.
        floor: absolute slack, only so that exact 0-vs-0 cases pass.

    Returns:
        ``(ok, kernel_error, reference_error)``.
    """
    assert out.shape == gold.shape == lowp.shape, (out.shape, gold.shape, lowp.shape)
    assert not out.isnan().any(), "kernel output has NaN (read a poisoned slot?)"
    err = (out.double() - gold.double()).abs().max().item()
    ref_err = (lowp.double() - gold.double()).abs().max().item()
    return err <= factor * ref_err + floor, err, ref_err


def check_against_twin(out: torch.Tensor, twin, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args) -> None:
    """Asserts :func:`reference_error_rule` for ``out`` against the attention ``twin`` on the same
    inputs: gold in fp64 for fp32 inputs, else in fp32 (``upcast``), and low precision in the
    inputs' own dtype."""
    if q.dtype == torch.float32:
        gold, lowp = twin(q.double(), k.double(), v.double(), *args), twin(q, k, v, *args)
    else:
        gold, lowp = twin(q, k, v, *args), twin(q, k, v, *args, upcast=False)
    ok, err, ref_err = reference_error_rule(out, gold, lowp)
    assert ok, f"error {err:.3e} > 2 x the twin's low-precision error {ref_err:.3e}"
