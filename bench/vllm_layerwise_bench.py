"""Layer-wise loads in vLLM: a request's stored prefix written into vLLM's blocks a layer at a time,
beside the forward that computes the rest of its prompt, against every layer before the forward.

A vLLM process with the connector stores ``--requests`` prompts of ``--prefix-tokens`` tokens.
Fresh vLLM processes (empty local caches, as another replica's) then serve each prompt followed by
``--suffix-tokens`` new ones, one request at a time, each timed to its first token: with the
connector writing loads layer by layer (``load_layerwise`` on: each attention layer waits for
its own layer only), with every layer written before the forward (``load_layerwise`` off, what
``auto`` does on a CPU), and with no connector (the whole prompt recomputed). Loading processes save nothing, so
each finds exactly what the first stored. The three must give the same first tokens.

vLLM runs in its own venv (``make setup-vllm``), single process on CPU, on a random Llama built in
the run. On a CPU the lander is a thread beside vLLM's, on the same cores; on a GPU the copies
run on a transfer stream (the GPU machine has no vLLM: ``bench/gpu_check.sh`` measures the
worker's layer-wise path there with ``bench/vllm_worker_load_bench.py --device cuda``).

    .venv/bin/python bench/vllm_layerwise_bench.py [--num-requests 16] [--suffix-tokens 256,32] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (assert_same, bench_parser, build_model, finish_child, make_llm,  # noqa: E402
                                run_requests, token_prompts, warm_up, word_prompts)

MODES = {"layer by layer (load_layerwise on)": {"load_layerwise": "on"},
         "every layer before the forward (off)": {"load_layerwise": "off"}}


def child(args) -> None:
    """One vLLM process (the vLLM venv's python): each request on its own, timed to its first token."""
    from vllm import SamplingParams

    extra = json.loads(args.extra)
    llm = make_llm(args.model, args.store, args.max_model_len, **extra)
    prompts = token_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    warm_up(llm)
    times, outputs = [], []
    for p in prompts:
        t0 = time.perf_counter()
        (out,) = llm.generate([p], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        outputs.append({"token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens})
    finish_child(args, {"times": times, "outputs": outputs})


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=3072)
    ap.add_argument("--suffix-tokens", default="256,32", help="new tokens after the prefix; several: one run each")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from tests.helpers import StoreProcess, require_venv

    require_venv("vllm")
    suffixes = [int(x) for x in args.suffix_tokens.split(",")]
    max_len = args.prefix_tokens + max(suffixes) + 64
    tmp = tempfile.mkdtemp(prefix="crescent-layerwise-")
    model = build_model(tmp, args.hidden, args.layers, max_positions=max_len)
    rng = random.Random(0)
    prefixes = word_prompts(rng, args.num_requests, args.prefix_tokens)
    common = ["--model", model, "--max-model-len", str(max_len)]

    def run(name: str, reqs, store, extra: dict) -> dict:
        result, _ = run_requests(__file__, tmp, name, reqs, common + ["--extra", json.dumps(extra)], store)
        print(f" median {statistics.median(result['times']) * 1e3:.0f} ms", flush=True)
        return result

    runs: dict[int, dict[str, dict]] = {n: {} for n in suffixes}
    prompts = {n: [p + s for p, s in zip(prefixes, word_prompts(rng, args.num_requests, n))] for n in suffixes}
    store = StoreProcess("--dram", "4GiB")
    try:
        print("storing the prefixes:", flush=True)
        run("store", prefixes, store.address, {})
        for n in suffixes:
            for mode, extra in MODES.items():
                print(f"+{n} tokens, {mode}:", flush=True)
                runs[n][mode] = run(f"{mode.split()[0]}-{n}", prompts[n], store.address, dict(extra, save=False))
    finally:
        store.stop()
    for n in suffixes:
        print(f"+{n} tokens, no connector:", flush=True)
        runs[n]["no connector (recompute)"] = run(f"recompute-{n}", prompts[n], None, {})

    rows = []
    for n in suffixes:
        assert_same({m: [o["token_ids"] for o in r["outputs"]] for m, r in runs[n].items()}, "first tokens")
        lw = runs[n]["layer by layer (load_layerwise on)"]["stats"]
        assert lw["num_layerwise_loads"] == args.num_requests, lw
        assert runs[n]["every layer before the forward (off)"]["stats"]["num_layerwise_loads"] == 0
        base = statistics.median(runs[n]["no connector (recompute)"]["times"])
        off = statistics.median(runs[n]["every layer before the forward (off)"]["times"])
        for mode, r in runs[n].items():
            cached = statistics.median(o["num_cached_tokens"] for o in r["outputs"])
            med = statistics.median(r["times"])
            rows.append([f"+{n}", mode, f"{cached:.0f}", f"{med * 1e3:.0f}", f"{min(r['times']) * 1e3:.0f}",
                         f"{max(r['times']) * 1e3:.0f}", f"{med / off:.3f}x", f"{med / base:.3f}x"])
    text = table(["new tokens", "each request's first token", "tokens loaded", "median ms", "min ms", "max ms",
                  "time vs off", "time vs recompute"], rows)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(suffixes), figsize=(4.5 * len(suffixes), 3), squeeze=False)
    for ax, n in zip(axes[0], suffixes):
        names = [m for m in runs[n] if "recompute" not in m]
        ax.bar(range(len(names)), [statistics.median(runs[n][m]["times"]) * 1e3 for m in names],
               color=["#2ca02c", "#1f77b4"])
        ax.set_xticks(range(len(names)), ["layer by layer", "every layer first"])
        ax.set_ylabel("ms to first token (median)")
        ax.set_title(f"{args.prefix_tokens} stored + {n} new tokens")
    fig.suptitle(f"vLLM + Crescent on a CPU, {args.layers} layers x {args.hidden}, {args.num_requests} requests")
    fig.tight_layout()
    kv_mib = args.prefix_tokens * args.layers * 2 * max(1, args.hidden // 256) * 64 * 4 / 2**20
    body = (f"vLLM (CPU, 2 cores, float32, a random Llama of {args.layers} layers x {args.hidden}) serving "
            f"{args.num_requests} requests one at a time, each a {args.prefix_tokens}-token prefix another process "
            f"stored ({kv_mib:.0f} MiB of KV each) followed by {' or '.join(map(str, suffixes))} new tokens, timed to "
            f"the first token: the connector writing the loaded layers beside the forward (`load_layerwise` on) "
            f"or every layer before it (off, `auto` on a CPU), and no connector. Fresh processes, the same "
            f"prompts, the same first tokens in all three. Command: "
            f"`.venv/bin/python bench/vllm_layerwise_bench.py --write-docs`.\n\n{text}\n")
    publish(fig, "vllm_layerwise", body, args.write_docs)


if __name__ == "__main__":
    main()
