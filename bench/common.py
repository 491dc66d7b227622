"""Shared helpers for the benchmarks: stats, tables, the docs section writer."""

from __future__ import annotations

import os
import re
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_docs_section(name: str, body: str, path: str = os.path.join(ROOT, "docs", "benchmarks.md")) -> None:
    """Replaces the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in docs/benchmarks.md."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def publish(fig, name: str, body: str, write_docs: bool) -> str:
    """Saves ``fig`` as bench/out/<name>.png; with ``write_docs``, copies it to docs/ and
    writes ``body`` plus the image into the ``<name>`` section of docs/benchmarks.md."""
    import shutil

    os.makedirs(OUT, exist_ok=True)
    png = os.path.join(OUT, f"{name}.png")
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")
    if write_docs:
        shutil.copy(png, os.path.join(ROOT, "docs", f"{name}.png"))
        write_docs_section(name, f"{body.rstrip()}\n\n![{name}]({name}.png)\n")
        print("docs/benchmarks.md updated")
    return png
