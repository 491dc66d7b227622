"""Speculative decoding on the engine: tokens/s and inter-token latency with and without it, acceptance.

Same engine, same requests, same run: plain decoding (the baseline) against n-gram drafting at K = 1,
2, 4, 8 drafted tokens per step, greedy, on two workloads:

- copy-heavy: prompts built from the shared Mooncake trace (tests/data/synthetic_trace.jsonl): each
  request's context is its trace blocks (16 random tokens per hash id, so requests that share hash ids
  share text), then one of those blocks quoted again, as a RAG question quoting its passage does;
- free: prompts of random tokens of the same lengths.

Requests run ``--concurrency`` at a time through ``LLMEngine.step`` (continuous batching); ITL is the
gap between a request's successive tokens as the step loop emits them (tokens accepted in one step
share its time). Every speculative run's tokens are checked against the baseline's (greedy: they must
be the same). A random model copies only what its own dynamics repeat, so acceptance here says what the
drafter and the verification cost; on a trained model copy-heavy tasks accept more.

    .venv/bin/python bench/spec_decode_bench.py [--model random:small] [--requests 16] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, pct, publish, table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                     "synthetic_trace.jsonl")
BLOCK = 16


def workloads(n: int, vocab: int, max_blocks: int = 8) -> dict[str, list[list[int]]]:
    rows = [json.loads(line) for line in open(TRACE)][:n]
    rng = random.Random(0)
    copy, free = [], []
    for r in rows:
        blocks = []
        for h in r["hash_ids"][:max_blocks]:
            g = random.Random(h)
            blocks.append([g.randrange(3, vocab) for _ in range(BLOCK)])
        ctx = [t for b in blocks for t in b]
        prompt = ctx + blocks[rng.randrange(len(blocks))]
        copy.append(prompt)
        free.append([rng.randrange(3, vocab) for _ in range(len(prompt))])
    from engine.serve.workload import load_workload

    demo, _ = load_workload(max(1, n // 4), 4, BLOCK, 64, vocab)  # the demo's: groups of 4 sharing a document
    return {"copy-heavy": copy, "free": free, "shared-prefix": [p for _, p, _ in demo]}


def run(model: str, prompts: list[list[int]], method: str, k: int, max_tokens: int, concurrency: int,
        draft: dict | None = None) -> dict:
    """One engine, ``method`` (plain, ngram or draft) at ``k`` drafted tokens per step, over ``prompts``."""
    spec = {} if method == "plain" else {"speculative": method, "num_speculative_tokens": k}
    if method == "ngram+history":
        spec.update(speculative="ngram", ngram_history=64)
    if method == "draft":
        spec.update(draft or {})
    cfg = EngineConfig(model=model, dtype="float32", max_num_seqs=concurrency, **spec)
    eng = LLMEngine(cfg)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    eng.add_request(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    while eng.has_work():
        eng.step()
    eng.num_spec_steps = eng.num_draft_tokens = eng.num_accepted_tokens = 0
    seqs = [eng.add_request(p, params) for p in prompts]
    last: dict[int, float] = {}
    gaps: list[float] = []
    steps = 0
    start = time.perf_counter()
    while eng.has_work():
        outs = eng.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.seq.seq_id in last:
                gaps.append(now - last[o.seq.seq_id])
            last[o.seq.seq_id] = now
    wall = time.perf_counter() - start
    tokens = sum(len(s.output) for s in seqs)
    return {"tokens": [s.output for s in seqs], "tok_s": tokens / wall, "itl_p50": median(gaps),
            "itl_p99": pct(gaps, 99), "steps": steps, "drafted": eng.num_draft_tokens,
            "accepted": eng.num_accepted_tokens, "spec_steps": eng.num_spec_steps}


def verify_cost(model: str, hf_overrides: dict | None, batch: int, context: int, ks: list[int], reps: int,
                kv_cache_memory: str) -> tuple[list, float | None]:
    """Seconds of one step verifying K drafts per sequence (``1 + K`` query tokens each) against a plain
    decode step, for ``batch`` sequences of ``context`` tokens: the cost side of speculation.

    Returns ``[(K, seconds)]`` (K = 0: the plain step as the engine runs it, a CUDA graph replay
    where it captured one) and, when that was a replay, the plain step run eagerly too: verify
    steps always run eagerly, so part of their cost against a replay is launch overhead, not work.
    """
    import torch

    from engine.scheduler import ScheduledSeq

    cfg = EngineConfig(model=model, hf_overrides=hf_overrides, max_num_seqs=batch, chunk_size=min(context, 8192),
                       max_num_batched_tokens=max(8192, batch * 9), kv_cache_memory=kv_cache_memory)
    eng = LLMEngine(cfg)
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    seqs = [eng.add_request([rng.randrange(3, vocab) for _ in range(context)], SamplingParams(max_tokens=64,
                            ignore_eos=True)) for _ in range(batch)]
    while any(not s.output for s in seqs):  # prefill every sequence: each has its first token
        eng.step()
    for s in seqs:  # pages for the drafts' KV
        s.pages += eng.blocks.allocate(eng.blocks.pages_for(s.num_tokens + max(ks)) - len(s.pages))
    cuda = eng.runner.device.type == "cuda"

    def step_seconds(k: int) -> float:
        for s in seqs:
            s.draft = [rng.randrange(3, vocab) for _ in range(k)]
        sched = [ScheduledSeq(s, 1 + k, k) for s in seqs]
        times = []
        for i in range(reps + 2):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.runner.run(sched)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - t)
        return median(times)

    out = [(k, step_seconds(k)) for k in [0, *ks]]
    eager_plain = None
    graphs = eng.runner.decode_graphs
    if graphs is not None:
        eng.runner.decode_graphs = None
        eager_plain = step_seconds(0)
        eng.runner.decode_graphs = graphs
    for s in seqs:
        s.draft = []
    return out, eager_plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:small")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--draft-model", default=None,
                    help="draft model for the 'draft' method, with the target's vocabulary (default: the target "
                         "itself: a random model agrees with no other, so this shows the mechanism's cost at "
                         "full acceptance)")
    ap.add_argument("--draft-hf-overrides", type=json.loads, default=None, help="the draft model's overrides")
    ap.add_argument("--draft-ks", default="2,4", help="K for the draft-model method ('' skips it)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--verify-cost", action="store_true",
                    help="only time a step verifying K drafts against a plain decode step (--batch, --context)")
    ap.add_argument("--hf-overrides", type=json.loads, default=None, help="JSON, e.g. '{\"num_hidden_layers\": 8}'")
    ap.add_argument("--batch", default="1,8", help="with --verify-cost: batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="with --verify-cost: tokens per sequence")
    ap.add_argument("--json", help="with --verify-cost: also write the figures here")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="with --verify-cost: the engine's KV pool")
    args = ap.parse_args()
    if args.verify_cost:
        ks = [int(k) for k in args.ks.split(",")]
        rows, raw = [], {}
        for b in (int(x) for x in args.batch.split(",")):
            print(f"verify cost: batch {b}, context {args.context} ...", file=sys.stderr, flush=True)
            res, eager = verify_cost(args.model, args.hf_overrides, b, args.context, ks, 10, args.kv_cache_memory)
            raw[b] = {"steps": res, "plain_eager": eager}
            plain = res[0][1]
            eager = eager or plain
            rows += [[b, k, f"{t * 1e3:.2f}", f"{t / plain:.2f}x", f"{t / eager:.2f}x", f"{(1 + k) / (t / plain):.2f}"]
                     for k, t in res]
        print(table(["batch", "K", "step ms", "vs plain step", "vs plain step run eagerly",
                     "tokens per plain-step time if all accepted"], rows))
        print("plain step: as the engine runs it (a CUDA graph replay where captured); verify steps run eagerly, "
              "so against a replay part of their cost is launch overhead", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "hf_overrides": args.hf_overrides, "context": args.context,
                           "batches": {str(b): r for b, r in raw.items()}}, f, indent=1)
        return
    from engine.model_runner import load_model_config

    vocab = load_model_config(args.model).vocab_size
    ks = [int(k) for k in args.ks.split(",")]
    methods = [("plain", 0)] + [("ngram", k) for k in ks] + [("ngram+history", 4)] \
        + [("draft", int(k)) for k in args.draft_ks.split(",") if k]
    args.draft_model = args.draft_model or args.model
    draft = {"draft_model": args.draft_model, "draft_hf_overrides": args.draft_hf_overrides}
    loads = workloads(args.requests, vocab)
    runs: dict[tuple[str, str, int], list[dict]] = {}
    todo = [(r, w, m, k) for r in range(args.rounds) for w in loads for m, k in methods]
    for i, (r, w, m, k) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] round {r + 1}: {w} {m}{f' K={k}' if k else ''} ...", file=sys.stderr, flush=True)
        res = run(args.model, loads[w], m, k, args.max_tokens, args.concurrency, draft)
        runs.setdefault((w, m, k), []).append(res)
        assert res["tokens"] == runs[w, "plain", 0][0]["tokens"], f"{w} {m} K={k}: tokens differ from plain decoding"
    results = {key: {**rs[0], **{f: median([x[f] for x in rs]) for f in ("tok_s", "itl_p50", "itl_p99")}}
               for key, rs in runs.items()}

    rows = []
    for w in loads:
        base = results[w, "plain", 0]
        for m, k in methods:
            r = results[w, m, k]
            acc = r["accepted"] / r["drafted"] if r["drafted"] else float("nan")
            per_step = (r["accepted"] + r["spec_steps"]) / r["spec_steps"] if r["spec_steps"] else 1.0
            rows.append([w, m if k == 0 else f"{m} K={k}", f"{r['tok_s']:.0f}",
                         f"{r['tok_s'] / base['tok_s']:.2f}x", f"{r['itl_p50'] * 1e3:.2f}", f"{r['itl_p99'] * 1e3:.2f}",
                         r["steps"], "-" if k == 0 else f"{acc:.2f}", "-" if k == 0 else f"{per_step:.2f}"])
    headers = ["workload", "method", "tokens/s", "vs plain", "ITL p50 ms", "ITL p99 ms", "engine steps",
               "acceptance", "tokens per verify step"]
    text = table(headers, rows)
    print(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for w, marker in zip(loads, "os^"):
        base = results[w, "plain", 0]["tok_s"]
        for m, ls in (("ngram", "-"), ("draft", ":")):  # (ngram+history: one K, in the table)
            mk = [k for mm, k in methods if mm == m]
            if not mk:
                continue
            ax1.plot(mk, [results[w, m, k]["tok_s"] / base for k in mk], marker=marker, ls=ls, label=f"{w}, {m}")
            ax2.plot(mk, [results[w, m, k]["accepted"] / max(results[w, m, k]["drafted"], 1) for k in mk],
                     marker=marker, ls=ls, label=f"{w}, {m}")
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="drafted tokens per step (K)", ylabel="tokens/s vs plain decoding", title="throughput")
    ax2.set(xlabel="drafted tokens per step (K)", ylabel="accepted / drafted", title="acceptance", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.set_xticks(ks)
        ax.legend()
    fig.suptitle(f"speculative decoding, {args.model}, {args.concurrency} concurrent, CPU")
    fig.tight_layout()
    body = (f"## Speculative decoding (bench/spec_decode_bench.py)\n\n"
            f"{args.model} on this 2-core CPU (float32), {args.requests} requests per workload, "
            f"medians of {args.rounds} interleaved rounds, "
            f"{args.concurrency} at a time, {args.max_tokens} greedy tokens each; plain decoding, n-gram "
            f"drafting and a draft model ({args.draft_model}"
            f"{' with ' + json.dumps(args.draft_hf_overrides) if args.draft_hf_overrides else ''}"
            f"{': the target itself, which accepts everything and so shows what drafting and verifying cost' if args.draft_model == args.model and not args.draft_hf_overrides else ''}"
            f") at each K in the same run; every speculative run's tokens equal the plain run's. "
            f"Copy-heavy prompts are the shared trace's blocks with one block quoted again; free prompts are "
            f"random tokens of the same lengths; shared-prefix prompts are the demo's (groups of 4 requests "
            f"sharing a trace document), where `ngram+history` (K=4, `--ngram-history 64`) may also draft from "
            f"the engine's finished sequences. Command: `.venv/bin/python bench/spec_decode_bench.py "
            f"--write-docs`.\n\n{text}\n")
    publish(fig, "spec_decode", body, args.write_docs)


if __name__ == "__main__":
    main()
