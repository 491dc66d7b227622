"""An evaluation harness's load: N prompts scored (``echo`` + ``logprobs``, ``max_tokens`` 0: the
loglikelihood requests lm-eval sends) and N short greedy answers, sent three ways to one
`crescent up --mode disagg` cluster (real processes): one request at a time, K requests in flight,
and one completions request holding all N prompts (a batch). Reports wall time and prompts/s, each
against one-at-a-time in the same run; each way gets fresh prompts of the same shape (no way finds
another's in the store), and the batch's answers are checked against the same prompts sent alone.

    python bench/batch_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import publish, table  # noqa: E402
from engine.serve.workload import UpCluster  # noqa: E402


def log(msg: str) -> None:
    print(f"[batch_bench] {msg}", flush=True)


def post(url: str, body: dict) -> dict:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        conn.request("POST", u.path.rstrip("/") + "/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        return data
    finally:
        conn.close()


TASKS = {  # what each prompt asks for
    "score (echo, logprobs, max_tokens 0)": {"echo": True, "logprobs": 1, "max_tokens": 0},
    "generate (16 tokens, greedy)": {"max_tokens": 16, "temperature": 0, "ignore_eos": True},
}


def answers(data: dict) -> list:
    """Per choice, what is compared: the tokens' logprobs (scores) or the text."""
    return [ch["logprobs"]["token_logprobs"] if ch.get("logprobs") else ch["text"] for ch in data["choices"]]


def same(a: list, b: list) -> bool:
    if isinstance(a[0], str):
        return a == b
    return all(len(x) == len(y) and all((p is None and q is None) or abs(p - q) < 1e-4 for p, q in zip(x, y))
               for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:small")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight for the concurrent way")
    ap.add_argument("--quick", action="store_true", help="16 prompts of 64 tokens")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.prompt_tokens = 16, 64
    from engine.model_runner import load_model_config

    vocab = load_model_config(args.model).vocab_size
    rng = random.Random(0)

    def fresh() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]

    rows, results = [], {}
    with UpCluster(args.model, ["--mode", "disagg", "--dram", "512MiB"]) as cluster:
        url = cluster.url
        model = args.model
        post(url, {"model": model, "prompt": fresh()[:4], "max_tokens": 2})  # warm-up
        for task, opts in TASKS.items():
            base = {"model": model, **opts}
            ways = {
                "one request at a time": lambda ps: [post(url, {**base, "prompt": p}) for p in ps],
                f"{args.concurrency} requests in flight": lambda ps: list(
                    ThreadPoolExecutor(args.concurrency).map(lambda p: post(url, {**base, "prompt": p}), ps)),
                f"one request of {args.prompts} prompts": lambda ps: [post(url, {**base, "prompt": ps})],
            }
            walls = {}
            for way, send in ways.items():
                prompts = fresh()
                t0 = time.perf_counter()
                got = send(prompts)
                walls[way] = time.perf_counter() - t0
                log(f"{task}, {way}: {walls[way]:.2f} s")
                if way.startswith("one request of"):  # the batch answers as the prompts alone do
                    alone = [answers(post(url, {**base, "prompt": p}))[0] for p in prompts[:4]]
                    assert same(answers(got[0])[:4], alone), "a batched answer differs from the prompt's alone"
                    assert len(got[0]["choices"]) == args.prompts
            one = walls["one request at a time"]
            for way, wall in walls.items():
                rows.append([task, way, f"{wall:.2f}", f"{args.prompts / wall:.1f}", f"{one / wall:.2f}×"])
            results[task] = walls
    md = table(["task", "sent as", "wall s", "prompts/s", "× one at a time"], rows)
    print()
    print(md)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    ways = list(next(iter(results.values())))
    width = 0.8 / len(ways)
    for k, way in enumerate(ways):
        ax.bar([t + k * width for t in range(len(results))], [args.prompts / w[way] for w in results.values()],
               width, label=way)
    ax.set_xticks([t + width * (len(ways) - 1) / 2 for t in range(len(results))], list(results), fontsize=8)
    ax.set_ylabel("prompts / s")
    ax.legend(fontsize=8)
    fig.suptitle(f"{args.model}, {args.prompts} prompts of {args.prompt_tokens} tokens, "
                 f"{os.cpu_count()} CPU cores")
    fig.tight_layout()
    body = (f"`{args.model}`, {args.prompts} prompts of {args.prompt_tokens} random tokens per way, fresh for each "
            f"way; `crescent up --mode disagg` (prefill engine, decode engine, store, gateway: processes on this "
            f"{os.cpu_count()}-core machine). The batch's first four answers equal the same prompts sent alone "
            f"(checked in the run). Command: `.venv/bin/python bench/batch_bench.py --write-docs`.\n\n{md}")
    publish(fig, "batch_bench", body, args.write_docs)


if __name__ == "__main__":
    main()
