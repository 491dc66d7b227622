"""Engine exactness on CPU (fp32): chunked prefill, store reuse across processes, corruption, tenants."""

import json
import subprocess
import sys

import pytest

from engine import LLM
from kvstore.client import StoreClient
from tests.helpers import ROOT, StoreProcess

GEN = {"max_tokens": 12, "ignore_eos": True}


def _prompt(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(0, 500) for _ in range(n)]


SHARED = _prompt(0, 300)  # a 300-token shared prefix: four 64-token chunks + a tail
PROMPTS = [SHARED + _prompt(1, 70), SHARED + _prompt(2, 33), _prompt(3, 150)]


def run_engine(**args) -> dict:
    """One engine in a fresh process (real process: nothing shared but the store)."""
    args.setdefault("model", "random:tiny")
    args.setdefault("dtype", "float32")
    args.setdefault("chunk_tokens", 64)
    args.setdefault("generate", GEN)
    r = subprocess.run([sys.executable, "-m", "tests.engine.worker", json.dumps(args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def tokens(res: dict) -> list[list[int]]:
    return [o["token_ids"] for o in res["outputs"]]


@pytest.fixture(scope="module")
def reference():
    """Store-less, one-shot prefill (chunk_size larger than any prompt)."""
    with LLM("random:tiny", dtype="float32", chunk_size=4096, chunk_tokens=64) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, **GEN)]


@pytest.mark.parametrize("chunk_size", [1, 16, 45, 64, 256])
def test_chunked_prefill_equals_one_shot(reference, chunk_size):
    with LLM("random:tiny", dtype="float32", chunk_size=chunk_size, chunk_tokens=64,
             max_num_batched_tokens=max(64, chunk_size)) as llm:
        outs = llm.generate(PROMPTS, **GEN)
    assert [o.token_ids for o in outs] == reference


def test_local_prefix_cache_shares_pages_and_keeps_tokens(reference):
    with LLM("random:tiny", dtype="float32", chunk_tokens=64) as llm:
        first = llm.generate(PROMPTS[:1], **GEN)[0]
        second = llm.generate(PROMPTS, **GEN)
    assert first.token_ids == reference[0]
    assert [o.token_ids for o in second] == reference
    assert second[0].num_local_cached_tokens == 368  # every full page but the last token's
    assert second[1].num_local_cached_tokens == 288  # the shared prefix's full pages
    assert second[2].num_local_cached_tokens == 0


@pytest.fixture
def store(tmp_path):
    proc = StoreProcess("--dram", "256MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "256MiB")
    yield proc
    proc.stop()


def test_second_process_reuses_the_store_exactly(store, reference):
    first = run_engine(store=store.address, prompts=PROMPTS)
    assert tokens(first) == reference
    # 370 tokens → 5 chunks, 333 → 5 (4 shared with the first, computed side by side), 150 → 2
    assert first["stats"]["chunks_saved"] == 5 + 5 + 2
    second = run_engine(store=store.address, prompts=PROMPTS)
    assert tokens(second) == reference
    assert [o["num_cached_tokens"] for o in second["outputs"]] == [320, 320, 128]
    assert second["stats"]["chunks_loaded"] == 5 + 5 + 2


def test_corrupted_chunk_is_detected_and_recomputed(store, reference):
    run_engine(store=store.address, prompts=PROMPTS[:1])
    # the keys, recomputed independently from the documented scheme
    from engine.config import EngineConfig
    from engine.llm_engine import model_identity
    from kvstore.keys import ModelFingerprint, chunk_keys, make_namespace

    fp = ModelFingerprint(model_identity(EngineConfig(model="random:tiny")), "float32", 2, 2, 16, 64)
    keys = chunk_keys(PROMPTS[0], make_namespace(fp), 64)
    c = StoreClient(store.address)
    assert c.lookup(keys) == 5
    bad = bytearray(c.get(keys[2]))
    bad[-7] ^= 0x40  # one bit of the payload
    c.put(keys[2], bad)
    res = run_engine(store=store.address, prompts=PROMPTS[:1])
    assert tokens(res) == reference[:1]
    assert res["outputs"][0]["num_cached_tokens"] == 128  # chunks 0 and 1; 2 failed verification
    assert res["stats"]["load_failures"] == 1
    # the recomputed chunk replaced the corrupt one
    c.close()
    again = run_engine(store=store.address, prompts=PROMPTS[:1])
    assert again["outputs"][0]["num_cached_tokens"] == 320 and tokens(again) == reference[:1]


def test_tenants_with_salts_never_share_without_salt_they_do(store, reference):
    run_engine(store=store.address, prompts=PROMPTS[:1], tenant_salt="alice")
    bob = run_engine(store=store.address, prompts=PROMPTS[:1], tenant_salt="bob")
    assert bob["outputs"][0]["num_cached_tokens"] == 0
    alice = run_engine(store=store.address, prompts=PROMPTS[:1], tenant_salt="alice")
    assert alice["outputs"][0]["num_cached_tokens"] == 320
    shared1 = run_engine(store=store.address, prompts=PROMPTS[:1])
    assert shared1["outputs"][0]["num_cached_tokens"] == 0  # no salt: its own namespace, first time
    shared2 = run_engine(store=store.address, prompts=PROMPTS[:1])
    assert shared2["outputs"][0]["num_cached_tokens"] == 320
    for r in (bob, alice, shared1, shared2):
        assert tokens(r) == reference[:1]


def test_store_down_is_a_miss_not_a_failure(reference):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_engine(store=f"127.0.0.1:{port}", prompts=PROMPTS[:1])
    assert tokens(res) == reference[:1]
    assert res["outputs"][0]["num_cached_tokens"] == 0
    assert res["stats"]["store_errors"] >= 1
