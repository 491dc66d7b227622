"""What the vLLM benches share: their model, their prompts and how they run a vLLM process.

Each bench runs itself again under the vLLM venv's python (``make setup-vllm``) with ``--child``
for every vLLM process, so that each starts with an empty local cache, as another replica would.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK_TOKENS = 64
VLLM_ENV = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
"""Single-process vLLM on CPU, 4 GiB of KV cache, nothing downloaded."""


def build_model(tmp: str, hidden: int, layers: int, max_positions: int) -> str:
    """A random Llama in ``tmp/model`` (word-level tokenizer): heads of 64, a KV head per 4."""
    from tests.integrations.tiny_llama import build_tiny_llama

    return build_tiny_llama(os.path.join(tmp, "model"), hidden=hidden, layers=layers, heads=hidden // 64,
                            kv_heads=max(1, hidden // 256), intermediate=hidden * 11 // 4,
                            max_positions=max_positions)


def word_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random words of the model's vocabulary (no special tokens)."""
    from tests.integrations.tiny_llama import NUM_WORDS, SPECIALS

    return [[rng.randrange(len(SPECIALS), len(SPECIALS) + NUM_WORDS) for _ in range(length)] for _ in range(n)]


def run_child(script: str, name: str, log: str, args: list[str]) -> float:
    """Runs ``script --child ARGS`` under the vLLM venv's python, its output into ``log``; exits
    the bench with the log's name if it fails. Returns its wall seconds."""
    from tests.helpers import venv_python

    print(f"  {name} ...", end="", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        rc = subprocess.run([venv_python("vllm"), os.path.abspath(script), "--child"] + args, cwd=ROOT,
                            env=dict(os.environ, **VLLM_ENV), stdout=logf, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    if rc != 0:
        sys.exit(f"vLLM {name} exited with {rc}; see {log}")
    return time.perf_counter() - t0


def run_requests(script: str, tmp: str, name: str, requests, args: list[str],
                 store: str | None) -> tuple[dict, float]:
    """One child of ``script`` on ``requests`` (written to ``tmp/NAME.requests.json``): ``args`` plus
    ``--requests``, ``--out`` and ``--store`` (when given). Returns its JSON result and wall seconds."""
    import json

    req, out, log = (os.path.join(tmp, f"{name}.{x}") for x in ("requests.json", "out.json", "log"))
    with open(req, "w") as f:
        json.dump(requests, f)
    seconds = run_child(script, name, log, args + ["--requests", req, "--out", out]
                        + (["--store", store] if store else []))
    with open(out) as f:
        return json.load(f), seconds


def make_llm(model: str, store: str | None, max_model_len: int, kv_cache_dtype: str = "auto",
             engine: dict | None = None, **extra):
    """A child's vLLM (float32, blocks of 32, eager), with the Crescent connector when ``store`` is
    given (chunks of ``CHUNK_TOKENS``; ``extra``: more of its ``kv_connector_extra_config``;
    ``engine``: more of vLLM's engine arguments)."""
    from vllm import LLM

    from kvstore.integrations.vllm import kv_transfer_config

    kw = {"kv_transfer_config": kv_transfer_config(store, chunk_tokens=CHUNK_TOKENS, timeout_s=60.0, **extra)} \
        if store else {}
    return LLM(model=model, tokenizer=model, dtype="float32", block_size=32, enforce_eager=True,
               max_model_len=max_model_len, max_num_seqs=64, max_num_batched_tokens=8192, seed=0,
               kv_cache_dtype=kv_cache_dtype, **kw, **(engine or {}))
