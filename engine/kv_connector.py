"""The engine's store connector: look up, load and save KV chunks by content hash.

Before prefill the engine asks the store how many leading chunks of the prompt
it holds (``lookup``), loads them into the sequence's pages (``load``: batches
fetched with batch_get_into into a staging pool made at start, the next batch
fetched while this one is verified and lands in its pages; see kv_transfer)
and computes only the rest. After each step,
every newly completed chunk is gathered from the pages into a save buffer (a
copy, so the pages may be reused at once; on CUDA an asynchronous copy on the
save stream) and handed to a background thread that encodes and stores it, so
the transfer of chunk k overlaps the compute of chunk k+1.

A verification failure or a store error is a miss: the engine recomputes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.kv_transfer import StagingPool, land_in_order, pipelined_load
from engine.model_runner import ModelRunner
from kvstore.chunk import (CHECK_WSUM, CHECK_XXH3, check_payload, encode_chunk, encoded_size, tensor_bytes,
                           verify_chunk, verify_header)
from kvstore.client import StoreClient
from kvstore.errors import ChunkVerificationError, CrescentError
from kvstore.keys import ROOT_KEY, ChunkKey, Namespace, chunk_keys, make_namespace
from kvstore.transport.descriptors import ItemStatus, Mover, value_extents
from kvstore.transport.memcopy import local_buffer, plan, slice_extents
from kvstore.transport.session import safe_end

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
    """Wall time spent in ``load`` (fetch, verify, scatter): bytes_loaded / load_s is the load rate."""
    chunks_loaded_in_place: int = 0
    """Of chunks_loaded: read where the node keeps them (same host), not through the pool."""
    chunks_loaded_from_device: int = 0
    """Of those: from the node's device tier, device to device (cuda_ipc)."""
    load_failures: int = 0
    """Chunks that were reported present but failed to load or verify."""
    save_failures: int = 0
    verify_failures: int = 0
    """Chunks read from the store whose header or payload failed verification (corrupt or mislabelled)."""
    store_errors: int = 0
    errors: list[str] = field(default_factory=list)


class StoreConnector:
    def __init__(self, runner: ModelRunner, client: StoreClient, fingerprint, *, save: bool = True,
                 load: bool = True, load_batch: int = 8, save_buffers: int = 16, check: str = "auto") -> None:
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
        self.chunk_bytes = encoded_size(runner.chunk_shape, runner.dtype, self.chunk_tokens)
        self.load_batch = load_batch
        # NOTE: made at start, with the store session (arena mapped, channels open), so that
        # the first load of a process costs what the others do
        pin = runner.device.type == "cuda"
        self.pool = StagingPool(self.chunk_bytes, 2 * load_batch, pin=pin)
        self.payload_bytes = runner.page_bytes * (self.chunk_tokens // runner.cfg.page_size)
        self.save_pool = StagingPool(self.payload_bytes, save_buffers, pin=pin)
        """Chunks gathered from the pages wait here for the saver (never a fresh tensor per save)."""
        wsum = check == "wsum" or (check == "auto" and pin)
        self.check = CHECK_WSUM if wsum and self.payload_bytes % 8 == 0 else CHECK_XXH3
        """The payload check of saved chunks (docs/keys.md)."""
        try:
            getattr(client, "transport", None)
            session = self._in_place_session()
            if session is not None and pin:
                why = session.register_cuda()  # once, at start
                if why:
                    log.warning("the store's arena stays pageable for the GPU (%s): loads stage through "
                                "the driver", why)
                why = session.open_device()  # the node's device tier, device to device
                if why:
                    log.info("the store's device tier is read through the node (%s)", why)
        except CrescentError as exc:  # the store is down now: loads recompute until it is back
            self._error("connect", exc)

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
        errors: the engine recomputes from there.
        """
        t0 = time.perf_counter()
        try:
            return self._load(tokens, salt, pages, first, num, seq_id, replicate)
        finally:
            self.stats.load_s += time.perf_counter() - t0

    def _load(self, tokens, salt, pages, first, num, seq_id, replicate) -> int:
        all_keys = self.keys(tokens, salt)
        keys = all_keys[first : first + num]
        ns = self.namespace(salt)
        dtype, shape = self.runner.dtype, self.runner.chunk_shape
        staged = self._staged.pop(seq_id, {})
        per_chunk = self.chunk_tokens // self.runner.cfg.page_size
        sizes: list[int] = []  # of the chunks landed, in order
        copies: list[bytes] = []  # replicate: their verified bytes, out of the pool
        device_checks: list[tuple[int, torch.Tensor, int]] = []  # (chunk, wsum where it landed, header's)

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

        def land_verified(i: int, hdr, payload: torch.Tensor, size: int, raw):
            """Starts a checked chunk's copy into its pages (a wsum64 payload is checked where it lands)."""
            c = first + i
            ev, dsum = self.runner.land_chunk(payload.view(dtype).view(shape),
                                              pages[c * per_chunk : (c + 1) * per_chunk],
                                              checksum=hdr.check == CHECK_WSUM)
            if dsum is not None:
                device_checks.append((i, dsum, hdr.payload_hash))
            sizes.append(size)
            if replicate:
                copies.append(raw())
            return True, ev

        def land(i: int, buf: int, size: int):
            """Chunk ``first + i`` from pool buffer ``buf``."""
            view = self.pool.view(buf)[:size]
            try:
                hdr = verify_chunk(view, **expected(i), payload=False)
            except CrescentError as exc:
                self.stats.verify_failures += 1
                self._error(f"chunk {first + i} failed verification", exc)
                return False, None
            payload = self.pool.tensor(buf)[hdr.payload_offset : hdr.payload_offset + hdr.payload_bytes]
            return land_verified(i, hdr, payload, size, lambda: bytes(view))

        def land_in_place(i: int, head: memoryview, payload: torch.Tensor, size: int):
            """Chunk ``first + i`` from the store's own memory: its header copied out, its
            payload where the node keeps it (leased)."""
            try:
                hdr = verify_header(head, size, **expected(i))
                if hdr.payload_offset != len(head) or hdr.payload_bytes != payload.numel():
                    raise ChunkVerificationError("chunk layout differs from this engine's")
                if hdr.check == CHECK_XXH3:  # read in place (a device-tier payload: a host copy)
                    check_payload(hdr, payload.cpu() if payload.is_cuda else payload)
            except CrescentError as exc:
                self.stats.verify_failures += 1
                self._error(f"chunk {first + i} failed verification", exc)
                return False, None
            return land_verified(i, hdr, payload, size, lambda: bytes(head) + bytes(tensor_bytes(payload)))

        self.runner.begin_landing()
        session = self._in_place_session() if not staged else None
        in_place, elsewhere = 0, not session
        if session is not None:
            in_place, elsewhere = self._load_in_place(session, keys, land_in_place)
        loaded = in_place
        if elsewhere and loaded < len(keys):
            # NOTE: from the first chunk not in the node's arena (on its disk or GPU tier) on, or
            # for every chunk without an shm session: through the staging pool (pinned on CUDA),
            # the node streaming disk values straight into it, then a DMA into the pages
            off = loaded
            loaded += pipelined_load(self.pool, len(keys) - off, self.load_batch,
                                     lambda s, c, v: fetch(off + s, c, v), lambda i, b, n: land(off + i, b, n),
                                     lambda exc: self._error("load", exc))
        self.runner.end_landing()
        bad = _first_mismatch(device_checks)
        if bad is not None and bad < loaded:  # its KV (and what followed) is recomputed over
            self.stats.verify_failures += 1
            self._error(f"chunk {first + bad} failed verification", "payload checksum mismatch where it landed")
            loaded = bad
        if loaded < len(keys):  # a miss (evicted since the lookup), a bad chunk or a store error
            self.stats.load_failures += 1
        self.stats.chunks_loaded += loaded
        self.stats.chunks_loaded_in_place += min(in_place, loaded)
        self.stats.bytes_loaded += sum(sizes[:loaded])
        if replicate and loaded and self.save_enabled:
            # NOTE: the verified bytes as they are: a put through the cluster client
            # lands on this engine's own node first.
            self._enqueue(None, list(zip(keys[:loaded], copies[:loaded])))
        return loaded

    def _in_place_session(self):
        """The client's shm session, when loads can read leased chunks where the node keeps them
        (no copy into the pool; on CUDA a DMA from the registered arena), else None (the pool path)."""
        get = getattr(self.client, "descriptor_session", None)
        try:
            session = get() if get is not None else None
        except CrescentError:
            return None
        return session if session is not None and session.mover is Mover.SHM else None

    def _load_in_place(self, session, keys: list[bytes], land) -> tuple[int, bool]:
        """Loads ``keys`` in batches, each under one read lease, from the node's memory as mapped
        here: its DRAM arena (shm) and, when mapped, its device tier (cuda_ipc: the payload
        copied device to device). A chunk's header is copied out, its payload lands from the
        leased slots (on CUDA a DMA from the registered mapping, or a device copy). The lease
        ends once every copy that read it has completed; copies that ended after the lease's
        safe end make the batch a miss. A chunk one tier holds elsewhere is asked of the other.
        Returns ``(chunks landed, whether it stopped at a chunk the node holds elsewhere)``:
        on its disk (or an unmapped GPU) tier, for the caller to read another way."""
        movers = [session.mover] + ([Mover.CUDA_IPC] if session.device_mapped else [])
        loaded, which, switched_at = 0, 0, -1
        while loaded < len(keys):
            batch = keys[loaded : loaded + self.load_batch]
            mover = movers[which]
            try:
                g = session.acquire(batch, mover)
            except CrescentError as exc:
                self._error("load", exc)
                return loaded, False
            landed, stop, events, in_time = 0, False, [], True
            if g.lease_id:
                try:
                    with session.in_place(g) as view:
                        if view is None:  # the node restarted between grant and read
                            return loaded, False
                        landed, stop = land_in_order(
                            self._leased_chunks(view, g, loaded, view.slot_bytes), land, events)
                        for ev in events:
                            ev.synchronize()  # the lease holds until the copies reading it are done
                        in_time = time.monotonic() < safe_end(g)
                finally:
                    try:
                        session.release(g.lease_id)
                    except CrescentError as exc:  # expired, or the node went away: not trusted
                        in_time = False
                        self._error("load", exc)
                if not in_time:
                    self._error("load", "a read lease ran out before its copies ended")
                    return loaded, False
                if mover is Mover.CUDA_IPC:
                    self.stats.chunks_loaded_from_device += landed
            else:
                stop = True
            loaded += landed
            if not stop:
                continue
            elsewhere = landed < len(g.items) and g.items[landed].status is ItemStatus.ELSEWHERE
            if not elsewhere or len(movers) == 1 or switched_at == loaded:
                return loaded, elsewhere  # a miss, a bad chunk, or a chunk on no tier mapped here
            which, switched_at = 1 - which, loaded  # held by the other tier: ask it from here on
        return loaded, False

    def _leased_chunks(self, mover, g, start: int, slot_bytes: int):
        """``(chunk index, header, payload, size)`` of each chunk ``g`` leased, in order: the
        header copied out, the payload a view of the leased slots; None at the first miss (or
        a value no chunk of ours)."""
        H = self.chunk_bytes - self.payload_bytes
        for j, d in enumerate(g.items):
            if d.status is not ItemStatus.OK or d.size != self.chunk_bytes:
                yield None
                return
            ext = value_extents(d.slots, d.size, slot_bytes)
            head = bytearray(H)
            addr, _, ka = local_buffer(head)
            mover.read(plan([(addr, H)], slice_extents(ext, 0, H)))
            del ka
            pext = slice_extents(ext, H, self.payload_bytes)
            payload = mover.tensor(*pext[0]) if len(pext) == 1 else self._gather_extents(mover, pext)
            yield start + j, memoryview(head), payload, d.size

    @staticmethod
    def _gather_extents(mover, extents) -> torch.Tensor:
        """A payload whose slots are not one run, as one host tensor (a copy; rare: the node
        hands out ascending runs)."""
        return torch.cat([mover.tensor(off, n) for off, n in extents])

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
        self.client.close()


def _first_mismatch(checks: list[tuple[int, torch.Tensor, int]]) -> int | None:
    """The first chunk whose wsum64 where it landed differs from its header's (one
    synchronisation for the whole load), or None."""
    if not checks:
        return None
    got = torch.stack([d for _, d, _ in checks])
    want = torch.tensor([h - (1 << 64) if h >= 1 << 63 else h for _, _, h in checks], dtype=torch.int64,
                        device=got.device)
    bad = (got != want).nonzero()
    return checks[int(bad[0])][0] if bad.numel() else None
