"""Serving: monolithic (unchunked), monolithic with chunked prefill, and disaggregated with the store.

One run, one workload (shared-prefix requests from the Mooncake synthetic
trace, scaled to this machine), three clusters started with `crescent up` one
after another: ``--mode mono --no-store --chunk-size 16384`` (a prompt is
prefilled in one step and stalls every running decode), ``--mode mono
--no-store --chunk-size 512`` (Sarathi-style chunked prefill), and
``--mode disagg`` (prefill engine + decode engine + store). Reports TTFT and
ITL p50/p99 per configuration; writes a table and a PNG.

    python bench/serving_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import publish, table  # noqa: E402
from engine.serve.workload import UpCluster, load_workload, pct, run_workload  # noqa: E402

CONFIGS = [
    ("monolithic, unchunked", ["--mode", "mono", "--no-store", "--chunk-size", "16384"]),
    ("monolithic, chunked prefill", ["--mode", "mono", "--no-store", "--chunk-size", "512"]),
    ("disaggregated + store", ["--mode", "disagg", "--chunk-size", "512"]),
]


def log(msg: str) -> None:
    print(f"[serving_bench] {msg}", flush=True)


def run_config(name: str, extra: list[str], model: str, work, concurrency: int) -> dict:
    with UpCluster(model, ["--dram", "512MiB", *extra]) as cluster:
        url = cluster.url
        import random

        rng = random.Random(12345)  # warm-up on prompts that share nothing with the workload
        warm = [("warmup", [rng.randrange(3, 200) for _ in range(300)], 4) for _ in range(4)]
        run_workload(url, model, warm, 2, progress=False)
        log(f"{name}: {len(work)} requests")
        results, wall = run_workload(url, model, work, concurrency)
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    return {"name": name, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50),
            "itl_p99": pct(itl, 99), "itl_max": max(itl) if itl else float("nan"),
            "cached": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
            "wall": wall, "ttft": ttft, "itl": itl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:small")
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.per_group, args.block_tokens, args.max_output = 4, 3, 16, 16
    from engine.model_runner import load_model_config

    vocab = load_model_config(args.model).vocab_size
    work, source = load_workload(args.groups, args.per_group, args.block_tokens, args.max_output, vocab)
    log(f"workload: {len(work)} requests from the {source}, {sum(len(p) for _, p, _ in work)} prompt tokens, "
        f"concurrency {args.concurrency}")
    results = [run_config(name, extra, args.model, work, args.concurrency) for name, extra in CONFIGS]
    rows = [[r["name"], f"{r['ttft_p50']:.3f}", f"{r['ttft_p99']:.3f}", f"{1e3 * r['itl_p50']:.1f}",
             f"{1e3 * r['itl_p99']:.1f}", f"{1e3 * r['itl_max']:.0f}", f"{r['cached']:.0%}", f"{r['wall']:.1f}"]
            for r in results]
    md = table(["configuration", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "ITL max ms",
                "cached tokens", "wall s"], rows)
    print()
    print(md)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "itl", "inter-token latency (s)")):
        for r in results:
            xs = sorted(r[key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["name"])
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.legend(fontsize=8)
    fig.suptitle(f"{args.model} on {os.cpu_count()} CPU cores, {len(work)} requests, concurrency {args.concurrency}")
    fig.tight_layout()
    body = (f"`{args.model}`, {len(work)} streaming requests ({source}: {args.groups} shared prefixes × "
            f"{args.per_group}, {args.block_tokens} tokens per 512-token block, outputs ≤ {args.max_output}), "
            f"concurrency {args.concurrency}, all processes on this {os.cpu_count()}-core machine.\n\n{md}")
    publish(fig, "serving_bench", body, args.write_docs)


if __name__ == "__main__":
    main()
