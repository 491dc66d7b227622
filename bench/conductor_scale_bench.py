"""One conductor at cluster scale: how fast it takes store nodes' KV events, what its index costs in
memory, and how fast it schedules as the index grows, against a plain gRPC round trip to the same
process in the same run.

A real ``crescent conductor`` process; this script plays ``--nodes`` store nodes and ``--engines``
prefill engines (Register, then StreamEvents / Heartbeat as their agents do). Prompts are chains of
``--prompt-chunks`` random 16-byte chunk keys; each prompt's chunks go to ``--replicas`` nodes (the
first to an engine's own node). Stages grow the index to each of ``--stages`` copies (key, node):

- ingest: the events streamed to reach the stage, in batches of 4096 (the agents' batch), all nodes
  streaming at once, timed from the first send to the last ack: events/s;
- memory: the conductor's resident set (VmRSS) per copy indexed;
- scheduling: ``--clients`` threads for ``--seconds`` each, alternating (per stage, interleaved
  rounds) between ``Schedule`` of a random indexed prompt (cache-aware: the index walk, every
  engine's plan) and the baseline, a ``Heartbeat`` of an engine (a round trip the conductor answers
  from a dict): calls/s and p50/p99 latency of each, and their ratio.

    .venv/bin/python bench/conductor_scale_bench.py                 # ~2 min: up to 1M copies
    .venv/bin/python bench/conductor_scale_bench.py --write-docs    # also the docs section and PNG
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import pct, publish  # noqa: E402
from kvstore.procs import stop_process  # noqa: E402
from proto.crescent.v1 import conductor_pb2 as cpb  # noqa: E402
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc  # noqa: E402
from proto.crescent.v1 import kvstore_pb2 as pb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK_TOKENS = 256
BATCH = 4096


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def start_conductor(policy: str):
    p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "conductor", "--listen", "127.0.0.1:0",
                          "--chunk-tokens", str(CHUNK_TOKENS), "--dead-timeout", "3600", "--heartbeat-interval", "600",
                          "--policy", policy],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = p.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    if not m:
        stop_process(p, 30)
        raise SystemExit(f"the conductor did not start: {line!r}")
    return p, m.group(1)


class Cluster:
    """The members this script plays, registered with the conductor."""

    def __init__(self, stub, nodes: int, engines: int) -> None:
        self.stub = stub
        self.nodes = [f"node-{i}" for i in range(nodes)]
        self.incarnation = {}
        for n in self.nodes:
            r = stub.Register(cpb.RegisterRequest(member_id=n, kind=cpb.MEMBER_KIND_STORE,
                                                  address=f"10.0.{int(n[5:]) // 250}.{int(n[5:]) % 250 + 1}:7000"))
            self.incarnation[n] = r.incarnation
        self.engines = [f"prefill-{i}" for i in range(engines)]
        for i, e in enumerate(self.engines):
            r = stub.Register(cpb.RegisterRequest(member_id=e, kind=cpb.MEMBER_KIND_PREFILL,
                                                  address=f"10.1.0.{i + 1}:8000", store_node=self.nodes[i % nodes],
                                                  kv_bytes_per_token=131072, namespace=bytes(16),
                                                  chunk_tokens=CHUNK_TOKENS))
            self.incarnation[e] = r.incarnation
        self._reset = set(self.nodes)  # each node's first stream starts with a (here empty) snapshot

    def stream(self, per_node: dict[str, list[bytes]]) -> float:
        """Streams the keys as STORED (DRAM) events, every node at once; seconds from first send to last ack."""
        batches = {}
        for n, keys in per_node.items():
            out = []
            for i in range(0, len(keys), BATCH):
                events = [cpb.ChunkEvent(kind=cpb.EVENT_KIND_STORED, key=k, tier=pb.TIER_DRAM) for k in keys[i:i + BATCH]]
                out.append(cpb.EventBatch(member_id=n, incarnation=self.incarnation[n],
                                          reset=n in self._reset and not i, events=events))
            batches[n] = out
        errors = []

        def run(n):
            try:
                ack = self.stub.StreamEvents(iter(batches[n]), timeout=600)
                assert ack.num_events == len(per_node[n]), (ack.num_events, len(per_node[n]))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in batches]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        self._reset -= set(batches)
        return elapsed


def timed_calls(fn, clients: int, seconds: float) -> list[float]:
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def run(seed):
        rng = random.Random(seed)
        mine = []
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            fn(rng)
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def summary(lat: list[float], seconds: float) -> dict:
    return {"calls": len(lat), "per_s": len(lat) / seconds, "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--prompt-chunks", type=int, default=32, help="chunks per prompt (32 x 256 = 8k tokens)")
    ap.add_argument("--replicas", type=int, default=2, help="nodes holding each prompt")
    ap.add_argument("--stages", default="10000,100000,1000000", help="index sizes (copies) to measure at")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of Schedule and baseline per stage")
    ap.add_argument("--policy", default="cache-aware")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    rng = random.Random(args.seed)

    proc, address = start_conductor(args.policy)
    out = {"args": vars(args), "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}", "stages": []}
    try:
        with grpc.insecure_channel(address) as ch:
            stub = cpb_grpc.ConductorStub(ch)
            cluster = Cluster(stub, args.nodes, args.engines)
            rss0 = rss_bytes(proc.pid)
            prompts: list[list[bytes]] = []
            copies = 0
            engine = cluster.engines[0]
            for target in stages:
                per_node: dict[str, list[bytes]] = {}
                while copies < target:
                    keys = [rng.randbytes(16) for _ in range(args.prompt_chunks)]
                    prompts.append(keys)
                    holders = rng.sample(cluster.nodes, args.replicas)
                    for n in holders:
                        per_node.setdefault(n, []).extend(keys)
                    copies += args.replicas * len(keys)
                events = sum(len(v) for v in per_node.values())
                ingest_s = cluster.stream(per_node)
                # the index has them all once every stream's ack is in (the conductor applies a batch before it
                # reads the next); a Locate of the last prompt shows it
                last = stub.Locate(cpb.LocateRequest(keys=prompts[-1]), timeout=60)
                assert last.num_prefix == args.prompt_chunks, last.num_prefix
                rss = rss_bytes(proc.pid)

                def schedule(r):
                    keys = r.choice(prompts)
                    ans = stub.Schedule(cpb.ScheduleRequest(keys=keys, num_tokens=len(keys) * CHUNK_TOKENS + 100,
                                                            num_output_tokens=100), timeout=60)
                    assert ans.accepted and ans.num_cached_chunks == len(keys), ans

                def heartbeat(r):
                    beat = cpb.HeartbeatRequest(member_id=engine, incarnation=cluster.incarnation[engine],
                                                engine=cpb.EngineLoad())
                    assert stub.Heartbeat(beat, timeout=60).known

                sched, base = [], []
                for _ in range(args.rounds):
                    base += timed_calls(heartbeat, args.clients, args.seconds)
                    sched += timed_calls(schedule, args.clients, args.seconds)
                s, b = summary(sched, args.seconds * args.rounds), summary(base, args.seconds * args.rounds)
                row = {"copies": copies, "prompts": len(prompts), "events": events, "ingest_s": ingest_s,
                       "events_per_s": events / ingest_s, "rss_bytes": rss, "rss_per_copy": (rss - rss0) / copies,
                       "schedule": s, "baseline": b}
                out["stages"].append(row)
                print(f"{copies:>9,} copies ({len(prompts):,} prompts): ingest {events / ingest_s:,.0f} events/s; "
                      f"conductor RSS {rss / 2**20:.0f} MiB ({(rss - rss0) / copies:.0f} B/copy); Schedule "
                      f"{s['per_s']:,.0f}/s p50 {s['p50_ms']:.2f} ms p99 {s['p99_ms']:.2f} ms; Heartbeat "
                      f"{b['per_s']:,.0f}/s p50 {b['p50_ms']:.2f} ms ({s['p50_ms'] / b['p50_ms']:.2f}x)", flush=True)
    finally:
        stop_process(proc, 60)
        proc.stdout.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    write_outputs(out, args.write_docs)


def write_outputs(out: dict, write_docs: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, rows = out["args"], out["stages"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["copies"] for r in rows]
    for name, key, style in (("Schedule", "schedule", "o-"), ("Heartbeat (baseline)", "baseline", "s--")):
        ax1.plot(x, [r[key]["p50_ms"] for r in rows], style, label=f"{name} p50")
        ax1.plot(x, [r[key]["p99_ms"] for r in rows], style, alpha=0.4, label=f"{name} p99")
    ax1.set(xscale="log", xlabel="copies indexed (key, node)", ylabel="ms", title="latency, same process, same run")
    ax1.legend(fontsize=8)
    ax2.plot(x, [r["rss_bytes"] / 2**20 for r in rows], "o-")
    ax2.set(xscale="log", xlabel="copies indexed (key, node)", ylabel="conductor RSS, MiB", title="memory")
    fig.tight_layout()
    lines = [
        f"A real conductor process, {a['nodes']} store nodes and {a['engines']} prefill engines played by the "
        f"bench (Register, StreamEvents in batches of {BATCH}, Heartbeat), prompts of {a['prompt_chunks']} chunks "
        f"({a['prompt_chunks'] * CHUNK_TOKENS} tokens) on {a['replicas']} nodes each, policy `{a['policy']}`, "
        f"{a['clients']} client threads, {a['rounds']} interleaved rounds of {a['seconds']:g} s per stage. "
        f"Machine: {out['machine']}. Re-run with `.venv/bin/python bench/conductor_scale_bench.py --write-docs`.",
        "",
        "| copies indexed | prompts | ingest events/s | conductor RSS | per copy | Schedule/s | p50 ms | p99 ms "
        "| Heartbeat/s (baseline) | p50 ms | Schedule p50 ÷ baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, b = r["schedule"], r["baseline"]
        lines.append(f"| {r['copies']:,} | {r['prompts']:,} | {r['events_per_s']:,.0f} "
                     f"| {r['rss_bytes'] / 2**20:,.0f} MiB "
                     f"| {r['rss_per_copy']:.0f} B | {s['per_s']:,.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} "
                     f"| {b['per_s']:,.0f} | {b['p50_ms']:.2f} | {s['p50_ms'] / b['p50_ms']:.2f}× |")
    publish(fig, "conductor_scale", "\n".join(lines), write_docs)


if __name__ == "__main__":
    main()
