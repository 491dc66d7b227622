"""`make demo`: `crescent up`, a multi-tenant workload with shared prefixes, a table and a plot.

The workload comes from the Mooncake FAST'25 synthetic trace (tests/data, with its source):
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
import shutil
import sys

from engine.serve.workload import TENANTS, UpCluster, load_workload, pct, run_workload
from kvstore import tls

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

    from engine.model_runner import load_model_config

    vocab = load_model_config(args.model).vocab_size
    work, source = load_workload(args.groups, args.per_group, args.block_tokens, args.max_output, vocab)
    data = os.path.abspath(args.data)
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(data)
    print(f"Starting `crescent up` ({args.model}) in the background; logs in {data}/logs", flush=True)
    cluster = UpCluster(args.model, ["--dram", "256MiB", "--disk-size", "2GiB"], data)
    try:
        cluster.start()
    except RuntimeError as exc:  # (it exited, or never served: its output)
        print(exc, file=sys.stderr)
        return 1
    try:
        state = cluster.state
        print(open(cluster.log_path).read().strip())
        print(f"\nWorkload: {len(work)} requests from the {source}, {args.groups} shared prefixes x "
              f"{args.per_group}, tenants {', '.join(TENANTS)}; "
              f"{sum(len(p) for _, p, _ in work)} prompt tokens\n", flush=True)
        results, wall = run_workload(cluster.url, args.model, work, args.concurrency)
        report(results, state, wall, data)
        showcase(cluster.url, args.model)
    finally:
        cluster.stop()
    print(f"cluster stopped (exit {cluster.returncode})")
    return 0


def report(results, state, wall, data) -> None:
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
            with tls.channel(addr) as ch:
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


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


def showcase(base_url: str, model: str) -> None:
    """The OpenAI API beyond plain text, on the same cluster: a JSON schema held by the grammar
    (a random model's output, valid all the same) and a tool call."""
    import openai

    c = openai.OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    try:
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=400, temperature=0.7, seed=1,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": SCHEMA}})
        text = r.choices[0].message.content
        print(f"\nstructured output (response_format: json_schema): {json.dumps(json.loads(text, strict=False))}")
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      max_tokens=200, temperature=0.7, seed=2, tools=[WEATHER],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0].function
        print(f"tool call (tool_choice: get_weather): {call.name}({json.dumps(json.loads(call.arguments))})")
    except openai.APIError as exc:  # (structured outputs need xgrammar: pip install 'crescent[structured]')
        print(f"\nstructured outputs and tool calls: not available here ({exc})")


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
