"""Crescent for other serving stacks.

- ``kvstore.integrations.vllm``: a vLLM v1 KV connector (``CrescentConnector``).
- ``kvstore.integrations.transformers``: save a Hugging Face ``DynamicCache``
  prefix to the store and rebuild one from stored chunks.
- ``kvstore.integrations.sglang``: SGLang's HiCache L3 storage backend
  (``CrescentHiCacheStorage``, loaded by SGLang's dynamic backend mechanism).
- ``kvstore.integrations.lmcache``: an LMCache remote storage plugin
  (``CrescentConnectorAdapter``).

The first two speak the same chunk format (docs/keys.md) through ``storelink.StoreLink``,
which turns every store fault into a miss: a serving stack that uses Crescent
recomputes when the store is away, it never fails a request or uses wrong KV.
"""
