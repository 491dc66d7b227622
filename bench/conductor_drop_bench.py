"""A store node leaves a conductor that indexes many of its chunks: how long do the conductor's
other calls wait?

A node that dies, deregisters or restarts (its new incarnation drops the old one's chunks) leaves
the index. Its chunks used to be cleared in one hold of the conductor's lock, and every Schedule,
heartbeat and event batch waited for it. Now they leave every answer at once (the node's slot
leaves a live mask) and a sweeper thread clears them in batches of ``SWEEP_KEYS``, letting go of
the lock between batches (``GlobalIndex.drop_node(lazy=True)``, ``Conductor.forget``).

A conductor in this process, serving real gRPC on loopback; this script plays the store nodes (a
``--big`` node and 63 others, prompts of 32 chunks on two nodes each) and one prefill engine.
``--clients`` threads call ``Schedule`` of random indexed prompts without pause; half a second in,
the big node's chunks are dropped, under the lock as the conductor does it, both ways in turn
(``--rounds`` each, the big node re-streamed before every round): ``eager``, the whole drop in
that one hold (what the conductor did before), and ``lazy``, the sweep (what it does now). Per
way: Schedule latency before the drop (baseline) and from the drop until its work is done plus
0.2 s, and how long the index work took.

    .venv/bin/python bench/conductor_drop_bench.py                  # ~1 min
    .venv/bin/python bench/conductor_drop_bench.py --write-docs     # also the docs section and PNG
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import pct, publish, table  # noqa: E402
from kvstore.conductor import service  # noqa: E402
from kvstore.conductor.config import ConductorConfig  # noqa: E402
from kvstore.conductor.service import Conductor  # noqa: E402
from proto.crescent.v1 import conductor_pb2 as cpb  # noqa: E402
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc  # noqa: E402
from proto.crescent.v1 import kvstore_pb2 as pb  # noqa: E402

CHUNK_TOKENS = 256
BATCH = 4096
PROMPT = 32


def stream(stub, member: str, incarnation: int, keys: list[bytes]) -> None:
    batches = [cpb.EventBatch(member_id=member, incarnation=incarnation, reset=not i,
                              events=[cpb.ChunkEvent(kind=cpb.EVENT_KIND_STORED, key=k, tier=pb.TIER_DRAM)
                                      for k in keys[i:i + BATCH]])
               for i in range(0, max(1, len(keys)), BATCH)]
    ack = stub.StreamEvents(iter(batches), timeout=600)
    assert ack.num_events == len(keys), (ack.num_events, len(keys))


def register(stub, member: str, kind=cpb.MEMBER_KIND_STORE, **kw) -> int:
    return stub.Register(cpb.RegisterRequest(member_id=member, kind=kind, **kw), timeout=60).incarnation


def one_round(c: Conductor, stub, way: str, prompts: list[list[bytes]], clients: int) -> dict:
    """Schedule calls from ``clients`` threads; the big node dropped ``way`` half a second in."""
    samples: list[tuple[float, float]] = []  # (start relative to the drop, latency)
    lock = threading.Lock()
    stop = threading.Event()
    t_drop = time.perf_counter() + 0.5

    def run(seed: int) -> None:
        rng, mine = random.Random(seed), []
        while not stop.is_set():
            keys = rng.choice(prompts)
            t0 = time.perf_counter()
            ans = stub.Schedule(cpb.ScheduleRequest(keys=keys, num_tokens=len(keys) * CHUNK_TOKENS + 100,
                                                    num_output_tokens=100), timeout=60)
            mine.append((t0 - t_drop, time.perf_counter() - t0))
            assert ans.accepted, ans
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, t_drop - time.perf_counter()))
    t0 = time.perf_counter()
    with c._lock:
        if way == "eager":
            n = c.index.drop_node("big")
        else:
            n = c.forget(c.index, "big")
    held = time.perf_counter() - t0
    while True:  # the sweep's end (at once for eager)
        with c._lock:
            if not c.index.sweep(0):
                break
        time.sleep(0.001)
    done = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    before = [lat for s, lat in samples if s < 0 and s + lat < 0]
    during = [lat for s, lat in samples if s + lat >= 0 and s <= done + 0.2]
    return {"way": way, "chunks": n, "held_s": held, "done_s": done, "samples": samples,
            "before": before, "during": during}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", type=int, default=500_000, help="chunks of the node that leaves")
    ap.add_argument("--prompts", type=int, default=2000, help="prompts indexed on the other nodes")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per way, interleaved")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    c = Conductor(ConductorConfig(listen="127.0.0.1:0", chunk_tokens=CHUNK_TOKENS, dead_timeout=3600,
                                  heartbeat_interval=600)).start()
    channel = grpc.insecure_channel(c.address)
    stub = cpb_grpc.ConductorStub(channel)
    try:
        rng = random.Random(1)
        others = [f"node-{i}" for i in range(63)]
        inc = {n: register(stub, n, address=f"10.0.0.{i + 1}:7000") for i, n in enumerate(others)}
        register(stub, "prefill-0", cpb.MEMBER_KIND_PREFILL, address="10.1.0.1:8000", store_node=others[0],
                 kv_bytes_per_token=131072, namespace=bytes(16), chunk_tokens=CHUNK_TOKENS)
        prompts = [[rng.randbytes(16) for _ in range(PROMPT)] for _ in range(args.prompts)]
        per_node: dict[str, list[bytes]] = {n: [] for n in others}
        for p in prompts:
            for n in rng.sample(others, 2):
                per_node[n].extend(p)
        for n, keys in per_node.items():
            stream(stub, n, inc[n], keys)
        big = [rng.randbytes(16) for _ in range(args.big)]
        print(f"{args.prompts} prompts on 63 nodes ({sum(map(len, per_node.values())):,} copies); "
              f"the leaving node holds {args.big:,} chunks; {args.clients} Schedule threads", flush=True)
        results = []
        for r in range(args.rounds):
            for way in ("eager", "lazy"):
                t0 = time.perf_counter()
                stream(stub, "big", register(stub, "big", address="10.0.9.1:7000"), big)
                res = one_round(c, stub, way, prompts, args.clients)
                results.append(res)
                with c._lock:  # every chunk of the node gone, no other's
                    assert res["chunks"] == len(big) and c.index.num_chunks() == len(prompts) * PROMPT, res["chunks"]
                print(f"round {r + 1}/{args.rounds} {way:5s}: streamed and ran in "
                      f"{time.perf_counter() - t0:.1f} s; index work {res['done_s'] * 1e3:.0f} ms "
                      f"(lock held at most {res['held_s'] * 1e3:.1f} ms by the drop call); Schedule max "
                      f"{max(res['during']) * 1e3:.0f} ms during, {max(res['before']) * 1e3:.0f} ms before",
                      flush=True)
    finally:
        channel.close()
        c.stop(0)

    rows, agg = [], {}
    for way in ("eager", "lazy"):
        rs = [r for r in results if r["way"] == way]
        before = [x for r in rs for x in r["before"]]
        during = [x for r in rs for x in r["during"]]
        worst = [max(r["during"]) for r in rs]
        agg[way] = {"worst": worst, "before_p50": pct(before, 50), "during_p99": pct(during, 99)}
        rows.append([way, f"{min(r['done_s'] for r in rs) * 1e3:.0f}–{max(r['done_s'] for r in rs) * 1e3:.0f}",
                     f"{1e3 * pct(before, 50):.1f}", f"{1e3 * pct(before, 99):.1f}", f"{1e3 * max(before):.1f}",
                     f"{1e3 * pct(during, 50):.1f}", f"{1e3 * pct(during, 99):.1f}",
                     " / ".join(f"{1e3 * w:.0f}" for w in worst)])
    ratio = max(agg["lazy"]["worst"]) / max(agg["eager"]["worst"])
    body = (
        f"An in-process conductor serving gRPC on loopback; {args.prompts:,} prompts of {PROMPT} chunks on 2 of 63 "
        f"nodes each, one more node holding {args.big:,} chunks, which leaves (its chunks dropped under the "
        f"conductor's lock, as a death, a deregistration or a restart does) while {args.clients} threads call "
        f"`Schedule` of random indexed prompts without pause; {args.rounds} rounds per way, interleaved. "
        f"`eager`: the whole drop in that hold, what the conductor did before; `lazy`: the node leaves every "
        f"answer at once and a sweeper clears its keys {service.SWEEP_KEYS} per hold of the lock. \"During\": calls "
        f"that ended after the drop began and started before its work ended + 0.2 s. Machine: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}. "
        f"Command: `.venv/bin/python bench/conductor_drop_bench.py --write-docs`.\n\n"
        + table(["way", "index work ms", "before p50 ms", "before p99 ms", "before max ms", "during p50 ms",
                 "during p99 ms", "during max ms (each round)"], rows)
        + f"\n\n**The longest Schedule while a node of {args.big:,} chunks leaves: "
          f"{1e3 * max(agg['lazy']['worst']):.0f} ms swept vs {1e3 * max(agg['eager']['worst']):.0f} ms "
          f"dropped in one hold ({ratio:.2f}×); p99 during the drop {1e3 * agg['lazy']['during_p99']:.1f} vs "
          f"{1e3 * agg['eager']['during_p99']:.1f} ms.**\n")
    print()
    print(body)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, way in zip(axes, ("eager", "lazy")):
        r = max((r for r in results if r["way"] == way), key=lambda r: max(r["during"]))
        xs = [s for s, _ in r["samples"]]
        ax.scatter(xs, [1e3 * lat for _, lat in r["samples"]], s=3)
        ax.axvspan(0, r["done_s"], color="tab:red", alpha=0.15, label="index work")
        ax.set(title=f"{way}: {args.big:,} chunks dropped", xlabel="call start, s from the drop", yscale="log")
        ax.legend(loc="upper right")
    axes[0].set_ylabel("Schedule latency, ms")
    fig.tight_layout()
    publish(fig, "conductor_drop", body, args.write_docs)


if __name__ == "__main__":
    main()
