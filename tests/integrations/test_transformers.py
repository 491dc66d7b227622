"""transformers: generation with a DynamicCache rebuilt from the store equals a cold run."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.client import StoreClient
from kvstore.integrations.transformers import CacheStore
from tests.helpers import StoreProcess
from tests.integrations.tiny_llama import build_tiny_llama, random_prompt, word_ids

transformers = pytest.importorskip("transformers")

CHUNK = 32
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def store():
    proc = StoreProcess("--dram", "64MiB")
    yield proc
    proc.stop()


def _generate(model, ids: torch.Tensor, cache=None) -> list[int]:
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_rebuilt_dynamic_cache_generates_like_a_cold_run(model_dir, store):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompt = torch.tensor([word_ids(random_prompt(rng, 150))])  # 4 full chunks of 32 + 22 tokens
    other = torch.tensor([word_ids(random_prompt(rng, 90))])

    with torch.no_grad():
        cold = _generate(model, prompt)
        cold_other = _generate(model, other)
        writer = CacheStore(store.address, model.config, chunk_tokens=CHUNK)
        past = model(prompt, use_cache=True).past_key_values
        assert writer.save(prompt, past) == 150 // CHUNK

        # A fresh helper, as another process would use it.
        reader = CacheStore(store.address, model.config, chunk_tokens=CHUNK)
        hit = reader.load(prompt)
        assert hit.num_tokens == 4 * CHUNK
        for layer, ref in zip(hit.cache.layers, past.layers):
            assert torch.equal(layer.keys, ref.keys[:, :, :hit.num_tokens])
            assert torch.equal(layer.values, ref.values[:, :, :hit.num_tokens])
        assert _generate(model, prompt, hit.cache) == cold

        # Another prompt, another tenant: nothing to load, generation is cold.
        assert reader.load(other).num_tokens == 0
        salted = CacheStore(store.address, model.config, chunk_tokens=CHUNK, tenant_salt="tenant-b")
        assert salted.load(prompt).num_tokens == 0
        assert _generate(model, other, reader.load(other).cache) == cold_other

        # A corrupt second chunk ends the prefix after the first one.
        keys = reader_keys(reader, prompt)
        with StoreClient(store.address) as c:
            raw = bytearray(c.get(keys[1]))
            raw[-1] ^= 0xFF
            c.put(keys[1], raw)
        hit = reader.load(prompt)
        assert hit.num_tokens == CHUNK and reader.link.num_rejected == 1
        assert _generate(model, prompt, hit.cache) == cold

    # The store away: an empty cache, and generation is still exact.
    store.stop()
    away = CacheStore(store.address, model.config, chunk_tokens=CHUNK)
    with torch.no_grad():
        hit = away.load(prompt)
        assert hit.num_tokens == 0 and away.link.num_faults >= 1
        assert _generate(model, prompt, hit.cache) == cold


def reader_keys(kv: CacheStore, ids: torch.Tensor):
    from kvstore.keys import chunk_keys

    return chunk_keys(ids[0].numpy(), kv.namespace, kv.chunk_tokens)
