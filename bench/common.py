"""Shared helpers for the benchmarks: stats, tables, the docs section writer."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

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


@contextlib.contextmanager
def up_cluster(model: str, extra: list[str], dram: str = "512MiB"):
    """``crescent up`` (conductor, store, engines, gateway: real processes, every port picked free)
    with ``extra`` flags; yields the gateway's OpenAI base URL; stops it all on exit (SIGTERM to
    ``up``, which stops its parts)."""
    data = tempfile.mkdtemp(prefix="crescent-bench-")
    out = open(os.path.join(data, "up.out"), "w")
    up = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "up", "--data", data, "--model", model,
                           "--store-port", "0", "--prefill-port", "0", "--decode-port", "0", "--gateway-port", "0",
                           "--conductor-port", "0", "--dram", dram, *extra], cwd=ROOT, stdout=out,
                          stderr=subprocess.STDOUT)
    try:
        state = os.path.join(data, "up.json")
        deadline = time.monotonic() + 300
        while not os.path.exists(state):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(open(os.path.join(data, "up.out")).read())
            time.sleep(0.2)
        yield json.load(open(state))["openai_base_url"]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
        out.close()
        shutil.rmtree(data, ignore_errors=True)
