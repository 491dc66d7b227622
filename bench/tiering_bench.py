"""Tiering under a working set larger than DRAM: disk bytes written per byte read, and the DRAM hit rate.

A store node's TieredStore (in process, a real LMDB file) with a DRAM tier of
``--dram-values`` values holds a working set ``--ratio`` times as large; a
read-mostly Zipf(``--zipf``) stream of gets runs over it (every miss is put
back, as an engine re-saves a recomputed chunk). Reported per promotion policy
(``promote_after`` 1: every disk read promotes, the old behaviour; 2: the
default) and tiering mode (``disk_copies`` False: exclusive, a promoted value
leaves the disk and demoting it again rewrites it, the old default; True:
inclusive, its disk record is kept, the default), in the same run: disk bytes
written per byte read (target <= 0.1 for the default), DRAM hit rate, and, as
the reference, the DRAM hit rate an offline LRU of the same size gets on the
same stream.

    python bench/tiering_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import publish, table  # noqa: E402


def zipf_stream(n_keys: int, s: float, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** s for i in range(n_keys)]
    order = list(range(n_keys))
    rng.shuffle(order)  # popularity not tied to insertion order
    return [order[i] for i in rng.choices(range(n_keys), weights=weights, k=length)]


def lru_hit_rate(stream: list[int], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in stream:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(stream)


def run(policy: int, copies: bool, stream: list[int], n_keys: int, dram_values: int, value_bytes: int,
        tmp: str) -> dict:
    from kvstore.config import StoreConfig
    from kvstore.store import Tier, TieredStore

    cfg = StoreConfig(dram=dram_values * value_bytes, slot_size=value_bytes, disk=os.path.join(tmp, f"p{policy}{'i' if copies else 'x'}"),
                      disk_size=4 * n_keys * value_bytes + (64 << 20), promote_after=policy, disk_copies=copies)
    s = TieredStore(cfg)
    try:
        value = os.urandom(value_bytes)
        for k in range(n_keys):  # the working set, once
            s.put(b"k%d" % k, value)
        base = s.stats()
        dram_hits = 0
        for k in stream:
            key = b"k%d" % k
            tier = s.tier_of(key)
            if s.get(key) is None:
                s.put(key, value)
            elif tier is Tier.DRAM:
                dram_hits += 1
        st = s.stats()
        read = st["disk_bytes_read"] - base["disk_bytes_read"]
        written = st["disk_bytes_written"] - base["disk_bytes_written"]
        return {"policy": policy, "copies": copies, "read": read, "written": written, "w_per_r": written / read if read else 0.0,
                "dram_hit": dram_hits / len(stream), "promotions": st["promotions"] - base["promotions"],
                "demotions": st["demotions"] - base["demotions"],
                "demotions_clean": st["demotions_clean"] - base["demotions_clean"]}
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dram-values", type=int, default=256)
    ap.add_argument("--ratio", type=float, default=4.0, help="working set / DRAM")
    ap.add_argument("--value-kib", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=0.9)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.dram_values, args.reads = 64, 3000
    n_keys = int(args.dram_values * args.ratio)
    stream = zipf_stream(n_keys, args.zipf, args.reads)
    ref = lru_hit_rate(stream, args.dram_values)
    tmp = tempfile.mkdtemp(prefix="crescent-tiering-")
    try:
        rows = []
        for policy, copies in ((1, False), (2, False), (1, True), (2, True)):
            print(f"[tiering] promote_after={policy}, disk_copies={copies}: {args.reads} Zipf({args.zipf}) reads "
                  f"over {n_keys} values, DRAM holds {args.dram_values}", flush=True)
            rows.append(run(policy, copies, stream, n_keys, args.dram_values, args.value_kib << 10, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    def mode(r: dict) -> str:
        return "inclusive" if r["copies"] else "exclusive"

    md = table(["promote_after", "disk_copies", "disk MiB read", "disk MiB written", "written / read",
                "DRAM hit rate", "offline LRU hit rate", "× LRU", "promotions", "demotions", "of which clean"],
               [[r["policy"], f"{r['copies']} ({mode(r)})", f"{r['read'] / 2**20:.0f}", f"{r['written'] / 2**20:.0f}",
                 f"{r['w_per_r']:.3f}", f"{r['dram_hit']:.1%}", f"{ref:.1%}", f"{r['dram_hit'] / ref:.3f}",
                 r["promotions"], r["demotions"], r["demotions_clean"]] for r in rows])
    default = next(r for r in rows if r["policy"] == 2 and r["copies"])
    old = next(r for r in rows if r["policy"] == 1 and not r["copies"])
    verdict = (f"Defaults (promote_after=2, inclusive): {default['w_per_r']:.3f} bytes written per byte read "
               f"(target ≤ 0.1: {'met' if default['w_per_r'] <= 0.1 else 'NOT met'}; old policy "
               f"{old['w_per_r']:.2f}), DRAM hit rate {default['dram_hit']:.1%} against the offline LRU's {ref:.1%}.")
    print()
    print(md)
    print()
    print(verdict)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"after={r['policy']}\n{mode(r)}" for r in rows]
    a.bar(names, [r["w_per_r"] for r in rows])
    a.axhline(0.1, color="gray", ls="--", lw=1, label="target (defaults) ≤ 0.1")
    a.legend(fontsize=7)
    a.set_ylabel("disk bytes written per byte read")
    b.bar(names + ["offline LRU"], [r["dram_hit"] for r in rows] + [ref])
    b.set_ylabel("DRAM hit rate")
    b.tick_params(axis="x", labelsize=7)
    a.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"Zipf({args.zipf}) reads, working set {args.ratio:g}x DRAM")
    fig.tight_layout()
    body = (f"In-process TieredStore with a real disk tier (kvstore/disk.py): DRAM holds {args.dram_values} values of "
            f"{args.value_kib} KiB, the working set is {args.ratio:g}x that ({n_keys} values), "
            f"{args.reads} Zipf({args.zipf}) gets (a miss is put back). Same stream for every policy and mode; the "
            f"offline LRU is a plain LRU of DRAM's size over it. `disk_copies` False (exclusive, the old default): a "
            f"value promoted from disk leaves it, demoting it again rewrites it; True (inclusive, the default): its "
            f"disk record is kept, so that demotion writes nothing (`of which clean`). Command: "
            f"`.venv/bin/python bench/tiering_bench.py --write-docs`.\n\n{md}\n\n**{verdict}**")
    publish(fig, "tiering", body, args.write_docs)


if __name__ == "__main__":
    main()
