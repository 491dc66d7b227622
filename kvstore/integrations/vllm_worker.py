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
from kvstore.integrations.paged import BlockLayout, gather_layer, scatter_layer
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
class _Staged:
    op: ChunkOp
    key: ChunkKey
    parent: ChunkKey
    namespace: Namespace
    payload: torch.Tensor
    """``[layers, 2, kv_heads, chunk_tokens, head_dim]``"""
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
        self._staged: dict[tuple[str, int], _Staged] = {}
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
        payloads = link.fetch_prefix(refs, None, self.dtype, self._shape)
        for op, payload in zip(r.loads, payloads):
            ids = torch.tensor(op.block_ids, dtype=torch.long)
            for layer, (cache, layout) in enumerate(self._kv):
                scatter_layer(payload[layer], cache, layout, ids, op.first_block)
        n = len(payloads)
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

    def _stage(self, req_id: str, op: ChunkOp) -> _Staged | None:
        st = self._staged.get((req_id, op.index))
        if st is None:
            rank = self.tp_rank
            ns = self.namespace_for(self._scopes.get(req_id), op.index)
            key, parent = op.keys[rank], op.parents[rank]
            if chunk_key(parent, ns, op.tokens) != key:
                log.error("crescent: chunk %d of request %s: scheduler and worker namespaces differ; "
                          "not saving it", op.index, req_id)
                return None
            st = _Staged(op, key, parent, ns, torch.empty(self._shape, dtype=self.dtype))
            self._staged[(req_id, op.index)] = st
        return st

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gathers one layer of every chunk this step saves (called after the layer ran)."""
        layer = self._layers.get(layer_name)
        if not self._saves or layer is None:
            return
        layout = self._kv[layer][1]
        for req_id, op in self._saves:
            if req_id in self._failed_reqs:
                continue
            st = self._stage(req_id, op)
            if st is None:
                continue
            gather_layer(kv_layer, layout, torch.tensor(op.block_ids, dtype=torch.long), st.payload[layer])
            st.layers_done.add(layer)

    def end_step(self) -> None:
        """Completes this step's chunks and queues them for the store."""
        batch = []
        for req_id, op in self._saves:
            if req_id in self._failed_reqs:
                # NOTE: this step's forward read blocks that failed to load; vLLM discards
                # its output and reruns, and the rerun saves these chunks.
                self.stats.num_dropped_chunks += 1
                continue
            st = self._stage(req_id, op)
            if st is None:
                self.stats.num_dropped_chunks += 1
                continue
            ids = torch.tensor(op.block_ids, dtype=torch.long)
            for layer in range(len(self._kv)):
                if layer not in st.layers_done:
                    gather_layer(*self._kv[layer], ids, st.payload[layer])
            batch.append((st.key, encode_chunk(st.payload, st.namespace, st.parent, op.tokens)))
        self._staged.clear()
        self._saves = []
        if batch:
            self._ensure_saver()
            self._queue.put(batch)

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
                stored = self.save_link.save(batch)
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
