"""Workloads for the demo and the serving benchmark, and a streaming load generator."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class UpCluster:
    """``crescent up`` as a subprocess (conductor, store, engines, gateway: real processes, every
    port picked free) with ``flags``, its output in ``<data>/up.out``. ``with`` waits until it serves
    (``state``: its ``up.json``; RuntimeError with its output if it exits or takes over 300 s) and
    stops it on exit (SIGTERM to ``up``, which stops its parts; ``returncode`` then). Without
    ``data``, a temporary folder, removed after. ``start``/``stop`` do the same without ``with``."""

    def __init__(self, model: str, flags: list[str], data: str | None = None) -> None:
        self.model, self.flags = model, flags
        self.temporary = data is None
        self.data = tempfile.mkdtemp(prefix="crescent-up-") if data is None else data
        self.log_path = os.path.join(self.data, "up.out")
        self.state: dict = {}
        self.returncode: int | None = None

    def __enter__(self) -> UpCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> UpCluster:
        self._log = open(self.log_path, "w")
        self._up = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "up", "--data", self.data, "--model",
                                     self.model, "--store-port", "0", "--prefill-port", "0", "--decode-port", "0",
                                     "--gateway-port", "0", "--conductor-port", "0", *self.flags],
                                    cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            path = os.path.join(self.data, "up.json")
            deadline = time.monotonic() + 300
            while not os.path.exists(path):
                if self._up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(open(self.log_path).read())
                time.sleep(0.2)
            with open(path) as f:
                self.state = json.load(f)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        """The gateway's OpenAI base URL."""
        return self.state["openai_base_url"]

    def stop(self) -> None:
        self._up.send_signal(signal.SIGTERM)
        self.returncode = self._up.wait(timeout=120)
        self._log.close()
        if self.temporary:
            shutil.rmtree(self.data, ignore_errors=True)
TRACE = os.path.join(ROOT, "tests", "data", "synthetic_trace.jsonl")  # public Mooncake data, see its SOURCES.md
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


def run_workload(base_url: str, model: str, work, concurrency: int, progress: bool = True) -> tuple[list, float]:
    """Streams every request through the official client, ``concurrency`` at a time, in order.

    Returns per-request records (tenant, prompt, cached, ttft, itl gaps, tokens, start) and the wall time.
    """
    import openai
    from tqdm import tqdm

    client = openai.OpenAI(base_url=base_url, api_key="crescent", timeout=600, max_retries=0)
    results = [None] * len(work)
    bar = tqdm(total=len(work), desc="requests", unit="req", disable=not progress)
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
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
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
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return results, time.perf_counter() - t_start
