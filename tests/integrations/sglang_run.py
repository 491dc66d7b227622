"""CrescentHiCacheStorage driven the way SGLang's HiCacheController drives an L3 backend (run by the sglang venv).

    sglang_run.py write STORE OUT.json             # process 1: stores pages, checks every call's answers
    sglang_run.py read STORE CONDUCTOR OUT.json    # process 2: reads process 1's pages; a cluster round trip

The backend is built by SGLang's own ``StorageBackendFactory`` ("dynamic"), page
keys are SGLang's own page hashes, and the calls, their arguments and their use
of the answers follow ``sglang/srt/managers/cache_controller.py``
(``_page_set_zero_copy``, ``_page_get_zero_copy``, ``_generic_page_set``,
``_generic_page_get``, ``_storage_hit_query``). The host pool is SGLang's
``MHATokenToKVPoolHost`` where SGLang's host pools import; they import torchvision,
whose PyPI builds need a CUDA torch, so with this project's CPU torch it is
``PageFirstPool``, a copy of that class's page_first layout and zero-copy map.
Pages are random bytes from a fixed seed, so both processes know every page.
Prints nothing on success; ``OUT.json`` holds what each call answered.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvstore.client import StoreClient

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 64
POOL_PAGES = 32
MODEL = "crescent-tests/tiny"
BACKEND = {"backend_name": "crescent", "module_path": "kvstore.integrations.sglang",
           "class_name": "CrescentHiCacheStorage"}


class PageFirstPool:
    """``MHATokenToKVPoolHost`` with layout page_first, as far as a storage backend sees it (sglang 0.5.23,
    sglang/srt/mem_cache/pool_host/mha.py): ``kv_buffer`` [2, tokens, layers, heads, head_dim]."""

    layout = "page_first"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.page_size, self.size = dtype, PAGE, POOL_PAGES * PAGE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.kv_buffer = torch.zeros((2, self.size, LAYERS, HEADS, HEAD_DIM), dtype=dtype)

    def get_page_buffer_meta(self, indices):
        token = self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        v_offset = self.size * token
        ptrs = []
        for i in indices.tolist()[::self.page_size]:
            ptrs += [self.kv_buffer.data_ptr() + i * token, self.kv_buffer.data_ptr() + i * token + v_offset]
        return ptrs, [self.page_size * token] * len(ptrs)

    def get_data_page(self, index, flat: bool = True):
        page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)


def host_pool(dtype: torch.dtype = torch.bfloat16):
    """SGLang's host pool on CPU where it imports, else the stand-in; its first 8 pages hold random bytes."""
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    except ImportError as exc:
        pool, kind = PageFirstPool(dtype), f"PageFirstPool (SGLang's host pools do not import here: {exc})"
    else:
        device = MHATokenToKVPool(size=POOL_PAGES * PAGE // 2, page_size=PAGE, dtype=dtype, head_num=HEADS,
                                  head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                  enable_alt_stream=False)
        cls, info, kwargs = _mha_host_inputs(device)
        pool = cls(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu", **kwargs)
        kind = type(pool).__name__
    g = torch.Generator().manual_seed(1234)
    pages = torch.randint(0, 256, (2, 8 * PAGE, LAYERS, HEADS, HEAD_DIM * dtype.itemsize), dtype=torch.uint8,
                          generator=g)
    pool.kv_buffer[:, :8 * PAGE] = pages.view(dtype)
    return pool, kind


def backend(address: str | None, pool, v1: bool = True, key: str = "crescent_store", **config):
    """The backend as SGLang's ``attach_storage_backend`` builds it: factory, then the host pool."""
    extra = {**BACKEND, "interface_v1": int(v1), **({key: address} if address else {})}
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL, extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(**{**fields, **config}), pool)
    b.register_mem_pool_host(pool)
    return b


def indices(first: int, n: int) -> torch.Tensor:
    """Token indices of host pages ``first .. first+n-1`` (what the controller slices from an operation)."""
    return torch.arange(first * PAGE, (first + n) * PAGE, dtype=torch.int64)


def same(pool, a: int, b: int, n: int) -> bool:
    """Whether host pages ``a..a+n-1`` and ``b..b+n-1`` hold the same bytes."""
    return all(torch.equal(pool.get_data_page((a + i) * PAGE).view(torch.uint8),
                           pool.get_data_page((b + i) * PAGE).view(torch.uint8)) for i in range(n))


def hashes(seed: int, n: int) -> list[str]:
    """SGLang's storage keys of ``n`` pages of a token sequence (the controller's ``get_storage_hash_str``)."""
    g = torch.Generator().manual_seed(seed)
    return get_storage_hash_str(torch.randint(0, 32000, (n * PAGE,), generator=g).tolist(), None, page_size=PAGE)


def zero_copy_get(b, keys: list[str], first: int) -> list[bool]:
    return b.batch_get_v1(keys, indices(first, len(keys)), HiCacheStorageExtraInfo(prefix_keys=None))


def zero_copy_set(b, keys: list[str], first: int) -> list[bool]:
    return b.batch_set_v1(keys, indices(first, len(keys)), HiCacheStorageExtraInfo(prefix_keys=None))


def generic_get(b, pool, keys: list[str], first: int) -> int:
    """``_generic_page_get``: reads into dummy flat pages, copies the leading hits into the pool."""
    data = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(data):
        if page is None:
            return i
        pool.set_from_flat_data_page((first + i) * PAGE, page)
    return len(keys)


def write(store: str) -> dict:
    pool, kind = host_pool()
    keys, other = hashes(1, 8), hashes(2, 3)
    out = {"pool": kind}
    b = backend(store, pool, enable_storage_metrics=True)
    out["backend"] = type(b).__name__
    with StoreClient(store) as c:
        # zero-copy path: store pages 0-5; SGLang's prefix queries; read back into pages 16-21
        out["set_v1"] = zero_copy_set(b, keys[:6], 0)
        before = c.stats()["tiers"]["dram"]["num_entries"]
        out["set_v1_again"] = zero_copy_set(b, keys[:6], 0)
        out["objects_added_by_rewrite"] = c.stats()["tiers"]["dram"]["num_entries"] - before
        out["exists_prefix"] = b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None))
        out["exists_with_gap"] = b.batch_exists([keys[0], keys[1], keys[7], keys[3]])
        out["exists_one"] = [b.exists(keys[0]), b.exists(keys[7])]
        out["get_v1"] = zero_copy_get(b, keys[:6], 16)
        out["get_v1_exact"] = same(pool, 0, 16, 6)
        out["get_v1_with_miss"] = zero_copy_get(b, [keys[0], keys[7], keys[2]], 24)
        stats = b.get_stats()
        out["stats_pages"] = {"backup": sum(stats.backup_pgs), "prefetch": sum(stats.prefetch_pgs)}

        # a damaged page reads as a miss: pages 0-2 of another sequence, page 1's V part flipped, page 2's K cut
        out["set_v1_other"] = zero_copy_set(b, other, 0)
        k1_v, k2_k = b._keys(other[1], 2)[1], b._keys(other[2], 2)[0]
        flipped = bytearray(c.get(k1_v))
        flipped[100] ^= 0xFF
        c.put(k1_v, flipped)
        c.put(k2_k, c.get(k2_k)[:-2])
        out["get_v1_damaged"] = zero_copy_get(b, other, 24)

        # the copying path (interface_v1 off): flat pages, its own objects
        g = backend(store, pool, v1=False)
        out["generic_exists_before"] = g.batch_exists(keys)
        out["generic_set"] = g.batch_set(keys[:4], [pool.get_data_page(i * PAGE) for i in range(4)])
        out["generic_exists"] = g.batch_exists(keys)
        out["generic_get_count"] = generic_get(g, pool, keys[:5], 26)
        out["generic_get_exact"] = same(pool, 0, 26, 4)
        page = pool.get_dummy_flat_data_page()
        out["generic_get_one"] = g.get(keys[1], page) is page and torch.equal(  # (bytes: random bytes hold NaNs)
            page.view(torch.uint8), pool.get_data_page(PAGE).view(torch.uint8))
        out["generic_get_miss"] = g.get(keys[7], pool.get_dummy_flat_data_page()) is None
        out["generic_set_one"] = [g.set(keys[4], pool.get_data_page(4 * PAGE)), g.exists(keys[4])]

        # who shares pages: MHA's other TP ranks and other dtypes never; MLA's TP ranks always
        out["exists_other_tp_shard"] = backend(store, pool, tp_size=2, tp_rank=1).batch_exists(keys)
        out["exists_float16"] = backend(store, host_pool(torch.float16)[0]).batch_exists(keys)
        mla = [backend(store, pool, v1=False, is_mla_model=True, tp_size=2, tp_rank=r) for r in (0, 1)]
        out["mla_set_rank0"] = mla[0].batch_set(keys[:2], [pool.get_data_page(i * PAGE) for i in range(2)])
        out["mla_exists_rank1"] = mla[1].batch_exists(keys)

    # start-up: bad options stop SGLang; the address may come from the environment
    for name, extra in (("unknown_option", {"crescent_stor": store}), ("no_address", {})):
        try:
            backend(None, pool, **{"extra_config": {**BACKEND, **extra}})
            out[f"refused_{name}"] = None
        except ValueError as exc:
            out[f"refused_{name}"] = str(exc)
    os.environ["CRESCENT_STORE"] = store
    out["exists_via_env"] = backend(None, pool).batch_exists(keys)
    del os.environ["CRESCENT_STORE"]
    return out


def unreachable(store: str) -> dict:
    """Every call of a backend whose store is gone: misses, refusals, no exception."""
    pool, _ = host_pool()
    keys = hashes(1, 4)
    b = backend(store, pool)
    g = backend(store, pool, v1=False)
    b.clear()
    return {"exists": b.batch_exists(keys), "get_v1": zero_copy_get(b, keys, 16), "set_v1": zero_copy_set(b, keys, 0),
            "generic_set": g.batch_set(keys, [pool.get_data_page(0)] * 4), "generic_get": generic_get(g, pool, keys, 16),
            "get": g.get(keys[0], pool.get_dummy_flat_data_page()), "exists_one": g.exists(keys[0])}


def read(store: str, conductor: str) -> dict:
    pool, kind = host_pool()
    keys = hashes(1, 8)
    b = backend(store, pool)
    out = {"pool": kind, "exists_prefix": b.batch_exists(keys), "get_v1": zero_copy_get(b, keys[:6], 16),
           "get_v1_exact": same(pool, 0, 16, 6)}
    b.clear()
    out["exists_after_clear"] = b.batch_exists(keys)

    # a conductor's cluster: pages spread over its nodes, read back once the conductor indexed them
    out["cluster_set_v1"] = zero_copy_set(backend(conductor, pool, key="crescent_conductor"), keys, 0)
    fresh = backend(conductor, pool, key="crescent_conductor")
    deadline = time.monotonic() + 60
    while fresh.batch_exists(keys) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.1)
    out["cluster_exists"] = fresh.batch_exists(keys)
    out["cluster_get_v1"] = zero_copy_get(fresh, keys, 16)
    out["cluster_get_v1_exact"] = same(pool, 0, 16, 8)
    out["unreachable"] = unreachable("127.0.0.1:1")
    return out


def main() -> None:
    phase, *args, path = sys.argv[1:]
    out = write(*args) if phase == "write" else read(*args)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
