"""A store node's KV events in vLLM's wire format, so routers built for vLLM can index Crescent.

vLLM (``vllm.distributed.kv_events``) publishes over ZeroMQ: a PUB socket sends
multipart messages ``(topic, sequence as 8 big-endian bytes, payload)``, the
payload a msgpack ``EventBatch`` — the array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``type``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) and
``AllBlocksCleared``. An optional ROUTER socket replays buffered batches: a
request is ``(empty frame, start sequence as 8 big-endian bytes)``; each answer
``(empty, topic, sequence, payload)``, then ``(empty, empty, -1, empty)``.
External KV-aware routers (llm-d's KV-cache indexer, Dynamo's KV router)
subscribe to exactly this.

``KvEventPublisher`` listens to a ``TieredStore`` (``listener()``), and a thread
turns its events into batches every ``flush_interval_s``:

- a KV chunk stored (or moved to another tier) becomes ``BlockStored`` with the
  chunk key as its block hash, its parent key (None for a prompt's first chunk),
  and the token ids and count read from the chunk's verified header; values that
  are not Crescent KV chunks are not published;
- a chunk removed (evicted, deleted, replaced, corrupt), or leaving a tier,
  becomes ``BlockRemoved`` (only for chunks published as stored);
- ``medium`` is the tier: ``GPU`` (device), ``CPU`` (DRAM), ``STORAGE`` (disk).

Crescent's block hashes are its 16-byte chunk keys (``bytes``, one of vLLM's
``ExternalBlockHash`` forms), one block per chunk of ``chunk_tokens`` tokens.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

log = logging.getLogger(__name__)

MEDIUM = {"DEVICE": "GPU", "DRAM": "CPU", "DISK": "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HEADER_PEEK = 64 << 10
"""Bytes read from a stored value to parse its chunk header (tokens: 4 bytes each)."""
_MAX_HEADERS = 1 << 16


def block_stored(key: bytes, parent: bytes | None, tokens: list[int], medium: str) -> dict:
    return {"type": "BlockStored", "block_hashes": [key], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": len(tokens), "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(key: bytes, medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [key], "medium": medium}


class KvEventPublisher:
    """Publishes a store's KV events on ``endpoint`` (``tcp://host:port``; port ``*`` picks one), with
    replay on ``replay_endpoint`` when given. ``endpoint`` and ``replay_endpoint`` hold the bound
    addresses once started."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, flush_interval_s: float = 0.05, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self.topic = topic.encode()
        self.flush_interval_s = flush_interval_s
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._tiers: dict[bytes, object] = {}  # key → tier, to name the tier a moved chunk left
        self._headers: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        """key → (parent, token ids) of recent chunks: a chunk moved to disk is not read back for them."""
        self._store = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.num_published = 0
        """Events published so far."""

    def listener(self, chained=None):
        """A ``TieredStore`` listener (calling ``chained`` too): it only queues the event."""

        def on_event(ev) -> None:
            self._events.put(ev)
            if chained is not None:
                chained(ev)

        return on_event

    def start(self, store) -> KvEventPublisher:
        """Starts publishing; ``store`` is read for the headers of stored chunks."""
        self._store = store
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    # ---- the publishing thread ---------------------------------------------------------

    def _stored(self, key: bytes, tier) -> dict | None:
        from kvstore.chunk import parse_header
        from kvstore.errors import ChunkVerificationError
        from kvstore.keys import ROOT_KEY

        known = self._headers.get(key)
        if known is None:
            head = self._store.peek(key, _HEADER_PEEK)
            if head is None:
                return None  # gone already (its removal follows)
            try:
                hdr = parse_header(head)
            except ChunkVerificationError:
                return None  # not a KV chunk
            parent = bytes(hdr.parent)
            known = (None if parent == bytes(ROOT_KEY) else parent, hdr.tokens.tolist())
            self._headers[key] = known
            if len(self._headers) > _MAX_HEADERS:
                self._headers.popitem(last=False)
        else:
            self._headers.move_to_end(key)
        return block_stored(key, known[0], known[1], MEDIUM[tier.name])

    def _events_of(self, ev) -> list[dict]:
        key = bytes(ev.key)
        if ev.kind == "removed":
            self._headers.pop(key, None)
            if self._tiers.pop(key, None) is None:
                return []  # never published as stored (not a KV chunk)
            return [block_removed(key, MEDIUM[ev.tier.name])]
        old = self._tiers.get(key)
        stored = self._stored(key, ev.tier)
        if stored is None:
            return []
        self._tiers[key] = ev.tier
        return ([block_removed(key, MEDIUM[old.name])] if ev.kind == "moved" and old is not None else []) + [stored]

    def _publish(self, events: list[dict]) -> None:
        import msgpack

        payload = msgpack.packb([time.time(), events, self.data_parallel_rank], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_published += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("bad KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except self._zmq.ZMQError as exc:
                    log.warning("KV-event replay: %s", exc)
            deadline = time.monotonic() + self.flush_interval_s
            batch: list[dict] = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    ev = self._events.get(timeout=left)
                except queue.Empty:
                    break
                try:
                    batch += self._events_of(ev)
                except Exception as exc:  # noqa: BLE001 - publishing must never stop the node
                    log.warning("KV event %s of %s not published: %s", ev.kind, bytes(ev.key).hex(), exc)
            if batch:
                try:
                    self._publish(batch)
                except self._zmq.ZMQError as exc:
                    log.warning("KV events not published: %s", exc)
