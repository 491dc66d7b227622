"""vLLM with the Crescent connector on a vision-language model: real vLLM processes, a real store.

An image's placeholder tokens are the same ids for every image; what they stand for is in the
image. The connector keys each chunk that holds placeholder tokens by the image's content hash too
(vLLM's ``MultiModalFeatureSpec.identifier``, docs/keys.md), so a chunk is reused only by a request
with the same image at the same place, while the text before the image is shared by every image.

Model: a tiny random Idefics3 (SmolVLM's architecture) built in code; each ``<image>`` becomes
``IMAGE_PLACEHOLDER`` (19) tokens. vLLM's own prefix cache is off in every run, so every reused
token comes from the store. Runs: a baseline without the connector; process 1 saves two requests;
process 2, a fresh vLLM, runs them and variants (another image, another question, two images, a
tenant salt). Every run's tokens must equal the baseline's.
"""

from __future__ import annotations

import os
import random

import pytest

from kvstore.client import StoreClient
from kvstore.keys import ModelFingerprint, chunk_keys, make_namespace
from tests.helpers import StoreProcess, require_venv
from tests.integrations.test_vllm import CHUNK, _run
from tests.integrations.tiny_llama import IMAGE_PLACEHOLDER, build_tiny_idefics3, random_prompt, word_ids

MODEL_ID = "crescent-tests/tiny-idefics3"
ARGS = ("--no-prefix-caching", "--model-id", MODEL_ID)
NAMESPACE = make_namespace(ModelFingerprint(MODEL_ID, "float32", num_layers=2, num_kv_heads=2, head_dim=64,
                                            chunk_tokens=CHUNK))
PREFIX = 100  # words before the image: chunk 0 is text only, chunk 1 holds the image (tokens 100..118)
pytestmark = pytest.mark.timeout(1800)

# request -> (image seeds, question, cache salt); A and B are two images
A, B = 1, 2
SAVED = ["a", "text"]


def _requests() -> dict[str, dict]:
    rng = random.Random(5)
    before, question = random_prompt(rng, PREFIX), random_prompt(rng, 100)
    other = " ".join(question.split()[:20] + random_prompt(rng, 80).split())  # same first 20 words
    one = f"{before} <image> {question}"
    return {
        "a": {"prompt": one, "images": [A]},
        "b": {"prompt": one, "images": [B]},  # another image, same words
        "a-other": {"prompt": f"{before} <image> {other}", "images": [A]},  # same image, another question
        "a+b": {"prompt": f"{before} <image> <image> {question}", "images": [A, B]},
        "text": {"prompt": f"{before} {question}"},  # no image
        "a-salted": {"prompt": one, "images": [A], "cache_salt": "tenant-x"},
    }


# Chunks (64 tokens) process 2 loads of each request, and why.
EXPECTED_CHUNKS = {
    "a": 3,  # all 3 loadable chunks of its 219 tokens
    "b": 1,  # the text before the image; chunk 1 holds image B's placeholders, stored with A's
    "a-other": 2,  # through chunk 1 (its 9 question tokens are the same), not chunk 2
    "a+b": 1,  # chunk 1 holds A's placeholders then B's: another chunk than a's
    "text": 3,  # saved as text by process 1
    "a-salted": 0,  # another tenant
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm-mm"))
    model = build_tiny_idefics3(os.path.join(tmp, "model"))
    reqs = _requests()
    names = list(reqs)
    res = {"names": names, "baseline": _run(tmp, "baseline", model, list(reqs.values()), None, extra_args=ARGS)}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "process1", model, [reqs[n] for n in SAVED], store.address, extra_args=ARGS)
        res["p2"] = _run(tmp, "process2", model, list(reqs.values()), store.address, extra_args=ARGS)
        ids = res["p1"]["outputs"][0]["prompt_token_ids"]
        with StoreClient(store.address) as c:
            res["plain_keys_held"] = c.lookup(chunk_keys(ids, NAMESPACE, CHUNK))
    finally:
        store.stop()
    return res


def _by_name(res: dict, run: str, names: list[str]) -> dict[str, dict]:
    return dict(zip(names, res[run]["outputs"]))


def test_images_change_the_answer(runs):
    """The check below can fail: the same words with another image give other tokens."""
    base = _by_name(runs, "baseline", runs["names"])
    assert base["a"]["token_ids"] != base["b"]["token_ids"]
    assert base["a"]["prompt_token_ids"] == base["b"]["prompt_token_ids"]  # the placeholders are the same ids
    a = base["a"]["prompt_token_ids"]
    assert len(a) == PREFIX + IMAGE_PLACEHOLDER + 100
    assert a[:PREFIX] == word_ids(_requests()["a"]["prompt"].split(" <image> ")[0])


def test_saved_then_loaded_by_a_fresh_vllm_with_the_same_tokens(runs):
    names = runs["names"]
    base = _by_name(runs, "baseline", names)
    p1 = _by_name(runs, "p1", SAVED)
    p2 = _by_name(runs, "p2", names)
    for name in SAVED:
        assert p1[name]["token_ids"] == base[name]["token_ids"], name
        assert p1[name]["num_cached_tokens"] == 0, name
    assert runs["p1"]["stats"]["num_saved_chunks"] >= 6  # 3 prompt chunks each
    for name in names:
        assert p2[name]["token_ids"] == base[name]["token_ids"], name
        assert p2[name]["num_cached_tokens"] == EXPECTED_CHUNKS[name] * CHUNK, name
    stats = runs["p2"]["stats"]
    assert stats["num_loaded_chunks"] == sum(EXPECTED_CHUNKS.values())
    assert stats["num_failed_chunks"] == 0


def test_an_image_chunk_is_not_stored_under_its_token_ids_alone(runs):
    """The store holds request a's first chunk (text) under the plain key, and its image chunk
    only under a key that names the image: a reader that keys by token ids alone misses it."""
    assert runs["plain_keys_held"] == 1
