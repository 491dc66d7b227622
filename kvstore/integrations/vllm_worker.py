"""Worker side of the vLLM connector: store chunks <-> vLLM's paged KV cache.

Every chunk of a load is fetched and checked (namespace, parent, tokens,
shape, dtype, checksums) before it is written into the blocks of every
layer; a chunk that is missing or fails verification is not written, and its
blocks, with those of the request's later chunks, are reported back to vLLM
as load errors, which vLLM recomputes. A step's synchronous loads are written
a layer at a time beside its forward (``load(layerwise=True)``, then
``wait_layer`` before each layer's attention; ``_Landing``), or every layer
before it; on a GPU the copies run on a transfer stream, the compute stream
waits on an event per layer, and a wsum64 payload is summed on the device as
it lands (checked by ``finish_loads`` at the step's end). Asynchronous loads
(``load_async``) run on a loader thread beside the steps, into blocks of
requests vLLM holds back until ``get_finished`` reports them, their load
errors reported no later than that.

Saves gather a chunk's blocks layer by layer as vLLM finishes each layer
(``save_layer``) into a buffer of the step's (a reused host buffer on a CPU,
device memory on a GPU), then ``end_step`` hands them to a background thread
that encodes and puts them (from a GPU: a DMA straight into the slots it
reserved in a same-host node's registered arena). The gathered copies no
longer reference vLLM's blocks, so vLLM may free or reuse the blocks as soon
as the step ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels.host import one_intra_op_thread, to_device
from kvstore.chunk import CHECK_WSUM, CHECK_XXH3, check_payload, encode_chunk, verify_header, wsum64_rows
from kvstore.errors import ChunkVerificationError, CrescentError
from kvstore.integrations.paged import BlockLayout, gather_chunks, scatter_chunks
from kvstore.integrations.storelink import ChunkRef, StoreLink
from kvstore.integrations.vllm_plan import ChunkOp, RequestOps, Scope
from kvstore.keys import ChunkKey, Namespace, chunk_key
from kvstore.transport.descriptors import ItemStatus, Mover
from kvstore.transport.session import leased_head, safe_end

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
    num_in_place_chunks: int = 0
    """Loaded chunks read where a node on this host keeps them, under a lease (not copied first)."""
    num_layerwise_loads: int = 0
    """Steps whose loads were written a layer at a time beside the forward, every layer's attention
    waiting for its own layer only."""
    num_device_saved_chunks: int = 0
    """Saved chunks a GPU worker handed to a node on this host from device memory, the node's arena
    registered with CUDA: each DMA'd into the slots reserved for it, no host copy (a zero-copy
    put; one the arena has no room for now is copied to the host on its way to the node's disk)."""


def _written_blocks(ops: Sequence[ChunkOp]) -> set[int]:
    """The blocks loads write (those before each one's ``first_block`` hold the engine's own KV)."""
    return {b for op in ops for b in op.block_ids[op.first_block:]}


@dataclass
class _Lease:
    """A read lease a load holds on chunks the node keeps in its arena (mapped here): their
    payloads are read where they are, until the landing's copies have completed."""

    session: Any
    grant: Any
    ctx: Any
    """``session.in_place(grant)``, entered: the mapping stays open until the lease ends."""
    request: int
    """Index of the request (in the load) whose chunks it holds, from its first."""


def _strided_runs(payloads: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(first index, view [k, *shape])`` for each run of consecutive payloads one strided view
    covers: in the same memory, each the same distance after the one before (a host buffer's
    slots; chunks the node stored side by side in its arena)."""
    runs: list[tuple[int, torch.Tensor]] = []
    i = 0
    while i < len(payloads):
        p, j, step = payloads[i], i + 1, None
        base = p.untyped_storage().data_ptr()
        while j < len(payloads):
            q = payloads[j]
            d = q.data_ptr() - payloads[j - 1].data_ptr()
            if q.untyped_storage().data_ptr() != base or d < p.nbytes or d % p.element_size() \
                    or (step is not None and d != step):
                break
            step, j = d, j + 1
        stride = (step or p.nbytes) // p.element_size()
        runs.append((i, p.as_strided((j - i, *p.shape), (stride, *p.stride()), p.storage_offset())))
        i = j
    return runs


class _Landing:
    """One load's verified chunks on their way into vLLM's blocks, a layer of every chunk at a
    time. A chunk's payload is where it was read: a slot of the worker's host buffer, or the
    node's arena itself, mapped here under a read lease (one host: no copy before the pages).

    With the caches on a GPU the moves are queued on a transfer stream (per layer: each chunk's
    layer DMA'd into a device stage, from pinned or registered memory; its wsum64 share summed
    there when the payload check was left to the device; one scatter into the pages; an event);
    ``wait(l)`` queues up to ``AHEAD`` layers past ``l`` and makes the compute stream wait for
    layer ``l``'s event (the host never waits). On the CPU the worker's lander thread writes the
    layers in order (``start``) and ``wait(l)`` waits for layer ``l``, or the caller writes them
    all (``land_all``). ``finish`` returns once every layer is written and every check known,
    then ends the leases (a lease that ran out fails its request's chunks: the node may have
    reused them under the copies), with each request's failed blocks: those of its first chunk
    that was missing or bad and of every chunk after it.
    """

    AHEAD = 2
    """Layers queued on the transfer stream ahead of the one the forward is at."""

    def __init__(self, w: WorkerSide, fetched: list[tuple[RequestOps, list[torch.Tensor], list[int | None]]],
                 leases: list[_Lease], who: str) -> None:
        self.w, self.fetched, self.leases = w, fetched, leases
        cache0 = w._kv[0][0]
        self.cuda = cache0.is_cuda
        self.num_layers = len(w._kv)
        m = w.chunk_tokens // w.block_size
        payloads = [p for _, ps, _ in fetched for p in ps]
        ops = [op for r, ps, _ in fetched for op in r.loads[:len(ps)]]
        self.n = n = len(payloads)
        dev = cache0.device

        def index(chunks: Sequence[ChunkOp]) -> tuple[torch.Tensor, torch.Tensor | None]:
            """Blocks written and, unless every block of every chunk, their rows in the source."""
            rows = [i * m + b for i, op in enumerate(chunks) for b in range(op.first_block, m)]
            # NOTE: to_device, not torch.tensor(..., device=cuda): no wait for the step in flight.
            ids = to_device([op.block_ids[b] for op in chunks for b in range(op.first_block, m)], torch.long, dev)
            full = len(rows) == len(chunks) * m
            return ids, None if full else to_device(rows, torch.long, dev)

        self.scratch = w._scratch_for(sum(len(op.block_ids) for op in ops), who) if n else None
        self.expect = [e for _, _, es in fetched for e in es]
        self.sums: torch.Tensor | None = None
        if self.cuda:
            self.payloads = payloads
            self.ids, self.rows = index(ops)
            self.stage = w._stage_for(n, who) if n else None
            self.stream = w._stream_for(who)
            self.layer_words = payloads[0].nbytes // self.num_layers // 8 if n else 0
            if any(e is not None for e in self.expect):
                self.sums = torch.zeros(n, dtype=torch.int64, device=dev)
            self.events: list = []
        else:
            # the pages are written straight from where the chunks are, a strided view per run
            self.runs = [(view, *index(ops[i:i + view.shape[0]])) for i, view in _strided_runs(payloads)]
            self.events = [threading.Event() for _ in range(self.num_layers)]
        self.queued = 0
        """Layers written (CPU) or queued on the transfer stream (GPU)."""
        self.error: BaseException | None = None
        self.layerwise = False
        self.waited: set[int] = set()
        """Layers the forward waited for (``layerwise``)."""
        self._future = None
        self._result: list[tuple[RequestOps, set[int]]] | None = None

    @torch.inference_mode()  # (vLLM's caches are inference tensors; the lander is another thread)
    def _move(self, layer: int) -> None:
        cache, layout = self.w._kv[layer]
        if not self.cuda:
            for view, ids, rows in self.runs:
                scatter_chunks(view[:, layer], cache, layout, ids, rows, self.scratch)
            return
        for j, p in enumerate(self.payloads):
            self.stage[j].copy_(p[layer], non_blocking=True)
        if self.sums is not None:
            self.sums += wsum64_rows(self.stage, layer * self.layer_words, self.layer_words * self.num_layers)
        scatter_chunks(self.stage, cache, layout, self.ids, self.rows, self.scratch)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            log.error("crescent: writing loaded KV into vLLM's blocks failed (%s: %s); vLLM recomputes it",
                      type(exc).__name__, exc)

    def _queue(self, upto: int) -> None:
        """GPU: queues every layer up to ``upto`` not queued yet."""
        upto = min(upto, self.num_layers - 1)
        if self.error is not None or self.queued > upto or not self.n:
            return
        try:
            with torch.cuda.stream(self.stream):
                for layer in range(self.queued, upto + 1):
                    self._move(layer)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self.events.append(ev)
                    self.queued = layer + 1
        except Exception as exc:  # noqa: BLE001 - the step goes on; its blocks are reported failed
            self._fail(exc)

    def _run(self) -> None:
        """CPU: writes every layer in order, each one's event set once it is in place."""
        for layer in range(self.num_layers):
            if self.error is None and self.n:
                try:
                    self._move(layer)
                except Exception as exc:  # noqa: BLE001 - the step goes on; its blocks are reported failed
                    self._fail(exc)
            self.queued = layer + 1
            self.events[layer].set()

    def start(self) -> None:
        """Begins writing beside the forward."""
        self.layerwise = True
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # (blocks it may still read)
            self._queue(self.AHEAD - 1)
        else:
            self._future = self.w._lander_pool().submit(self._run)

    def land_all(self) -> None:
        """Writes every layer now (GPU: queues them; the compute stream waits for the last)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._queue(self.num_layers - 1)
            if self.events:
                torch.cuda.current_stream(self.stream.device).wait_event(self.events[-1])
        else:
            self._run()

    def wait(self, layer: int) -> None:
        self.waited.add(layer)
        if self.cuda:
            self._queue(layer + self.AHEAD)
            if layer < len(self.events):
                torch.cuda.current_stream(self.stream.device).wait_event(self.events[layer])
        else:
            self.events[layer].wait()

    def finish(self) -> list[tuple[RequestOps, set[int]]]:
        if self._result is not None:
            return self._result
        sums = None
        if self.cuda:
            self._queue(self.num_layers - 1)  # (the forward did not reach them all)
            try:
                if self.events:
                    self.events[-1].synchronize()
                sums = self.sums.tolist() if self.sums is not None else None
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        elif self._future is not None:  # (land_all wrote them on the caller's thread)
            self._future.result()
        if self.layerwise and self.error is None and len(self.waited) == self.num_layers:
            with self.w._lock:
                self.w.stats.num_layerwise_loads += 1
        expired = release_leases(self.leases)  # (every copy that read them has completed, or failed)
        out, j = [], 0
        for i, (r, ps, _) in enumerate(self.fetched):
            good = len(ps)
            if self.error is not None or i in expired:
                good = 0
            elif sums is not None:
                for k in range(len(ps)):
                    want = self.expect[j + k]
                    if want is not None and sums[j + k] & _U64 != want:
                        log.warning("crescent: chunk %s rejected: payload checksum mismatch (on the device)",
                                    bytes(r.loads[k].keys[self.w.tp_rank]).hex())
                        good = k
                        break
            j += len(ps)
            failed = _written_blocks(r.loads[good:])
            self.w._account(r, good, failed)
            out.append((r, failed))
        self.payloads = self.runs = None  # (they may view the node's arena, whose leases ended)
        self._result = out
        return out


_U64 = (1 << 64) - 1


def release_leases(leases: Sequence[_Lease]) -> set[int]:
    """Ends read leases (their copies have completed); returns the requests of those that had
    run out first (their chunks may have been rewritten under the copies), or could not be ended."""
    expired = set()
    for lease in leases:
        in_time = time.monotonic() < safe_end(lease.grant)
        try:
            lease.ctx.__exit__(None, None, None)
            lease.session.release(lease.grant.lease_id)
        except Exception as exc:  # noqa: BLE001 - an expired lease, a node gone: its chunks are not trusted
            log.warning("crescent: a read lease could not be ended in time (%s): its chunks are recomputed", exc)
            in_time = False
        if not in_time:
            expired.add(lease.request)
    return expired


class _HostBuffers:
    """Host buffers a CPU worker gathers a step's saves into, reused from step to step (given back
    by the saver thread once their chunks are stored): a fresh buffer costs vLLM's thread a page
    fault per 4 KiB on first touch (128 MiB here: 36 ms to fill fresh, 8 ms warm)."""

    def __init__(self, keep: int = 2) -> None:
        self._free: list[torch.Tensor] = []
        self._keep = keep
        """Free buffers kept (the largest); any more are freed."""
        self._lock = threading.Lock()
        self.num_allocated = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (the smallest free one that fits)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            self.num_allocated += 1
        return torch.empty(numel, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    @property
    def num_free(self) -> int:
        return len(self._free)


@dataclass
class _SaveBatch:
    """One step's chunks, for the saver thread."""

    items: list
    """``(index in the step, key, namespace, parent, tokens)`` per chunk."""
    gathered: torch.Tensor
    """``[step's chunks, layers, 2, kv_heads, chunk_tokens, head_dim]``: their payloads, on the
    caches' device."""
    ready: Any = None
    """GPU: recorded behind the step's gathers and sums (None: the payloads are on the host)."""
    hashes: torch.Tensor | None = None
    """GPU: ``[step's chunks]`` wsum64 of each, in pinned memory, valid once ``ready``."""
    buffer: torch.Tensor | None = None
    """CPU: the pooled buffer ``gathered`` views, given back once the chunks are stored."""


@dataclass
class _StepSaves:
    chunks: list[tuple[str, ChunkOp, ChunkKey, ChunkKey, Namespace]]
    """(request, op, key, parent, namespace) of each chunk this step saves."""
    gathered: torch.Tensor
    """``[n, layers, 2, kv_heads, chunk_tokens, head_dim]`` on the caches' device, where the layers
    are gathered: a pooled host buffer (CPU) or device memory the saver thread writes from."""
    ids: torch.Tensor
    """Every chunk's blocks, in order (on the caches' device)."""
    buffer: torch.Tensor | None = None
    """CPU: the pooled buffer ``gathered`` views."""
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
        self._scratch: dict[str, torch.Tensor] = {}
        """Per mover (``step`` loads, ``async`` loads, ``save``), the pages ``scatter_chunks`` /
        ``gather_chunks`` assemble, reused (grown as needed)."""
        self._staging: dict[int, torch.Tensor] = {}
        """Per link (one per thread that loads), the host buffer its loads are read into, grown as
        loads need (pinned when the caches are on a GPU: one DMA per chunk, no pageable copy)."""
        self._stages: dict[str, torch.Tensor] = {}
        """GPU: per loader (``step``, ``async``), where a layer of its chunks lands before the scatter."""
        self._streams: dict[str, torch.cuda.Stream] = {}
        """GPU: per loader, the transfer stream its copies run on."""
        self._landing: _Landing | None = None
        """This step's synchronous loads, until ``finish_loads``."""
        self.in_place = True
        """Read chunks a node on this host keeps in its arena where they are, under a lease (no
        copy into the host buffer first); False: always copy."""
        self._lander: ThreadPoolExecutor | None = None
        """CPU: writes a layer-wise load's pages beside the forward."""
        self._save_buffers = _HostBuffers()
        """CPU: what a step's saves are gathered into."""
        self._save_stream = None
        """GPU: the saver thread's stream, for a step's copy into pinned memory when the node's
        arena is not registered here (another host, no room, CUDA could not register it)."""

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
        if self.on_gpu:
            self._ensure_saver()  # (it registers the node's arena with CUDA now, not on the first save)

    def warm_up(self, step_tokens: int, load_async: bool = False, layerwise: bool = True) -> None:
        """Makes now, at start, what the first load and save would otherwise make on vLLM's thread:
        the loads' store session (connected; a same-host node's arena mapped, and on a GPU
        registered with CUDA), the lander thread (CPU, when ``layerwise`` loads may run: it writes
        those) or transfer stream (GPU), and buffers for a
        step of ``step_tokens`` tokens, their pages touched: a save's host buffer (CPU), the
        device stage of a layer-wise load (GPU), and the read buffer of copied loads when the node
        is not on this host. Larger steps grow them. With ``load_async``, the loader thread and its
        own session too. A store that is down now is found by the first load (a miss until it is
        back)."""
        chunks = max(1, -(-step_tokens // self.chunk_tokens))
        session = self.link.shm_session(register_cuda=self.on_gpu)  # (connects: also for copied loads)
        if session is None or not self.in_place:  # (every load is read into this buffer)
            self._staging_for(self.link, chunks).fill_(0)
        if load_async and self.load_link is None:
            self.load_link = StoreLink(self.link.config)
            self.load_link.shm_session(register_cuda=self.on_gpu)  # (before its thread starts: not shared)
            self._ensure_loader()
        if self.on_gpu:
            self._stream_for("step")
            self._stage_for(chunks, "step")
            return
        if layerwise:
            self._lander_pool().submit(torch.zeros(1 << 16).add_, 1).result()  # (its thread's first op)
        numel = chunks * int(np.prod(self._shape))
        self._save_buffers.give(self._save_buffers.take(numel, self.dtype).fill_(0))

    @property
    def on_gpu(self) -> bool:
        """The registered caches are on a CUDA device."""
        return bool(self._kv) and self._kv[0][0].is_cuda

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """``[layers, 2, kv_heads, chunk_tokens, head_dim]``"""
        return self._shape

    # ---- loads ---------------------------------------------------------------

    def begin_step(self, requests: Sequence[RequestOps]) -> None:
        """Records this step's saves (before the forward, whether or not it loads)."""
        self.finish_loads()  # (a step whose forward ended early: its loads complete before the next)
        self._saves = [(r.req_id, op) for r in requests for op in r.saves]
        self._scopes = {r.req_id: r.scope for r in requests}
        self._failed_reqs = set()
        self._step = None

    def load(self, requests: Sequence[RequestOps], layerwise: bool = False) -> None:
        """Starts this step's synchronous loads; queues the asynchronous ones for the loader thread.

        The synchronous chunks are leased where a same-host node keeps them, or read into one host
        buffer, and verified (headers and keys, and xxh3 payloads; a wsum64 payload, with the
        caches on a GPU, is summed there as it lands and checked by ``finish_loads``). With
        ``layerwise`` their pages are written a layer at a time beside the forward (``wait_layer``
        before each layer's attention), else every layer before this returns (on a GPU: the
        compute stream waits for the copies, the host does not).
        """
        self.finish_loads()
        sync = []
        for r in requests:
            if not r.loads:
                continue
            if r.async_load:
                self._ensure_loader()
                self._loads.put(r)
            else:
                sync.append(r)
        if not sync:
            return
        try:
            landing = self._fetch(sync, self.link, "step")
        except Exception:  # noqa: BLE001
            # NOTE: a load that broke is a load that failed (vLLM recomputes it), never a failed step.
            log.exception("crescent: loading %d requests failed", len(sync))
            for r in sync:
                failed = _written_blocks(r.loads)
                self._account(r, 0, failed)
                self._failed_reqs.add(r.req_id)
                with self._lock:
                    self._invalid_blocks |= failed
            return
        # NOTE: a request with a chunk already known bad saves nothing this step (its forward reads
        # blocks vLLM will recompute); one whose GPU-side check fails is dropped in end_step.
        self._failed_reqs |= {r.req_id for r, payloads, _ in landing.fetched if len(payloads) < len(r.loads)}
        self._landing = landing
        if layerwise:
            landing.start()
        else:
            landing.land_all()

    def wait_layer(self, layer_name: str) -> None:
        """Before a layer's attention computes: its loaded KV is in its blocks (on a GPU, the
        compute stream waits for it)."""
        layer = self._layers.get(layer_name)
        if self._landing is not None and layer is not None:
            self._landing.wait(layer)

    def finish_loads(self) -> None:
        """Completes this step's synchronous loads (every layer written, every check known): the
        requests with a chunk that failed join ``_failed_reqs``, their blocks ``take_invalid_blocks``."""
        landing, self._landing = self._landing, None
        if landing is not None:
            for r, failed in landing.finish():
                if failed:
                    self._failed_reqs.add(r.req_id)
                    with self._lock:
                        self._invalid_blocks |= failed

    def _fetch(self, requests: Sequence[RequestOps], link: StoreLink, who: str) -> _Landing:
        """Reads and verifies the requests' loads, each its leading run of good chunks. With the
        node on this host (shm), the chunks it keeps in its arena are leased and read where they
        are (on a GPU: when CUDA could page-lock the mapping, so that the copies are DMA); the
        others (on its disk, or every chunk with another node) are read into the link's host
        buffer, one slot per chunk."""
        rank, cuda = self.tp_rank, self.on_gpu
        session = link.shm_session(register_cuda=cuda) if self.in_place else None
        slot_bytes = link.staging_bytes(1, self.dtype, self._shape)
        total = sum(len(r.loads) for r in requests)
        staging: torch.Tensor | None = None
        fetched: list[tuple[RequestOps, list[torch.Tensor], list[int | None]]] = []
        leases: list[_Lease] = []
        slot = 0
        try:
            for r in requests:
                refs = [ChunkRef(op.keys[rank], op.parents[rank], np.asarray(op.tokens, dtype=np.int32),
                                 self.namespace_for(r.scope, op.index)) for op in r.loads]
                payloads: list[torch.Tensor] = []
                expect: list[int | None] = []
                rest = session is None or self._lease_prefix(session, link, refs, len(fetched), payloads, expect,
                                                             leases)
                if rest and len(payloads) < len(refs):
                    rest_refs = refs[len(payloads):]
                    staging = staging if staging is not None else self._staging_for(link, total)
                    deferred: list[int | None] | None = [] if cuda else None
                    got = link.fetch_prefix(rest_refs, None, self.dtype, self._shape,
                                            into=staging[slot * slot_bytes:(slot + len(rest_refs)) * slot_bytes],
                                            deferred=deferred)
                    payloads += got
                    expect += deferred if deferred is not None else [None] * len(got)
                    slot += len(rest_refs)
                fetched.append((r, payloads, expect))
        except BaseException:
            release_leases(leases)
            raise
        return _Landing(self, fetched, leases, who)

    def _lease_prefix(self, session, link: StoreLink, refs: Sequence[ChunkRef], request: int,
                      payloads: list[torch.Tensor], expect: list[int | None], leases: list[_Lease]) -> bool:
        """Leases ``refs`` where the node keeps them and appends the leading run of good ones
        (each header copied out and checked now, the payload a view of the node's arena; an
        xxh3 payload, or any on a CPU, checked now too; a wsum64 one on a GPU left to the device:
        its hash to ``expect``). Returns whether the chunks after that run may still be read
        another way (the node holds the next one outside its arena, e.g. on its disk, or the
        lease could not be made); False after a miss or a bad chunk."""
        try:
            g = session.acquire([ref.key for ref in refs], Mover.SHM)
        except CrescentError as exc:
            log.debug("crescent: could not lease chunks in place (%s); reading them", exc)
            return True
        view = None
        if g.lease_id:
            ctx = session.in_place(g)
            view = ctx.__enter__()
            leases.append(_Lease(session, g, ctx, request))  # ended by the landing's finish, whatever happens
            if view is None:  # (the node restarted between the grant and now)
                return True
        chunk_bytes = link.staging_bytes(1, self.dtype, self._shape)
        payload_bytes = int(np.prod(self._shape)) * self.dtype.itemsize
        head_bytes = chunk_bytes - payload_bytes
        for ref, d in zip(refs, g.items):
            if d.status is not ItemStatus.OK:
                return d.status is ItemStatus.ELSEWHERE
            if d.size != chunk_bytes:
                return False  # (a value no chunk of this model)
            if view is None:
                return True
            head, pext = leased_head(view, d, head_bytes)
            try:
                # (the header's checks make the rest exactly the payload)
                hdr = verify_header(head, d.size, key=ref.key, namespace=ref.namespace, parent=ref.parent,
                                    tokens=ref.tokens, dtype=self.dtype, shape=self._shape)
                if len(pext) == 1:
                    payload = view.tensor(*pext[0])
                else:  # (slots not in one run, rare: one copy, where a DMA can read it)
                    payload = torch.cat([view.tensor(o, n) for o, n in pext])
                    payload = payload.pin_memory() if self.on_gpu else payload
                deferred = self.on_gpu and hdr.check == CHECK_WSUM
                if not deferred:
                    check_payload(hdr, payload)
            except ChunkVerificationError as exc:
                link.num_rejected += 1
                log.warning("crescent chunk %s rejected: %s", bytes(ref.key).hex(), exc)
                return False
            payloads.append(payload.view(self.dtype).view(self._shape))
            expect.append(hdr.payload_hash if deferred else None)
            with self._lock:
                self.stats.num_in_place_chunks += 1
        return False

    def _account(self, r: RequestOps, num_good: int, failed: set[int]) -> None:
        good = r.loads[:num_good]
        loaded_tokens = sum(len(op.block_ids) - op.first_block for op in good) * self.block_size
        with self._lock:
            self.stats.num_loaded_chunks += num_good
            self.stats.num_loaded_tokens += loaded_tokens
            self.stats.num_failed_chunks += len(r.loads) - num_good
            self.stats.num_failed_tokens += len(failed) * self.block_size
        if failed:
            log.warning("crescent: request %s: %d of %d chunks could not be loaded; vLLM recomputes them",
                        r.req_id, len(r.loads) - num_good, len(r.loads))
        if good:
            log.info("crescent: request %s: loaded %d tokens (%d chunks) from the store%s", r.req_id,
                     loaded_tokens, num_good, " beside the steps" if r.async_load else "")

    def _staging_for(self, link: StoreLink, num_chunks: int) -> torch.Tensor:
        need = link.staging_bytes(num_chunks, self.dtype, self._shape)
        buf = self._staging.get(id(link))
        if buf is None or buf.numel() < need:
            cuda = self._kv[0][0].is_cuda
            size = max(need, 2 * buf.numel() if buf is not None else 0)
            buf = self._staging[id(link)] = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        return buf

    def _scratch_for(self, num_blocks: int, who: str) -> torch.Tensor:
        cache = self._kv[0][0]
        need = num_blocks * cache[0].numel()
        buf = self._scratch.get(who)
        if buf is None or buf.numel() < need:
            size = max(need, 2 * buf.numel() if buf is not None else 0)
            buf = self._scratch[who] = torch.empty(size, dtype=cache.dtype, device=cache.device)
        return buf

    def _stage_for(self, num_chunks: int, who: str) -> torch.Tensor:
        """``[num_chunks, 2, kv_heads, chunk_tokens, head_dim]`` on the caches' GPU: one layer of
        every chunk of a load, DMA'd in before it is scattered into the pages (reused, grown)."""
        buf = self._stages.get(who)
        if buf is None or buf.shape[0] < num_chunks:
            n = max(num_chunks, 2 * buf.shape[0] if buf is not None else 0)
            buf = self._stages[who] = torch.empty((n, *self._shape[1:]), dtype=self.dtype,
                                                  device=self._kv[0][0].device)
        return buf[:num_chunks]

    def _stream_for(self, who: str):
        stream = self._streams.get(who)
        if stream is None:
            stream = self._streams[who] = torch.cuda.Stream(self._kv[0][0].device)
        return stream

    def _lander_pool(self) -> ThreadPoolExecutor:
        if self._lander is None:
            self._lander = ThreadPoolExecutor(1, thread_name_prefix="crescent-lander",
                                              initializer=one_intra_op_thread)
        return self._lander

    def _ensure_loader(self) -> None:
        if self._loader is None:
            if self.load_link is None:
                self.load_link = StoreLink(self.link.config)
            self._loader = threading.Thread(target=self._load_loop, name="crescent-loader", daemon=True)
            self._loader.start()

    def _load_loop(self) -> None:
        one_intra_op_thread()
        if self.on_gpu:
            torch.cuda.set_device(self._kv[0][0].device)  # (this thread's copies: the caches' GPU)
        while True:
            r = self._loads.get()
            try:
                if r is None:
                    return
                try:
                    landing = self._fetch([r], self.load_link, "async")
                    landing.land_all()
                    ((_, failed),) = landing.finish()
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
        self.finish_loads()
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # ---- saves ---------------------------------------------------------------

    def _step_saves(self) -> _StepSaves:
        """This step's chunks to save, staged once per step (after its loads: a request whose load
        failed saves nothing): one buffer for all of them, filled a layer at a time."""
        if self._step is None:
            chunks: list[tuple[str, ChunkOp, ChunkKey, ChunkKey, Namespace]] = []
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
                chunks.append((req_id, op, key, parent, ns))
            cache0 = self._kv[0][0]
            shape = (len(chunks), *self._shape)
            numel = int(np.prod(shape))
            ids = to_device([b for _, op, *_ in chunks for b in op.block_ids], torch.long, cache0.device)
            if cache0.is_cuda or not chunks:
                # NOTE: device memory (the caching allocator's), held until the saver thread wrote
                # it: at most ``save_queue_steps`` steps wait (a GiB moves in ~20 ms at 55 GB/s).
                self._step = _StepSaves(chunks, torch.empty(shape, dtype=self.dtype, device=cache0.device), ids)
            else:
                buf = self._save_buffers.take(numel, self.dtype)
                self._step = _StepSaves(chunks, buf[:numel].view(shape), ids, buf)
        return self._step

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gathers one layer of every chunk this step saves (called after the layer ran): one gather
        for all of them."""
        layer = self._layers.get(layer_name)
        if not self._saves or layer is None:
            return
        step = self._step_saves()
        if step.chunks:
            gather_chunks(kv_layer, self._kv[layer][1], step.ids, step.gathered[:, layer],
                          self._scratch_for(step.ids.numel(), "save"))
            step.layers_done.add(layer)

    def end_step(self) -> None:
        """Completes this step's loads, then its chunks to save (layers not handed over during the
        step are gathered now), and queues them for the saver thread, which encodes and stores
        them. On a GPU each chunk's wsum64 is summed there, queued on the compute stream behind
        the step: the saver thread waits for it (an event), vLLM's thread does not, and writes the
        chunks from device memory with that check (it hashes nothing): one DMA each straight into
        the slots it reserved in a same-host node's arena (registered with CUDA: a zero-copy put),
        else one DMA into pinned memory first."""
        self.finish_loads()
        if not self._saves:
            return
        step = self._step_saves()
        self._step, self._saves = None, []
        if not step.chunks:
            return
        n = len(step.chunks)
        keep = [i for i, (req_id, *_) in enumerate(step.chunks) if req_id not in self._failed_reqs]
        if len(keep) < n:
            # NOTE: a load this step's forward read failed its check on the device (or could not be
            # written): vLLM discards the output and reruns, and the rerun saves these chunks.
            with self._lock:
                self.stats.num_dropped_chunks += n - len(keep)
        if not keep:
            if step.buffer is not None:
                self._save_buffers.give(step.buffer)
            return
        scratch = self._scratch_for(step.ids.numel(), "save")
        for layer, (cache, layout) in enumerate(self._kv):
            if layer not in step.layers_done:
                gather_chunks(cache, layout, step.ids, step.gathered[:, layer], scratch)
        items = [(i, key, ns, parent, op.tokens) for i in keep for _, op, key, parent, ns in (step.chunks[i],)]
        batch = _SaveBatch(items, step.gathered, buffer=step.buffer)
        if step.gathered.is_cuda:
            words = step.gathered[0].numel() * step.gathered.element_size() // 8
            batch.hashes = torch.empty(n, dtype=torch.int64, pin_memory=True)
            batch.hashes.copy_(wsum64_rows(step.gathered, 0, words), non_blocking=True)
            batch.ready = torch.cuda.Event()
            batch.ready.record(torch.cuda.current_stream(step.gathered.device))
        self._ensure_saver()
        self._queue.put(batch)

    def _ensure_saver(self) -> None:
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="crescent-saver", daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        one_intra_op_thread()
        if self.on_gpu:
            torch.cuda.set_device(self._kv[0][0].device)  # (this thread's streams and copies: the caches' GPU)
            self.save_link.shm_session(register_cuda=True)  # (None where the node is elsewhere or away)
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                direct = False
                try:
                    hashes, payloads = None, batch.gathered
                    if batch.ready is not None:
                        batch.ready.synchronize()  # (the step's gathers and sums have completed)
                        hashes = [h & _U64 for h in batch.hashes.tolist()]
                        direct = self.save_link.shm_session(register_cuda=True) is not None
                        if not direct:
                            payloads = self._to_pinned(payloads)
                    encoded = [(key, encode_chunk(payloads[i], ns, parent, tokens, CHECK_XXH3, None) if hashes is None
                                else encode_chunk(payloads[i], ns, parent, tokens, CHECK_WSUM, hashes[i]))
                               for i, key, ns, parent, tokens in batch.items]
                except Exception:  # noqa: BLE001
                    # NOTE: a chunk that cannot be encoded is a lost save, never a dead saver thread
                    # (the queue would fill and block the forward).
                    log.exception("crescent: encoding %d chunks failed; not saving them", len(batch.items))
                    encoded = []
                stored = self.save_link.save(encoded)
                with self._lock:
                    self.stats.num_saved_chunks += stored
                    self.stats.num_dropped_chunks += len(batch.items) - stored
                    if direct:
                        self.stats.num_device_saved_chunks += stored
            finally:
                if batch is not None and batch.buffer is not None:
                    self._save_buffers.give(batch.buffer)
                self._queue.task_done()

    def _to_pinned(self, gathered: torch.Tensor) -> torch.Tensor:
        """A step's chunks copied from the device into pinned memory (one DMA, on the saver's own
        stream), for a node whose arena is not registered here."""
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(gathered.device)
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        with torch.cuda.stream(self._save_stream):
            host.copy_(gathered, non_blocking=True)
        self._save_stream.synchronize()
        return host

    def flush(self) -> None:
        """Blocks until every queued chunk was stored or dropped."""
        self._queue.join()

    def close(self) -> None:
        self.finish_loads()
        if self._lander is not None:
            self._lander.shutdown()
            self._lander = None
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
