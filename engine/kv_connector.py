"""The engine's store connector: look up, load and save KV chunks by content hash.

Before prefill the engine asks the store how many leading chunks of the prompt
it holds (``lookup``), loads them into the sequence's pages beside the step
that computes the rest (``begin_load``; see kv_transfer): read in place from a
same-host node's arena, or streamed layer-major from another node, layer ``l``
landing while earlier layers compute (a staging pool made at start, batch by
batch before the step, where the node cannot stream). After each step,
every newly completed chunk is gathered from the pages into a save buffer (a
copy, so the pages may be reused at once; on CUDA an asynchronous copy on the
save stream) and handed to a background thread that encodes and stores it, so
the transfer of chunk k overlaps the compute of chunk k+1.

A verification failure or a store error is a miss: the engine recomputes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

import kernels
from kernels.host import one_intra_op_thread
from engine.kv_transfer import (RING_UNITS, STAGE_CHUNKS, DeviceStage, LayerwiseLanding, StagingPool, source_rows,
                                StreamedLanding, StreamRing, pipelined_load)
from engine.model_runner import ModelRunner
from kvstore.chunk import (CHECK_WSUM, CHECK_XXH3, WSUM_K, check_payload, encode_chunk, encoded_size, tensor_bytes,
                           verify_chunk, verify_header)
from kvstore.client import StoreClient
from kvstore.errors import ChunkVerificationError, CrescentError
from kvstore.keys import ROOT_KEY, ChunkKey, Namespace, chunk_keys, make_namespace
from kvstore.transport.descriptors import ItemStatus, Mover
from kvstore.transport.memcopy import buffer_address
from kvstore.transport.session import LAYERED_AHEAD, leased_head, safe_end

log = logging.getLogger(__name__)

SAVE_WAIT_S = 5.0
"""How long ``save`` waits for a free save buffer before it gives up on the rest of its chunks."""


@dataclass
class ConnectorStats:
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_saved: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    """Host time the engine spent on loads and not on computing: starting them (fetches, checks),
    the step's waits for a layer (on a CPU, landing it there), finishing them. For ``load``
    alone, bytes_loaded / load_s is the load rate."""
    chunks_loaded_in_place: int = 0
    """Of chunks_loaded: read where the node keeps them (same host), not through the pool."""
    chunks_loaded_from_device: int = 0
    """Of those: from the node's device tier, device to device (cuda_ipc)."""
    load_failures: int = 0
    """Chunks that were reported present but failed to load or verify."""
    save_failures: int = 0
    verify_failures: int = 0
    """Chunks read from the store whose header or payload failed verification (corrupt or mislabelled)."""
    late_failures: int = 0
    """Loads with a chunk that failed a check made after the step had computed beside it (its
    wsum64 where it landed, a lease that ran out before its copy ended): the engine threw that
    step's tokens away and recomputed from the chunk."""
    store_errors: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Lease:
    """A read lease a pending load holds: its chunks' payloads are read where they are."""

    grant: object
    ctx: object
    """``session.in_place(grant)``, entered (None until then): the mapping stays open until the lease ends."""
    start: int
    """The load's index of its first chunk."""
    mover: Mover
    count: int = 0
    """Of its chunks, those that passed their checks (held for landing)."""


class PendingLoad:
    """A load under way beside the step that needs it (``StoreConnector.begin_load``).

    ``landed`` chunks passed every check made before the step (present, leased, their
    headers and any xxh3 payload verified): the step computes after them, the model calling
    ``wait_layer(l)`` before each layer. ``finish``, after the step, waits for the copies,
    ends the leases and compares each wsum64 payload as it landed; it returns how many
    chunks are good: fewer than ``landed`` (a bad chunk, a lease that ran out) and the engine
    rolls the step back to recompute from exactly there.
    """

    def __init__(self, connector: StoreConnector, keys: list[bytes], first: int, replicate: bool) -> None:
        self.connector, self.keys, self.first, self.replicate = connector, keys, first, replicate
        self.session = None
        self.leases: list[_Lease] = []
        self.held: list[tuple] = []
        """``(index, header, head bytes, payload view, size)`` of each chunk read in place, in order."""
        self.in_place = 0
        self.landed = 0
        self.landing: LayerwiseLanding | None = None
        self.streamed: StreamedLanding | None = None
        """Chunks ``stream_at ..`` streamed layer-major from a node (another host, or a disk tier)."""
        self.stream_at = 0
        self.device_checks: list[tuple[int, torch.Tensor, int]] = []
        """Chunks through the pool: (index, wsum64 where it landed, header's)."""
        self.sizes: list[int] = []
        """Chunks through the pool: their sizes; with ``replicate``, their verified bytes."""
        self.copies: list[bytes] = []
        self.loaded: int | None = None

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer`` computes: its KV of these chunks is in the pages (on CUDA the
        compute stream waits, the host does not)."""
        t0 = time.perf_counter()
        if self.landing is not None:
            self.landing.wait(layer)
        if self.streamed is not None:
            self.streamed.wait(layer)
        self.connector.stats.load_s += time.perf_counter() - t0  # the step waited (or landed, on a CPU)

    def finish(self) -> int:
        """Chunks loaded and good (a prefix); the copies have completed and every lease ended.
        Safe to call again (the same answer)."""
        if self.loaded is None:
            t0 = time.perf_counter()
            try:
                self.loaded = self._finish()
            finally:
                self.connector.stats.load_s += time.perf_counter() - t0
        return self.loaded

    def _finish(self) -> int:
        conn, st = self.connector, self.connector.stats
        good, sums, copies = self.landed, None, []
        stream_checks: list = []
        try:
            try:
                if self.streamed is not None:
                    good = min(good, self._finish_stream(stream_checks))
            finally:  # NOTE: whatever the stream did, the copies that read leased slots end first
                if self.landing is not None:
                    sums = self.landing.finish()
            if self.replicate:  # the verified bytes as they are, while their mapping is open
                copies = [bytes(head) + bytes(tensor_bytes(pl.cpu() if pl.is_cuda else pl))
                          for _, _, head, pl, _ in self.held]
        finally:
            for lease in self.leases:  # every copy that read them has completed (or failed)
                in_time = time.monotonic() < safe_end(lease.grant)
                if lease.ctx is not None:
                    lease.ctx.__exit__(None, None, None)
                try:
                    self.session.release(lease.grant.lease_id)
                except CrescentError as exc:  # expired, or the node went away: not trusted
                    in_time = False
                    conn._error("load", exc)
                if not in_time and lease.start < good:
                    conn._error("load", "a read lease ran out before its copies ended")
                    good = lease.start
        checks = [(i, sums[j], hdr.payload_hash) for j, (i, hdr, *_) in enumerate(self.held)
                  if hdr.check == CHECK_WSUM and sums is not None] + self.device_checks + stream_checks
        bad = _first_mismatch(checks, conn.runner.transfer_stream)
        if bad is not None and bad < good:  # its KV (and what followed) is recomputed over
            st.verify_failures += 1
            conn._error(f"chunk {self.first + bad} failed verification", "payload checksum mismatch where it landed")
            good = bad
        if good < len(self.keys):  # a miss (evicted since the lookup), a bad chunk or a store error
            st.load_failures += 1
        if good < self.landed:
            st.late_failures += 1
        st.chunks_loaded += good
        st.chunks_loaded_in_place += min(self.in_place, good)
        st.chunks_loaded_from_device += sum(min(lease.count, max(0, good - lease.start)) for lease in self.leases
                                            if lease.mover is Mover.CUDA_IPC)
        st.bytes_loaded += sum(([h[4] for h in self.held] + self.sizes)[:good])
        self.held = []  # the views: their mapping may close now
        if self.replicate and good and conn.save_enabled:
            # NOTE: the verified bytes as they are: a put through the cluster client
            # lands on this engine's own node first.
            conn._enqueue(None, list(zip(self.keys[:good], (copies + self.copies)[:good])))
        return good

    def _finish_stream(self, wsum_checks: list) -> int:
        """Ends the streamed part: how many chunks are good through it (those before it
        count); its chunks' wsum64 comparisons go to ``wsum_checks`` (made with the others)."""
        s, at = self.streamed, self.stream_at
        whole = s.finish()
        if s.error is not None:
            self.connector._error("load", s.error)
        for j in range(whole):
            hdr = s.headers[j]
            if hdr.check == CHECK_WSUM:
                wsum_checks.append((at + j, s.sums[j], hdr.payload_hash))
            elif s.digests[j].intdigest() != hdr.payload_hash:
                self.connector.stats.verify_failures += 1
                self.connector._error(f"chunk {self.first + at + j} failed verification",
                                      "payload checksum mismatch as it streamed in")
                return at + j
        if whole < s.count:
            self.connector._error("load", f"chunk {self.first + at + whole} did not arrive whole")
        return at + whole


class StoreConnector:
    def __init__(self, runner: ModelRunner, client: StoreClient, fingerprint, *, save: bool = True,
                 load: bool = True, load_batch: int = 8, save_buffers: int = 16, check: str = "auto",
                 stream_loads: bool = True, land_direct: bool = False) -> None:
        self.runner = runner
        self.client = client
        self.fingerprint = fingerprint
        self.chunk_tokens = fingerprint.chunk_tokens
        self.save_enabled, self.load_enabled = save, load
        self.stats = ConnectorStats()
        self._namespaces: dict[str | None, Namespace] = {}
        self._staged: dict[int, dict[bytes, bytearray]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self.saves_reach_store = True
        """False from a save that failed to reach the store until one succeeds: a prefill engine then
        names no chunk keys to its decode engine, which would only wait for chunks that never come."""
        self._saver = threading.Thread(target=self._save_loop, name="kv-saver", daemon=True)
        self._saver.start()
        self._host_buffers: list[tuple[int, int]] = []
        """The host buffers loads and saves copy into and out of (set once the pools are made): an
        RDMA session registers them once (``DescriptorSession.register_buffers``), not per copy."""
        self.chunk_bytes = encoded_size(runner.chunk_shape, runner.dtype, self.chunk_tokens)
        self.load_batch = load_batch
        # NOTE: made at start, with the store session (arena mapped, channels open), so that
        # the first load of a process costs what the others do
        pin = runner.device.type == "cuda"
        cuda = runner.device if pin else None
        self.pool = StagingPool(self.chunk_bytes, 2 * load_batch, pin=pin, pin_device=cuda)
        self.payload_bytes = runner.page_bytes * (self.chunk_tokens // runner.cfg.page_size)
        self.land_direct = land_direct and pin and kernels.select_backend(runner.device) == "triton"
        """CUDA: the landing kernel reads chunks in place in page-locked host memory (no device stage)."""
        layer_shape = runner.chunk_shape[1:]
        self.layer_stage = DeviceStage(STAGE_CHUNKS, layer_shape, runner.dtype, runner.device) if pin else None
        """A layer-by-layer load's device staging (``LayerwiseLanding``), made at start."""
        self.stream_loads = stream_loads and load
        """Chunks not readable in place arrive layer-major (``StreamedLanding``) when the node can stream."""
        layer_bytes = self.payload_bytes // len(runner.k_caches)
        self.stream_ring = (StreamRing(RING_UNITS, STAGE_CHUNKS, layer_bytes, pin,
                                       direct=runner.device if self.land_direct else None, pin_device=cuda)
                            if self.stream_loads else None)
        self.stream_stage = (DeviceStage(STAGE_CHUNKS, layer_shape, runner.dtype, runner.device)
                             if pin and self.stream_loads and not self.land_direct else None)
        self._streamer = ThreadPoolExecutor(1, thread_name_prefix="kv-stream", initializer=one_intra_op_thread)
        self.stream_timeout_s = float(getattr(client, "timeout_s", 60.0))
        wsum = check == "wsum" or (check == "auto" and pin)
        self.check = CHECK_WSUM if wsum and self.payload_bytes % 8 == 0 else CHECK_XXH3
        """The payload check of saved chunks (docs/keys.md)."""
        registered = False
        self._arena_registered = False
        """The node's arena is page-locked for CUDA here (a kernel can read it in place)."""
        try:
            getattr(client, "transport", None)
            session = self._in_place_session()
            if session is not None and pin:
                why = session.register_cuda(runner.device)  # once, at start
                registered = self._arena_registered = why is None
                if why:
                    log.warning("the store's arena stays pageable for the GPU (%s): loads stage through "
                                "the driver", why)
                why = session.open_device()  # the node's device tier, device to device
                if why:
                    log.info("the store's device tier is read through the node (%s)", why)
        except CrescentError as exc:  # the store is down now: loads recompute until it is back
            self._error("connect", exc)
        # NOTE: with the node's arena page-locked here, a chunk is gathered into a device buffer
        # and the put DMAs it straight into the slots it reserved (a zero-copy put: no pinned
        # bounce, no host memcpy on the saver thread); otherwise into pinned host buffers.
        on_device = registered and self.check == CHECK_WSUM
        self.save_pool = StagingPool(self.payload_bytes, save_buffers, pin=pin,
                                     device=runner.device if on_device else None, pin_device=cuda)
        """Chunks gathered from the pages wait here for the saver (never a fresh tensor per save)."""
        self._host_buffers = self._long_lived_buffers()
        try:
            self._session(Mover.RDMA)  # registers them now, when this client reads over RDMA
        except CrescentError:
            pass  # the store is down now: the first load registers them
        if pin:
            self._warm_up()
        if self.stream_loads:  # the stream's threads, its data connection and the lander's CUDA context, now
            self._streamer.submit(self._open_stream_connection)
            self.stream_ring.lander.submit(self._warm_lander)

    def _warm_lander(self) -> None:
        r = self.runner
        if r.transfer_stream is not None:
            with torch.cuda.stream(r.transfer_stream):
                torch.zeros(8, device=r.device).add_(1)
            r.transfer_stream.synchronize()

    def _open_stream_connection(self) -> None:
        channel = getattr(self.client, "_data_channel", None)
        try:
            dc = channel() if channel is not None else None
            if dc is not None:
                dc.get()
        except (CrescentError, OSError):
            pass  # the first load opens it (or finds the node down) then

    def _warm_up(self) -> None:
        """Compiles the page kernels a load and a save launch, and makes the wsum64 tables, now
        rather than on the first request (a first load would otherwise wait for Triton). They
        write only the runner's scratch page, which no sequence owns."""
        from kvstore.chunk import wsum64, wsum64_rows

        r = self.runner
        kernels.warm_pointer_tables(r.k_caches, r.v_caches)  # every layer's, not only the layer 0 below
        ids = torch.full((1, self.chunk_tokens // r.cfg.page_size), r.scratch_page, dtype=torch.int32,
                         device=r.device)
        stage = self.layer_stage.buf[:1]
        kernels.scatter_kv_chunks(stage, r.k_caches[0], r.v_caches[0], ids)
        for at in (None, 0):  # the landing kernel, without and with its checksum
            kernels.scatter_kv_layer(self.layer_stage.rows[:1], r.k_caches[0], r.v_caches[0], ids,
                                     wsum_at=at, wsum_k=WSUM_K, table=source_rows(self.layer_stage.table, 1))
        chunk = kernels.gather_kv_pages(r.k_caches, r.v_caches, ids[0])
        kernels.scatter_kv_pages(chunk, r.k_caches, r.v_caches, ids[0])
        if self.check == CHECK_WSUM:
            wsum64_rows(stage, 0, chunk.numel() * chunk.element_size() // 8)
            wsum64(chunk)
        torch.cuda.synchronize(r.device)

    def namespace(self, salt: str | None) -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = make_namespace(self.fingerprint, salt)
        return ns

    def keys(self, tokens: list[int], salt: str | None) -> list[ChunkKey]:
        return chunk_keys(tokens, self.namespace(salt), self.chunk_tokens)

    def _error(self, what: str, exc: Exception) -> None:
        self.stats.store_errors += 1
        msg = f"{what}: {exc}"
        self.stats.errors = (self.stats.errors + [msg])[-20:]
        log.warning("store %s", msg)

    def lookup(self, tokens: list[int], salt: str | None) -> int:
        """Leading chunks of ``tokens`` the store holds (0 on any store error)."""
        if not self.load_enabled:
            return 0
        keys = self.keys(tokens, salt)
        if not keys:
            return 0
        try:
            return self.client.lookup(keys)
        except CrescentError as exc:
            self._error("lookup", exc)
            return 0

    def stage(self, seq_id: int, chunks: dict[bytes, bytearray]) -> None:
        """Keeps already-fetched encoded chunks for the sequence's ``load``."""
        self._staged[seq_id] = chunks

    def unstage(self, seq_id: int) -> None:
        self._staged.pop(seq_id, None)

    def fetch_as_they_arrive(self, keys: list[bytes], timeout_s: float) -> dict[bytes, bytearray]:
        """Fetches the leading ``keys`` as they appear in the store (a producer may still be saving them).

        Polls ``lookup`` and fetches each newly present run of chunks at once, so
        loading the first chunks overlaps the saving of later ones. Gives up
        ``timeout_s`` after the last progress. Returns key → encoded chunk for
        the fetched prefix (verification happens at load time).
        """
        size = encoded_size(self.runner.chunk_shape, self.runner.dtype, self.chunk_tokens)
        got: dict[bytes, bytearray] = {}
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while len(got) < len(keys) and time.monotonic() < deadline:
            try:
                present = self.client.lookup(keys[len(got):])
            except CrescentError as exc:
                self._error("lookup", exc)
                break
            if present:
                batch = keys[len(got) : len(got) + present]
                bufs = [bytearray(size) for _ in batch]
                try:
                    sizes = self.client.batch_get_into(batch, bufs)
                except CrescentError as exc:
                    self._error("fetch", exc)
                    break
                for k, b, n in zip(batch, bufs, sizes):
                    if n is None:
                        break
                    got[k] = b if n == size else bytearray(memoryview(b)[:n])
                else:
                    deadline = time.monotonic() + timeout_s
                    delay = 0.002
                    continue
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return got

    def load(self, tokens: list[int], salt: str | None, pages: list[int], first: int, num: int,
             seq_id: int | None = None, replicate: bool = False) -> int:
        """Loads chunks ``first .. first+num-1`` into their pages; returns how many loaded.

        Loading stops at the first chunk that is missing, fails verification or
        errors: the engine recomputes from there. (``begin_load`` and its ``finish``,
        with nothing computed in between.)
        """
        return self.begin_load(tokens, salt, pages, first, num, seq_id, replicate).finish()

    def begin_load(self, tokens: list[int], salt: str | None, pages: list[int], first: int, num: int,
                   seq_id: int | None = None, replicate: bool = False) -> PendingLoad:
        """Starts loading chunks ``first .. first+num-1`` into their pages, for a step to compute
        beside it (``PendingLoad``): chunks read where a same-host node keeps them land layer
        by layer (``LayerwiseLanding``); others (another host, the node's disk) through the
        staging pool, before this returns. The caller must ``finish`` it, whatever happens."""
        t0 = time.perf_counter()
        try:
            return self._begin(tokens, salt, pages, first, num, seq_id, replicate)
        finally:
            self.stats.load_s += time.perf_counter() - t0

    def _begin(self, tokens, salt, pages, first, num, seq_id, replicate) -> PendingLoad:
        all_keys = self.keys(tokens, salt)
        keys = all_keys[first : first + num]
        ns = self.namespace(salt)
        dtype, shape = self.runner.dtype, self.runner.chunk_shape
        staged = self._staged.pop(seq_id, {})
        per_chunk = self.chunk_tokens // self.runner.cfg.page_size
        p = PendingLoad(self, keys, first, replicate)

        def fetch(start: int, count: int, views: list[memoryview]) -> list[int | None]:
            out: list[int | None] = [None] * count
            need = []
            for j in range(count):
                b = staged.get(keys[start + j])
                if b is None:
                    need.append(j)
                elif len(b) <= len(views[j]):  # prefetched: already in host memory
                    views[j][: len(b)] = b
                    out[j] = len(b)
            if need:
                got = self.client.batch_get_into([keys[start + j] for j in need], [views[j] for j in need])
                for j, n in zip(need, got):
                    out[j] = n
            return out

        def expected(i: int) -> dict:
            """What chunk ``first + i`` must be: its key, parent, tokens, dtype and shape."""
            c = first + i
            return dict(key=keys[i], namespace=ns, parent=bytes(ROOT_KEY) if c == 0 else all_keys[c - 1],
                        tokens=tokens[c * self.chunk_tokens : (c + 1) * self.chunk_tokens], dtype=dtype, shape=shape)

        def chunk_pages(i: int) -> list[int]:
            c = first + i
            return pages[c * per_chunk : (c + 1) * per_chunk]

        def land(i: int, buf: int, size: int):
            """Chunk ``i`` from pool buffer ``buf``: verified, then its copy into its pages started
            (a wsum64 payload is checked where it lands, after the step)."""
            view = self.pool.view(buf)[:size]
            try:
                hdr = verify_chunk(view, **expected(i), payload=False)
            except CrescentError as exc:
                self.stats.verify_failures += 1
                self._error(f"chunk {first + i} failed verification", exc)
                return False, None
            payload = self.pool.tensor(buf)[hdr.payload_offset : hdr.payload_offset + hdr.payload_bytes]
            ev, dsum = self.runner.land_chunk(payload.view(dtype).view(shape), chunk_pages(i),
                                              checksum=hdr.check == CHECK_WSUM)
            if dsum is not None:
                p.device_checks.append((i, dsum, hdr.payload_hash))
            p.sizes.append(size)
            if replicate:
                p.copies.append(bytes(view))
            return True, ev

        def verify_in_place(i: int, head: memoryview, payload: torch.Tensor, size: int):
            """Chunk ``i`` where the node keeps it: its header (copied out) checked, and an xxh3
            payload where it is (a device-tier one: a host copy); None when it fails."""
            try:
                hdr = verify_header(head, size, **expected(i))
                if hdr.payload_offset != len(head) or hdr.payload_bytes != payload.numel():
                    raise ChunkVerificationError("chunk layout differs from this engine's")
                if hdr.check == CHECK_XXH3:
                    check_payload(hdr, payload.cpu() if payload.is_cuda else payload)
            except CrescentError as exc:
                self.stats.verify_failures += 1
                self._error(f"chunk {first + i} failed verification", exc)
                return None
            return hdr

        self.runner.begin_landing()
        try:
            session = self._in_place_session() if not staged else None
            elsewhere = not session
            if session is not None:
                p.session = session
                elsewhere = self._lease_in_place(session, keys, verify_in_place, p)
            p.in_place = len(p.held)
            p.landed = p.in_place
            if elsewhere and p.landed < len(keys):
                # NOTE: from the first chunk not in the node's arena (on its disk or GPU tier) on, or
                # for every chunk without an shm session: streamed layer-major beside the step where
                # the node can, else through the staging pool (pinned on CUDA), before it
                off = p.landed
                if not staged and self._stream(p, off, expected, chunk_pages):
                    pass  # lands beside the step
                else:
                    p.landed += pipelined_load(self.pool, len(keys) - off, self.load_batch,
                                               lambda s, c, v: fetch(off + s, c, v),
                                               lambda i, b, n: land(off + i, b, n),
                                               lambda exc: self._error("load", exc))
            if p.held:
                dt = self.runner.dtype
                p.landing = LayerwiseLanding(
                    self.runner, [payload.view(dt).view(shape) for _, _, _, payload, _ in p.held],
                    [chunk_pages(i) for i, *_ in p.held], any(h.check == CHECK_WSUM for _, h, *_ in p.held),
                    stage=self.layer_stage, direct=self.land_direct and self._arena_registered)
                p.landing.start()
            if p.landing is None or p.landing.events is None:
                self.runner.end_landing()  # (with a layerwise landing its per-layer events cover the pool's)
        except BaseException:
            p.finish()
            raise
        return p

    def _stream(self, p: PendingLoad, off: int, expected, chunk_pages) -> bool:
        """Starts streaming chunks ``off ..`` of ``p`` layer-major (``StreamedLanding``) and waits
        for their headers; False (nothing started) where it does not apply: replication wants
        the chunks' bytes, or the node cannot stream."""
        if not self.stream_loads or self.stream_ring is None or p.replicate:
            return False
        get = self._layered_reader()
        if get is None:
            return False

        def check(j: int, head: bytes):
            i = off + j
            try:
                hdr = verify_header(memoryview(head), self.chunk_bytes, **expected(i))
                if hdr.payload_offset != len(head) or hdr.payload_bytes != self.payload_bytes:
                    raise ChunkVerificationError("chunk layout differs from this engine's")
            except CrescentError as exc:
                self.stats.verify_failures += 1
                self._error(f"chunk {p.first + i} failed verification", exc)
                return None
            return hdr

        n = len(p.keys) - off
        s = StreamedLanding(self.runner, get, p.keys[off:], self.chunk_bytes - self.payload_bytes,
                            [chunk_pages(off + j) for j in range(n)], check, ring=self.stream_ring,
                            stage=self.stream_stage, fetcher=self._streamer, timeout_s=self.stream_timeout_s)
        try:
            if not s.start():
                return False
        except BaseException:
            s.finish()
            raise
        p.streamed, p.stream_at = s, off
        p.landed += s.count
        p.sizes += [self.chunk_bytes] * s.count
        return True

    def _session(self, mover: Mover):
        """The client's descriptor session when it reads the node with ``mover``, else None.
        An RDMA session gets this connector's long-lived buffers registered first (once)."""
        get = getattr(self.client, "descriptor_session", None)
        try:
            session = get() if get is not None else None
        except CrescentError:
            return None
        if session is not None and session.mover is Mover.RDMA and self._host_buffers:
            try:
                session.register_buffers(self._host_buffers)
            except Exception as exc:  # noqa: BLE001 - e.g. the memlock limit: copies register per call
                log.warning("could not register the staging buffers for RDMA (%s): every copy "
                            "registers its buffer", exc)
                self._host_buffers = []
        return session if session is not None and session.mover is mover else None

    def _long_lived_buffers(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of the host buffers a load or save copies into or out of: the
        staging pools, the stream ring and its drain."""
        out = []
        for pool in (self.pool, self.save_pool):
            if pool.device.type == "cpu":
                out += [(pool.tensor(i).data_ptr(), pool.slot_bytes) for i in range(pool.count)]
        ring = self.stream_ring
        if ring is not None:
            out.append((ring.buf.data_ptr(), ring.buf.numel()))
            out.append((buffer_address(ring.trash), ring.trash.nbytes))
        return out

    def _layered_reader(self):
        """How a stream reads the node: with one-sided RDMA READs of its arena, part by part,
        when this client reads it over RDMA (``DescriptorSession.get_layered``; a chunk on the
        node's disk tier sends the load through the pool), else from its data channel
        (``batch_get_layered``: the node sends the parts); None when neither is there."""
        session = self._session(Mover.RDMA)
        if session is not None:
            # NOTE: reading a group's first part takes the ring unit of the group three back, free
            # once that group arrived and landed: parts in flight (of one layer) must not reach back
            # to it. At most a group of them do not (more stalled the stream: a test with groups of 3).
            return functools.partial(session.get_layered, ahead=min(LAYERED_AHEAD, self.stream_ring.group))
        return getattr(self.client, "batch_get_layered", None)

    def _in_place_session(self):
        """The client's shm session, when loads can read leased chunks where the node keeps them
        (no copy into the pool; on CUDA a DMA from the registered arena), else None (the pool path)."""
        return self._session(Mover.SHM)

    def _lease_in_place(self, session, keys: list[bytes], verify, p: PendingLoad) -> bool:
        """Leases ``keys`` in batches where the node keeps them: its DRAM arena (shm) and, when
        mapped here, its device tier (cuda_ipc). Every chunk's header is copied out and checked
        now; its payload stays where it is, a view under a lease that ``p`` holds until the copies
        that read it have completed (``PendingLoad.finish``). A chunk one tier holds elsewhere is
        asked of the other. Returns whether it stopped at a chunk the node holds elsewhere (on
        its disk, or an unmapped GPU tier) for the caller to read another way; stops without at a
        miss, a bad chunk or an error."""
        movers = [session.mover] + ([Mover.CUDA_IPC] if session.device_mapped else [])
        which, switched_at = 0, -1
        while len(p.held) < len(keys):
            start = len(p.held)
            batch = keys[start : start + self.load_batch]
            mover = movers[which]
            try:
                g = session.acquire(batch, mover)
            except CrescentError as exc:
                self._error("load", exc)
                return False
            landed, stop = 0, True
            if g.lease_id:
                lease = _Lease(g, None, start, mover)
                p.leases.append(lease)  # ended at finish, whatever happens from here
                ctx = session.in_place(g)
                view = ctx.__enter__()
                lease.ctx = ctx
                if view is None:  # the node restarted between grant and read
                    return False
                stop = False
                for step in self._leased_chunks(view, g, start):
                    hdr = None if step is None else verify(*step)
                    if hdr is None:
                        stop = True
                        break
                    i, head, payload, size = step
                    p.held.append((i, hdr, head, payload, size))
                    landed += 1
                lease.count = landed
            if not stop:
                continue
            elsewhere = landed < len(g.items) and g.items[landed].status is ItemStatus.ELSEWHERE
            if not elsewhere or len(movers) == 1 or switched_at == len(p.held):
                return elsewhere  # a miss, a bad chunk, or a chunk on no tier mapped here
            which, switched_at = 1 - which, len(p.held)  # held by the other tier: ask it from here on
        return False

    def _leased_chunks(self, mover, g, start: int):
        """``(chunk index, header, payload, size)`` of each chunk ``g`` leased, in order: the
        header copied out, the payload a view of the leased slots; None at the first miss (or
        a value no chunk of ours)."""
        H = self.chunk_bytes - self.payload_bytes
        for j, d in enumerate(g.items):
            if d.status is not ItemStatus.OK or d.size != self.chunk_bytes:
                yield None
                return
            head, pext = leased_head(mover, d, H)
            payload = mover.tensor(*pext[0]) if len(pext) == 1 else self._gather_extents(mover, pext)
            yield start + j, memoryview(head), payload, d.size

    def _gather_extents(self, mover, extents) -> torch.Tensor:
        """A payload whose slots are not one run, as one tensor (a copy; rare: the node hands out
        ascending runs, but a fragmented arena has gaps). Made where the landing can read it:
        from host slots on a GPU engine, page-locked (the direct kernel reads only such memory,
        and a DMA from it is asynchronous); from device-tier slots, by the compute stream, which
        the transfer stream then waits for (the landing reads it there)."""
        out = torch.cat([mover.tensor(off, n) for off, n in extents])
        if self.runner.device.type == "cuda":
            if out.is_cuda:
                self.runner.begin_landing()
            else:
                out = out.pin_memory()
        return out

    def save(self, tokens: list[int], salt: str | None, pages: list[int], first: int, num: int) -> None:
        """Gathers chunks ``first .. first+num-1`` into save buffers now; stores them in the background.

        The engine thread only queues the gather and its copy; the saver waits for the copy,
        encodes and puts. When every save buffer is taken for ``SAVE_WAIT_S`` (the store is
        slower than the engine, or hung), the rest of the chunks are not saved (counted in
        ``save_failures``): a slow store costs reuse, never compute.
        """
        if not self.save_enabled or num <= 0:
            return
        keys = self.keys(tokens[: (first + num) * self.chunk_tokens], salt)
        ns = self.namespace(salt)
        per_chunk = self.chunk_tokens // self.runner.cfg.page_size
        group = max(1, self.save_pool.count // 2)
        items = []
        for c in range(first, first + num):
            try:
                (buf,) = self.save_pool.take(1, timeout_s=SAVE_WAIT_S)
            except TimeoutError:
                self.stats.save_failures += first + num - c
                self._error("save", f"no free save buffer in {SAVE_WAIT_S} s: {first + num - c} chunks not saved")
                break
            ev, dsum = self.runner.gather_chunk_into(pages[c * per_chunk : (c + 1) * per_chunk], self._saved(buf),
                                                     checksum=self.check == CHECK_WSUM)
            parent = bytes(ROOT_KEY) if c == 0 else keys[c - 1]
            items.append((keys[c], parent, tokens[c * self.chunk_tokens : (c + 1) * self.chunk_tokens], buf,
                          ev, dsum))
            if len(items) == group:  # the saver can start (and give buffers back) while we gather more
                self._enqueue(ns, items)
                items = []
        if items:
            self._enqueue(ns, items)

    def _saved(self, buf: int) -> torch.Tensor:
        """Save buffer ``buf`` as a ``chunk_shape`` tensor."""
        return self.save_pool.tensor(buf)[: self.payload_bytes].view(self.runner.dtype).view(self.runner.chunk_shape)

    def _enqueue(self, ns: Namespace | None, items: list) -> None:
        with self._cv:
            self._pending += 1
        self._queue.put((ns, items))

    def _save_loop(self) -> None:
        one_intra_op_thread()  # (kernels.host: a team of its own would slow every op of the forward's)
        # NOTE: on CUDA the saver's own work (a wsum64 read back, the put stream's wait) queues on
        # the save stream: on the default stream it would wait behind the steps the engine
        # launched since, and each save would end a step late
        stream = getattr(self.runner, "save_stream", None)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._save_jobs()

    def _save_jobs(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            ns, items = job
            try:
                if ns is None:  # already-encoded chunks (replication)
                    batch = [(key, [raw]) for key, raw in items]
                else:
                    batch = []
                    for key, parent, toks, buf, ev, dsum in items:
                        if ev is not None:
                            ev.synchronize()  # the chunk has reached its save buffer
                        batch.append((key, encode_chunk(self._saved(buf), ns, parent, toks, check=self.check,
                                                        payload_hash=None if dsum is None else int(dsum))))
                stored = self.client.batch_put(batch)
                self.saves_reach_store = True
                for ok, (_, parts) in zip(stored, batch):
                    if ok:
                        self.stats.chunks_saved += 1
                        self.stats.bytes_saved += sum(len(p) for p in parts)
                    else:
                        self.stats.save_failures += 1
            except CrescentError as exc:
                self.stats.save_failures += len(items)
                self.saves_reach_store = False
                self._error("save", exc)
            except Exception as exc:  # noqa: BLE001 - a save must never kill the engine
                self.stats.save_failures += len(items)
                self._error("save (unexpected)", exc)
            finally:
                if ns is not None:
                    self.save_pool.give([it[3] for it in items])
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued save is done; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self) -> None:
        self.flush(timeout_s=60)
        self._queue.put(None)
        self._saver.join(timeout=10)
        self.pool.close()
        self.save_pool.close()
        self._streamer.shutdown(wait=False)  # (a stream stalled on a node ends with the client's sockets)
        if self.stream_ring is not None:
            self.stream_ring.close()
        self.client.close()


def _first_mismatch(checks: list[tuple[int, torch.Tensor, int]], stream=None) -> int | None:
    """The first chunk whose wsum64 where it landed differs from its header's, or None.

    The sums are read on ``stream``, the transfer stream that landed and summed them (CUDA):
    the host waits for the landing there, not for the step computing beside it on the compute
    stream (under async scheduling the next step is launched after this). One read for the
    whole load."""
    if not checks:
        return None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        got = torch.stack([d for _, d, _ in checks]).cpu().tolist()
    bad = [i for (i, _, h), g in zip(checks, got) if g != (h - (1 << 64) if h >= 1 << 63 else h)]
    return min(bad, default=None)
