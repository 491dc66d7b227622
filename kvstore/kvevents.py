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


def reachable_endpoint(bound: str, host: str) -> str:
    """A bound ZeroMQ endpoint as another host connects to it: a wildcard address (``tcp://0.0.0.0:P``,
    ``tcp://*:P``, ``tcp://[::]:P``) becomes ``host``'s. Empty stays empty."""
    if not bound.startswith("tcp://"):
        return bound
    addr, _, port = bound[len("tcp://"):].rpartition(":")
    if addr in ("*", "0.0.0.0", "[::]", "::", "[::0]"):
        addr = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{addr}:{port}"


def block_stored(key: bytes, parent: bytes | None, tokens: list[int], medium: str) -> dict:
    return {"type": "BlockStored", "block_hashes": [key], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": len(tokens), "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(key: bytes, medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [key], "medium": medium}


def warn_if_exposed_in_plaintext(endpoint: str) -> bool:
    """Logs a warning (and returns True) when this process runs under TLS but ``endpoint``, a bound
    ZeroMQ endpoint, is reachable beyond this host: KV events speak vLLM's plaintext protocol, which
    the routers that read them (llm-d's indexer, Dynamo's) expect; ZeroMQ has no TLS."""
    from kvstore import tls

    if not endpoint.startswith("tcp://") or tls.config() is None:
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return False
    log.warning("KV events on %s are plaintext although this process uses TLS (ZeroMQ, vLLM's protocol): "
                "bind them to a private interface, or to 127.0.0.1 for a router on this host", endpoint)
    return True


class _Worker:
    """A daemon thread running ``_run`` until ``stop``."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class EventPublisher(_Worker):
    """vLLM's ``ZmqEventPublisher`` sockets: a PUB sending ``(topic, sequence, payload)``, the last
    ``buffer_steps`` batches kept for the ROUTER replay socket (when ``replay_endpoint`` is given). One
    thread owns the sockets; ``submit`` queues a ready payload from any thread. ``endpoint`` and
    ``replay_endpoint`` hold the bound addresses (port ``*`` picks one)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 flush_interval_s: float = 0.05, name: str = "kv-events") -> None:
        import zmq

        super().__init__(name)
        self._zmq = zmq
        self.flush_interval_s = flush_interval_s
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
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self._pub.close(0)
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        for bound in (self.endpoint, self.replay_endpoint):
            if bound:
                warn_if_exposed_in_plaintext(bound)
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=buffer_steps)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self.num_batches = 0
        """Batches published so far."""

    def stop(self) -> None:
        super().stop()
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    def submit(self, topic: bytes, payload: bytes) -> None:
        """Publishes ``payload`` (a msgpack ``EventBatch``) under ``topic`` with the next sequence number."""
        self._ready.put((topic, payload))

    def _collect(self, deadline: float) -> list[tuple[bytes, bytes]]:
        """The ``(topic, payload)`` batches to publish now, gathered until ``deadline`` (monotonic)."""
        out = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                out.append(self._ready.get(timeout=left))
            except queue.Empty:
                break
        return out

    def _publish(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, topic, payload))
        self.num_batches += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("bad KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except self._zmq.ZMQError as exc:
                    log.warning("KV-event replay: %s", exc)
            for topic, payload in self._collect(time.monotonic() + self.flush_interval_s):
                try:
                    self._publish(topic, payload)
                except self._zmq.ZMQError as exc:
                    log.warning("KV events not published: %s", exc)


class KvEventPublisher(EventPublisher):
    """Publishes a store's KV events on ``endpoint`` (``tcp://host:port``; port ``*`` picks one), with
    replay on ``replay_endpoint`` when given."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, flush_interval_s: float = 0.05, data_parallel_rank: int = 0) -> None:
        super().__init__(endpoint, replay_endpoint, buffer_steps, flush_interval_s)
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._tiers: dict[bytes, object] = {}  # key → tier, to name the tier a moved chunk left
        self._headers: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        """key → (parent, token ids) of recent chunks: a chunk moved to disk is not read back for them."""
        self._store = None
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
        super().start()
        return self

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

    def _collect(self, deadline: float) -> list[tuple[bytes, bytes]]:
        """One batch of the store events that arrive until ``deadline``."""
        import msgpack

        batch: list[dict] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                break
            try:
                batch += self._events_of(ev)
            except Exception as exc:  # noqa: BLE001 - publishing must never stop the node
                log.warning("KV event %s of %s not published: %s", ev.kind, bytes(ev.key).hex(), exc)
        if not batch:
            return []
        self.num_published += len(batch)
        return [(self.topic, msgpack.packb([time.time(), batch, self.data_parallel_rank], use_bin_type=True))]


class EventFollower(_Worker):
    """Follows one publisher of vLLM-format KV events (vLLM's own, a store node's): live batches from its
    PUB socket and, with a replay endpoint, every buffered batch when it connects and again after a gap
    in the sequence numbers. ``on_batch(seq, payload)`` gets each batch once, in order;
    ``on_restart()`` runs when the publisher's sequence starts over (it restarted). Subclasses override
    both; they run on the follower's thread."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        super().__init__(f"kv-events-{name}")
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.last_seq = -1
        self.num_bad = 0
        """Messages that were not a publisher's three frames, and batches or events that could not be taken."""

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def on_batch(self, seq: int, payload: bytes) -> None:
        raise NotImplementedError

    def on_restart(self) -> None:
        pass

    def _deliver(self, seq: int, payload: bytes) -> None:
        if seq == 0 and self.last_seq >= 0:  # the publisher restarted (a replay from 0 is only the first)
            log.warning("KV events of %s: the sequence restarted", self.name)
            self.on_restart()
        elif seq <= self.last_seq:
            return  # replayed and received live: delivered already
        self.last_seq = seq
        try:
            self.on_batch(seq, payload)
        except Exception:  # noqa: BLE001 - one batch it cannot take must not end the following
            self.num_bad += 1
            log.exception("KV events of %s: batch %d failed; following on", self.name, seq)

    def _replay(self, ctx, zmq, start: int) -> None:
        """Delivers every buffered batch from ``start`` (the publisher's replay socket)."""
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            while not self._stop.is_set():
                if not req.poll(5000):
                    log.warning("KV events of %s: no answer from the replay socket", self.name)
                    return
                frames = req.recv_multipart()  # (empty, topic, sequence, payload), as vLLM answers
                if len(frames) != 4:
                    log.warning("KV events of %s: a replay answer of %d frames, not 4", self.name, len(frames))
                    return
                _, _, seq_b, payload = frames
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    return
                self._deliver(seq, payload)
        finally:
            req.close(0)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint:
                self._replay(ctx, zmq, 0)  # what it published before we listened
            while not self._stop.is_set():
                if not sub.poll(200):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    self.num_bad += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                if self.replay_endpoint and self.last_seq >= 0 and seq > self.last_seq + 1:
                    self._replay(ctx, zmq, self.last_seq + 1)  # a gap: fetch what was missed first
                self._deliver(seq, frames[2])
        except Exception:  # noqa: BLE001 - a bad publisher must not take its follower's process down
            log.exception("KV events of %s: follower failed", self.name)
        finally:
            sub.close(0)
