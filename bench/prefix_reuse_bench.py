"""TTFT with 0%, 50% and 90% of a ~4k-token prompt cached in the store, against recompute.

One `random:medium` engine (fp32 on CPU) and a real `crescent store` process.
The engine first computes a 4096-token prompt and stores its chunks. Then, per
cached fraction, prompts made of the stored prefix plus fresh tokens are run
twice: once loading the prefix from the store, once recomputing everything
(store loads off), in the same process, alternating; the local prefix cache is
off so only the store can help. Reports median TTFT, the ratio to recompute
and the bytes moved from the store; writes a table and a PNG.

    python bench/prefix_reuse_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, median, publish, table  # noqa: E402


def log(msg: str) -> None:
    print(f"[prefix_reuse] {msg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:medium")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="random:small, 1024 tokens, 1 rep")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.model, args.prompt_tokens, args.reps = "random:small", 1024, 1

    from engine import LLM

    tmp = tempfile.mkdtemp(prefix="crescent-prefix-")
    store = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0",
                              "--dram", "2GiB"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    address = store.stdout.readline().split("listening on ")[1].split(",")[0]
    try:
        log(f"loading {args.model}")
        llm = LLM(args.model, store=address, chunk_tokens=args.chunk_tokens, chunk_size=512,
                  enable_prefix_caching=False, kv_cache_memory=2 << 30)
        conn = llm.engine.connector
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        n = args.prompt_tokens
        base = [rng.randrange(3, vocab) for _ in range(n)]
        log(f"computing and storing a {n}-token prompt")
        t0 = time.perf_counter()
        llm.generate([base], max_tokens=1)
        log(f"  done in {time.perf_counter() - t0:.1f}s; {conn.stats.chunks_saved} chunks stored "
            f"({conn.stats.bytes_saved / 2**20:.0f} MiB)")
        conn.save_enabled = False
        conn.load_enabled = False
        llm.generate([[rng.randrange(3, vocab) for _ in range(n)]], max_tokens=1)  # warm-up
        results = []
        for frac in (0.0, 0.5, 0.9):
            # NOTE: the cached prefix is whole chunks; the prompt's length is then
            # chosen so that the prefix is exactly `frac` of it (90%: 3584 of 3982).
            cached = round(frac * n / args.chunk_tokens) * args.chunk_tokens
            total = round(cached / frac) if frac else n
            ttft_store, ttft_recompute, moved, hits = [], [], [], []
            for rep in range(args.reps):
                prompt = base[:cached] + [rng.randrange(3, vocab) for _ in range(total - cached)]
                for mode in ("store", "recompute"):
                    conn.load_enabled = mode == "store"
                    before = conn.stats.bytes_loaded
                    out = llm.generate([prompt], max_tokens=1)[0]
                    (ttft_store if mode == "store" else ttft_recompute).append(out.ttft_s)
                    if mode == "store":
                        moved.append(conn.stats.bytes_loaded - before)
                        hits.append(out.num_cached_tokens)
                log(f"{frac:.0%} cached, rep {rep + 1}/{args.reps}: store {ttft_store[-1]:.2f}s, "
                    f"recompute {ttft_recompute[-1]:.2f}s, {hits[-1]} tokens from the store")
            s, r = median(ttft_store), median(ttft_recompute)
            results.append({"target": frac, "cached_tokens": hits[0], "fraction": hits[0] / total,
                            "prompt_tokens": total, "ttft_store": s,
                            "ttft_recompute": r, "ratio": s / r, "bytes": median(moved)})
        llm.close()
    finally:
        store.terminate()
        store.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [[f"{x['target']:.0%}", x["prompt_tokens"], f"{x['cached_tokens']} ({x['fraction']:.1%})",
             f"{x['ttft_recompute']:.2f}",
             f"{x['ttft_store']:.2f}", f"{x['ratio']:.2f}×", f"{x['bytes'] / 2**20:.0f} MiB"] for x in results]
    md = table(["cached (target)", "prompt tokens", "tokens from store", "TTFT recompute s", "TTFT with store s",
                "× recompute", "bytes from store"], rows)
    print()
    print(md)
    at90 = results[-1]
    summary = (f"at {at90['fraction']:.1%} cached, TTFT is {at90['ratio']:.2f}× recompute (target ≤ 0.20×)")
    print("\n" + summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["ttft_recompute"] for r in results], 0.4, label="recompute")
    ax.bar([x + 0.2 for x in xs], [r["ttft_store"] for r in results], 0.4, label="load prefix from store")
    ax.set_xticks(list(xs), [f"{r['fraction']:.0%} cached" for r in results])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{args.model}, {n}-token prompt, CPU fp32")
    ax.legend()
    fig.tight_layout()
    body = (f"`{args.model}` (8 layers, hidden 1024, GQA 8/2 heads of 128), fp32 on this 2-core CPU, "
            f"~{n}-token prompts, {args.chunk_tokens}-token chunks, chunked prefill of 512, store on loopback "
            f"(TCP data channel), median of {args.reps}.\n\n{md}\n\n**{summary}.**")
    publish(fig, "prefix_reuse", body, args.write_docs)


if __name__ == "__main__":
    main()
