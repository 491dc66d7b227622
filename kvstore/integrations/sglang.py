"""SGLang HiCache L3 storage on Crescent: ``CrescentHiCacheStorage``.

SGLang's hierarchical cache keeps KV pages in GPU memory (L1), in a host memory
pool (L2) and, with a storage backend, in shared storage (L3) that every
instance reads: a page written by one instance is a prefix hit for all. This
backend makes a Crescent store node, or a conductor's cluster, that L3. SGLang
loads it through its dynamic backend mechanism::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "crescent", "module_path": "kvstore.integrations.sglang",
        "class_name": "CrescentHiCacheStorage", "interface_v1": 1,
        "crescent_store": "127.0.0.1:7400"}'

Extra-config keys read here (others belong to SGLang):

- ``crescent_store``: ``host:port`` of a store node, or ``crescent_conductor``:
  a conductor (``host:port[,...]``; pages then spread over its store nodes).
  Without either, ``$CRESCENT_STORE``, else ``$CRESCENT_CONDUCTOR``.
- ``crescent_timeout_s``: deadline of each store call (default 10).
- ``interface_v1`` (SGLang's own switch): 1 makes SGLang call the zero-copy
  ``batch_get_v1``/``batch_set_v1``, which move page bytes straight between the
  host pool and the store; without it SGLang copies each page through a flat
  tensor (``batch_get``/``batch_set``).

Objects. SGLang names a page by a chained SHA-256 of its tokens (salted per
tenant by SGLang). Each page is stored as its parts, the buffers the host pool
maps it to for zero-copy I/O (K and V for MHA's page-first layouts, one part for
MLA, one flat part on the copying path), plus one object holding the parts'
XXH3-64 checksums. Keys name the model, the KV dtype, the host layout and page
size, the TP shard (MHA's heads are split across TP ranks; MLA's KV is the same
on every rank) and pipeline / context-parallel shards, so instances that would
lay a page out differently never read each other's bytes.

Faults. A page that is missing, incomplete, of another size or whose checksum
does not match reads as a miss; a store that cannot be reached reads as misses
and takes no writes. No call raises into SGLang: it recomputes what it misses.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.client import ClusterClient, Retry, StoreClient, as_bytes_view
from kvstore.errors import CrescentError

log = logging.getLogger("crescent.integrations.sglang")

OPTIONS = ("crescent_store", "crescent_conductor", "crescent_timeout_s")
T = TypeVar("T")


def _storage_metrics():
    """An empty ``StorageMetrics``: SGLang's own where its metrics module imports (always inside an SGLang
    server; on a CPU-only torch its import chain fails on torchvision), else one with the same fields."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        import types

        return types.SimpleNamespace(prefetch_pgs=[], backup_pgs=[], prefetch_bandwidth=[], backup_bandwidth=[])
    return StorageMetrics()


class CrescentHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage on a Crescent store node or cluster (thread-safe, like its client).

    Args:
        storage_config: SGLang's storage config; its ``extra_config`` holds the keys
            above.
        kwargs: the factory's extra arguments (SGLang passes none).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        unknown = sorted(k for k in extra if k.startswith("crescent_") and k not in OPTIONS)
        if unknown:
            raise ValueError(f"unknown Crescent option(s) {unknown}; known: {list(OPTIONS)}")
        if storage_config.should_split_heads:
            raise ValueError("Crescent's HiCache backend does not split heads across TP sizes (tp_lcm_size)")
        store = extra.get("crescent_store")
        conductor = extra.get("crescent_conductor")
        if store and conductor:
            raise ValueError("give crescent_store or crescent_conductor, not both")
        if not store and not conductor:
            store = os.environ.get("CRESCENT_STORE")
            conductor = None if store else os.environ.get("CRESCENT_CONDUCTOR")
        if not store and not conductor:
            raise ValueError("no Crescent address: set crescent_store or crescent_conductor in "
                             "--hicache-storage-backend-extra-config, or $CRESCENT_STORE / $CRESCENT_CONDUCTOR")
        timeout_s = float(extra.get("crescent_timeout_s", 10.0))
        retry = Retry(attempts=2, backoff_s=0.05, max_backoff_s=0.5)  # a store fault costs a miss, not a wait
        self.address = store or conductor
        self._client = (StoreClient(store, timeout_s=timeout_s, retry=retry) if store
                        else ClusterClient(conductor, timeout_s=timeout_s, retry=retry))
        self._v1 = bool(extra.get("interface_v1", 0))
        c = storage_config
        shard = [] if c.is_mla_model else [f"tp{c.tp_rank}of{c.tp_size}"]
        if c.pp_size > 1:
            shard.append(f"pp{c.pp_rank}of{c.pp_size}")
        if c.attn_cp_size > 1:
            shard.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
        self._prefix = "|".join(["sglang", c.model_name or "", *shard])
        self._parts = 1  # per page; the host pool's zero-copy map decides on the v1 path
        self._metrics = storage_config.enable_storage_metrics
        self._stats: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                        "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._failing = False
        try:
            self._client.health()
            log.info("crescent: HiCache L3 on %s (%s)", self.address, "zero-copy v1" if self._v1 else "copying")
        except Exception as exc:  # noqa: BLE001 - SGLang starts anyway; every page misses until the store answers
            log.warning("crescent: store %s does not answer yet (%s); pages miss until it does", self.address, exc)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Takes the host pool's page format into the keys (SGLang calls this right after creating the backend)."""
        super().register_mem_pool_host(mem_pool_host)
        p = mem_pool_host
        self._prefix = "|".join([self._prefix, str(p.dtype).removeprefix("torch."), p.layout, f"page{p.page_size}"])
        if self._v1:
            self._parts = len(p.get_page_buffer_meta(torch.arange(p.page_size))[0])

    # ---- SGLang's calls ----------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Reads pages straight into the host pool at ``host_indices``; per page, whether it arrived intact."""
        return self._guard("read", lambda: self._read(keys, self._pool_views(keys, host_indices)), [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Stores pages straight from the host pool; per page, whether the store holds it now."""
        return self._guard("write", lambda: self._write(keys, self._pool_views(keys, host_indices)),
                           [False] * len(keys))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Reads one page into ``target_location`` (required: a contiguous CPU tensor of the page's size)."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Reads pages into their target tensors (SGLang passes the host pool's flat dummy pages); None: a miss."""
        ok = self._guard("read", lambda: self._read(keys, [[as_bytes_view(t)] for t in target_locations]),
                         [False] * len(keys))
        return [t if hit else None for t, hit in zip(target_locations, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores flat page tensors; True when the store holds every one."""
        return all(self._guard("write", lambda: self._write(keys, [[as_bytes_view(v.contiguous())] for v in values]),
                               [False]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages the store holds whole (one lookup of every part and checksum key)."""
        n = self._parts
        flat = [k for p in keys for k in self._keys(p, n)]
        return self._guard("lookup", lambda: self._client.lookup(flat) // (n + 1), 0)

    def clear(self) -> None:
        """Removes every object from the store node (every node of a conductor's cluster), not only SGLang's:
        Crescent nodes keep no key listing to select by."""
        removed = self._guard("clear", self._client.clear, None)
        if removed is not None:
            log.info("crescent: cleared %d objects from %s", removed, self.address)

    def get_stats(self):
        """Pages and GB/s per read and write batch since the last call (with --enable-cache-report metrics)."""
        if not self._metrics:
            return None
        out = _storage_metrics()
        for name, values in self._stats.items():
            getattr(out, name).extend(values)
            values.clear()
        return out

    def close(self) -> None:
        self._client.close()

    # ---- store I/O ---------------------------------------------------------------

    def _keys(self, page: str, n: int) -> list[bytes]:
        """A page's ``n`` part keys, then its checksum key."""
        base = f"{self._prefix}|{page}|{n}"
        return [f"{base}.{j}".encode() for j in range(n)] + [f"{base}.xxh3".encode()]

    def _pool_views(self, pages: Sequence[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Each page's parts as writable views of the host pool, from the pool's own zero-copy map."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(ptrs) // max(len(pages), 1)
        if n * len(pages) != len(ptrs) or n != self._parts:
            raise ValueError(f"the host pool maps {len(pages)} pages to {len(ptrs)} buffers, not {self._parts} each")
        views = [memoryview((ctypes.c_char * size).from_address(ptr)).cast("B") for ptr, size in zip(ptrs, sizes)]
        return [views[i * n:(i + 1) * n] for i in range(len(pages))]

    def _write(self, pages: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Stores each page's parts and checksums; a page the store holds whole is not sent again
        (same key, same bytes: keys name content)."""
        keys = [self._keys(p, len(ps)) for p, ps in zip(pages, parts)]
        held = iter(self._client.exists([k for ks in keys for k in ks]))
        ok = [all([next(held) for _ in ks]) for ks in keys]
        todo = [i for i, held_all in enumerate(ok) if not held_all]
        items = []
        for i in todo:
            checksums = b"".join(xxhash.xxh3_64_digest(p) for p in parts[i])
            items += [*zip(keys[i], parts[i]), (keys[i][-1], checksums)]
        start = time.perf_counter()
        stored = iter(self._client.batch_put(items))
        for i in todo:
            ok[i] = all([next(stored) for _ in keys[i]])
        self._record("backup", [i for i in todo if ok[i]], parts, time.perf_counter() - start)
        return ok

    def _read(self, pages: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Reads each page's parts into its buffers; a page counts when every part has its size and checksum."""
        keys = [k for p, ps in zip(pages, parts) for k in self._keys(p, len(ps))]
        checksums = [bytearray(8 * len(ps)) for ps in parts]
        start = time.perf_counter()
        sizes = iter(self._client.batch_get_into(keys, [b for ps, c in zip(parts, checksums) for b in (*ps, c)]))
        ok = []
        for ps, c in zip(parts, checksums):
            got = [next(sizes) for _ in range(len(ps) + 1)]
            ok.append(got == [p.nbytes for p in ps] + [len(c)]
                      and c == b"".join(xxhash.xxh3_64_digest(p) for p in ps))
        self._record("prefetch", [i for i, hit in enumerate(ok) if hit], parts, time.perf_counter() - start)
        return ok

    def _record(self, kind: str, moved: list[int], parts: Sequence[Sequence[memoryview]], seconds: float) -> None:
        if self._metrics and moved:
            nbytes = sum(p.nbytes for i in moved for p in parts[i])
            self._stats[f"{kind}_pgs"].append(len(moved))
            self._stats[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / (1 << 30))

    def _guard(self, what: str, call: Callable[[], T], miss: T) -> T:
        """``call()``, or ``miss`` when it fails: SGLang then recomputes. Logs when the store starts and
        stops failing, not on every call."""
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 - a store fault is a miss, never a failed request
            if not self._failing:
                log.warning("crescent: %s on %s failed (%s); pages miss until it answers", what, self.address, exc,
                            exc_info=not isinstance(exc, CrescentError))
            self._failing = True
            return miss
        if self._failing:
            log.info("crescent: %s answers again", self.address)
            self._failing = False
        return out
