"""Beam search on the engine: what the prefix cache saves it.

Each step of a beam search is a one-token request per live beam whose prompt is the last step's
plus one token (engine/beam_search.py). With the local prefix cache (pages shared by content hash)
an engine computes a page or less per beam per step; without it, every beam's whole prompt every
step. Same process, same prompts, same answer (checked): ``LLM.beam_search`` with the cache (the
default) against the same engine with ``enable_prefix_caching=False``, per prompt length; and, for
scale, greedy decoding of as many tokens.

    .venv/bin/python bench/beam_search_bench.py [--model random:small] [--width 4] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, publish, table  # noqa: E402
from engine.llm import LLM  # noqa: E402


def counted(llm: LLM) -> dict:
    """Counts the prompt tokens ``llm``'s engine computes, step by step."""
    seen = {"prefill": 0}
    step = llm.engine.step

    def wrapped():
        out = step()
        seen["prefill"] += llm.engine.last_step_prefill_tokens or 0
        return out

    llm.engine.step = wrapped
    return seen


def measure(llm: LLM, seen: dict, prompt: list[int], width: int, max_tokens: int):
    """(seconds, prompt tokens computed, steps, the hypotheses) of a beam search of ``prompt``."""
    seen["prefill"] = 0
    t0 = time.perf_counter()
    outs, = llm.beam_search(prompt, beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    took = time.perf_counter() - t0
    return took, seen["prefill"], outs[0].steps, [(o.token_ids, round(o.cum_logprob, 4)) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:small")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", default="128,512,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    kw = dict(dtype="float32", num_pages=4096, max_num_seqs=64, chunk_size=4096, max_num_batched_tokens=16384)
    cached = LLM(args.model, **kw)
    plain = LLM(args.model, enable_prefix_caching=False, **kw)
    seen_c, seen_p = counted(cached), counted(plain)
    vocab = cached.engine.model_config.vocab_size
    rows, results = [], []
    for n in lengths:
        r = random.Random(n)
        prompts = [[r.randrange(3, vocab) for _ in range(n)] for _ in range(args.reps)]
        # (a fresh prompt each rep: the cached engine's first step computes the prompt, as a new request's does)
        tc, pc, steps, hc = zip(*(measure(cached, seen_c, p, args.width, args.max_tokens) for p in prompts))
        tp, pp, _, hp = zip(*(measure(plain, seen_p, p, args.width, args.max_tokens) for p in prompts))
        assert hc == hp, "the prefix cache changed a beam search's answer"
        t0 = time.perf_counter()
        for p in prompts:
            cached.generate(p, max_tokens=args.max_tokens, ignore_eos=True)
        greedy = (time.perf_counter() - t0) / len(prompts)
        c_s, p_s = median(tc), median(tp)
        results.append((n, c_s, p_s, greedy))
        rows.append([f"{n:,}", steps[0], f"{median(pc):,.0f}", f"{median(pp):,.0f}", f"{c_s * 1e3:,.0f}",
                     f"{p_s * 1e3:,.0f}", f"{p_s / c_s:.1f}x", f"{greedy * 1e3:,.0f}", f"{c_s / greedy:.1f}x"])
        print(f"prompt {n:>6}: cache {c_s * 1e3:8.0f} ms ({median(pc):,.0f} prompt tokens computed), "
              f"no cache {p_s * 1e3:8.0f} ms ({median(pp):,.0f}), greedy {greedy * 1e3:6.0f} ms", flush=True)
    cached.close()
    plain.close()
    headers = ["prompt tokens", "steps", "tokens computed, cache", "no cache", "ms, cache", "ms, no cache",
               "no cache / cache", f"greedy {args.max_tokens} tokens, ms", "beam / greedy"]
    text = table(headers, rows)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(results))
    w = 0.27
    ax.bar([x - w for x in xs], [r[2] * 1e3 for r in results], w, label="beam search, no prefix cache")
    ax.bar(list(xs), [r[1] * 1e3 for r in results], w, label="beam search, prefix cache")
    ax.bar([x + w for x in xs], [r[3] * 1e3 for r in results], w, label=f"greedy, {args.max_tokens} tokens")
    ax.set_xticks(list(xs), [f"{r[0]:,}" for r in results])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.set_title(f"{args.model}, width {args.width}, {args.max_tokens} tokens (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    body = (f"Beam search (`LLM.beam_search`, width {args.width}, {args.max_tokens} tokens, `ignore_eos`) on "
            f"`{args.model}` (float32, CPU: 2 cores), with the local prefix cache against the same engine "
            f"without it, in the same run, a fresh random prompt per repetition (median of {args.reps}); both "
            f"gave the same hypotheses. Each step is a one-token request per live beam: with the cache an "
            f"engine computes the prompt once and then a page or less per beam per step; without it every "
            f"beam's whole prompt every step. Greedy decoding of as many tokens beside it, for scale: a beam "
            f"step is {args.width} requests each computing up to a page (the beam's last tokens) over the whole "
            f"history, where a greedy step decodes one token. Command: "
            f"`.venv/bin/python bench/beam_search_bench.py --write-docs`.\n\n{text}\n")
    publish(fig, "beam_search", body, args.write_docs)


if __name__ == "__main__":
    main()
