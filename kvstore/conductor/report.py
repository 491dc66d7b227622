"""Replay reports: summary numbers, a markdown table, a PNG plot, a progress bar."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence

import numpy as np

from kvstore.conductor.simulator import ReplayConfig, ReplayResult

COLUMNS = [("policy", "policy"), ("hit_rate", "hit rate"), ("ttft_mean_s", "TTFT mean s"),
           ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"), ("ttft_p99_s", "TTFT p99 s"),
           ("tbt_mean_ms", "TBT mean ms"), ("tbt_p90_ms", "TBT p90 ms"), ("slo_goodput", "SLO goodput"),
           ("goodput_rps", "goodput req/s"), ("num_rejected", "rejected"), ("prefill_utilization", "prefill util")]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(r: ReplayResult, cfg: ReplayConfig) -> dict:
    """The figures of one replay, as plain data."""
    finite_tbt = [t for t in r.tbt_s if math.isfinite(t)]
    return {
        "policy": r.policy, "num_requests": r.num_requests, "num_accepted": r.num_accepted,
        "num_rejected": r.num_rejected, "hit_rate": r.hit_rate,
        "ttft_mean_s": float(np.mean(r.ttft_s)) if r.ttft_s else float("nan"),
        "ttft_p50_s": _pct(r.ttft_s, 50), "ttft_p90_s": _pct(r.ttft_s, 90), "ttft_p99_s": _pct(r.ttft_s, 99),
        "tbt_mean_ms": float(np.mean(finite_tbt)) * 1e3 if finite_tbt else float("nan"),
        "tbt_p90_ms": _pct(finite_tbt, 90) * 1e3,
        "slo_goodput": r.goodput, "goodput_rps": r.goodput_rps, "num_slo_met": r.num_slo_met,
        "num_remote_loads": r.num_remote_loads, "num_replications": r.num_replications,
        "prefill_utilization": r.prefill_busy_s / (cfg.num_prefill * r.duration_s) if r.duration_s else 0.0,
        "duration_s": r.duration_s, "wall_s": r.wall_s,
        "config": {"num_prefill": cfg.num_prefill, "num_decode": cfg.num_decode,
                   "cache_blocks": cfg.cache_blocks, "slo_ttft_s": cfg.slo_ttft, "slo_tbt_s": cfg.slo_tbt,
                   "profile": cfg.profile.name},
    }


def _fmt(key: str, v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "-"
    if key in ("hit_rate", "slo_goodput", "prefill_utilization"):
        return f"{v:.3f}"
    return f"{v:.2f}"


def markdown_table(rows: Sequence[dict]) -> str:
    out = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_fmt(k, r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def text_table(rows: Sequence[dict]) -> str:
    """An aligned plain-text table for the terminal."""
    cells = [[h for _, h in COLUMNS]] + [[_fmt(k, r[k]) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Bar charts of hit rate, mean and p90 TTFT, and SLO goodput per policy.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--compare writes a PNG with matplotlib: pip install matplotlib") from None
    names = [r["policy"] for r in rows]
    panels = [("hit_rate", "prefix hit rate"), ("ttft_mean_s", "mean TTFT (s)"),
              ("ttft_p90_s", "p90 TTFT (s)"), ("slo_goodput", "SLO goodput (fraction)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        vals = [r[key] for r in rows]
        bars = ax.bar(range(len(names)), vals, color=["#999", "#bbb", "#6a9fd4", "#e3a33b", "#c0392b"][: len(names)])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        for b, v in zip(bars, vals):
            ax.annotate(_fmt(key, v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every 0.1 s."""

    def __init__(self, label: str, stream=sys.stderr, width: int = 30) -> None:
        self.label, self.stream, self.width = label, stream, width
        self._last = 0.0
        self._t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = int(self.width * done / total) if total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r{self.label:<12} [{bar}] {done}/{total} {now - self._t0:5.1f}s{end}")
        self.stream.flush()
