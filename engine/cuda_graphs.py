"""Decode steps replayed from CUDA graphs.

A decode step of a small batch is a few hundred kernel launches that each take
microseconds on the GPU; launched one by one from Python, the host is the
bottleneck (batch 1 ran 7x its HBM floor). So decode steps are captured once per
batch-size bucket at engine start and replayed: one launch per step.

A graph replays fixed shapes and fixed addresses, so every input lives in a
static buffer sized for the largest bucket, and a batch is padded up to its
bucket. Padding rows are harmless by construction: token 0 at position 0, block
table and KV slot in the runner's scratch page (a page no sequence owns), so
their writes land there and their reads see only it. The block table is as
wide as the longest sequence the model allows; the decode kernel slices each
sequence by its own length, so the width costs no parallelism.

With ``capture=False`` the same static-buffer path runs eagerly (no graph): the
CPU tests check the padding and the buffers with it, token for token against
the plain path; ``pytest -m gpu`` checks the captured graphs the same way.
"""

from __future__ import annotations

import bisect

import torch

from engine.model import AttnMetadata, CausalLM


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (vLLM's
    ladder: at most 7 padding rows past 8, so padding costs little of a step)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Static buffers and one CUDA graph per batch bucket for pure decode steps.

    Args:
        model: the runner's model.
        kv_caches: per layer ``(k_cache, v_cache)``; never reallocated while the graphs live.
        max_batch: the largest batch captured (larger ones run eagerly).
        max_pages: block-table width: pages of the longest sequence (longer ones run eagerly).
        scratch_page: a page no sequence owns, for the padding rows.
        capture: capture graphs (CUDA); False runs the static buffers eagerly.
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *, max_batch: int,
                 max_pages: int, scratch_page: int, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.page_size = k0.shape[1]
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.scratch_page = scratch_page
        self.buckets = batch_buckets(max_batch)
        pin = self.device.type == "cuda"
        # Host mirrors (pinned on CUDA: one small DMA each per step) and their device twins.
        self._host_i64 = torch.zeros(3, max_batch, dtype=torch.int64, pin_memory=pin)  # ids, positions, slots
        self._host_i32 = torch.zeros(max_batch, 1 + max_pages, dtype=torch.int32, pin_memory=pin)  # ctx, table
        self._np_i64 = self._host_i64.numpy()
        self._np_i32 = self._host_i32.numpy()
        self._dev_i64 = torch.zeros(3, max_batch, dtype=torch.int64, device=self.device)
        self._dev_i32 = torch.zeros(max_batch, 1 + max_pages, dtype=torch.int32, device=self.device)
        self._cu = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self._rows: list[tuple[list[int], int] | None] = [None] * max_batch
        """What each block-table row of the host mirror holds: (a sequence's page list, pages
        written), or None (padding). A list seen again is only longer (``Sequence.pages`` is
        appended to in place, replaced otherwise): its new pages alone are written, so a step
        costs O(batch), not O(batch x pages)."""
        self._fill_padding(0, max_batch)
        self._dev_i64.copy_(self._host_i64)
        self._dev_i32.copy_(self._host_i32)
        self._copied: torch.cuda.Event | None = None
        self._hidden: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0
        """Decode steps run through the buffers."""
        self.fallbacks = 0
        """Decode steps that did not fit (counted by the runner) and ran the plain path."""
        if capture:
            self._capture()

    def _meta(self, bucket: int) -> AttnMetadata:
        return AttnMetadata(
            positions=self._dev_i64[1, :bucket],
            slot_mapping=self._dev_i64[2, :bucket],
            block_tables=self._dev_i32[:bucket, 1:],
            cu_q_lens=self._cu[: bucket + 1],
            context_lens=self._dev_i32[:bucket, 0],
            is_decode=True,
            max_q_len=1,
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self._dev_i64[0, :bucket], self._meta(bucket), self.kv_caches)

    def _fill_padding(self, start: int, end: int) -> None:
        self._np_i64[:2, start:end] = 0
        self._np_i64[2, start:end] = self.scratch_page * self.page_size
        self._np_i32[start:end, 0] = 0
        self._np_i32[start:end, 1:] = self.scratch_page
        self._rows[start:end] = [None] * (end - start)

    def _capture(self) -> None:
        # NOTE: largest bucket first, all in one memory pool: the smaller graphs reuse the
        # activations' memory of the larger ones (they never run at the same time).
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                # An eager run first: Triton compiles this bucket's kernels (their split counts
                # differ by batch), cuBLAS picks its algorithms, outside the capture.
                self._forward(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._hidden[bucket] = self._forward(bucket)
                self._graphs[bucket] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, batch: int, max_pages: int) -> bool:
        return 0 < batch <= self.max_batch and max_pages <= self.max_pages

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of ``B`` sequences (one token each): ``[B, hidden]`` final hidden states.

        Args:
            ids: each sequence's token.
            positions: its position (also the tokens cached before it: one token per sequence).
            slots: the cache slot its K/V goes to.
            tables: each sequence's pages.
            input_ids: on the device, the tokens of the first ``len(input_ids)`` rows instead of
                ``ids`` (sampled there by the step before, not yet known to the host); copied in
                behind the host mirrors.
        """
        batch = len(ids)
        self.steps += 1
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's DMA has read the host mirrors
        self._np_i64[0, :batch] = ids
        self._np_i64[1, :batch] = positions
        self._np_i64[2, :batch] = slots
        self._np_i32[:batch, 0] = positions
        rows, table = self._rows, self._np_i32
        for b, pages in enumerate(tables):
            n, held = len(pages), rows[b]
            if held is not None and held[0] is pages and held[1] <= n:
                if held[1] < n:
                    table[b, 1 + held[1] : 1 + n] = pages[held[1] :]
            else:
                table[b, 1 : 1 + n] = pages
                table[b, 1 + n :] = self.scratch_page
            rows[b] = (pages, n)
        self._fill_padding(batch, bucket)
        self._dev_i64.copy_(self._host_i64, non_blocking=True)  # contiguous, a few KiB
        self._dev_i32[:bucket].copy_(self._host_i32[:bucket], non_blocking=True)
        if input_ids is not None:
            self._dev_i64[0, : len(input_ids)].copy_(input_ids)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        if self.captured:
            self._graphs[bucket].replay()
            return self._hidden[bucket][:batch]
        return self._forward(bucket)[:batch]


__all__ = ["DecodeGraphs", "batch_buckets"]
