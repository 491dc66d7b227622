"""`make demo`: `crescent up`, a multi-tenant workload with shared prefixes, a table and a plot.

The workload comes from the Mooncake FAST'25 synthetic trace (../shared/traces):
requests whose prompts share long prefixes (the same document, the next turn
of a conversation), 4 per prefix, spread over four tenants so the store's
cross-tenant reuse shows. Each 512-token trace block becomes ``--block-tokens``
deterministic tokens (scaled to this machine), outputs are capped. Requests go
through the official `openai` client, streaming, a few at a time, in trace
order. Without the trace file, a built-in workload of the same shape is used.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
TENANTS = ["acme", "globex", "initech", "umbrella"]


def load_workload(num_groups: int, per_group: int, block_tokens: int, max_output: int, vocab: int):
    """``[(tenant, prompt token ids, max_tokens)]`` in trace order."""
    if os.path.exists(TRACE):
        rows = [json.loads(line) for line in open(TRACE)]
        source = "Mooncake synthetic trace"
    else:  # built in: groups of requests over shared random "documents"
        rng = random.Random(0)
        rows = []
        for g in range(num_groups):
            doc = [10_000 * g + i for i in range(rng.randrange(20, 60))]
            for k in range(per_group):
                extra = [10_000 * g + 5000 + 100 * k + i for i in range(rng.randrange(1, 4))]
                rows.append({"timestamp": g * 10 + k, "hash_ids": doc + extra,
                             "input_length": 512 * len(doc + extra), "output_length": rng.randrange(8, 64)})
        source = "built-in workload (trace not found)"
    groups = collections.defaultdict(list)
    for i, r in enumerate(rows):
        groups[r["hash_ids"][0]].append(i)
    big = sorted(groups.values(), key=len, reverse=True)[:num_groups]
    picked = sorted(i for g in big for i in g[:per_group])
    out = []
    for n, i in enumerate(picked):
        r = rows[i]
        toks = []
        for h in r["hash_ids"]:
            rng = random.Random(h)
            toks += [rng.randrange(3, vocab) for _ in range(block_tokens)]
        length = max(1, r["input_length"] * block_tokens // 512)
        out.append((TENANTS[n % len(TENANTS)], toks[:length], max(1, min(r["output_length"], max_output))))
    return out, source


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:small")
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--data", default="crescent-data/demo")
    args = ap.parse_args()

    import openai
    from tqdm import tqdm

    from engine.model_runner import load_model_config

    vocab = load_model_config(args.model).vocab_size
    work, source = load_workload(args.groups, args.per_group, args.block_tokens, args.max_output, vocab)
    data = os.path.abspath(args.data)
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(data)
    print(f"Starting `crescent up` ({args.model}) in the background; logs in {data}/logs", flush=True)
    up_log = open(os.path.join(data, "up.out"), "w")
    up = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "up", "--data", data, "--model", args.model,
                           "--store-port", "0", "--prefill-port", "0", "--decode-port", "0", "--gateway-port", "0",
                           "--dram", "256MiB", "--disk-size", "2GiB"], cwd=ROOT, stdout=up_log,
                          stderr=subprocess.STDOUT)
    try:
        state_path = os.path.join(data, "up.json")
        deadline = time.monotonic() + 300
        while not os.path.exists(state_path):
            if up.poll() is not None or time.monotonic() > deadline:
                print(open(os.path.join(data, "up.out")).read(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        state = json.load(open(state_path))
        print(open(os.path.join(data, "up.out")).read().strip())
        client = openai.OpenAI(base_url=state["openai_base_url"], api_key="demo", timeout=600, max_retries=0)
        print(f"\nWorkload: {len(work)} requests from the {source}, {args.groups} shared prefixes x "
              f"{args.per_group}, tenants {', '.join(TENANTS)}; "
              f"{sum(len(p) for _, p, _ in work)} prompt tokens\n", flush=True)
        results = [None] * len(work)
        bar = tqdm(total=len(work), desc="requests", unit="req")
        lock = threading.Lock()
        next_i = iter(range(len(work)))

        def worker():
            while True:
                with lock:
                    i = next(next_i, None)
                if i is None:
                    return
                tenant, prompt, max_tokens = work[i]
                t0 = time.perf_counter()
                first, last, gaps, cached, n = None, None, [], 0, 0
                stream = client.completions.create(model=args.model, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True, user=tenant,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                for ch in stream:
                    now = time.perf_counter()
                    if ch.usage is not None:
                        cached = ch.usage.prompt_tokens_details.cached_tokens
                        n = ch.usage.completion_tokens
                    if ch.choices:  # a token arrived (its text may be held back mid-character)
                        if first is None:
                            first = now - t0
                        elif last is not None:
                            gaps.append(now - last)
                        last = now
                results[i] = {"tenant": tenant, "prompt": len(prompt), "cached": cached, "ttft": first or 0.0,
                              "itl": gaps, "tokens": n, "start": t0}
                bar.update(1)

        t_start = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bar.close()
        wall = time.perf_counter() - t_start
        report(results, state, wall, data)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
        up_log.close()
    print(f"cluster stopped (exit {up.returncode})")
    return 0


def report(results, state, wall, data) -> None:
    import grpc

    from kvstore.client import StoreClient
    from proto.crescent.v1 import engine_pb2, engine_pb2_grpc

    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    print(f"\n{'metric':<28}{'p50':>10}{'p99':>10}")
    print(f"{'TTFT (s)':<28}{pct(ttft, 50):>10.3f}{pct(ttft, 99):>10.3f}")
    print(f"{'ITL (ms)':<28}{1e3 * pct(itl, 50):>10.1f}{1e3 * pct(itl, 99):>10.1f}")
    print(f"\ncached-token ratio          {cached / prompt:.1%}  ({cached} of {prompt} prompt tokens not recomputed)")
    by_tenant = collections.defaultdict(lambda: [0, 0])
    for r in results:
        by_tenant[r["tenant"]][0] += r["cached"]
        by_tenant[r["tenant"]][1] += r["prompt"]
    print("  by tenant: " + ", ".join(f"{t} {c / p:.0%}" for t, (c, p) in by_tenant.items()))
    print(f"throughput                  {len(results) / wall:.2f} req/s, "
          f"{sum(r['tokens'] for r in results) / wall:.1f} output tok/s over {wall:.1f}s")
    engines = {}
    for role in ("prefill", "decode"):
        addr = state.get(f"{role}_engine")
        if addr:
            with grpc.insecure_channel(addr) as ch:
                engines[role] = engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=30)
    mib = 1 / 2**20
    print("\nbytes moved")
    if "prefill" in engines:
        print(f"  prefill engine -> store    {engines['prefill'].bytes_saved * mib:9.1f} MiB "
              f"({engines['prefill'].chunks_saved} chunks saved)")
    if "decode" in engines:
        print(f"  store -> decode engine     {engines['decode'].bytes_loaded * mib:9.1f} MiB "
              f"({engines['decode'].chunks_loaded} chunks loaded)")
        if "prefill" in engines:
            print(f"  store -> prefill engine    {engines['prefill'].bytes_loaded * mib:9.1f} MiB "
                  f"({engines['prefill'].chunks_loaded} chunks loaded)")
    if state.get("store"):
        with StoreClient(state["store"]) as sc:
            st = sc.stats()
        for tier, t in st["tiers"].items():
            print(f"  store {tier:<5} tier         {t['used_bytes'] * mib:9.1f} MiB held, {t['num_entries']} chunks, "
                  f"{t['hits']} hits, {t['evictions']} evictions")
        print(f"  demotions {st['demotions']}, promotions {st['promotions']}, misses {st['misses']}")
    plot(results, os.path.join(data, "demo.png"))


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    order = sorted(range(len(results)), key=lambda i: results[i]["start"])
    ratio = [results[i]["cached"] / results[i]["prompt"] for i in order]
    sc = a.scatter(range(len(order)), [results[i]["ttft"] for i in order], c=ratio, cmap="viridis", vmin=0, vmax=1)
    a.set_xlabel("request (arrival order)")
    a.set_ylabel("TTFT (s)")
    a.set_title("TTFT per request, colored by cached fraction")
    fig.colorbar(sc, ax=a, label="cached prompt fraction")
    for name, xs in (("TTFT", [r["ttft"] for r in results]), ("ITL", [g for r in results for g in r["itl"]])):
        xs = sorted(xs)
        if xs:
            b.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    b.set_xscale("log")
    b.set_xlabel("seconds")
    b.set_ylabel("CDF")
    b.set_title("latency CDFs")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    sys.exit(main())
