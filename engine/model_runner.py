"""Owns the model and its paged KV cache; turns a scheduled step into tensors and logits."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

import kernels
from kernels.host import to_device
from engine.config import EngineConfig, ModelConfig, apply_overrides, preset_config
from engine.cuda_graphs import DecodeGraphs
from engine.model import AttnMetadata, CausalLM, load_checkpoint, random_model
from engine.scheduler import ScheduledSeq
from kvstore.chunk import wsum64

log = logging.getLogger(__name__)


def load_model_config(model: str, hf_overrides: dict | None = None) -> ModelConfig:
    if model.startswith("random:"):
        return preset_config(model.split(":", 1)[1], hf_overrides)
    return apply_overrides(ModelConfig.from_folder(model), hf_overrides)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_config: ModelConfig) -> None:
        self.cfg = cfg
        self.model_config = mc = model_config
        self.device = cfg.torch_device()
        self.dtype = cfg.torch_dtype()
        if cfg.model.startswith("random:"):
            self.model: CausalLM = random_model(mc, cfg.seed, self.dtype, self.device)
        else:
            self.model = load_checkpoint(cfg.model, mc, self.dtype, self.device)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.page_bytes = 2 * mc.num_hidden_layers * cfg.page_size * mc.num_key_value_heads * mc.head_dim * elem
        self.num_pages = cfg.num_pages or max(1, cfg.kv_cache_memory // self.page_bytes)
        self.scratch_page = self.num_pages
        """One page past the pool that no sequence owns: CUDA-graph padding rows write and read it."""
        shape = (self.num_pages + 1, cfg.page_size, mc.num_key_value_heads, mc.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_hidden_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_hidden_layers)]
        self.kv_caches = list(zip(self.k_caches, self.v_caches))
        cuda = self.device.type == "cuda"
        self.transfer_stream = torch.cuda.Stream(self.device) if cuda else None
        """Loads from the store land on this stream, beside the compute stream (None on CPU)."""
        self.save_stream = torch.cuda.Stream(self.device) if cuda else None
        """Chunks on their way to the store leave on this one (the other copy direction)."""
        self.decode_graphs: DecodeGraphs | None = None
        """Pure decode steps replay these CUDA graphs (captured here, at start), on CUDA unless
        ``enforce_eager``."""
        if cuda and not cfg.enforce_eager:
            try:
                self.decode_graphs = self.make_decode_graphs(capture=True)
            except Exception as exc:  # noqa: BLE001 - a graph that cannot be captured costs speed, not service
                log.warning("decode steps run eagerly: CUDA graph capture failed (%s: %s)", type(exc).__name__, exc)
                torch.cuda.synchronize(self.device)

    def make_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static decode buffers for up to ``max_num_seqs`` sequences as long as the model allows."""
        page = self.cfg.page_size
        max_pages = min(self.num_pages, -(-self.model_config.max_position_embeddings // page))
        return DecodeGraphs(self.model, self.kv_caches, max_batch=self.cfg.max_num_seqs, max_pages=max_pages,
                            scratch_page=self.scratch_page, capture=capture)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """``[layers, 2, kv_heads, chunk_tokens, head_dim]`` of one stored chunk."""
        mc = self.model_config
        return (mc.num_hidden_layers, 2, mc.num_key_value_heads, self.cfg.chunk_tokens, mc.head_dim)

    def run(self, scheduled: list[ScheduledSeq], kv_ready: Callable[[int], None] | None = None,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Computes the step's tokens; returns the logits of each sequence's last ``1 + num_draft``
        tokens (of all its tokens with ``all_rows``), in order: ``[B, vocab]`` when nothing is
        speculative and no prompt log-probabilities are asked for.

        ``kv_ready(l)``, when given, is called before layer ``l`` computes (loads landing
        beside the step); a replayed CUDA graph calls it for every layer first.
        ``input_ids``, when given, are the tokens of the first ``len(input_ids)`` sequences, one
        each (decodes), already on the device: the step before sampled them there and the host
        does not know them yet."""
        page = self.cfg.page_size
        max_pages = max(len(s.seq.pages) for s in scheduled)
        graphs = self.decode_graphs
        if graphs is not None and all(s.num_new_tokens == 1 and not s.num_draft for s in scheduled):
            if graphs.fits(len(scheduled), max_pages):
                if kv_ready is not None:
                    for layer in range(len(self.kv_caches)):
                        kv_ready(layer)
                return self._run_decode_graph(graphs, scheduled, input_ids)
            graphs.fallbacks += 1
        assert input_ids is None or all(s.num_new_tokens == 1 and not s.num_draft
                                        for s in scheduled[: len(input_ids)])
        ids, pos, slots, cu, ctx, rows = [], [], [], [0], [], []
        tables = np.zeros((len(scheduled), max_pages), dtype=np.int32)
        for b, s in enumerate(scheduled):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed if s.start is None else s.start
            ids += seq.token_range(start, start + n)  # (not seq.tokens: a copy of the whole context)
            pos += range(start, start + n)
            pages = seq.pages
            slots += [pages[p // page] * page + p % page for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            rows += range(cu[-1] - s.num_rows, cu[-1])
            ctx.append(start)
            tables[b, : len(pages)] = pages
        dev = self.device
        # NOTE: to_device: queued through pinned memory, so the host does not wait here for the
        # work still running on the compute stream (saves' gathers, a load's waits)
        meta = AttnMetadata(
            positions=to_device(pos, torch.int64, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            block_tables=to_device(torch.from_numpy(tables), torch.int32, dev),
            cu_q_lens=to_device(cu, torch.int32, dev),
            context_lens=to_device(ctx, torch.int32, dev),
            is_decode=all(s.num_new_tokens == 1 for s in scheduled),
            max_q_len=max(s.num_new_tokens for s in scheduled),
            kv_ready=kv_ready,
        )
        token_ids = to_device(ids, torch.int64, dev)
        if input_ids is not None:
            token_ids[: len(input_ids)] = input_ids
        hidden = self.model(token_ids, meta, self.kv_caches)
        return self.model.logits(hidden[to_device(rows, torch.int64, dev)])

    def _run_decode_graph(self, graphs: DecodeGraphs, scheduled: list[ScheduledSeq],
                          input_ids: torch.Tensor | None) -> torch.Tensor:
        page = self.cfg.page_size
        ids, pos, slots, tables = [], [], [], []
        on_device = 0 if input_ids is None else len(input_ids)
        for b, s in enumerate(scheduled):
            seq = s.seq
            p = seq.num_computed if s.start is None else s.start
            ids.append(0 if b < on_device else seq.token_at(p))  # (a draft model's pass: its last draft)
            pos.append(p)
            slots.append(seq.pages[p // page] * page + p % page)
            tables.append(seq.pages)
        return self.model.logits(graphs.run(ids, pos, slots, tables, input_ids))

    def gather_chunk_into(self, pages: list[int], out: torch.Tensor, checksum: bool = False):
        """Copies one chunk's pages of every layer into ``out``, a ``chunk_shape`` tensor on the
        host (or on the device: gathered there on the compute stream): ``(event, wsum)``.

        On CPU it is done on return (``(None, None)``). On CUDA the gather runs on the compute
        stream (after the step that wrote the pages) and the copy to ``out`` (pinned: an
        asynchronous DMA) on the save stream; ``event`` marks its end (``out`` holds the chunk
        then; the engine thread never waits for it). With ``checksum``, ``wsum`` is the chunk's
        wsum64 computed on the device beside the copy (so no host pass hashes it).
        """
        ids = to_device(pages, torch.int32, self.device)
        if self.save_stream is None:
            kernels.gather_kv_pages(self.k_caches, self.v_caches, ids, out=out)
            return None, None
        if out.is_cuda:  # a device save buffer: the store's client DMAs it into the node's pages
            kernels.gather_kv_pages(self.k_caches, self.v_caches, ids, out=out)
            dsum = wsum64(out) if checksum else None
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return ev, dsum
        dev = kernels.gather_kv_pages(self.k_caches, self.v_caches, ids)
        self.save_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.save_stream):
            out.copy_(dev, non_blocking=True)
            dsum = wsum64(dev) if checksum else None
            dev.record_stream(self.save_stream)  # the allocator keeps it until the copy is done
            ev = torch.cuda.Event()
            ev.record(self.save_stream)
        return ev, dsum

    def scatter_chunk(self, chunk: torch.Tensor, pages: list[int]) -> None:
        """Writes a ``chunk_shape`` tensor into ``pages`` of every layer."""
        ids = to_device(pages, torch.int32, self.device)
        kernels.scatter_kv_pages(chunk.to(self.device, non_blocking=True), self.k_caches, self.v_caches, ids)

    def begin_landing(self) -> None:
        """Before chunks land: the transfer stream waits for the compute already queued
        (a page being filled may have been read by a step of another sequence)."""
        if self.transfer_stream is not None:
            self.transfer_stream.wait_stream(torch.cuda.current_stream(self.device))

    def land_chunk(self, chunk: torch.Tensor, pages: list[int], checksum: bool = False):
        """``scatter_chunk`` for a load: ``(event, wsum)``.

        On CUDA it runs on the transfer stream (an asynchronous DMA when ``chunk`` is pinned
        host memory); ``event`` marks its end. On CPU it is done on return (event None).
        With ``checksum``, ``wsum`` is the wsum64 of the bytes as they arrived on the device
        (a 0-dim tensor there, computed after the copy: the caller compares it later), else None.
        """
        if self.transfer_stream is None:
            dsum = wsum64(chunk) if checksum else None
            self.scatter_chunk(chunk, pages)
            return None, dsum
        with torch.cuda.stream(self.transfer_stream):
            dev = chunk.to(self.device, non_blocking=True)
            dsum = wsum64(dev) if checksum else None
            self.scatter_chunk(dev, pages)
            ev = torch.cuda.Event()
            ev.record(self.transfer_stream)
        return ev, dsum

    def end_landing(self) -> None:
        """After chunks landed: the compute stream waits for them (no host synchronisation)."""
        if self.transfer_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.transfer_stream)
