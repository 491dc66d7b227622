"""What the vLLM benches share: their model, their prompts and how they run a vLLM process.

Each bench runs itself again under the vLLM venv's python (``make setup-vllm``) with ``--child``
for every vLLM process, so that each starts with an empty local cache, as another replica would.
"""

from __future__ import annotations

import argparse
import json
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


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every vLLM bench has: its children's (set by ``run_requests``, hidden from
    ``--help``), the random model's size and ``--write-docs``. The description: ``doc``'s first paragraph."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--requests", "--out", "--store"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=1024, help="the random model's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="the random model's layers")
    ap.add_argument("--write-docs", action="store_true", help="write the table and plot into docs/")
    return ap


def token_prompts(path: str) -> list[dict]:
    """A child's requests (``--requests``: lists of token ids) as vLLM prompts."""
    with open(path) as f:
        return [{"prompt_token_ids": ids} for ids in json.load(f)]


def warm_up(llm) -> None:
    """One tiny request first, so that no timed request pays vLLM's first-step costs."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)


def finish_child(args, result: dict) -> None:
    """Writes a child's ``result`` to ``--out``, with the worker connector's counters (``stats``,
    after its queued saves) when it ran with a store."""
    if args.store:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        conn.flush()
        result["stats"] = dict(vars(conn.worker_stats))
    with open(args.out, "w") as f:
        json.dump(result, f)


def assert_same(runs: dict, what: str = "tokens") -> None:
    """Every run (name -> its tokens, any JSON value) gave the same ``what``."""
    assert len({json.dumps(v) for v in runs.values()}) == 1, f"the runs gave different {what}: {runs}"


def barh_figure(bars: list[tuple[str, float]], colors: list[str], xlabel: str, title: str,
                figsize: tuple[float, float], fontsize: float | None = None):
    """A horizontal bar per (label, value), the first on top; returns the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    ax.barh([m for m, _ in bars][::-1], [s for _, s in bars][::-1], color=colors[:len(bars)][::-1])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=fontsize)
    fig.tight_layout()
    return fig
