"""Structured outputs' cost: grammar compilation, and the host time a sampling step spends on the
grammars' token masks, against the same step without them, in the same run.

A real-sized byte-level BPE vocabulary is trained here (no download) on Python's standard library
sources and cached under bench/out/. Each step samples one token per row from random logits over
that vocabulary, through the engine's ``Sampler``: with every row held to a JSON schema (each
row's matcher following its own output; a row that completes starts over as a new request), and
with none. Figures: host µs per step, median of the reps.

    .venv/bin/python bench/structured_bench.py                 # vocab 32000, batch 1/8/64
    .venv/bin/python bench/structured_bench.py --write-docs    # + docs/benchmarks.md, docs/structured.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import OUT, median, publish, table  # noqa: E402
from engine.sampling import Sampler, SamplingParams  # noqa: E402
from engine.structured import Grammars  # noqa: E402
from engine.tokenizer import HFTokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
SPECS = {"json schema": ("json", json.dumps(SCHEMA)), "json object": ("json_object", ""),
         "regex": ("regex", r"(\d{3}-){2}\d{4}|[A-Z][a-z]+ [A-Z][a-z]+"),
         "choice (3)": ("choice", json.dumps(["positive", "negative", "neutral"])),
         "ebnf": ("grammar", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"')}


def tokenizer(vocab: int) -> HFTokenizer:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library's sources (cached)."""
    folder = os.path.join(OUT, f"bpe-{vocab}")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))
        files = [f for f in files if "site-packages" not in f and "/test" not in f][:1500]
        print(f"training a byte-level BPE of {vocab} tokens on {len(files)} standard library files "
              f"(once; cached in {folder})", flush=True)
        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
        print(f"  trained in {time.perf_counter() - t0:.1f} s", flush=True)
    return HFTokenizer(folder)


def compile_times(tok, vocab: int, eos: set[int]) -> list[list]:
    """Per spec: the first compilation (a fresh compiler: its tokenizer info included the first
    time) and a cached one."""
    rows = []
    g = Grammars(tok, vocab, eos)
    t0 = time.perf_counter()
    g.compile(("regex", "a"))
    setup = time.perf_counter() - t0
    for name, spec in SPECS.items():
        t0 = time.perf_counter()
        g.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        g.compile(spec)
        rows.append([name, f"{cold * 1e3:.1f}", f"{(time.perf_counter() - t0) * 1e6:.0f}"])
    return [["(tokenizer info + compiler, once per engine)", f"{setup * 1e3:.0f}", "–"]] + rows


class _Timed:
    """Time spent in the matchers' host work (following the output, filling the bitmask): what
    stays on the host when the masking runs on a GPU."""

    def __init__(self) -> None:
        from engine.structured import Matcher

        self.total = 0.0
        for name in ("follow", "fill"):
            f = getattr(Matcher, name)

            def wrapped(*a, _f=f, **kw):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    self.total += time.perf_counter() - t0

            setattr(Matcher, name, wrapped)
            self.__dict__.setdefault("orig", {})[name] = f

    def close(self) -> None:
        from engine.structured import Matcher

        for name, f in self.orig.items():
            setattr(Matcher, name, f)


def step_times(tok, vocab: int, eos: set[int], batch: int, steps: int, spec) -> tuple[float, int, float]:
    """Median host µs of a sampling step over ``batch`` rows (each with ``spec``, or none), the
    number of outputs that completed, and the matchers' mean host µs per row and step."""
    timed = _Timed()
    g = Grammars(tok, vocab, eos)
    s = Sampler(eos, g)
    params = SamplingParams(max_tokens=1000, structured=spec) if spec else SamplingParams(max_tokens=1000)
    ids = list(range(batch))
    outputs: list[list[int]] = [[] for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    next_id, done, times = batch, 0, []
    for i in range(steps + 5):
        logits = torch.randn(batch, vocab, generator=gen)
        history = [([1], out) if spec else None for out in outputs]
        t0 = time.perf_counter()
        if i == 5:
            timed.total = 0.0
        toks = s.sample_async(logits, [params] * batch, ids, history).tolist()
        if i >= 5:
            times.append(time.perf_counter() - t0)
        for r, t in enumerate(toks):
            outputs[r].append(t)
            if t in eos:  # complete: the row starts over as a new request
                s.forget(ids[r])
                ids[r], next_id, outputs[r], done = next_id, next_id + 1, [], done + 1
    timed.close()
    return median(times) * 1e6, done, timed.total / steps / batch * 1e6


def speculation(model: str, requests: int, k: int) -> list[list]:
    """JSON-schema outputs through the engine (greedy, ``model``'s byte tokenizer), without drafts and
    with n-gram drafts of ``k`` tokens, in the same run: engine steps, output tokens per step, draft
    acceptance, wall time here. The outputs must be the same."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    rows, outputs = [], {}
    for name, kw in (("no drafts", {}), (f"n-gram, k={k}", {"speculative": "ngram", "num_speculative_tokens": k})):
        eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_pages=2048, max_num_seqs=requests, **kw))
        params = SamplingParams(max_tokens=600, structured=SPECS["json schema"])
        seqs = [eng.add_request([3 + i, 40 + i, 41], params) for i in range(requests)]
        t0, steps = time.perf_counter(), 0
        while eng.has_work():
            eng.step()
            steps += 1
        wall = time.perf_counter() - t0
        outputs[name] = [s.output for s in seqs]
        toks = sum(len(s.output) for s in seqs)
        drafted = sum(s.num_draft_tokens for s in seqs)
        accepted = sum(s.num_accepted_tokens for s in seqs)
        rows.append([name, steps, toks, f"{toks / steps:.1f}",
                     f"{accepted / drafted:.0%}" if drafted else "–", f"{wall:.2f}"])
        print(f"speculation {name}: {steps} steps, {toks} tokens, {wall:.2f} s", flush=True)
    a, b = outputs.values()
    assert a == b, "speculation changed a greedy structured output"
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--spec-model", default="random:small", help="the engine model of the speculation runs")
    p.add_argument("--spec-requests", type=int, default=8)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = tokenizer(args.vocab)
    vocab = tok.backend.get_vocab_size()
    eos = {tok.eos_token_id}
    print(f"vocabulary: {vocab} tokens (byte-level BPE)", flush=True)
    ctab = table(["grammar", "first compile ms", "cached µs"], compile_times(tok, vocab, eos))
    print(ctab, flush=True)
    rows, plot = [], []
    for b in [int(x) for x in args.batch.split(",")]:
        none, _, _ = step_times(tok, vocab, eos, b, args.steps, None)
        js, done, host = step_times(tok, vocab, eos, b, args.steps, SPECS["json schema"])
        print(f"batch {b}: none {none:.0f} µs/step, json schema {js:.0f} µs/step ({done} outputs completed)",
              flush=True)
        rows.append([b, f"{none:.0f}", f"{js:.0f}", f"{js / none:.1f}×", f"{(js - none) / b:.0f}", f"{host:.1f}",
                     done])
        plot.append((b, none, js))
    stab = table(["batch", "host µs/step, no grammar", "every row a JSON schema", "ratio",
                  "extra µs per constrained row", "of it, matcher µs (follow + fill)", "outputs completed"], rows)
    print(stab)
    sptab = table(["drafting", "engine steps", "output tokens", "output tokens per step", "drafts accepted",
                   "wall s (CPU)"], speculation(args.spec_model, args.spec_requests, 4))
    print(sptab)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(plot))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in plot], 0.4, label="no grammar")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in plot], 0.4, label="every row a JSON schema")
    ax.set_xticks(list(xs), [f"batch {r[0]}" for r in plot])
    ax.set_ylabel("host µs per sampling step")
    ax.set_yscale("log")
    ax.set_title(f"Structured outputs' host cost (vocab {vocab}, CPU)")
    ax.legend()
    fig.tight_layout()
    body = (f"Structured outputs (engine/structured.py, xgrammar): compiling a grammar, and the host time a "
            f"sampling step spends on the grammars' token masks (fill the bitmask, copy it packed, unpack, "
            f"mask), against the same `Sampler` step without them in the same run. Vocabulary: a byte-level "
            f"BPE of {vocab} tokens trained here on the standard library's sources; random logits; each row's "
            f"matcher follows its own output and a completed row starts over as a new request. Median of "
            f"{args.steps} steps; CPU: this machine, one thread. On a GPU the mask's unpacking and the masking "
            f"(one set of kernels for all the step's constrained rows) are device work; the matchers' share "
            f"(following the output, filling the bitmask: xgrammar, C++) is what stays host work there. "
            f"Command: "
            f"`.venv/bin/python bench/structured_bench.py --write-docs`.\n\n{ctab}\n\n{stab}\n\n"
            f"Speculation on structured outputs: {args.spec_requests} JSON-schema requests (the schema above) "
            f"through the engine ({args.spec_model}, greedy, its byte tokenizer), without drafts and with "
            f"n-gram drafts cut to what the grammar allows, in the same run; the outputs are the same "
            f"(checked). Decode reads the weights once a step whatever the tokens verified, so on a GPU "
            f"fewer steps is lower latency; the wall time is this CPU's.\n\n{sptab}\n")
    publish(fig, "structured", body, args.write_docs)


if __name__ == "__main__":
    main()
