"""Hugging Face transformers: save a ``DynamicCache`` prefix, rebuild one from the store.

    from kvstore.integrations.transformers import CacheStore

    kv = CacheStore("127.0.0.1:7400", model.config, chunk_tokens=256)
    out = model(ids, use_cache=True)                 # ids: [1, T]
    kv.save(ids[0], out.past_key_values)             # full chunks of the prompt
    ...
    hit = kv.load(ids[0])                            # in another process, later
    model.generate(ids, past_key_values=hit.cache, max_new_tokens=32)

Chunks use Crescent's key scheme and verified codec (docs/keys.md): a chunk is
``[layers, 2 (K,V), kv_heads, chunk_tokens, head_dim]``, the keys chain over
the token ids under a namespace of the model's fingerprint and a tenant salt.
``load`` returns the longest stored prefix that verifies, never the last token
(generation must compute at least one), and an empty cache when the store is
away or holds nothing: the caller then computes the whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.chunk import encode_chunk
from kvstore.integrations.storelink import ChunkRef, StoreLink, StoreLinkConfig
from kvstore.keys import ROOT_KEY, ModelFingerprint, Namespace, chunk_keys, make_namespace


@dataclass(frozen=True)
class LoadedPrefix:
    """A cache rebuilt from stored chunks."""

    cache: object
    """A ``transformers.DynamicCache`` holding ``num_tokens`` tokens (empty on a miss)."""
    num_tokens: int
    """Leading prompt tokens whose KV came from the store."""


def _token_array(input_ids: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be one sequence ([T] or [1, T]), got {tuple(input_ids.shape)}")
        return input_ids.cpu().numpy().astype(np.int64)
    return np.asarray(input_ids, dtype=np.int64)


class CacheStore:
    """Saves and loads ``DynamicCache`` prefixes of one model in a Crescent store.

    Args:
        store: ``host:port`` of a store node, or a ``StoreLink``.
        config: the model's ``PretrainedConfig`` (its text config is used).
        model_id: model identity in the namespace (default: ``config.name_or_path``).
            Processes share chunks only when it matches.
        chunk_tokens: tokens per chunk.
        dtype: KV dtype (default: the config's dtype, else float32).
        tenant_salt: isolates a tenant's chunks (None: shared).
    """

    def __init__(self, store: str | StoreLink, config, *, model_id: str | None = None, chunk_tokens: int = 256,
                 dtype: torch.dtype | None = None, tenant_salt: str | None = None) -> None:
        self.link = store if isinstance(store, StoreLink) else StoreLink(StoreLinkConfig(store))
        self.config = config
        text = config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        cfg_dtype = getattr(text, "dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        self.dtype = dtype or (cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32)
        self.chunk_tokens = chunk_tokens
        self.fingerprint = ModelFingerprint(
            model_id=model_id or config.name_or_path, dtype=str(self.dtype).removeprefix("torch."),
            num_layers=text.num_hidden_layers, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim, chunk_tokens=chunk_tokens)
        self.namespace: Namespace = make_namespace(self.fingerprint, tenant_salt)
        fp = self.fingerprint
        self.chunk_shape = (fp.num_layers, 2, fp.num_kv_heads, chunk_tokens, fp.head_dim)

    def _check_layers(self, cache) -> None:
        from transformers.cache_utils import DynamicLayer

        if len(cache.layers) != self.fingerprint.num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {self.fingerprint.num_layers}")
        for i, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(f"layer {i} is a {type(layer).__name__}: only full-attention DynamicLayer "
                                 "caches can be stored (sliding-window layers drop old tokens)")

    def save(self, input_ids: Sequence[int] | torch.Tensor, cache) -> int:
        """Stores every full chunk of ``input_ids`` that ``cache`` holds.

        Args:
            input_ids: ``[T]`` (or ``[1, T]``) token ids the cache was computed for.
            cache: a ``DynamicCache`` of batch 1 whose layers hold ``>= chunk_tokens`` tokens.

        Returns:
            Chunks stored (0 when the store is away).
        """
        self._check_layers(cache)
        ids = _token_array(input_ids)
        n_cached = cache.layers[0].keys.shape[-2]
        if cache.layers[0].keys.shape[0] != 1:
            raise ValueError("save one sequence at a time (batch size 1)")
        num = min(len(ids), n_cached) // self.chunk_tokens
        keys = chunk_keys(ids[: num * self.chunk_tokens], self.namespace, self.chunk_tokens)
        c, items = self.chunk_tokens, []
        for j, key in enumerate(keys):
            kv = torch.stack([torch.stack([layer.keys[0, :, j * c:(j + 1) * c], layer.values[0, :, j * c:(j + 1) * c]])
                              for layer in cache.layers]).to(device="cpu", dtype=self.dtype).contiguous()
            parent = keys[j - 1] if j else ROOT_KEY
            items.append((key, encode_chunk(kv, self.namespace, parent, ids[j * c:(j + 1) * c])))
        return self.link.save(items)

    def load(self, input_ids: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu") -> LoadedPrefix:
        """Rebuilds a ``DynamicCache`` for the longest stored prefix of ``input_ids``.

        The prefix ends on a chunk boundary before the last token. Chunks that are
        missing or fail verification end the prefix; nothing after them is used.
        """
        from transformers import DynamicCache

        ids = _token_array(input_ids)
        cache = DynamicCache(config=self.config)
        c = self.chunk_tokens
        n = max(0, len(ids) - 1) // c
        keys = chunk_keys(ids[: n * c], self.namespace, c)
        n = self.link.lookup(keys)
        refs = [ChunkRef(keys[j], keys[j - 1] if j else ROOT_KEY, ids[j * c:(j + 1) * c].astype(np.int32))
                for j in range(n)]
        payloads = self.link.fetch_prefix(refs, self.namespace, self.dtype, self.chunk_shape)
        if not payloads:
            return LoadedPrefix(cache, 0)
        kv = torch.cat(payloads, dim=3).to(device)  # [layers, 2, heads, tokens, head_dim]
        for layer in range(kv.shape[0]):
            cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        self._check_layers(cache)
        return LoadedPrefix(cache, len(payloads) * c)

    def close(self) -> None:
        self.link.close()
