"""vLLM with the Crescent connector on sliding-window models: real vLLM processes, a real store.

Two tiny random models, each run three times on one batch of greedy requests (a baseline without
the connector, process 1 saving, a fresh process 2 loading):
- every layer sliding-window (Mistral's, window 64): vLLM's cache group frees the blocks behind the
  window, so process 2 loads only the chunks the window reaches back to at each hit's end;
- sliding-window and full-attention layers in turn (Gemma 3's): vLLM keeps every block (its hybrid
  cache manager is off with a connector that does not declare ``SupportsHMA``), so every stored
  chunk loads.
Every run's tokens must equal its baseline's.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.helpers import StoreProcess, require_venv
from tests.integrations.test_vllm import CHUNK, _run
from tests.integrations.tiny_llama import build_tiny_sliding, random_prompt

WINDOW = 64
LENGTHS = [150, 260, 300, 200]
pytestmark = pytest.mark.timeout(1800)


def _requests() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt": random_prompt(rng, n), "cache_salt": None} for n in LENGTHS]


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def runs(request, tmp_path_factory):
    require_venv("vllm")
    kind = request.param
    tmp = str(tmp_path_factory.mktemp(f"vllm-{kind}"))
    model = build_tiny_sliding(os.path.join(tmp, "model"), kind, WINDOW)
    reqs = _requests()
    args = ("--model-id", f"crescent-tests/tiny-{kind}")
    res = {"kind": kind, "baseline": _run(tmp, "baseline", model, reqs, None, extra_args=args)}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "process1", model, reqs, store.address, extra_args=args)
        # (layer by layer: the landing writes only the blocks vLLM still holds)
        res["p2"] = _run(tmp, "process2", model, reqs, store.address, extra_args=args + ("--load-layerwise", "on"))
    finally:
        store.stop()
    return res


def _hit_chunks(n: int) -> int:
    return (n - 1) // CHUNK  # every loadable chunk is stored by process 1


def _window_chunks(n: int) -> int:
    """Chunks with a block the window still reaches when the hit ends (blocks of 32)."""
    end = _hit_chunks(n) * CHUNK
    freed_blocks = max(0, end - WINDOW + 1) // 32
    return _hit_chunks(n) - freed_blocks // (CHUNK // 32)


def test_same_tokens_and_the_loads_the_cache_layout_needs(runs):
    base = [o["token_ids"] for o in runs["baseline"]["outputs"]]
    for run in ("p1", "p2"):
        assert [o["token_ids"] for o in runs[run]["outputs"]] == base, run
    p2 = runs["p2"]
    # vLLM counts the whole hit as computed either way
    assert [o["num_cached_tokens"] for o in p2["outputs"]] == [_hit_chunks(n) * CHUNK for n in LENGTHS]
    assert runs["p1"]["stats"]["num_saved_chunks"] >= sum(_hit_chunks(n) for n in LENGTHS)
    per_request = _window_chunks if runs["kind"] == "mistral" else _hit_chunks
    assert p2["stats"]["num_loaded_chunks"] == sum(per_request(n) for n in LENGTHS)
    assert p2["stats"]["num_failed_chunks"] == 0 and p2["stats"]["num_layerwise_loads"] >= 1
    if runs["kind"] == "mistral":
        assert p2["stats"]["num_loaded_chunks"] < sum(_hit_chunks(n) for n in LENGTHS)
