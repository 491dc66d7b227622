"""The conductor's hot-prefix tracker under a stream of fresh prompts, against its previous design.

``Schedule`` touches every chunk key of a prompt in ``HotTracker`` under the conductor's lock. A
cluster that keeps seeing new prompts fills the tracker (``--max-entries``, the conductor's 2^20)
and then keeps it full. Both designs run the same stream in the same process: ``--touches``
prompts of ``--prompt-chunks`` fresh 16-byte keys behind a shared ``--prefix-chunks`` system prompt,
one prompt every ``--interval-ms`` of simulated time (half-life 60 s, the conductor's default):

- ``HotTracker`` (kvstore/conductor/index.py): an OrderedDict of one float per key; each touch past
  the size drops as many least recently used keys as it added (a hot one gets another pass);
- the previous design (``PrunedHotTracker`` below, as it was at commit 8981960): a dict of
  ``(count, time)``, pruned past the size by one pass over every key (cold ones go), then the least
  recently used down to 3/4 of the size.

It prints per-touch latency (mean, p50, p99, the longest: a prune is a pause under the lock), bytes
per key (tracemalloc, the keys themselves not counted: the index holds them too) and plots each
touch's time.

    .venv/bin/python bench/hot_tracker_bench.py                 # ~1 min
    .venv/bin/python bench/hot_tracker_bench.py --write-docs    # also the docs section and PNG
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import platform
import random
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import pct, publish  # noqa: E402
from kvstore.conductor.index import HotTracker  # noqa: E402


class PrunedHotTracker:
    """The previous ``HotTracker`` (commit 8981960), kept here as the baseline."""

    def __init__(self, half_life_s: float, max_entries: int = 1 << 20) -> None:
        self._rate = math.log(2) / half_life_s
        self._counts: dict = {}
        self._max_entries = max_entries

    def _decayed(self, key, now: float) -> float:
        v = self._counts.get(key)
        if v is None:
            return 0.0
        count, t = v
        return count * math.exp(-self._rate * max(0.0, now - t))

    def touch(self, keys, now: float) -> None:
        counts = self._counts
        for k in keys:
            value = self._decayed(k, now) + 1.0
            counts.pop(k, None)
            counts[k] = (value, now)
        if len(counts) > self._max_entries:
            self._prune(now)

    def count(self, key, now: float) -> float:
        return self._decayed(key, now)

    def __len__(self) -> int:
        return len(self._counts)

    def _prune(self, now: float) -> None:
        for k in [k for k in self._counts if self._decayed(k, now) < 0.5]:
            del self._counts[k]
        excess = len(self._counts) - self._max_entries * 3 // 4
        if excess > 0:
            for k in list(itertools.islice(self._counts, excess)):
                del self._counts[k]


DESIGNS = {"HotTracker": HotTracker, "previous (prune pass)": PrunedHotTracker}


def stream(args) -> list[list[bytes]]:
    rng = random.Random(args.seed)
    prefix = [rng.randbytes(16) for _ in range(args.prefix_chunks)]
    return [prefix + [rng.randbytes(16) for _ in range(args.prompt_chunks)] for _ in range(args.touches)]


def run(cls, prompts: list[list[bytes]], args) -> dict:
    tracker = cls(half_life_s=60.0, max_entries=args.max_entries)
    times = []
    now = 0.0
    gc.collect()
    gc.disable()  # (a collection would land in some touch's time, a different one per design)
    try:
        for keys in prompts:
            now += args.interval_ms / 1e3
            t0 = time.perf_counter()
            tracker.touch(keys, now)
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    hot = tracker.count(prompts[-1][0], now)
    return {"times": times, "entries": len(tracker), "prefix_count": hot}


def bytes_per_key(cls, prompts: list[list[bytes]], args) -> float:
    """tracemalloc's count of what the tracker allocates for its first ``max_entries`` keys (filled
    without eviction), per key."""
    tracker = cls(half_life_s=60.0, max_entries=args.max_entries)
    n, fill = 0, []
    for keys in prompts:
        if n + len(keys) > args.max_entries:
            break
        fill.append(keys)
        n += len(keys)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i, keys in enumerate(fill):
        tracker.touch(keys, float(i))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / len(tracker)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-entries", type=int, default=1 << 20)
    ap.add_argument("--touches", type=int, default=60_000)
    ap.add_argument("--prompt-chunks", type=int, default=32)
    ap.add_argument("--prefix-chunks", type=int, default=4)
    ap.add_argument("--interval-ms", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    prompts = stream(args)
    new_keys = args.touches * args.prompt_chunks + args.prefix_chunks
    print(f"{args.touches:,} touches of {args.prefix_chunks}+{args.prompt_chunks} keys ({new_keys:,} distinct) into "
          f"{args.max_entries:,} entries", file=sys.stderr)
    results = {}
    for name, cls in DESIGNS.items():
        print(f"  {name}: touches ...", file=sys.stderr, flush=True)
        r = run(cls, prompts, args)
        print(f"  {name}: bytes per key ...", file=sys.stderr, flush=True)
        r["bytes_per_key"] = bytes_per_key(cls, prompts, args)
        results[name] = r
    write_outputs(args, results)


def write_outputs(args, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["previous (prune pass)"]
    lines = [
        f"{args.touches:,} touches (one `Schedule`'s: a prompt of {args.prefix_chunks} shared and "
        f"{args.prompt_chunks} fresh chunk keys, every {args.interval_ms:g} ms of simulated time, half-life 60 s) "
        f"into a tracker of {args.max_entries:,} entries, both designs in one process. "
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}. "
        "Re-run with `.venv/bin/python bench/hot_tracker_bench.py --write-docs`.",
        "",
        "| design | mean µs | p50 µs | p99 µs | longest touch | touches over 10 ms | bytes per key "
        "| entries at the end | shared prefix's count |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r["times"]
        lines.append(f"| {name} | {sum(t) / len(t) * 1e6:.1f} | {pct(t, 50) * 1e6:.1f} | {pct(t, 99) * 1e6:.1f} "
                     f"| {max(t) * 1e3:.1f} ms | {sum(x > 0.01 for x in t)} | {r['bytes_per_key']:.0f} "
                     f"| {r['entries']:,} | {r['prefix_count']:.1f} |")
    new = results["HotTracker"]
    lines += ["", f"Longest touch: {max(new['times']) / max(base['times']):.4f}× the previous design's; total "
              f"time: {sum(new['times']) / sum(base['times']):.2f}×; bytes per key: "
              f"{new['bytes_per_key'] / base['bytes_per_key']:.2f}×."]
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for name, r in results.items():
        ax.plot([t * 1e3 for t in r["times"]], lw=0.6, label=name)
    ax.set(yscale="log", xlabel="touch (one Schedule's prompt)", ylabel="ms",
           title=f"each touch's time; the tracker is full after {args.max_entries // (args.prompt_chunks):,} touches")
    ax.legend(fontsize=8)
    fig.tight_layout()
    publish(fig, "hot_tracker", "\n".join(lines), args.write_docs)


if __name__ == "__main__":
    main()
