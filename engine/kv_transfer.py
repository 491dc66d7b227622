"""Moving KV chunks between the store and the KV pages: a fixed staging pool and a pipelined load.

``StagingPool`` holds host buffers allocated once, at engine start: a load
never allocates (the old path made a fresh ``bytearray`` per chunk, zeroed by
the allocator, then copied it pageable to the device). On CUDA the buffers are
pinned, so their copy to the device is an asynchronous DMA at full bandwidth
on a transfer stream.

``pipelined_load`` runs a load in batches of chunks: while batch b is verified
and started towards its pages on the caller's thread, batch b+1 is fetched
into other buffers on the pool's fetch thread (the store's copies release the
GIL). Chunks land in order; the first miss or failed verification stops the
load, and nothing after it lands. A buffer goes back to the pool only once the
copy that reads it has completed, on every path (miss, bad chunk, store error).

``LayerwiseLanding`` lands chunks already in memory here (a same-host node's
arena) layer by layer beside the step; ``StreamedLanding`` does the same for
chunks another node streams layer-major, through a ``StreamRing`` of host
buffers made at start.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels.host import HostSlab, one_intra_op_thread, to_device
from kvstore.chunk import CHECK_WSUM, WSUM_K
from kvstore.errors import CrescentError


class StagingPool:
    """``count`` host buffers of ``slot_bytes`` each, allocated once (pinned when ``pin``).

    Args:
        slot_bytes: bytes of one buffer (an encoded chunk).
        count: buffers; a pipelined load of batches of ``b`` chunks needs ``2 * b``.
        pin: page-lock them (needs CUDA): device copies from them are asynchronous DMA.
        device: where the buffers are (default the host); a device pool has no byte views.
        pin_device: the GPU whose copies use a pinned pool (default: the current one).
    """

    def __init__(self, slot_bytes: int, count: int, pin: bool = False, device: torch.device | None = None,
                 pin_device: torch.device | None = None) -> None:
        if slot_bytes <= 0 or count <= 0:
            raise ValueError("a staging pool needs a positive buffer size and count")
        self.slot_bytes, self.count = slot_bytes, count
        self.device = torch.device("cpu") if device is None else torch.device(device)
        on_host = self.device.type == "cpu"
        self.pinned = pin and on_host
        self.slab = None
        if on_host:  # one slab, each buffer page-aligned in it (see HostSlab: pin_memory rounds each up)
            stride = -(-slot_bytes // PAGE) * PAGE
            self.slab = HostSlab(stride * count, pin=self.pinned, device=pin_device)
            self.pinned = self.slab.pinned
            self._bufs = [self.slab.tensor[i * stride : i * stride + slot_bytes] for i in range(count)]
        else:
            self._bufs = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self._views = [memoryview(b.numpy()) for b in self._bufs] if on_host else []
        self._free = list(range(count))
        self._cv = threading.Condition()
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch", initializer=one_intra_op_thread)

    def take(self, n: int, timeout_s: float = 60.0) -> list[int]:
        """``n`` free buffers' ids, waiting for copies in flight to give theirs back."""
        if n > self.count:
            raise ValueError(f"{n} buffers asked of a pool of {self.count}")
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._free) >= n, timeout=timeout_s):
                raise TimeoutError(f"no {n} free staging buffers in {timeout_s} s (a leak?)")
            ids, self._free = self._free[:n], self._free[n:]
            return ids

    def give(self, ids: Sequence[int]) -> None:
        with self._cv:
            self._free.extend(ids)
            self._cv.notify_all()

    def view(self, i: int) -> memoryview:
        """Buffer ``i`` as a writable byte view (what ``batch_get_into`` fills; host pools)."""
        return self._views[i]

    def tensor(self, i: int) -> torch.Tensor:
        return self._bufs[i]

    @property
    def in_use(self) -> int:
        with self._cv:
            return self.count - len(self._free)

    def close(self) -> None:
        self.fetcher.shutdown(wait=True)
        if self.slab is not None:
            self.slab.close()


Fetch = Callable[[int, int, list[memoryview]], list[int | None]]
"""``fetch(first, count, views)``: fills ``views[j]`` with chunk ``first + j``; its size, or None (a miss)."""
Land = Callable[[int, int, int], tuple[bool, object]]
"""``land(i, buffer_id, size)``: verifies chunk ``i`` and starts its copy into the pages:
``(ok, event)``; ``event.synchronize()`` waits for an asynchronous copy (None: it is done)."""


def land_in_order(steps, land: Callable, events: list) -> tuple[int, bool]:
    """Calls ``land(*step)`` for each step in order (a step of None is a miss), keeping the
    events of the copies started in ``events``; stops at the first miss or refusal.
    Returns ``(chunks landed, stopped early)``."""
    landed = 0
    for step in steps:
        if step is None:
            return landed, True
        ok, ev = land(*step)
        if ev is not None:
            events.append(ev)
        if not ok:
            return landed, True
        landed += 1
    return landed, False


def pipelined_load(pool: StagingPool, num: int, batch: int, fetch: Fetch, land: Land,
                   on_error: Callable[[CrescentError], None]) -> int:
    """Loads chunks ``0 .. num-1`` through ``pool``; returns how many landed (a prefix).

    The fetch of the next batch overlaps the landing of this one. A store error
    (``on_error`` gets it), a miss or a chunk ``land`` refuses stops the load
    there. Returns once every copy it started has completed and every buffer is
    back in the pool.
    """
    batch = max(1, min(batch, pool.count // 2 or 1))
    spans = [(s, min(batch, num - s)) for s in range(0, num, batch)]
    landed = 0
    in_flight: list[tuple[list, list[int]]] = []  # (events, buffer ids) of copies started

    def settle() -> None:
        while in_flight:
            events, ids = in_flight.pop(0)
            for ev in events:
                ev.synchronize()
            pool.give(ids)

    def start(k: int):
        first, count = spans[k]
        ids = pool.take(count)
        return ids, pool.fetcher.submit(fetch, first, count, [pool.view(i) for i in ids])

    nxt = start(0) if spans else None
    try:
        for k, (first, count) in enumerate(spans):
            ids, fut = nxt
            nxt = None
            try:
                sizes = fut.result()
            except CrescentError as exc:
                pool.give(ids)
                on_error(exc)
                break
            except BaseException:
                pool.give(ids)
                raise
            settle()  # the batch before this one has reached its pages: its buffers are free again
            if k + 1 < len(spans) and all(s is not None for s in sizes):
                nxt = start(k + 1)
            events: list = []
            try:
                n, stop = land_in_order(((first + j, ids[j], size) if size is not None else None
                                         for j, size in enumerate(sizes)), land, events)
                landed += n
            finally:
                in_flight.append((events, ids))
            if stop:
                break
    finally:
        if nxt is not None:  # fetched ahead of a stop: wait for it, then return its buffers
            ids, fut = nxt
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the load stopped before this batch anyway
                pass
            pool.give(ids)
        settle()
    return landed


STAGE_CHUNKS = 32
"""Chunk-layers the device staging buffer of a layer-by-layer load holds (a layer of more
chunks lands in groups of this many, one after another on the transfer stream)."""


class DeviceStage:
    """A device buffer of ``group`` chunk-layers, made at start: on CUDA a group's layer is DMA'd
    in by the copy engine, then one ``scatter_kv_layer`` launch reads it into the pages (and
    sums its wsum64 shares from the same loads). ``table`` says where that kernel reads each row."""

    def __init__(self, group: int, layer_shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        import kernels

        self.buf = torch.empty((group, *layer_shape), dtype=dtype, device=device)
        self.rows = list(self.buf.unbind(0))
        self.table = kernels.source_table(self.rows, device)

    @property
    def group(self) -> int:
        return self.buf.shape[0]


def source_rows(table: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The first ``n`` rows of a source table (None where the twin lands: it needs none)."""
    return None if table is None else table[:n]


def land_layer(sources: Sequence[torch.Tensor], table, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
               sums: torch.Tensor | None, offset_words: int, position_words: int) -> None:
    """One launch: layer parts where they are (``sources``, read through ``table``) into their
    pages; their wsum64 shares (at payload word ``position_words``) added to ``sums`` when given."""
    import kernels

    share = kernels.scatter_kv_layer(sources, k, v, page_ids, offset_words=offset_words,
                                     wsum_at=position_words if sums is not None else None, wsum_k=WSUM_K,
                                     table=table)
    if sums is not None:
        sums += share


class LayerwiseLanding:
    """Lands chunks layer by layer, beside the step that reads them: layer ``l`` of every chunk
    reaches its pages before layer ``l`` of the step computes, and layer ``l + 1`` moves while it
    does (the way LMCache's layerwise mode and SGLang's HiCache load).

    A chunk is a ``[L, 2, KVH, chunk_tokens, D]`` tensor where its bytes already are: the node's
    registered arena (a host→device DMA), its device tier (a device copy), or host memory.

    On CUDA a layer's copies go on the transfer stream (per group of ``STAGE_CHUNKS`` chunks:
    a DMA of their layer into ``stage``, then one ``scatter_kv_layer`` launch into the layer's
    pages that also sums their wsum64 shares), followed by an event; with ``direct`` the kernel
    reads every chunk's layer where it is (registered host memory, the node's device tier) in
    one launch per layer, without the DMA; ``start`` queues the first layers, ``wait(l)`` queues up to layer
    ``l + AHEAD`` and makes the compute stream wait for layer ``l``'s event (the host never
    waits). On the CPU ``wait(l)`` lands the layers up to ``l``
    there and then: the same order, with no transfer engine to overlap.

    ``finish`` lands whatever is left and returns once every copy has completed (the chunks'
    source may be released then): the wsum64 of each chunk as it landed (``[N]`` int64 on the
    device) when ``checksum``, else None.
    """

    def __init__(self, runner, chunks: list[torch.Tensor], pages: list[list[int]], checksum: bool,
                 stage: DeviceStage | None = None, direct: bool = False) -> None:
        self.runner, self.chunks = runner, chunks
        self.direct = direct
        self._sources = None
        """Where the landing kernel reads each chunk (``direct``; made with the page table)."""
        self.num_layers = len(runner.k_caches)
        self._pages, self._checksum = pages, checksum
        self.page_ids: torch.Tensor | None = None
        self.sums: torch.Tensor | None = None
        first = chunks[0] if chunks else None
        self._layer_words = first[0].numel() * first.element_size() // 8 if first is not None else 0
        self._total_words = self._layer_words * self.num_layers
        self.stage = stage
        self.events: list | None = None
        self.landed_layers = 0
        """Layers landed (CPU), or queued on the transfer stream (CUDA)."""

    def _tables(self) -> None:
        """Page ids and wsum64 accumulators, on the device (made on the stream that uses them)."""
        if self.page_ids is None:
            dev = self.runner.device
            self.page_ids = to_device(self._pages, torch.int32, dev)
            if self.direct:
                import kernels

                self._sources = kernels.source_table(self.chunks, dev)
            if self._checksum:
                self.sums = torch.zeros(len(self.chunks), dtype=torch.int64, device=dev)

    def _share(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        from kvstore.chunk import wsum64_rows

        return wsum64_rows(rows, layer * self._layer_words, self._total_words)

    def start(self) -> None:
        """CUDA: queues the first ``AHEAD`` layers' copies on the transfer stream (each later
        one is queued as the step's layers are launched, so the compute stream's first
        kernels are not held back by the host queueing every copy first). CPU: nothing yet."""
        if self.runner.transfer_stream is None or not self.chunks:
            return
        self.events = []
        self._queue(self.AHEAD - 1)

    AHEAD = 2
    """Layers queued ahead of the one the step is launching (CUDA)."""

    def _queue(self, upto: int) -> None:
        """Queues the copies of every layer up to ``upto`` not queued yet (CUDA)."""
        upto = min(upto, self.num_layers - 1)
        if self.landed_layers > upto:
            return
        stream = self.runner.transfer_stream
        n, lw = len(self.chunks), self._layer_words
        with torch.cuda.stream(stream):
            self._tables()
            for layer in range(self.landed_layers, upto + 1):
                k, v = self.runner.k_caches[layer], self.runner.v_caches[layer]
                if self.direct:
                    land_layer(self.chunks, self._sources, k, v, self.page_ids, self.sums, layer * lw, layer * lw)
                else:
                    group = self.stage.group
                    for g0 in range(0, n, group):
                        g = min(group, n - g0)
                        for j in range(g):
                            self.stage.rows[j].copy_(self.chunks[g0 + j][layer], non_blocking=True)
                        land_layer(self.stage.rows[:g], source_rows(self.stage.table, g), k, v,
                                   self.page_ids[g0 : g0 + g], None if self.sums is None else self.sums[g0 : g0 + g],
                                   0, layer * lw)
                ev = torch.cuda.Event()
                ev.record(stream)
                self.events.append(ev)
        self.landed_layers = upto + 1

    def wait(self, layer: int) -> None:
        """Before layer ``layer`` computes: its KV (and every earlier layer's) is in the pages."""
        if self.events is not None:
            self._queue(layer + self.AHEAD)
            torch.cuda.current_stream(self.runner.device).wait_event(self.events[layer])
            return
        import kernels

        self._tables()
        while self.landed_layers <= layer:
            l = self.landed_layers
            k, v = self.runner.k_caches[l], self.runner.v_caches[l]
            for i, chunk in enumerate(self.chunks):
                part = chunk[l][None]
                if self.sums is not None:
                    self.sums[i] += self._share(part, l)[0]
                kernels.scatter_kv_chunks(part, k, v, self.page_ids[i : i + 1])
            self.landed_layers += 1

    def finish(self) -> torch.Tensor | None:
        if not self._pages:
            return None
        if self.events is None:
            if self.landed_layers < self.num_layers:  # the step did not need them all (or did not run)
                self.wait(self.num_layers - 1)
        else:
            self._queue(self.num_layers - 1)  # the step did not need them all (or did not run)
            self.events[-1].synchronize()
        return self.sums


PAGE = 4096
"""Staging buffers start on page boundaries, as ``pin_memory``'s did (DMA and 16-byte vector loads)."""

RING_UNITS = 3
"""Host buffers of a streamed load (``StreamRing``), each a group of up to ``STAGE_CHUNKS``
chunk-layers: one fills from the socket while the one before it lands."""


class StreamRing:
    """The host buffers streamed loads receive into, made at start and shared by every one of
    them: ``units`` groups of ``group`` chunk-layers of ``layer_bytes`` (pinned on CUDA), and the
    thread that lands them, so that receiving group g + 1 overlaps landing group g.

    A unit is ``take``n by the receiving thread before it fills it and set ``free`` by the lander
    once it has landed it (on CUDA, once its copy is queued: ``take`` then also waits for that
    copy, ``copies[u]``, to complete).
    """

    def __init__(self, units: int, group: int, layer_bytes: int, pin: bool,
                 direct: torch.device | None = None, pin_device: torch.device | None = None) -> None:
        self.slab = HostSlab(units * group * layer_bytes, pin=pin, device=pin_device or direct)
        self.buf = self.slab.tensor.view(units, group, layer_bytes)
        self.rows = [[memoryview(self.buf[u, r].numpy()) for r in range(group)] for u in range(units)]
        self.tables = None
        """With ``direct`` (a CUDA device; the buffers pinned): where the landing kernel there reads
        each buffer's rows, in place over the bus (no DMA into a device stage first)."""
        if direct is not None:
            import kernels

            self.tables = [kernels.source_table(list(self.buf[u].unbind(0)), direct) for u in range(units)]
        self.trash = memoryview(bytearray(layer_bytes))
        """Where the parts of chunks a load does not land are drained (one stream at a time writes it)."""
        self.free = [threading.Event() for _ in range(units)]
        for ev in self.free:
            ev.set()
        self.copies: list = [None] * units
        self.lander = ThreadPoolExecutor(1, thread_name_prefix="kv-land", initializer=one_intra_op_thread)

    @property
    def units(self) -> int:
        return self.buf.shape[0]

    @property
    def group(self) -> int:
        return self.buf.shape[1]

    def take(self, unit: int, timeout_s: float) -> None:
        if not self.free[unit].wait(timeout_s):
            raise TimeoutError(f"stream ring buffer {unit} not landed in {timeout_s} s")
        self.free[unit].clear()
        ev = self.copies[unit]
        if ev is not None:  # the DMA that read it last must be done before the socket writes it
            ev.synchronize()
            self.copies[unit] = None

    def close(self) -> None:
        self.lander.shutdown(wait=False)


class StreamedLanding:
    """Chunks another node streams layer-major (``batch_get_layered``: every chunk's header, then
    layer 0 of every chunk, layer 1, …), landed as they arrive, beside the step that reads them.

    Where ``LayerwiseLanding`` reads chunks already in memory here, this one overlaps the
    network too: the fetch thread receives the chunks' layers into a ``StreamRing`` group by
    group (up to ``STAGE_CHUNKS`` chunk-layers) and hands each full group to the ring's lander,
    which hashes it (xxh3 chunks) and lands it (CUDA: one DMA into ``stage`` and one
    ``scatter_kv_layer`` launch that also sums the wsum64 shares, on the transfer stream, then an
    event; with a direct ring, the kernel reads the pinned buffer itself; CPU: the scatter)
    while the socket fills the next group and the step computes the layers before it.

    ``start`` returns once every header is in and checked (``check_header(i, head)``: its
    ``ChunkHeader``, or None to refuse chunk ``i``): the chunks before the first refused one
    land, the rest of the stream is drained. ``wait(l)`` before layer ``l`` computes: the host
    waits until the layer has landed (CUDA: its copies are queued), then the compute stream
    waits on their event. ``finish`` after the step; ``headers``, ``digests`` (xxh3, as the
    layers went by) and ``sums`` (wsum64 as landed, on the device) are then the caller's to
    compare.

    ``fetch(keys, head, layer, on_sizes, dest, arrived) -> bool`` runs the stream: a client's
    ``batch_get_layered`` (the node's data channel) or a one-sided session's ``get_layered``
    (RDMA READs of the node's arena, layer by layer); False: it cannot (read another way).
    """

    def __init__(self, runner, fetch: Callable[..., bool], keys: list[bytes], head_bytes: int, pages: list[list[int]],
                 check_header: Callable[[int, bytes], object], *, ring: StreamRing,
                 stage: DeviceStage | None, fetcher: ThreadPoolExecutor, timeout_s: float) -> None:
        self.runner, self._fetch, self.keys = runner, fetch, keys
        self.head_bytes, self._pages, self._check_header = head_bytes, pages, check_header
        self.num_layers = len(runner.k_caches)
        self._layer_shape = runner.chunk_shape[1:]
        self.layer_bytes = ring.buf.shape[-1]
        self._ring, self._stage, self._fetcher, self.timeout_s = ring, stage, fetcher, timeout_s
        self.heads = [bytearray(head_bytes) for _ in keys]
        self.count = 0
        """Leading chunks present with a good header: these land (the step computes after them)."""
        self._sizes: list[int | None] = []
        self._last = -1
        self.layers_in = [0] * len(keys)
        """Layers of each chunk landed (queued, on CUDA)."""
        self.headers: list = []
        """The checked header of each of the ``count`` chunks (``check_header``'s answer)."""
        self.digests: list = []
        self.sums: torch.Tensor | None = None
        self.page_ids: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._heads_in = threading.Event()
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self._layer_events: list = [None] * self.num_layers
        self._future = None
        self._cuda = runner.transfer_stream is not None
        self._lock = threading.Lock()
        """Held while a group lands, while ``start`` gives up on the headers and while ``finish``
        closes: no layer lands after either."""
        self._closed = False
        self._stalled = False
        self._held: set[int] = set()
        """Ring buffers this stream took and has not handed to the lander yet (fetch thread only)."""

    def start(self) -> bool:
        """Starts the stream and waits for the headers; False (nothing started) when the node
        cannot stream (no data channel: read another way). ``count`` chunks will land."""
        if not self.keys:
            return False
        self._future = self._fetcher.submit(self._run)
        got = self._heads_in.wait(self.timeout_s)
        with self._lock:  # a stream that failed (or stalled) before the step: nothing lands from it now
            if not got or self.error is not None:
                self.count = 0
                if self.error is None:
                    self.error = TimeoutError(f"no chunk headers in {self.timeout_s} s")
        if isinstance(self.error, _NoStream):
            self._future.result()
            self.error = None
            return False
        if self.count == 0 and self._cuda:  # copies it queued before failing end before the step writes
            torch.cuda.current_stream(self.runner.device).wait_stream(self.runner.transfer_stream)
        return True

    def _run(self) -> None:
        try:
            if not self._fetch(self.keys, self.head_bytes, self.layer_bytes, self._on_sizes, self._dest,
                               self._arrived):
                raise _NoStream()
        except BaseException as exc:  # noqa: BLE001 - the waiters learn of it; finish reports it
            if self.error is None:
                self.error = exc
        finally:
            self._heads_in.set()
            for unit in self._held:  # a group the stream broke off in the middle of: nothing lands it
                self._ring.free[unit].set()
            self._held.clear()
            try:  # after every group handed to the lander
                self._ring.lander.submit(self._end)
            except RuntimeError:  # the lander was shut down (the connector closed)
                self._end()

    def _end(self) -> None:
        """The stream is over and its groups landed: nothing waits on it any longer."""
        for ev in self._ready:
            ev.set()

    def _on_sizes(self, sizes: list[int | None]) -> None:
        import xxhash

        want = self.head_bytes + self.num_layers * self.layer_bytes
        n = 0
        while n < len(sizes) and sizes[n] == want:
            n += 1
        self.count = n  # provisional: the headers may refuse some
        self._sizes = sizes
        self._last = max((i for i, s in enumerate(sizes) if s is not None), default=-1)
        self.digests = [xxhash.xxh3_64() for _ in range(n)]
        if self._last < 0:
            self._heads_in.set()

    def _heads_checked(self) -> None:
        """Every header is in: the page table and (for wsum64 chunks) the sums, before any layer."""
        n = self.count
        if n:
            dev = self.runner.device
            with torch.cuda.stream(self.runner.transfer_stream) if self._cuda else contextlib.nullcontext():
                self.page_ids = to_device(self._pages[:n], torch.int32, dev)
                if any(h.check == CHECK_WSUM for h in self.headers[:n]):
                    self.sums = torch.zeros(n, dtype=torch.int64, device=dev)
        self._heads_in.set()

    def _unit(self, j: int, part: int) -> int:
        g = self._ring.group
        return (part * -(-self.count // g) + j // g) % self._ring.units

    def _dest(self, j: int, part: int) -> memoryview:
        if part < 0:
            return memoryview(self.heads[j])
        if j >= self.count or self._closed:
            return self._ring.trash
        unit = self._unit(j, part)
        if j % self._ring.group == 0:
            self._ring.take(unit, self.timeout_s)
            self._held.add(unit)
        return self._ring.rows[unit][j % self._ring.group]

    def _arrived(self, j: int, part: int) -> None:
        if part < 0:
            with self._lock:
                if j < self.count:
                    hdr = self._check_header(j, bytes(self.heads[j]))
                    if hdr is None:
                        self.count = j  # it and every chunk after it are recomputed
                    else:
                        self.headers.append(hdr)
                if j == self._last:
                    self._heads_checked()
            return
        g = self._ring.group
        unit = self._unit(j, part)
        if unit in self._held and (j % g == g - 1 or j == self.count - 1):  # a group is in: land it
            self._held.discard(unit)
            self._ring.lander.submit(self._land_group, part, j - j % g, j % g + 1, unit)

    def _land_group(self, layer: int, g0: int, n: int, unit: int) -> None:
        """On the lander: hashes and lands chunks ``g0 .. g0+n-1``'s layer from ring buffer ``unit``."""
        try:
            with self._lock:
                if self._closed or g0 >= self.count:
                    return
                rows = self._ring.rows[unit]
                for j in range(g0, g0 + n):
                    if self.headers[j].check != CHECK_WSUM:
                        self.digests[j].update(rows[j - g0])
                self._land(layer, g0, n, unit)
        except BaseException as exc:  # noqa: BLE001 - its chunks do not arrive whole: finish tells
            if self.error is None:
                self.error = exc
        finally:
            self._ring.free[unit].set()
            if g0 + n >= self.count:
                self._ready[layer].set()

    def _land(self, layer: int, g0: int, n: int, unit: int) -> None:
        import kernels

        rows = self._ring.buf[unit, :n].view(self.runner.dtype).view(n, *self._layer_shape)
        k, v = self.runner.k_caches[layer], self.runner.v_caches[layer]
        ids = self.page_ids[g0 : g0 + n]
        if self._cuda:
            sums = None if self.sums is None else self.sums[g0 : g0 + n]
            at = layer * (self.layer_bytes // 8)
            with torch.cuda.stream(self.runner.transfer_stream):
                if self._ring.tables is not None:  # read where it is: the pinned ring buffer
                    land_layer(list(self._ring.buf[unit, :n].unbind(0)), self._ring.tables[unit][:n], k, v, ids,
                               sums, 0, at)
                else:  # a DMA into the device stage, then the kernel reads it there
                    self._stage.buf[:n].copy_(rows, non_blocking=True)
                    land_layer(self._stage.rows[:n], source_rows(self._stage.table, n), k, v, ids, sums, 0, at)
                ev = torch.cuda.Event()
                ev.record(self.runner.transfer_stream)
            self._ring.copies[unit] = ev
            self._layer_events[layer] = ev
        else:
            if self.sums is not None:
                self.sums[g0 : g0 + n] += self._share(rows, layer)
            kernels.scatter_kv_chunks(rows, k, v, ids)
        for j in range(g0, g0 + n):
            self.layers_in[j] += 1

    def _share(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        from kvstore.chunk import wsum64_rows

        words = self.layer_bytes // 8
        return wsum64_rows(rows, layer * words, words * self.num_layers)

    def wait(self, layer: int) -> None:
        """Before layer ``layer`` computes: its KV of these chunks is in the pages (CUDA: queued,
        and the compute stream waits for it). A stream that broke or stalls leaves the pages as
        they are (``finish`` tells: the step is thrown away)."""
        if self.count == 0 or self._stalled:
            return
        if not self._ready[layer].wait(self.timeout_s):
            self._stalled = True  # the step goes on (and is thrown away), not one timeout per layer
            return
        ev = self._layer_events[layer]
        if ev is not None:
            torch.cuda.current_stream(self.runner.device).wait_event(ev)

    def finish(self) -> int:
        """Ends the landing once every layer has landed (or the stream broke, or stalled for
        ``timeout_s``): nothing lands after it returns (a stream still running, stalled on
        a node, lands no more; its thread ends with its socket, and a later stream queues
        behind it) and every copy queued has completed. Returns how many leading chunks
        arrived and landed whole (of ``count``)."""
        if self.count and not self._stalled and not self._ready[-1].wait(self.timeout_s):
            self._stalled = True  # (a step that did not need every layer, or none: they land first)
        with self._lock:
            self._closed = True
        if self._cuda:
            for ev in list(self._ring.copies):
                if ev is not None:
                    ev.synchronize()
        whole = 0
        while whole < self.count and self.layers_in[whole] == self.num_layers:
            whole += 1
        return whole


class _NoStream(Exception):
    """The node has no data channel to stream from."""
