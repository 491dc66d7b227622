"""Copy plans between a client's buffers and arena extents, run on several threads.

A plan is a list of ``(local address, arena offset, length)`` operations. The
shm mover turns each into one ``memmove``; ``ctypes.memmove`` is a foreign call
and releases the GIL, so a large plan split across threads copies in parallel.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

Extent = tuple[int, int]
"""``(address or offset, length)``."""
Op = tuple[int, int, int]
"""``(local address, arena offset, length)``."""

DEFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))  # 8 copy at 27 GB/s on a 16-core H200 host (6 on one)
PARALLEL_MIN_BYTES = 2 << 20
"""Plans smaller than this run on the calling thread (a hand-off costs more than it saves)."""
PIECE_BYTES = 1 << 20
"""Large copies are cut to at most this much; threads take pieces as they come free."""


def buffer_address(buf) -> int:
    """The address of a writable Python buffer (mmap, bytearray, memoryview)."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def local_buffer(buf) -> tuple[int, int, object]:
    """``(address, nbytes, keepalive)`` of a contiguous CPU buffer or tensor (no copy).

    Keep ``keepalive`` referenced until every copy that uses the address is done.
    """
    if hasattr(buf, "data_ptr"):  # torch.Tensor
        if buf.device.type != "cpu":
            raise ValueError("a CUDA tensor needs the staging path (kvstore/transport/gpu.py)")
        if not buf.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    if type(buf) in (bytearray, memoryview) and not (type(buf) is memoryview and buf.readonly):
        try:  # the common case, ~5x cheaper than going through numpy
            c = ctypes.c_char.from_buffer(buf)
            return ctypes.addressof(c), memoryview(buf).nbytes, c
        except (TypeError, ValueError):  # empty or not contiguous: numpy says which
            pass
    arr = np.frombuffer(buf, dtype=np.uint8)
    return (arr.ctypes.data if arr.size else 0), arr.nbytes, arr


def slice_extents(extents: Sequence[Extent], offset: int, length: int) -> list[Extent]:
    """The sub-runs of ``extents`` (taken back to back) that cover bytes ``[offset, offset+length)``."""
    out, pos = [], 0
    end = offset + length
    for start, n in extents:
        lo, hi = max(pos, offset), min(pos + n, end)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += n
        if pos >= end:
            break
    return out


def plan(local: Sequence[Extent], arena: Sequence[Extent]) -> list[Op]:
    """Pairs local runs with arena runs of the same total length, in order."""
    local = [e for e in local if e[1]]
    arena = [e for e in arena if e[1]]
    ops: list[Op] = []
    i = j = 0
    la, ln = local[0] if local else (0, 0)
    aa, an = arena[0] if arena else (0, 0)
    while i < len(local) and j < len(arena):
        n = min(ln, an)
        if n:
            ops.append((la, aa, n))
        la, ln, aa, an = la + n, ln - n, aa + n, an - n
        if not ln:
            i += 1
            if i < len(local):
                la, ln = local[i]
        if not an:
            j += 1
            if j < len(arena):
                aa, an = arena[j]
    assert i == len(local) and j == len(arena), "local and arena extents differ in length"
    return ops


class CopyEngine:
    """Runs memmove lists on up to ``threads`` threads (the caller's included).

    Large lists are cut into pieces of at most PIECE_BYTES that every thread
    takes from one shared counter, so a thread the scheduler delays (a busy
    core) leaves its share to the others instead of holding up the batch.
    """

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="shm-copy")
                      if self.threads > 1 else None)

    def run(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Performs every ``(dst address, src address, length)`` move; all addresses must be valid."""
        total = sum(m[2] for m in moves)
        if self._pool is None or total < PARALLEL_MIN_BYTES:
            _run(moves)
            return
        pieces = _pieces(moves)
        counter = itertools.count()  # next() is atomic under the GIL
        helpers = min(self.threads - 1, len(pieces) - 1)
        futures = [self._pool.submit(_take, pieces, counter) for _ in range(helpers)]
        try:
            _take(pieces, counter)
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _run(moves) -> None:
    memmove = ctypes.memmove
    for dst, src, n in moves:
        memmove(dst, src, n)


def _take(pieces, counter) -> None:
    memmove, num = ctypes.memmove, len(pieces)
    for i in counter:
        if i >= num:
            return
        dst, src, n = pieces[i]
        memmove(dst, src, n)


def _pieces(moves) -> list[tuple[int, int, int]]:
    """The moves cut into pieces of at most PIECE_BYTES, in order."""
    out = []
    for dst, src, n in moves:
        while n > PIECE_BYTES:
            out.append((dst, src, PIECE_BYTES))
            dst, src, n = dst + PIECE_BYTES, src + PIECE_BYTES, n - PIECE_BYTES
        if n:
            out.append((dst, src, n))
    return out
