"""LMCache remote backend: LMCache's KV chunks in a Crescent store node or cluster.

LMCache (tested with 0.5.6) loads it through its Remote Storage Plugin framework,
which imports a third-party connector named in the config (nothing in LMCache is
patched):

    remote_storage_plugins: ["crescent"]
    extra_config:
      remote_storage_plugin.crescent.module_path: kvstore.integrations.lmcache
      remote_storage_plugin.crescent.class_name: CrescentConnectorAdapter
      remote_storage_plugin.crescent.url: "crescent://127.0.0.1:7400"
      remote_storage_plugin.crescent.timeout_s: 10      # optional

The URL names a store node or a conductor (then every store node it knows is
used, as ``ClusterClient`` does). Not ``remote_url``: LMCache 0.5.6 resolves a
``remote_url`` scheme only through its built-in adapters and the plugins listed
in ``remote_storage_plugins``, and each listed plugin also gets a backend of its
own, so ``remote_url: crescent://...`` would write every chunk twice. The
adapter refuses that configuration at start-up with a message saying so.

Each LMCache chunk is one Crescent value under its ``CacheEngineKey`` string:
LMCache's remote metadata header (shapes, dtypes, format, length, as its
Redis and Mooncake connectors write it), the KV bytes, and an XXH3-64 of the
key, header and bytes. A value that is missing, truncated, corrupt, stored
under another key or of a shape this engine cannot hold reads as a miss, and
so does every store fault: LMCache then recomputes. Store calls are blocking
gRPC, run in threads off LMCache's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlparse

import xxhash
from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvstore.client import ReadSlabs, Retry, StoreClient, as_bytes_view
from kvstore.config import MAX_KEY_BYTES
from kvstore.errors import CrescentError

log = logging.getLogger("crescent.integrations")

SCHEME = "crescent://"
PLUGIN_TYPE = "crescent"
_DIGEST_BYTES = 8


def _store_key(name: bytes) -> bytes:
    """The Crescent key of an LMCache key string: the string, or its digest when longer than a
    Crescent key may be (the value's checksum still binds the whole string)."""
    return name if len(name) <= MAX_KEY_BYTES else b"lmcache-xxh3-128:" + xxhash.xxh3_128_digest(name)


def connect(address: str, timeout_s: float):
    """A ``StoreClient`` when a store node answers at ``address``, else a ``ClusterClient`` of its conductor.

    Raises:
        CrescentError: neither a store node nor a conductor answers.
    """
    from kvstore.cluster import ClusterClient
    from kvstore.conductor.client import ConductorClient

    retry = Retry(attempts=2, backoff_s=0.05, max_backoff_s=0.5)
    store = StoreClient(address, timeout_s=timeout_s, retry=retry)
    try:
        store.health()
        return store
    except CrescentError:
        store.close()
    with ConductorClient(address, timeout_s=timeout_s, retry=retry) as cc:
        cc.members()
    return ClusterClient(address, timeout_s=timeout_s, retry=retry)


def _address(url: str, where: str) -> str:
    """``host:port`` of a ``crescent://host:port`` URL; a bad one stops LMCache from making the backend."""
    parsed = urlparse(url)
    if not url.startswith(SCHEME) or not parsed.hostname or parsed.port is None:
        raise IrrecoverableException(f"{where} must be crescent://host:port, got {url!r}")
    return f"{parsed.hostname}:{parsed.port}"


class CrescentConnectorAdapter(ConnectorAdapter):
    """Makes ``CrescentConnector``s for LMCache's remote storage plugin ``crescent`` (or ``crescent.NAME``)."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith("plugin://"):
            return extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE
        return url.startswith(SCHEME)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        if context.plugin_name is None:  # LMCache's legacy remote_url path
            raise IrrecoverableException(
                f"remote_url {context.url!r}: set it as extra_config remote_storage_plugin.crescent.url and drop "
                "remote_url (with remote_url LMCache would make two backends over the same store)")
        extra = context.config.extra_config or {}
        prefix = f"remote_storage_plugin.{context.plugin_name}."
        return CrescentConnector(_address(extra.get(prefix + "url", ""), f"extra_config {prefix}url"),
                                 context.local_cpu_backend, timeout_s=float(extra.get(prefix + "timeout_s", 10.0)))


class CrescentConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over a Crescent store node or cluster.

    Args:
        address: ``host:port`` of a store node or a conductor.
        local_cpu_backend: LMCache's allocator of the memory objects that reads fill.
        timeout_s: deadline of each store call; a slower call reads as a miss.

    Raises:
        CrescentError: nothing answers at ``address`` (LMCache retries the connection later).
    """

    def __init__(self, address: str, local_cpu_backend: LocalCPUBackend, timeout_s: float = 10.0) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.address = address
        self.local_cpu_backend = local_cpu_backend
        self.client = connect(address, timeout_s)
        self._slabs = ReadSlabs()  # what reads land in before LMCache's memory objects

    def __repr__(self) -> str:
        return f"<CrescentConnector {self.address}>"

    # ---- values ---------------------------------------------------------------------

    @staticmethod
    def _keys(keys: list[CacheEngineKey]) -> list[bytes]:
        return [_store_key(k.to_string().encode()) for k in keys]

    @staticmethod
    def _encode(name: bytes, memory_obj: MemoryObj) -> list:
        """The value's parts: header and digest around the memory object's own bytes (not copied)."""
        payload = as_bytes_view(memory_obj.byte_array)
        header = RemoteMetadata(payload.nbytes, memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                memory_obj.get_memory_format()).serialize()
        h = xxhash.xxh3_64(name)
        h.update(header)
        h.update(payload)
        return [header, payload, h.digest()]

    def _verify(self, name: bytes, value: bytearray | memoryview | None) -> tuple[RemoteMetadata, memoryview] | None:
        """The header and KV bytes of a value, or None when it is missing or does not verify."""
        if value is None:
            return None
        view, hlen = memoryview(value), self.remote_metadata_bytes
        if len(view) < hlen + _DIGEST_BYTES:
            log.warning("crescent: LMCache chunk %s is truncated (%d bytes); read as a miss", name.decode(), len(view))
            return None
        h = xxhash.xxh3_64(name)
        h.update(view[:-_DIGEST_BYTES])
        if h.digest() != view[-_DIGEST_BYTES:]:
            log.warning("crescent: LMCache chunk %s failed its checksum; read as a miss", name.decode())
            return None
        payload = view[hlen:-_DIGEST_BYTES]
        try:
            meta = RemoteMetadata.deserialize(view[:hlen])
        except Exception as exc:  # noqa: BLE001 - a header this LMCache cannot read is a miss
            log.warning("crescent: LMCache chunk %s has an unreadable header (%r); read as a miss", name.decode(), exc)
            return None
        if meta.length != len(payload):
            log.warning("crescent: LMCache chunk %s holds %d KV bytes, its header says %d; read as a miss",
                        name.decode(), len(payload), meta.length)
            return None
        return meta, payload

    def _memory_obj(self, meta: RemoteMetadata, payload: memoryview) -> MemoryObj | None:
        """A memory object from LMCache's allocator holding ``payload``; None when its buffer is full
        or the header's shape does not hold exactly those bytes."""
        try:
            obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        except Exception as exc:  # noqa: BLE001 - a shape this LMCache cannot allocate is a miss
            log.warning("crescent: LMCache cannot allocate a chunk of %s %s: %r", meta.shapes, meta.dtypes, exc)
            return None
        if obj is None:
            return None
        dst = as_bytes_view(obj.byte_array)
        if dst.nbytes != len(payload):
            log.warning("crescent: an LMCache chunk of shape %s holds %d bytes, not %d; read as a miss",
                        meta.shapes, dst.nbytes, len(payload))
            obj.ref_count_down()
            return None
        dst[:] = payload
        return obj

    async def _call(self, what: str, fn, *args, default=None):
        """``fn(*args)`` in a thread, off LMCache's event loop (store calls, checksums); ``default`` (a miss)
        on any fault."""
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # noqa: BLE001 - a store fault is a miss, never an error in LMCache
            log.warning("crescent store %s: %s failed: %r", self.address, what, exc)
            return default

    # ---- RemoteConnector --------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._call("exists", self.client.exists, self._keys([key]), default=[False]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.client.exists(self._keys([key]))[0]
        except Exception as exc:  # noqa: BLE001
            log.warning("crescent store %s: exists failed: %r", self.address, exc)
            return False

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Reads (into a kept slab: fresh memory would page-fault in on every read) and verifies in a
        thread; allocates and copies here, after the last await, so that a get LMCache cancels (on its
        timeout) leaves no memory object behind. The slab goes back once the copies are made; a
        cancelled get's slab is left to the thread still reading into it."""
        slab = self._slabs.take()
        found = await self._call("get", self._fetch, keys, slab, default=[None] * len(keys))
        try:
            return [self._memory_obj(*f) if f is not None else None for f in found]
        finally:
            self._slabs.give(slab)

    def _fetch(self, keys: list[CacheEngineKey], slab) -> list[tuple[RemoteMetadata, memoryview] | None]:
        names = [k.to_string().encode() for k in keys]
        values = self.client.batch_get([_store_key(n) for n in names], slab.alloc)
        return [self._verify(n, v) for n, v in zip(names, values)]

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Stores the chunks; one the store has no room for is dropped (LMCache recomputes it)."""
        stored = await self._call("put", self._put, keys, memory_objs, default=[])
        if not all(stored):
            log.info("crescent store %s: no room for %d of %d LMCache chunks", self.address,
                     stored.count(False), len(stored))

    def _put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> list[bool]:
        names = [k.to_string().encode() for k in keys]
        return self.client.batch_put([(_store_key(n), self._encode(n, m)) for n, m in zip(names, memory_objs)])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys the store holds (one lookup call)."""
        try:
            return self.client.lookup(self._keys(keys)) if keys else 0
        except Exception as exc:  # noqa: BLE001
            log.warning("crescent store %s: lookup failed: %r", self.address, exc)
            return 0

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks that read and verified; the others' memory is released."""
        objs = await self.batched_get(keys)
        n = next((i for i, o in enumerate(objs) if o is None), len(objs))
        for o in objs[n:]:
            if o is not None:
                o.ref_count_down()
        return objs[:n]

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.client.delete(self._keys([key])) > 0
        except Exception as exc:  # noqa: BLE001
            log.warning("crescent store %s: delete failed: %r", self.address, exc)
            return False

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the store answers; LMCache's health monitor bypasses the backend otherwise."""
        health = await self._call("ping", self.client.health)
        return 0 if health and health["serving"] else 1

    async def list(self) -> list[str]:
        """Always empty: a Crescent node has no key listing."""
        return []

    async def close(self) -> None:
        self.client.close()
