"""The gateway's host time to stream one tool call, per piece of text, as the call grows: a
``write_file`` call whose arguments hold a file of N characters (strings with escapes, a list of
numbers), fed to ``CallStream`` in 4-character pieces (about a token each), as the gateway feeds a
streamed choice; in the hermes format (JSON) and the pythonic one (Python literals). Two ways in the
same run: the scanner resuming where it stopped (the gateway's), and the baseline rescanning the
whole text at every piece (the same scanner without its memo). Both must send exactly the call's
arguments.

    python bench/tool_stream_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import publish, table  # noqa: E402
from engine.serve.tools import CallStream, ToolRequest  # noqa: E402

TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}


def call_text(n: int, fmt: str = "hermes") -> tuple[str, str]:
    """A call whose arguments hold about ``n`` characters; (the model's text, the arguments)."""
    kw = {"path": "src/app.py", "content": 'print("hi")\n' * (n // 14), "lines": list(range(n // 50))}
    args = json.dumps(kw, ensure_ascii=False)
    if fmt == "pythonic":
        return "[write_file(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")]", args
    return f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>', args


def stream_once(text: str, resume: bool, fmt: str = "hermes") -> tuple[float, str]:
    """Seconds to feed ``text`` in 4-character pieces; the arguments the deltas carried."""
    stream = CallStream(ToolRequest((TOOL,), "auto"), fmt)
    if not resume:
        stream._memo = None  # the baseline: every piece rescans the text from the start
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    sent = []
    t0 = time.perf_counter()
    for k, piece in enumerate(pieces):
        _, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        sent += [d["function"]["arguments"] for d in deltas]
    return time.perf_counter() - t0, "".join(sent)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 4_000, 16_000, 64_000],
                    help="characters of the call's arguments")
    ap.add_argument("--reps", type=int, default=3, help="runs per way and size (the median is reported)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one run (a smoke test)")
    ap.add_argument("--write-docs", action="store_true", help="write the table and plot into docs/benchmarks.md")
    ns = ap.parse_args()
    sizes, reps = ([500, 2_000], 1) if ns.quick else (ns.sizes, ns.reps)
    rows, points = [], {}
    for fmt, n in [(f, n) for f in ("hermes", "pythonic") for n in sizes]:
        text, args = call_text(n, fmt)
        pieces = -(-len(text) // 4)
        got = {}
        for resume in (True, False):
            times = []
            for _ in range(reps):
                dt, sent = stream_once(text, resume, fmt)
                if sent != args:
                    print(f"the {'resuming' if resume else 'rescanning'} stream sent other arguments", file=sys.stderr)
                    return 1
                times.append(dt)
            got[resume] = sorted(times)[len(times) // 2] / pieces * 1e6
        print(f"[tool_stream_bench] {fmt} {len(args):,} chars: {got[True]:.1f} us/piece resuming, "
              f"{got[False]:.1f} rescanning", flush=True)
        rows.append([fmt, f"{len(args):,}", f"{pieces:,}", f"{got[True]:.1f}", f"{got[False]:.1f}",
                     f"{got[False] / got[True]:.1f}×"])
        points.setdefault(fmt, []).append((len(args), got[True], got[False]))
    body = ("Host time per streamed piece (4 characters, about a token) of one `write_file` tool call, in the "
            "hermes format (JSON) and the pythonic one (Python literals, each read once whole), by the size "
            "of its arguments; median of "
            f"{reps}; CPU: this machine, one thread. Command: `.venv/bin/python bench/tool_stream_bench.py "
            "--write-docs`.\n\n"
            + table(["format", "arguments (chars)", "pieces", "resuming µs/piece", "rescanning µs/piece",
                     "rescanning ÷ resuming"], rows))
    print(body)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for fmt, pts in points.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{fmt}: resuming (the gateway)")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label=f"{fmt}: rescanning (baseline)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("characters of the call's arguments")
    ax.set_ylabel("µs per streamed piece")
    ax.set_title("Streaming one tool call: host time per piece")
    ax.legend(fontsize=8)
    fig.tight_layout()
    publish(fig, "tool_stream_bench", body, ns.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
