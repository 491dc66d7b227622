"""The conductor subscribes to vLLM instances' own KV events, so it schedules them cache-aware too.

A vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` publishes every block its prefix
cache stores or evicts (kvstore/kvevents.py describes the wire format). ``crescent conductor
--vllm-kv-events ID=tcp://host:5557[,tcp://host:5558][,http://host:8000]`` makes instance ``ID`` a
prefill member and follows its events:

- vLLM's block hashes are its own (SHA-256 over its block size, seeded per process), so the
  conductor re-keys: a ``BlockStored`` carries its parent and token ids, so each block's chain of
  tokens is known, and every time ``chunk_tokens`` of them complete, the chunk gets the Crescent key
  ``chunk_key(parent chunk, namespace, tokens)`` — the key any caller computes for the same prompt
  under the same namespace (the member's, shown by ``crescent ctl nodes``). Those keys enter the
  conductor's device-cache index as held on the instance's GPU;
- ``BlockRemoved`` drops the chunk its block completed (vLLM evicts a sequence's blocks from the
  tail); ``AllBlocksCleared`` (a prefix-cache reset) and a publisher restart (its sequence going
  back) drop the instance's chunks;
- a request's ``cache_salt`` (vLLM hashes it into the request's first block, so every block after
  differs too) and its LoRA adapter (hashed into every block) put its chunks under
  ``request_namespace(namespace, salt, lora_name)``: a caller that computes such a request's keys
  that way finds them, and no other request's keys are ever equal;
- blocks hashed with other extra keys (multimodal inputs, prompt embeddings) or of a KV-cache group
  other than the first are not indexed: their reuse depends on more than tokens, salt and adapter;
- batches are decoded in both forms vLLM has used — arrays (``array_like``) and maps — and unknown
  fields and event types are ignored;
- with a replay endpoint, the subscriber asks for every buffered batch when it connects and after a
  gap in the sequence numbers;
- with an HTTP URL (the instance's OpenAI server, handed to callers as its address), the instance is
  alive while ``GET URL/health`` answers 200; without one, while the conductor follows it.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import urllib.error
import urllib.request
from collections.abc import Hashable

import xxhash

from kvstore.keys import ROOT_KEY, chunk_key
from kvstore.kvevents import EventFollower
from kvstore.store import Tier

log = logging.getLogger(__name__)

FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
"""The events' fields in declaration order: the array form lists them positionally after the tag."""
DEFAULT_NAMESPACE = xxhash.xxh3_128_digest(b"crescent/vllm-kv-events")
"""The namespace chunk keys of vLLM instances are computed under unless --vllm-namespace says."""
_SCOPE_DOMAIN = b"crescent/vllm-request\0"


def request_namespace(namespace: bytes, cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The namespace the chunk keys of a vLLM request are computed under: ``namespace`` itself for a
    request with neither a ``cache_salt`` (an empty one counts as none, as in vLLM) nor a LoRA adapter,
    else ``XXH3_128(b"crescent/vllm-request\\0" ‖ namespace ‖ u32le len ‖ salt ‖ u32le len ‖ adapter
    name)``, both UTF-8 (the empty string for the one absent)."""
    if not cache_salt and not lora_name:
        return namespace
    salt, lora = (cache_salt or "").encode(), (lora_name or "").encode()
    return xxhash.xxh3_128_digest(b"".join([_SCOPE_DOMAIN, namespace, struct.pack("<I", len(salt)), salt,
                                            struct.pack("<I", len(lora)), lora]))


def _scope_of(f: dict) -> tuple[str | None, str | None] | None:
    """``(cache_salt, lora_name)`` of a ``BlockStored``'s request, or None when its blocks' extra keys
    hold anything else (such blocks are not indexed).

    vLLM publishes each block's extra keys without their tags: a LoRA request's adapter name on every
    block (the event names the adapter in ``lora_name`` too), then, on the request's first block only
    (no parent), its ``cache_salt``, both bare strings. Multimodal inputs are pairs, prompt embeddings
    bytes.
    """
    lora = f.get("lora_name") or None
    if lora is not None and not isinstance(lora, str):
        return None
    first_block = f.get("parent_block_hash") is None
    salt = None
    for i, x in enumerate(f.get("extra_keys") or []):
        keys = list(x) if isinstance(x, (list, tuple)) else [] if x is None else [x]
        if lora is not None:
            if not keys or keys[0] != lora:
                return None
            keys = keys[1:]
        if i == 0 and first_block and len(keys) == 1 and isinstance(keys[0], str) and keys[0]:
            salt = keys[0]
        elif keys:
            return None
    if lora is not None and len(f.get("extra_keys") or []) != len(f.get("block_hashes") or []):
        return None  # an adapter's name is on every block
    return salt, lora


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    type: str
    fields: dict


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """(timestamp, events) of one msgpack ``EventBatch``, map or array form.

    Raises:
        ValueError: the payload is not an event batch.
    """
    import msgpack

    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types on bad input
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(obj, dict):
        ts, events = obj.get("ts"), obj.get("events")
    elif isinstance(obj, list) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
    else:
        raise ValueError("not an event batch")
    if not isinstance(events, list):
        raise ValueError("an event batch without a list of events")
    out = []
    for e in events:
        if isinstance(e, dict):
            tag, fields = e.get("type"), e
        elif isinstance(e, list) and e and isinstance(e[0], str):
            tag = e[0]
            fields = dict(zip(FIELDS.get(tag, ()), e[1:]))
        else:
            continue
        if tag in FIELDS:
            out.append(Event(tag, fields))
    try:
        ts = float(ts or 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"an event batch with a timestamp of {type(ts).__name__}") from None
    return ts, out


@dataclasses.dataclass(slots=True)
class _Block:
    last_key: bytes
    """Key of the last full chunk up to and including this block (ROOT_KEY: none yet)."""
    pending: tuple[int, ...]
    """Tokens after that chunk, up to the end of this block."""
    completes: list[bytes]
    """Keys of the chunks this block completes."""
    namespace: bytes
    """The namespace of its request's chunk keys (``request_namespace``)."""


class BlockRekeyer:
    """vLLM block hashes → Crescent chunk keys, for one instance. Not thread-safe."""

    def __init__(self, namespace: bytes, chunk_tokens: int) -> None:
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.blocks: dict[Hashable, _Block] = {}
        self.num_skipped = 0
        """Blocks not indexed: unknown parent, extra keys, another KV-cache group, bad fields."""

    def stored(self, f: dict) -> list[bytes]:
        """The chunk keys a ``BlockStored`` completes."""
        hashes, tokens, size = f.get("block_hashes") or [], f.get("token_ids") or [], f.get("block_size")
        scope = _scope_of(f)
        if f.get("group_idx") not in (None, 0) or not isinstance(size, int) or size <= 0 \
                or len(tokens) != size * len(hashes) or scope is None:
            self.num_skipped += len(hashes)
            return []
        parent = f.get("parent_block_hash")
        if parent is None:
            last, pending, ns = bytes(ROOT_KEY), (), request_namespace(self.namespace, *scope)
        elif (p := self.blocks.get(_hashable(parent))) is not None:
            last, pending, ns = p.last_key, p.pending, p.namespace
        else:  # its parent was stored before we listened, or skipped
            self.num_skipped += len(hashes)
            return []
        new = []
        for i, h in enumerate(hashes):
            pending = pending + tuple(tokens[i * size:(i + 1) * size])
            completes = []
            while len(pending) >= self.chunk_tokens:
                last = chunk_key(last, ns, pending[:self.chunk_tokens])
                pending = pending[self.chunk_tokens:]
                completes.append(bytes(last))
            self.blocks[_hashable(h)] = _Block(last, pending, completes, ns)
            new += completes
        return new

    def removed(self, f: dict) -> list[bytes]:
        """The chunk keys a ``BlockRemoved`` takes away."""
        if f.get("group_idx") not in (None, 0):
            return []
        out = []
        for h in f.get("block_hashes") or []:
            b = self.blocks.pop(_hashable(h), None)
            if b is not None:
                out += b.completes
        return out

    def clear(self) -> None:
        self.blocks.clear()


def _hashable(h) -> Hashable:
    return tuple(h) if isinstance(h, list) else h


@dataclasses.dataclass(frozen=True)
class VllmSource:
    """One ``--vllm-kv-events`` value: ``ID=tcp://pub[,tcp://replay][,http://openai-server]``."""

    member_id: str
    endpoint: str
    replay_endpoint: str | None = None
    url: str | None = None

    @classmethod
    def parse(cls, spec: str) -> VllmSource:
        member_id, sep, rest = spec.partition("=")
        if not sep or not member_id.strip() or not rest:
            raise ValueError(f"--vllm-kv-events takes ID=tcp://HOST:PORT[,tcp://HOST:PORT][,http://HOST:PORT], "
                             f"got {spec!r}")
        tcp = [p for p in rest.split(",") if p.startswith("tcp://")]
        http = [p for p in rest.split(",") if p.startswith(("http://", "https://"))]
        other = [p for p in rest.split(",") if p not in tcp and p not in http]
        if other or not 1 <= len(tcp) <= 2 or len(http) > 1:
            raise ValueError(f"--vllm-kv-events {spec!r}: give the PUB endpoint, optionally the replay endpoint "
                             "(tcp://HOST:PORT each) and the instance's http(s):// URL")
        return cls(member_id.strip(), tcp[0], tcp[1] if len(tcp) > 1 else None,
                   http[0].rstrip("/") if http else None)


class VllmSubscriber(EventFollower):
    """Follows one vLLM instance's KV events into the conductor's device-cache index."""

    def __init__(self, conductor, source: VllmSource, namespace: bytes, chunk_tokens: int) -> None:
        super().__init__(source.member_id, source.endpoint, source.replay_endpoint)
        self.conductor = conductor
        self.source = source
        self.rekeyer = BlockRekeyer(namespace, chunk_tokens)
        self.num_batches = 0

    def alive(self) -> bool:
        """Whether the instance answers its health check (no URL: while followed)."""
        if self.source.url is None:
            return not self.stopped
        try:
            with urllib.request.urlopen(f"{self.source.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def on_restart(self) -> None:
        self.rekeyer.clear()
        with self.conductor._lock:
            self.conductor.forget(self.conductor.device_index, self.source.member_id)

    def on_batch(self, seq: int, payload: bytes) -> None:
        c = self.conductor
        try:
            _, events = decode_batch(payload)
        except ValueError as exc:
            self.num_bad += 1
            log.warning("vLLM %s: batch %d not decoded: %s", self.source.member_id, seq, exc)
            return
        node = self.source.member_id
        with c._lock:
            for e in events:
                try:
                    if e.type == "BlockStored":
                        for k in self.rekeyer.stored(e.fields):
                            c.device_index.stored(node, k, Tier.DEVICE)
                    elif e.type == "BlockRemoved":
                        for k in self.rekeyer.removed(e.fields):
                            c.device_index.removed(node, k)
                    else:
                        self.rekeyer.clear()
                        c.forget(c.device_index, node)
                except (TypeError, ValueError, OverflowError) as exc:  # fields of the wrong type or range
                    self.num_bad += 1
                    if self.num_bad <= 10 or self.num_bad % 1000 == 0:
                        log.warning("vLLM %s: a %s event of batch %d skipped (%d so far): %s", node, e.type, seq,
                                    self.num_bad, exc)
        self.num_batches += 1
