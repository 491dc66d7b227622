"""The engine's host time per decode step: what a replayed CUDA graph does not remove.

On a GPU a pure decode step is one graph replay, but around it the engine's Python runs
on the host while the device waits: scheduling, filling the graph's input buffers,
sampling's wait for the tokens, appending them, stop checks, the local prefix cache's page
hashes. Waiting for every step, that time adds to the inter-token latency one for one, so it
must stay well under the step's HBM floor (issue 13: ITL <= 1.15x the floor at batch 64, <= 2x
at batch 1). With async scheduling (``EngineConfig.async_scheduling``) the next step is
launched before the host handles this one's tokens, so the host's time hides behind the
device's as long as it is shorter; the bench runs that mode too (same work, a little more
bookkeeping).

This runs the engine's real decode loop on the CPU through the CUDA graphs' static buffers
(``DecodeGraphs(capture=False)``, the host code a GPU runs), with the model's forward pass
replaced by what a replay hands the host: the graph's static output tensor, no computation
(prefill included: the KV is never read, the tokens do not matter). The LM head and the sampler still run (on a GPU they are
device work, so their time is timed apart and left out of the host time). Reported per batch
and context: host microseconds per step, its parts, and the ratio to the HBM floor of the
same batch on an H200 (``random:llama3-8b`` cut to 8 layers in bf16, weights + KV at 4.8 TB/s:
the shapes of issue 13's engine target), computed, not measured.

    .venv/bin/python bench/engine_host_bench.py                 # ~1 min on 2 cores
    .venv/bin/python bench/engine_host_bench.py --write-docs    # + docs/benchmarks.md, docs/engine_host.png
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import median, publish, table  # noqa: E402

CONFIGS = [(1, 4096), (8, 4096), (64, 4096), (256, 1024)]
MODES = [(True, False), (True, True), (False, False)]
"""(prefix caching, async scheduling): the serving default, with async scheduling, the cache off."""
H200_TBS = 4.8
FLOOR_MODEL, FLOOR_LAYERS = "llama3-8b", 8


def _floor_model() -> tuple[int, int, int, int]:
    """``random:llama3-8b`` cut to 8 layers: (weights a step reads, in elements: the embedding
    only for the batch's rows, left out; layers; q width; bf16 KV bytes per token)."""
    from engine.config import preset_config

    mc = preset_config(FLOOR_MODEL, {"num_hidden_layers": FLOOR_LAYERS})
    h, hd, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
    q, kv = mc.num_attention_heads * hd, mc.num_key_value_heads * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    weights = mc.num_hidden_layers * layer + h + mc.vocab_size * h  # + final norm, LM head
    return weights, mc.num_hidden_layers, q, mc.num_hidden_layers * 2 * kv * 2


def floor_ms(batch: int, ctx: int, tbs: float = H200_TBS) -> float:
    """HBM floor of one decode step of ``random:llama3-8b`` cut to 8 layers in bf16: every weight
    read once plus the batch's KV, at ``tbs``. The same count as bench/kernels_bench.py's
    ``_step_bytes``, from the config alone."""
    weights, _, _, kv_token = _floor_model()
    return (weights * 2 + batch * ctx * kv_token) / (tbs * 1e12) * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _host_only(eng):
    """``eng`` on the CUDA graphs' static buffers (run eagerly) with a model that computes
    nothing: a replay hands the host the graph's static output tensor (and the prefill's KV is
    never read here). So every step's time is the engine's host work."""
    runner = eng.runner
    graphs = runner.decode_graphs = runner.make_decode_graphs(capture=False)
    static = torch.zeros(max(graphs.max_batch, eng.cfg.max_num_batched_tokens), runner.model_config.hidden_size)
    runner.model.forward = lambda ids, meta, kv_caches: static[: ids.shape[0]]
    return eng


def measure(batch: int, ctx: int, steps: int, prefix_caching: bool, async_scheduling: bool = False,
            logprobs: int | None = None) -> dict:
    """Host microseconds per pure decode step of ``batch`` sequences at ``ctx`` tokens (each asking
    for ``logprobs``)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    max_tokens = steps + 40
    cfg = EngineConfig(model="random:tiny", hf_overrides={"max_position_embeddings": 8192}, dtype="float32", device="cpu",
                       max_num_seqs=batch, chunk_size=8192, max_num_batched_tokens=max(8192, ctx),
                       num_pages=batch * (-(-(ctx + max_tokens + 16) // 16)) + 8,
                       enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    eng = _host_only(LLMEngine(cfg))
    runner, graphs = eng.runner, eng.runner.decode_graphs
    gen = torch.Generator().manual_seed(batch * 7919 + ctx)
    seqs = [eng.add_request(torch.randint(3, 250, (ctx,), generator=gen).tolist(),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs))
            for _ in range(batch)]
    t = time.perf_counter()
    while any(s.num_computed < s.num_tokens - 1 or not s.output for s in seqs):  # prefill
        eng.step()
    prefill_s = time.perf_counter() - t
    parts = {"schedule": 0.0, "inputs": 0.0, "lm_head": 0.0, "sample": 0.0}

    def timed(obj, name, part):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[part] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(eng.scheduler, "schedule", "schedule")
    timed(graphs, "run", "inputs")
    timed(runner.model, "logits", "lm_head")
    timed(eng.sampler, "sample_async", "sample")
    eng.step()
    for k in parts:
        parts[k] = 0.0
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t
    assert graphs.steps == steps + 1 and graphs.fallbacks == 0, "a step left the decode buffers"
    assert all(len(s.output) >= steps + 1 and not s.is_finished for s in seqs)
    assert not async_scheduling or eng.num_overlapped_steps >= steps, "a step was not overlapped"
    host = wall - parts["lm_head"]
    us = {k: v / steps * 1e6 for k, v in parts.items()}
    us["outputs"] = (host - parts["schedule"] - parts["inputs"] - parts["sample"]) / steps * 1e6
    return {"batch": batch, "ctx": ctx, "prefix_caching": prefix_caching, "async": async_scheduling,
            "host_us": host / steps * 1e6,
            "prefill_s": prefill_s, **us}


def _h200_step_ms(prefill_tokens: int, seqs: int, context_tokens: int) -> float:
    """A step's time on an H200 as the replay's clock counts it: the larger of its bytes (weights
    + the KV it reads, at HBM speed) and its FLOPs (weights x tokens, plus the prompt tokens'
    attention over the step's mean context per sequence, at 60% of dense bf16 peak).
    ``random:llama3-8b`` cut to 8 layers; a model of the clock, not a measurement."""
    weights, layers, q, kv_token = _floor_model()
    read = 2 * weights + context_tokens * kv_token
    tokens = prefill_tokens + max(0, seqs - (1 if prefill_tokens else 0))
    flops = 2 * weights * tokens + 4 * layers * q * prefill_tokens * context_tokens / max(1, seqs)
    return max(read / (H200_TBS * 1e12), flops / (0.6 * 989e12)) * 1e3


def replay(num_requests: int, async_scheduling: bool, progress: bool = True) -> dict:
    """The first ``num_requests`` of the Mooncake synthetic trace (shared prefixes from its
    512-token block hashes, its input and output lengths, its arrival times) through the engine's
    serving configuration (chunked prefill of 512, 2,048 tokens a step, 64 sequences, the local
    prefix cache), the forward replaced as in ``measure``, arrivals on the H200 clock of
    ``_h200_step_ms``.

    Counts the steps after which the host waited for that step's own tokens before launching the
    next one: on a GPU the device idles through that wait and the host work after it (every
    sampling step when waiting for every step). Under async scheduling the host waits for a
    step's tokens only once the next step is launched, except where that step must wait
    (``LLMEngine._overlap_skip``). A step that samples nothing (prompt chunks only) never waits."""
    import json

    import numpy as np

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SampledTokens, SamplingParams

    trace = Path(__file__).resolve().parents[1] / "tests" / "data" / "synthetic_trace.jsonl"
    rows = [json.loads(line) for _, line in zip(range(num_requests), open(trace))]
    blocks: dict[int, list[int]] = {}

    def prompt(r: dict) -> list[int]:
        toks = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = np.random.default_rng(h).integers(3, 250, 512).tolist()
            toks += blocks[h]
        return toks[: r["input_length"]]

    cfg = EngineConfig(model="random:tiny", hf_overrides={"max_position_embeddings": 131072}, dtype="float32",
                       device="cpu", max_num_seqs=64, chunk_size=512, max_num_batched_tokens=2048,
                       num_pages=60_000, enable_prefix_caching=True, async_scheduling=async_scheduling)
    eng = _host_only(LLMEngine(cfg))
    runner = eng.runner
    # which step's tokens each wait is for: the latest launched (in series) or an earlier one
    runs = [0]
    run, sample_async, tolist = runner.run, eng.sampler.sample_async, SampledTokens.tolist
    in_series: set[int] = set()  # runs whose tokens the host waited for before launching another

    def counted_run(*a, **k):
        runs[0] += 1
        return run(*a, **k)

    def tagged_sample_async(*a, **k):
        out = sample_async(*a, **k)
        out.launch = runs[0]
        return out

    def waited_tolist(self):
        if getattr(self, "launch", None) == runs[0]:
            in_series.add(runs[0])
        return tolist(self)

    runner.run, eng.sampler.sample_async = counted_run, tagged_sample_async
    SampledTokens.tolist = waited_tolist
    clock_ms, i, host = 0.0, 0, 0.0
    counts = {"steps": 0, "chunk_steps": 0}
    timeline = []  # (clock s, running, prompt tokens, the host waited for this step's tokens in series)
    try:
        while i < len(rows) or eng.has_work():
            while i < len(rows) and rows[i]["timestamp"] <= clock_ms:
                eng.add_request(prompt(rows[i]), SamplingParams(max_tokens=rows[i]["output_length"], ignore_eos=True))
                i += 1
            if not eng.has_work():
                clock_ms = rows[i]["timestamp"]
                continue
            before = runs[0]
            t0 = time.perf_counter()
            eng.step()
            host += time.perf_counter() - t0
            if runs[0] == before:
                continue  # (nothing scheduled: a launched step resolved)
            chunk = bool(eng.last_step_prefill_tokens)
            counts["steps"] += 1
            counts["chunk_steps"] += chunk
            clock_ms += _h200_step_ms(eng.last_step_prefill_tokens, eng.last_step_seqs, eng.last_step_context_tokens)
            timeline.append([clock_ms / 1e3, len(eng.scheduler.running), eng.last_step_prefill_tokens, chunk])
            assert len(timeline) == runs[0]  # (one forward pass a step: no drafts here)
            if progress and counts["steps"] % 5000 == 0:
                print(f"  replay {'async' if async_scheduling else 'sync '}: step {counts['steps']}, "
                      f"{i}/{len(rows)} requests arrived, modeled clock {clock_ms / 1e3:.1f} s", flush=True)
    finally:
        SampledTokens.tolist = tolist
    for r, x in enumerate(timeline, 1):
        x.append(r in in_series)
    counts["in_series"] = len(in_series)
    counts["chunk_in_series"] = sum(x[4] and x[3] for x in timeline)
    return {**counts, "requests": len(rows), "host_ms_per_step": host / counts["steps"] * 1e3,
            "modeled_s": clock_ms / 1e3, "timeline": timeline}


def main_replay(args) -> None:
    results = []
    for async_ in (False, True):
        print(f"replaying {args.replay} requests of the Mooncake trace, "
              f"{'async scheduling' if async_ else 'waiting for every step'}", flush=True)
        results.append(replay(args.replay, async_scheduling=async_))
    sync, asy = results
    assert (sync["steps"], sync["chunk_steps"]) == (asy["steps"], asy["chunk_steps"]), "the two modes ran other steps"
    rows = [[name, r["requests"], r["steps"], f"{r['modeled_s']:.1f}",
             f"{r['in_series']} ({r['in_series'] / r['steps']:.1%})", r["chunk_steps"],
             f"{r['chunk_in_series']} ({r['chunk_in_series'] / max(1, r['chunk_steps']):.1%})",
             f"{r['host_ms_per_step']:.2f}"]
            for name, r in (("wait for every step", sync), ("async scheduling", asy))]
    md = table(["scheduling", "requests", "steps", "modeled H200 s", "steps waited for before the next launch",
                "steps with a prompt chunk", "of them waited for", "host ms/step (CPU)"], rows)
    print(md)
    body = (f"The first {asy['requests']} requests of the Mooncake synthetic trace (`tests/data/synthetic_trace.jsonl`: "
            f"shared prefixes from its block hashes, its lengths and arrival times) through the engine: chunked "
            f"prefill of 512, 2,048 tokens a step, 64 sequences, the local prefix cache; the forward replaced by a "
            f"replay's static output as above; arrivals on a modeled H200 clock (`random:{FLOOR_MODEL}` cut to "
            f"{FLOOR_LAYERS} layers: a step's bytes at {H200_TBS} TB/s or its FLOPs at 60% of bf16 peak, the larger). "
            f"Counted: the steps whose tokens the host waited for before launching the next step (on a GPU the "
            f"device idles through that wait and the host's work after it), both ways in the same run. "
            f"Command: `.venv/bin/python bench/engine_host_bench.py --replay {args.replay} --write-docs`.\n\n{md}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    t = [x[0] for x in asy["timeline"]]
    ax.plot(t, [x[1] for x in asy["timeline"]], lw=1, color="tab:blue", label="running sequences")
    top = max(x[1] for x in asy["timeline"])
    strips = (-0.12 * top, -0.24 * top)
    for y, (name, r, color) in zip(strips, (("waiting for every step", sync, "tab:gray"),
                                            ("async scheduling", asy, "tab:red"))):
        waited = [x[0] for x in r["timeline"] if x[4]]
        ax.plot(waited, [y] * len(waited), "|", color=color, ms=9,
                label=f"{name}: steps waited for before the next launch ({len(waited) / r['steps']:.1%})")
    ticks = [t for t in ax.get_yticks() if 0 <= t <= top]
    ax.set_yticks(ticks + list(strips), [f"{t:g}" for t in ticks] + ["waits (sync)", "waits (async)"])
    ax.set_ylim(1.4 * strips[1], 1.35 * top)
    ax.set_ylabel("running sequences")
    ax.set_xlabel("modeled H200 time (s)")
    ax.set_title(f"Mooncake trace, {asy['requests']} requests through the engine: where the host waits in series")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    publish(fig, "engine_replay", body, args.write_docs)


def main_logprobs(args) -> None:
    """Host time per decode step with every sequence asking for ``--logprobs`` K against none, in the
    same run (serving default: prefix caching and async scheduling on). On a GPU the log-softmax and
    top-k are device work beside the sampling; the host's share is turning the K alternatives of
    every sequence into Python values (``outputs``)."""
    from bench.common import write_docs_section

    rows, n = [], 0
    total = 2 * len(CONFIGS) * args.reps
    for batch, ctx in CONFIGS:
        med = {}
        for k in (None, args.logprobs):
            runs = []
            for _ in range(args.reps):
                n += 1
                runs.append(measure(batch, ctx, args.steps, True, True, logprobs=k))
                print(f"[{n}/{total}] B={batch:<3d} ctx={ctx:<5d} logprobs {k} host {runs[-1]['host_us']:7.1f} "
                      f"us/step", flush=True)
            med[k] = {key: median([r[key] for r in runs]) for key in ("host_us", "sample", "outputs")}
        off, on = med[None], med[args.logprobs]
        rows.append([batch, ctx, f"{off['host_us']:.0f}", f"{on['host_us']:.0f}", f"{on['host_us'] / off['host_us']:.2f}",
                     f"{off['sample']:.0f} → {on['sample']:.0f}", f"{off['outputs']:.0f} → {on['outputs']:.0f}",
                     f"{(on['outputs'] - off['outputs']) / 1e3 / floor_ms(batch, ctx):.1%}"])
    md = table(["batch", "context", "host µs/step, no logprobs", f"with {args.logprobs}", "ratio",
                "sample µs", "outputs µs", "outputs' extra / H200 floor"], rows)
    print(md)
    body = (f"Every sequence asking for `logprobs={args.logprobs}` against none, in the same run: host time "
            f"per pure decode step as in `engine_host` above (prefix caching and async scheduling on, "
            f"`random:tiny`, {args.steps} steps, median of {args.reps}; CPU: {cpu_name()}, one thread). "
            f"`sample` includes the log-softmax and top-k (device work on a GPU, here on the CPU over "
            f"`random:tiny`'s vocabulary); `outputs` includes turning each sequence's logprobs into Python "
            f"values, the host's own share, set against the step's H200 floor. At batch 256 most of that "
            f"share is Python's garbage collector: the requests keep their tokens' logprobs, so the heap "
            f"grows and full collections come more often and cost more (in a run with the collector off, "
            f"`outputs` went from 721 to 1,152 µs). Command: "
            f"`.venv/bin/python bench/engine_host_bench.py --logprobs {args.logprobs} --reps {args.reps} --write-docs`.\n\n{md}\n")
    if args.write_docs:
        write_docs_section("engine_host_logprobs", body)
        print("docs/benchmarks.md updated")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per run (default 200)")
    p.add_argument("--reps", type=int, default=5, help="runs per configuration; medians reported (default 5)")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="instead: replay the Mooncake trace's first N requests, waiting for every step and with "
                        "async scheduling, and count the steps the host waits for before launching the next")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="instead: every sequence asking for K logprobs against none, async scheduling on")
    p.add_argument("--write-docs", action="store_true", help="write docs/benchmarks.md's section and the PNG")
    args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.replay < 0 or not 0 <= (args.logprobs or 0) <= 20:
        p.error("--steps and --reps must be >= 1, --replay >= 0, --logprobs in [0, 20]")
    torch.set_num_threads(1)  # the host path is one thread; keep BLAS threads off the other core
    if args.replay:
        return main_replay(args)
    if args.logprobs is not None:
        return main_logprobs(args)
    results = []
    total = len(MODES) * len(CONFIGS) * args.reps
    n = 0
    for prefix, async_ in MODES:
        for batch, ctx in CONFIGS:
            runs = []
            for _ in range(args.reps):
                n += 1
                r = measure(batch, ctx, args.steps, prefix, async_)
                runs.append(r)
                print(f"[{n}/{total}] prefix caching {'on ' if prefix else 'off'} {'async' if async_ else 'sync '} "
                      f"B={batch:<3d} ctx={ctx:<5d} host {r['host_us']:7.1f} us/step (prefill {r['prefill_s']:.1f} s)",
                      flush=True)
            med = {k: median([r[k] for r in runs]) if isinstance(runs[0][k], float) else runs[0][k] for k in runs[0]}
            med["spread"] = (min(r["host_us"] for r in runs), max(r["host_us"] for r in runs))
            med["floor_ms"] = floor_ms(batch, ctx)
            results.append(med)

    headers = ["prefix cache", "scheduling", "batch", "context", "host µs/step", "range", "schedule", "inputs", "sample",
               "outputs", "H200 floor ms", "host / floor"]
    rows = [["on" if r["prefix_caching"] else "off", "async" if r["async"] else "sync", r["batch"], r["ctx"], f"{r['host_us']:.0f}",
             f"{r['spread'][0]:.0f}–{r['spread'][1]:.0f}", f"{r['schedule']:.0f}", f"{r['inputs']:.0f}",
             f"{r['sample']:.0f}", f"{r['outputs']:.0f}", f"{r['floor_ms']:.3f}",
             f"{r['host_us'] / 1e3 / r['floor_ms']:.2f}"] for r in results]
    md = table(headers, rows)
    print(md)
    body = (f"Host time of pure decode steps through the CUDA graphs' static buffers, the model's forward "
            f"replaced by a replay's static output (`random:tiny` for the engine's state; the model's "
            f"size does not enter the host path), {args.steps} steps, median of {args.reps}; CPU: "
            f"{cpu_name()}, one thread. Parts: `schedule` the scheduler, `inputs` the buffers' fill and "
            f"copy, `sample` argmax and the tokens to the host, `outputs` the rest of the step (tokens "
            f"appended, stop checks, page hashes, step outputs); the LM head's time is left out (device "
            f"work on a GPU). The floor: `random:{FLOOR_MODEL}` cut to {FLOOR_LAYERS} layers, bf16, "
            f"weights + the batch's KV at {H200_TBS} TB/s; on a GPU the host time adds to it one for one when every step is waited for, and hides "
            f"behind the device's step (when shorter) with async scheduling. "
            f"Command: `.venv/bin/python bench/engine_host_bench.py --write-docs`.\n\n{md}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [f"B={b}\nctx={c}" for b, c in CONFIGS]
    x = range(len(CONFIGS))
    for off, (prefix, async_) in zip((-0.27, 0, 0.27), MODES):
        vals = [next(r["host_us"] / 1e3 for r in results
                     if (r["prefix_caching"], r["async"]) == (prefix, async_) and (r["batch"], r["ctx"]) == bc)
                for bc in CONFIGS]
        ax.bar([i + off for i in x], vals, width=0.26,
               label=f"host ms/step, prefix cache {'on' if prefix else 'off'}{', async' if async_ else ''}")
    floors = [floor_ms(b, c) for b, c in CONFIGS]
    ax.hlines(floors, [i - 0.42 for i in x], [i + 0.42 for i in x], colors="k", linewidth=2,
              label=f"H200 HBM floor of the step ({FLOOR_MODEL}, {FLOOR_LAYERS} layers)")
    ax.set_ylim(0, 1.35 * max(floors + [r["host_us"] / 1e3 for r in results]))
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title("Engine host time per decode step (CPU) vs the GPU step's floor")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    publish(fig, "engine_host", body, args.write_docs)


if __name__ == "__main__":
    main()
