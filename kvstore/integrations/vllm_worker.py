"""Worker side of the vLLM connector: store chunks <-> vLLM's paged KV cache.

Every chunk of a load is fetched and checked (namespace, parent, tokens,
shape, dtype, checksums) before it is scattered into the blocks of every
layer. A chunk that is missing or fails verification is not written; its
blocks, and those of the request's later chunks, are reported back to vLLM as
load errors, and vLLM recomputes them. Loads are synchronous (done in
``start_load_kv``, before the step's forward) unless the scheduler side made
them asynchronous (``load_async``): those run on a loader thread beside the
steps, into blocks of requests vLLM holds back until ``get_finished`` reports
them, their load errors reported no later than that.

Saves gather a chunk's blocks layer by layer as vLLM finishes each layer
(``save_layer``), then ``end_step`` encodes the chunks and hands them to a
background thread that puts them. The gathered copies no longer reference
vLLM's blocks, so vLLM may free or reuse the blocks as soon as the step ends.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.chunk import encode_chunk
from kvstore.integrations.paged import BlockLayout, gather_chunks, scatter_chunks
from kvstore.integrations.storelink import ChunkRef, StoreLink
from kvstore.integrations.vllm_plan import ChunkOp, RequestOps, Scope
from kvstore.keys import ChunkKey, Namespace, chunk_key

log = logging.getLogger("crescent.integrations")


@dataclass
class WorkerStats:
    """Counters of one worker since it started."""

    num_loaded_chunks: int = 0
    num_loaded_tokens: int = 0
    """Tokens whose KV was written into vLLM's cache from Crescent."""
    num_failed_chunks: int = 0
    """Chunks planned for loading that were missing or failed verification."""
    num_failed_tokens: int = 0
    num_saved_chunks: int = 0
    num_dropped_chunks: int = 0
    """Chunks that could not be stored (store away or full) or were skipped after a failed load."""


def _written_blocks(ops: Sequence[ChunkOp]) -> set[int]:
    """The blocks loads write (those before each one's ``first_block`` hold the engine's own KV)."""
    return {b for op in ops for b in op.block_ids[op.first_block:]}


@dataclass
class _StepSaves:
    chunks: list[tuple[ChunkOp, ChunkKey, ChunkKey, Namespace]]
    """(op, key, parent, namespace) of each chunk this step saves."""
    host: torch.Tensor
    """``[n, layers, 2, kv_heads, chunk_tokens, head_dim]``: what the saver thread encodes (pinned
    when the caches are on a GPU)."""
    device: torch.Tensor
    """Where the layers are gathered: ``host`` itself, or on the caches' GPU (copied to ``host`` in
    one DMA at the end of the step)."""
    ids: torch.Tensor
    """Every chunk's blocks, in order (on the caches' device)."""
    layers_done: set[int] = field(default_factory=set)


class WorkerSide:
    """Per-worker state: the registered caches, pending saves and counters.

    Args:
        link: the store, for loads (on vLLM's thread).
        save_link: the store, for the saver thread (its own client: no client is shared by threads).
        namespace_for: a request's scope (``vllm_plan.Scope``) and a chunk index -> that chunk's
            namespace on this rank.
        tp_rank: this worker's tensor-parallel rank (selects keys in ``ChunkOp``).
        chunk_tokens: tokens per chunk.
        block_size: vLLM's KV block size.
        dtype: KV dtype (must match the registered caches).
        save_queue_steps: steps of encoded chunks that may wait for the saver thread.
    """

    def __init__(self, link: StoreLink, save_link: StoreLink, namespace_for: Callable[[Scope, int], Namespace],
                 tp_rank: int, chunk_tokens: int, block_size: int, dtype: torch.dtype,
                 save_queue_steps: int = 4) -> None:
        self.link = link
        self.save_link = save_link
        self.load_link: StoreLink | None = None
        """The store, for the loader thread (asynchronous loads), made with it."""
        self.namespace_for = namespace_for
        self.tp_rank = tp_rank
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.dtype = dtype
        self.stats = WorkerStats()
        self._layers: dict[str, int] = {}
        self._kv: list[tuple[torch.Tensor, BlockLayout]] = []
        self._shape: tuple[int, ...] = ()
        self._step: _StepSaves | None = None
        self._saves: list[tuple[str, ChunkOp]] = []
        self._scopes: dict[str, Scope] = {}
        self._failed_reqs: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, save_queue_steps))
        self._saver: threading.Thread | None = None
        self._lock = threading.Lock()
        """Guards the counters, ``_invalid_blocks`` and ``_recv_done`` (the loader thread writes them)."""
        self._loads: queue.Queue = queue.Queue()
        self._loader: threading.Thread | None = None
        self._recv_done: dict[str, set[int]] = {}
        """Asynchronous loads done and not yet reported: request -> its blocks that failed."""
        self._scratch: dict[int, torch.Tensor] = {}
        """Per thread that moves pages, the pages ``scatter_chunks`` / ``gather_chunks`` assemble,
        reused (grown as needed)."""
        self._staging: dict[int, torch.Tensor] = {}
        """Per link (one per thread that loads), the host buffer its loads are read into, grown as
        loads need (pinned when the caches are on a GPU: one DMA per chunk, no pageable copy)."""

    # ---- setup ---------------------------------------------------------------

    def register(self, caches: Sequence[tuple[str, torch.Tensor, BlockLayout]]) -> None:
        """Registers the per-layer caches, in layer order.

        Args:
            caches: ``(layer name, cache [num_blocks, ...], its block layout)`` per layer.
        """
        for i, (name, t, layout) in enumerate(caches):
            if t.dtype != self.dtype:
                raise ValueError(f"layer {name} caches {t.dtype}, the connector expects {self.dtype}")
            if layout.block_size != self.block_size:
                raise ValueError(f"layer {name} uses kernel blocks of {layout.block_size} tokens, vLLM's "
                                 f"block_size is {self.block_size}: set block_size to the backend's own")
            self._layers[name] = i
            self._kv.append((t, layout))
        lay = self._kv[0][1]
        self._shape = (len(self._kv), 2, lay.heads, self.chunk_tokens, lay.head_dim)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """``[layers, 2, kv_heads, chunk_tokens, head_dim]``"""
        return self._shape

    # ---- loads ---------------------------------------------------------------

    def begin_step(self, requests: Sequence[RequestOps]) -> None:
        """Records this step's saves (before the forward, whether or not it loads)."""
        self._saves = [(r.req_id, op) for r in requests for op in r.saves]
        self._scopes = {r.req_id: r.scope for r in requests}
        self._failed_reqs = set()
        self._step = None

    def load(self, requests: Sequence[RequestOps]) -> None:
        """Loads this step's synchronous chunks into every layer; queues the asynchronous ones
        for the loader thread."""
        for r in requests:
            if not r.loads:
                continue
            if r.async_load:
                self._ensure_loader()
                self._loads.put(r)
                continue
            failed = self._load(r, self.link)
            if failed:
                self._failed_reqs.add(r.req_id)
                with self._lock:
                    self._invalid_blocks |= failed

    def _load(self, r: RequestOps, link: StoreLink) -> set[int]:
        """Fetches, verifies and scatters one request's loads; returns the blocks that failed."""
        rank = self.tp_rank
        refs = [ChunkRef(op.keys[rank], op.parents[rank], np.asarray(op.tokens, dtype=np.int32),
                         self.namespace_for(r.scope, op.index)) for op in r.loads]
        staging = self._staging_for(link, len(refs))
        payloads = link.fetch_prefix(refs, None, self.dtype, self._shape, into=staging)
        n = len(payloads)
        if n:
            self._scatter(staging, payloads, r.loads[:n])
        failed = _written_blocks(r.loads[n:])
        loaded_tokens = sum(len(op.block_ids) - op.first_block for op in r.loads[:n]) * self.block_size
        with self._lock:
            self.stats.num_loaded_chunks += n
            self.stats.num_loaded_tokens += loaded_tokens
            self.stats.num_failed_chunks += len(r.loads) - n
            self.stats.num_failed_tokens += len(failed) * self.block_size
        if failed:
            log.warning("crescent: request %s: %d of %d chunks could not be loaded; vLLM recomputes them",
                        r.req_id, len(r.loads) - n, len(r.loads))
        if payloads:
            log.info("crescent: request %s: loaded %d tokens (%d chunks) from the store%s", r.req_id,
                     loaded_tokens, n, " beside the steps" if r.async_load else "")
        return failed

    def _staging_for(self, link: StoreLink, num_chunks: int) -> torch.Tensor:
        need = link.staging_bytes(num_chunks, self.dtype, self._shape)
        buf = self._staging.get(id(link))
        if buf is None or buf.numel() < need:
            cuda = self._kv[0][0].is_cuda
            size = max(need, 2 * buf.numel() if buf is not None else 0)
            buf = self._staging[id(link)] = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        return buf

    def _scratch_for(self, num_blocks: int) -> torch.Tensor:
        cache = self._kv[0][0]
        need = num_blocks * cache[0].numel()
        buf = self._scratch.get(threading.get_ident())
        if buf is None or buf.numel() < need:
            size = max(need, 2 * buf.numel() if buf is not None else 0)
            buf = self._scratch[threading.get_ident()] = torch.empty(size, dtype=cache.dtype, device=cache.device)
        return buf

    def _scatter(self, staging: torch.Tensor, payloads: Sequence[torch.Tensor], ops: Sequence[ChunkOp]) -> None:
        """Writes verified payloads (views of ``staging``, one chunk every ``stride`` bytes) into
        their blocks: per layer, every chunk at once."""
        n, (cache0, _) = len(payloads), self._kv[0]
        m = self.chunk_tokens // self.block_size
        rows = [i * m + b for i, op in enumerate(ops) for b in range(op.first_block, m)]
        ids = torch.tensor([op.block_ids[b] for op in ops for b in range(op.first_block, m)], dtype=torch.long,
                           device=cache0.device)
        rows_t = None if len(rows) == n * m else torch.tensor(rows, dtype=torch.long)
        if cache0.is_cuda:
            src = torch.empty((n, *self._shape), dtype=self.dtype, device=cache0.device)
            for i, p in enumerate(payloads):  # (pinned: a DMA each, in the stream's order)
                src[i].copy_(p, non_blocking=True)
        else:
            base = payloads[0].data_ptr() - staging.data_ptr()
            stride = payloads[1].data_ptr() - payloads[0].data_ptr() if n > 1 else 0
            nbytes = payloads[0].numel() * payloads[0].element_size()
            src = staging.as_strided((n, nbytes), (stride, 1), base).view(self.dtype).view(n, *self._shape)
        scratch = self._scratch_for(ids.numel())
        for layer, (cache, layout) in enumerate(self._kv):
            scatter_chunks(src[:, layer], cache, layout, ids, rows_t, scratch)
        if cache0.is_cuda:
            torch.cuda.current_stream(cache0.device).synchronize()  # (staging is reused by the next load)

    def _ensure_loader(self) -> None:
        if self._loader is None:
            if self.load_link is None:
                self.load_link = StoreLink(self.link.config)
            self._loader = threading.Thread(target=self._load_loop, name="crescent-loader", daemon=True)
            self._loader.start()

    def _load_loop(self) -> None:
        while True:
            r = self._loads.get()
            try:
                if r is None:
                    return
                try:
                    failed = self._load(r, self.load_link)
                except Exception:  # noqa: BLE001
                    # NOTE: a load that broke is a load that failed, never a request left waiting.
                    log.exception("crescent: request %s: loading failed", r.req_id)
                    failed = _written_blocks(r.loads)
                with self._lock:
                    self._recv_done[r.req_id] = failed
            finally:
                self._loads.task_done()

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call; their failed blocks join
        ``take_invalid_blocks`` (vLLM asks for both in the same pass, that one second)."""
        with self._lock:
            done, self._recv_done = self._recv_done, {}
            for failed in done.values():
                self._invalid_blocks |= failed
        return set(done)

    def take_invalid_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # ---- saves ---------------------------------------------------------------

    def _step_saves(self) -> _StepSaves:
        """This step's chunks to save, staged once per step (after its loads: a request whose load
        failed saves nothing): one buffer for all of them, filled a layer at a time."""
        if self._step is None:
            chunks: list[tuple[ChunkOp, ChunkKey, ChunkKey, Namespace]] = []
            for req_id, op in self._saves:
                if req_id in self._failed_reqs:
                    # NOTE: this step's forward read blocks that failed to load; vLLM discards
                    # its output and reruns, and the rerun saves these chunks.
                    self.stats.num_dropped_chunks += 1
                    continue
                ns = self.namespace_for(self._scopes.get(req_id), op.index)
                key, parent = op.keys[self.tp_rank], op.parents[self.tp_rank]
                if chunk_key(parent, ns, op.tokens) != key:
                    log.error("crescent: chunk %d of request %s: scheduler and worker namespaces differ; "
                              "not saving it", op.index, req_id)
                    self.stats.num_dropped_chunks += 1
                    continue
                chunks.append((op, key, parent, ns))
            cache0 = self._kv[0][0]
            n = len(chunks)
            host = torch.empty((n, *self._shape), dtype=self.dtype, pin_memory=cache0.is_cuda)
            device = torch.empty((n, *self._shape), dtype=self.dtype, device=cache0.device) if cache0.is_cuda else host
            ids = torch.tensor([b for op, *_ in chunks for b in op.block_ids], dtype=torch.long, device=cache0.device)
            self._step = _StepSaves(chunks, host, device, ids)
        return self._step

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gathers one layer of every chunk this step saves (called after the layer ran): one gather
        for all of them."""
        layer = self._layers.get(layer_name)
        if not self._saves or layer is None:
            return
        step = self._step_saves()
        if step.chunks:
            gather_chunks(kv_layer, self._kv[layer][1], step.ids, step.device[:, layer],
                          self._scratch_for(step.ids.numel()))
            step.layers_done.add(layer)

    def end_step(self) -> None:
        """Completes this step's chunks (layers not handed over during the step are gathered now)
        and queues them for the saver thread, which encodes (checksums) and stores them."""
        if not self._saves:
            return
        step = self._step_saves()
        self._step, self._saves = None, []
        if not step.chunks:
            return
        scratch = self._scratch_for(step.ids.numel())
        for layer, (cache, layout) in enumerate(self._kv):
            if layer not in step.layers_done:
                gather_chunks(cache, layout, step.ids, step.device[:, layer], scratch)
        if step.device is not step.host:
            step.host.copy_(step.device, non_blocking=True)  # (one DMA into pinned memory)
            torch.cuda.current_stream(step.device.device).synchronize()
        self._ensure_saver()
        self._queue.put([(key, step.host[i], ns, parent, op.tokens)
                         for i, (op, key, parent, ns) in enumerate(step.chunks)])

    def _ensure_saver(self) -> None:
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="crescent-saver", daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                try:
                    encoded = [(key, encode_chunk(payload, ns, parent, tokens))
                               for key, payload, ns, parent, tokens in batch]
                except Exception:  # noqa: BLE001
                    # NOTE: a chunk that cannot be encoded is a lost save, never a dead saver thread
                    # (the queue would fill and block the forward).
                    log.exception("crescent: encoding %d chunks failed; not saving them", len(batch))
                    encoded = []
                stored = self.save_link.save(encoded)
                with self._lock:
                    self.stats.num_saved_chunks += stored
                    self.stats.num_dropped_chunks += len(batch) - stored
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Blocks until every queued chunk was stored or dropped."""
        self._queue.join()

    def close(self) -> None:
        if self._saver is not None:
            self._queue.put(None)
            self._saver.join()
            self._saver = None
        if self._loader is not None:
            # NOTE: loads not yet begun are dropped (their requests end with the engine), so that a
            # store that stopped answering delays shutdown by one call at most, not one per request.
            while True:
                try:
                    self._loads.get_nowait()
                except queue.Empty:
                    break
                self._loads.task_done()
            self._loads.put(None)
            self._loader.join()
            self._loader = None
        self.link.close()
        self.save_link.close()
        if self.load_link is not None:
            self.load_link.close()
