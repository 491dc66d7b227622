"""Drives the real LMCache (in .venv-lmcache) against a Crescent store; run by test_lmcache.py.

    lmcache_run.py store OUT       an LMCacheEngine stores the KV of PROMPT
    lmcache_run.py load OUT        a fresh LMCacheEngine looks up and retrieves PROMPT and OTHER
    lmcache_run.py connector OUT   the connector alone, made by LMCache's CreateConnector

The LMCache config comes from LMCACHE_CONFIG_FILE, read by the function vLLM's
LMCacheConnectorV1 reads it with. The engine's local CPU cache is off
(``local_cpu: false``: LMCache's CPU memory only stages transfers), so every hit
comes from Crescent. The KV lives in a plain CPU tensor ``[2, layers, tokens,
hidden]``: LMCache's GPU connectors need CUDA, ``HostKV`` copies to and from it.
Findings go to OUT as JSON; test_lmcache.py makes the assertions.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import torch
from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 16
DTYPE = torch.bfloat16
PROMPT = list(range(1000, 1000 + 3 * CHUNK + 5))  # three full chunks and a partial one
OTHER = list(range(5000, 5000 + 2 * CHUNK))  # never stored


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="crescent-tests/tiny", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=DTYPE, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
                           chunk_size=CHUNK)


def kv_of(tokens: list[int]) -> torch.Tensor:
    """The KV the "model" computes for ``tokens``: the same in every process."""
    g = torch.Generator().manual_seed(tokens[0])
    return torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM, generator=g).to(DTYPE)


class HostKV(GPUConnectorInterface):
    """LMCache's GPU connector over a CPU tensor ``[2, layers, tokens, hidden]`` passed as ``kv=``."""

    def from_gpu(self, memory_obj, start, end, **kwargs):
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(m, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(m, s, e, **kwargs)

    def get_shape(self, num_tokens):
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])


def engine():
    e = LMCacheEngineBuilder.get_or_create("crescent-test", lmcache_get_or_create_config(), metadata(), HostKV(),
                                           lambda t, src: None, lambda o, src: o)
    e.post_init()
    return e


def backends(e) -> list[str]:
    return [f"{name}: {b.connection!r}" if hasattr(b, "connection") else name
            for name, b in e.storage_manager.storage_backends.items()]


def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    """Polls ``cond`` (LMCache's puts are asynchronous); generous for a loaded 2-core machine."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def store() -> dict:
    e = engine()
    e.store(PROMPT, kv=kv_of(PROMPT))
    wait_for(lambda: e.lookup(PROMPT) == len(PROMPT), "LMCache's puts to reach Crescent")
    keys = [key.to_string() for _, _, key in e.token_database.process_tokens(PROMPT)]
    return {"backends": backends(e), "keys": keys, "lookup": e.lookup(PROMPT)}


def retrieve(e, tokens: list[int]) -> dict:
    """What a fresh engine finds for ``tokens``; the retrieved KV is compared with ``kv_of`` byte for byte."""
    kv = torch.zeros(2, LAYERS, len(tokens), HEADS * HEAD_DIM, dtype=DTYPE)
    looked_up = e.lookup(tokens)
    mask = e.retrieve(tokens, kv=kv)
    n = int(mask.sum())
    return {"lookup": looked_up, "retrieved": n, "prefix": bool(mask[:n].all()),
            "equal": torch.equal(kv[:, :, :n].view(torch.int16), kv_of(tokens)[:, :, :n].view(torch.int16)),
            "rest_untouched": not kv[:, :, n:].any().item()}


def load() -> dict:
    e = engine()
    return {"backends": backends(e), "prompt": retrieve(e, PROMPT), "other": retrieve(e, OTHER)}


def connector() -> dict:
    """The connector's contract, through LMCache's own factory and CPU allocator."""
    from lmcache.v1.exceptions import IrrecoverableException
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvstore.client import StoreClient
    from kvstore.config import StoreConfig
    from kvstore.integrations.lmcache import CrescentConnector
    from kvstore.server import StoreNode

    config, meta = lmcache_get_or_create_config(), metadata()
    cpu = LocalCPUBackend(config, meta)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    wrapped = CreateConnector("plugin://crescent", loop, cpu, config, meta, plugin_name="crescent")
    conn = wrapped.getWrappedConnector()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def key(i: int, model_name: str = "crescent-tests/tiny") -> CacheEngineKey:
        return CacheEngineKey(model_name=model_name, world_size=1, worker_id=0, chunk_hash=i, dtype=DTYPE)

    def chunk(tokens: int, seed: int):
        obj = cpu.allocate(meta.get_shapes(tokens), meta.get_dtypes(), MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE))
        return obj

    def handed(obj):
        """As RemoteBackend hands a chunk to a put: with a reference that LMCache's wrapper drops after it."""
        obj.ref_count_up()
        return obj

    def same(a, b) -> bool:
        return (a is not None and b is not None and a.get_shapes() == b.get_shapes()
                and a.get_dtypes() == b.get_dtypes() and a.get_memory_format() == b.get_memory_format()
                and bytes(a.byte_array) == bytes(b.byte_array))

    full, partial = chunk(CHUNK, 1), chunk(5, 2)
    long_key = key(3, "m" * 1100)  # longer than a Crescent key may be
    out = {"connector": repr(wrapped), "type": type(conn).__name__, "ping": run(wrapped.ping()),
           "exists_before": run(wrapped.exists(key(1))), "get_missing": run(wrapped.get(key(1))) is None}
    run(wrapped.batched_put([key(1), key(2)], [handed(full), handed(partial)]))
    run(wrapped.put(long_key, handed(chunk(CHUNK, 3))))
    out["exists_after"] = [run(wrapped.exists(key(1))), wrapped.exists_sync(key(2))]
    out["full_equal"] = same(run(wrapped.get(key(1))), full)
    out["partial_equal"] = same(run(wrapped.batched_get([key(2)]))[0], partial)
    out["long_key_equal"] = same(run(wrapped.get(long_key)), chunk(CHUNK, 3))
    out["contains"] = [wrapped.batched_contains([key(1), key(2), key(9), long_key]),
                       run(wrapped.batched_async_contains("l", [key(1), key(2), key(9)]))]
    out["non_blocking"] = len(run(wrapped.batched_get_non_blocking("l", [key(1), key(9), key(2)])))
    # Several chunks in one read, twice (the second into the buffer the first left), the first's checked after.
    several = [key(2), key(9), key(1), long_key]
    first, second = run(wrapped.batched_get(several)), run(wrapped.batched_get(several))
    out["several_twice"] = [[o is None for o in first], [o is None for o in second],
                            [same(a, b) for a, b in zip(first[::2] + second[::2], [partial, full] * 2)],
                            same(first[3], chunk(CHUNK, 3)) and same(second[3], chunk(CHUNK, 3))]

    # Values that do not verify read as misses: flipped byte, truncated, another key's value, garbage.
    with StoreClient(conn.address) as c:
        good = c.get(key(1).to_string().encode())
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0x01
        for i, bad in ((11, flipped), (12, good[:-100]), (13, good), (14, b"not an LMCache chunk")):
            c.put(key(i).to_string().encode(), bad)
    out["bad_values"] = [run(wrapped.get(key(i))) is None for i in (11, 12, 13, 14)]
    out["removed"] = [wrapped.remove_sync(key(1)), run(wrapped.exists(key(1)))]

    # remote_url: crescent://... (LMCache's legacy path) is refused at start-up with a message.
    try:
        CreateConnector(f"crescent://{conn.address}", loop, cpu, config, meta)
        out["remote_url"] = "accepted"
    except IrrecoverableException as exc:
        out["remote_url"] = str(exc)

    # A store that goes away: every call is a miss, none raises.
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    gone = CrescentConnector(node.address, cpu, timeout_s=2.0)
    run(gone.put(key(1), full))
    node.stop(grace=0)
    out["store_gone"] = [run(gone.exists(key(1))), run(gone.get(key(1))), gone.batched_contains([key(1)]),
                         run(gone.put(key(2), full)), run(gone.ping()) != 0]
    run(gone.close())
    run(wrapped.close())
    loop.call_soon_threadsafe(loop.stop)
    return out


if __name__ == "__main__":
    mode, path = sys.argv[1:3]
    try:
        result = {"store": store, "load": load, "connector": connector}[mode]()
    finally:
        LMCacheEngineBuilder.destroy("crescent-test")  # its threads would keep the process alive
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
