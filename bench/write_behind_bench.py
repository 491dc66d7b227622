"""Put latency and throughput with and without write-behind, in the same run.

An in-process TieredStore (64 MiB of DRAM in 64 KiB slots over a real disk
tier) takes a stream of puts far larger than DRAM, so every put past the first
64 MiB must make room by demoting. With ``write_behind`` off, the demotion's
disk write runs inside the put that needed the room; with it on, a background
thread writes the coldest values ahead of time and the eviction finds them
clean. Reported per value size: put latency p50 / p99 / max, puts' GB/s, and
how many demotions found their value clean; runs alternate off/on.

    python bench/write_behind_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, pct, publish, table  # noqa: E402


def run(folder: str, size: int, total: int, write_behind: bool) -> dict:
    from kvstore.config import StoreConfig
    from kvstore.store import TieredStore

    shutil.rmtree(folder, ignore_errors=True)
    s = TieredStore(StoreConfig(dram=64 << 20, slot_size=64 << 10, disk=folder, disk_size=2 * total + (64 << 20),
                                write_behind=write_behind))
    try:
        value, n, lat = os.urandom(size), total // size, []
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            s.put(b"k%d" % i, value)
            lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        st = s.stats()
    finally:
        s.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {"size": size, "write_behind": write_behind, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3, "gbps": n * size / wall / 1e9, "demotions": st["demotions"],
            "clean": st["demotions_clean"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller stream, one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    total = (192 if args.quick else 512) << 20
    rounds = 1 if args.quick else args.rounds
    tmp = tempfile.mkdtemp(prefix="crescent-wb-", dir=os.environ.get("CRESCENT_BENCH_DIR", "/tmp"))
    results = []
    try:
        for size in (1 << 20, 64 << 10):
            for r in range(rounds):
                for wb in (False, True):
                    res = run(os.path.join(tmp, "d"), size, total, wb)
                    results.append(res)
                    print(f"[write-behind] {size >> 10} KiB values, round {r + 1}/{rounds}, write_behind={wb}: "
                          f"p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, max {res['max_ms']:.1f} ms, "
                          f"{res['gbps']:.2f} GB/s, {res['clean']} of {res['demotions']} demotions clean", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows, summary = [], []
    for size in (1 << 20, 64 << 10):
        agg = {}
        for wb in (False, True):
            rs = [r for r in results if r["size"] == size and r["write_behind"] == wb]
            agg[wb] = {k: median([r[k] for r in rs]) for k in ("p50_ms", "p99_ms", "max_ms", "gbps", "demotions", "clean")}
            a = agg[wb]
            rows.append([f"{size >> 10} KiB", "on" if wb else "off", f"{a['p50_ms']:.2f}", f"{a['p99_ms']:.2f}",
                         f"{a['max_ms']:.1f}", f"{a['gbps']:.2f}", f"{a['clean']:.0f} of {a['demotions']:.0f}"])
        summary.append(f"{size >> 10} KiB values: max put latency {agg[True]['max_ms'] / agg[False]['max_ms']:.2f}×, "
                       f"p99 {agg[True]['p99_ms'] / agg[False]['p99_ms']:.2f}×, "
                       f"throughput {agg[True]['gbps'] / agg[False]['gbps']:.2f}× with write-behind")
    tab = table(["values", "write-behind", "put p50 ms", "put p99 ms", "put max ms", "puts GB/s",
                 "demotions found clean"], rows)
    print("\n" + tab + "\n\n" + "; ".join(summary))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, size in zip(axes, (1 << 20, 64 << 10)):
        for k, wb in enumerate((False, True)):
            rs = [r for r in results if r["size"] == size and r["write_behind"] == wb]
            vals = [median([r[m] for r in rs]) for m in ("p50_ms", "p99_ms", "max_ms")]
            ax.bar([x + 0.4 * k for x in range(3)], vals, 0.4, label="write-behind " + ("on" if wb else "off"))
        ax.set_xticks([x + 0.2 for x in range(3)], ["p50", "p99", "max"])
        ax.set_yscale("log")
        ax.set_ylabel("put latency (ms)")
        ax.set_title(f"{size >> 10} KiB values")
        ax.legend(fontsize=8)
    fig.tight_layout()
    body = ("## Write-behind (bench/write_behind_bench.py)\n\n"
            f"In-process TieredStore, 64 MiB of DRAM in 64 KiB slots over a disk tier on the VM's ext4 virtual "
            f"disk; a stream of {total >> 20} MiB of puts (every put past the first 64 MiB makes room by demoting); "
            f"medians over {rounds} alternating round(s) of write-behind off and on, same run. 2-core VM: the "
            "background writer competes with the putting thread for the cores and the GIL. Command: "
            "`.venv/bin/python bench/write_behind_bench.py --write-docs`.\n\n"
            + tab + "\n\n**" + "; ".join(summary) + ".**\n")
    publish(fig, "write_behind", body, args.write_docs)


if __name__ == "__main__":
    main()
