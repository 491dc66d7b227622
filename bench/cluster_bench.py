"""Conductor failover: kill -9 the leader ten times under a live Schedule workload.

Real processes: a one-member etcd, three `crescent conductor --etcd` replicas
(leader lease --leader-ttl, default 2 s), a store node holding a prompt's
chunks, and a prefill engine's membership (a MemberAgent in this process),
both given every conductor address. A client thread asks Schedule for the
prompt every 20 ms through ConductorClient (which follows a follower's hint to
the leader). Each round kills the leader with SIGKILL, then restarts it on the
same port (it rejoins as a follower).

Per kill it measures the time to the first answered Schedule (a new leader)
and to the first one reusing the whole cached prefix again (the store node has
re-registered and resent its chunks); over the run, requests answered and the
reuse before, during (kill → reuse restored) and after. Baseline: the reuse and
answer rate of the same workload before any kill. The TTL bounds the first
figure from above: etcd holds a dead leader's key until its lease lapses.

    .venv/bin/python bench/cluster_bench.py [--kills 10] [--leader-ttl 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, median, publish, table  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.conductor.agent import MemberAgent  # noqa: E402
from kvstore.conductor.client import ConductorClient  # noqa: E402
from kvstore.conductor.membership import MemberKind  # noqa: E402
from kvstore.coord import LocalEtcd  # noqa: E402
from kvstore.errors import CrescentError  # noqa: E402
from kvstore.procs import stop_process  # noqa: E402

NUM_KEYS, CACHED = 8, 6


class Proc:
    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on ([^\s,]+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"crescent {args[0]} did not start: {line!r}")
        self.address = m.group(1)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        stop_process(self.proc, 60)
        self.proc.stdout.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--leader-ttl", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true", help="write the figures into docs/benchmarks.md")
    ns = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="crescent-cluster-bench-")
    etcd = LocalEtcd(os.path.join(tmp, "etcd"))
    common = ["--etcd", etcd.endpoint, "--leader-ttl", str(ns.leader_ttl), "--heartbeat-interval", "0.2",
              "--dead-timeout", "30"]
    conductors = [Proc(["conductor", "--listen", "127.0.0.1:0", *common]) for _ in range(ns.replicas)]
    everyone = ",".join(c.address for c in conductors)
    store = Proc(["store", "--listen", "127.0.0.1:0", "--dram", "8MiB", "--slot-size", "4KiB", "--node-id", "store-0",
                  "--conductor", everyone])
    agent = MemberAgent(everyone, "prefill-0", MemberKind.PREFILL, store_node="store-0").start()
    keys = [bytes([i + 1]) * 16 for i in range(NUM_KEYS)]
    with StoreClient(store.address) as s:
        s.batch_put([(k, b"v" * 100) for k in keys[:CACHED]])

    samples: list[tuple[float, bool, int]] = []  # (time, answered, cached chunks)
    stop = threading.Event()
    client = ConductorClient(everyone, timeout_s=2.0)

    def workload() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = client.schedule(keys, num_tokens=NUM_KEYS * 256, chunk_tokens=256)
                samples.append((t, True, r.num_cached_chunks if r.accepted else 0))
            except CrescentError:
                samples.append((t, False, 0))
            stop.wait(0.02)

    worker = threading.Thread(target=workload, daemon=True)
    t0 = time.monotonic()
    worker.start()
    kills = []
    try:
        deadline = time.monotonic() + 120
        while not (samples and samples[-1][2] == CACHED):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster never reused the cached prefix")
            time.sleep(0.05)
        t_warm = samples[-1][0]
        time.sleep(3.0)  # the baseline window
        for k in range(ns.kills):
            leader_addr = client.address
            victim = next(c for c in conductors if c.address == leader_addr)
            t_kill = time.monotonic()
            victim.kill9()
            answered = restored = None
            deadline = t_kill + 120
            while restored is None and time.monotonic() < deadline:
                time.sleep(0.01)
                after = [x for x in samples if x[0] >= t_kill]
                answered = answered or next((x[0] for x in after if x[1]), None)
                restored = next((x[0] for x in after if x[2] == CACHED), None)
            if restored is None:
                raise RuntimeError(f"kill {k + 1}: reuse did not come back within 120 s")
            kills.append((t_kill, answered - t_kill, restored - t_kill))
            print(f"kill {k + 1}/{ns.kills}: leader {leader_addr} -> {client.address}: answered after "
                  f"{answered - t_kill:.2f} s, reuse restored after {restored - t_kill:.2f} s", flush=True)
            port = victim.address.rpartition(":")[2]
            conductors[conductors.index(victim)] = Proc(["conductor", "--listen", f"127.0.0.1:{port}", *common])
            time.sleep(2.0)
        time.sleep(3.0)
    finally:
        stop.set()
        worker.join(timeout=10)
        client.close()
        agent.stop()
        store.stop()
        for c in conductors:
            c.stop()
        etcd.stop()

    first = [a for _, a, _ in kills]
    full = [r for _, _, r in kills]
    spans = [(t, t + r) for t, _, r in kills]

    def phase(x) -> str:
        if x[0] < t_warm:
            return "warm-up"  # the store's chunks still reaching the first leader's index
        if x[0] < kills[0][0]:
            return "before"
        if any(a <= x[0] < b for a, b in spans):
            return "during"
        return "after"

    rows = []
    for name in ("before", "during", "after"):
        xs = [x for x in samples if phase(x) == name]
        ok = [x for x in xs if x[1]]
        reuse = sum(x[2] for x in ok) / (len(ok) * NUM_KEYS) if ok else float("nan")
        rows.append([name, len(xs), len(ok), f"{len(ok) / len(xs):.1%}" if xs else "-", f"{reuse:.3f}"])
    text = (f"{ns.replicas} conductor replicas on one etcd (leader lease {ns.leader_ttl:g} s), {ns.kills} kill -9 "
            f"of the leader under a Schedule loop every 20 ms (2 s deadline; the client follows followers' "
            f"hints and the address list).\n\n"
            + table(["failover", "median", "max"],
                    [["first answered Schedule (a new leader)", f"{median(first):.2f} s", f"{max(first):.2f} s"],
                     ["whole prefix reused again (index rebuilt)", f"{median(full):.2f} s", f"{max(full):.2f} s"]])
            + "\n\n" + table(["phase", "requests", "answered", "answered %", f"reuse (of {NUM_KEYS} chunks)"], rows)
            + f"\n\nBaseline: the reuse before any kill is {CACHED / NUM_KEYS:.3f} ({CACHED} of {NUM_KEYS} chunks "
            f"cached). `during` spans each kill to its restored reuse: requests there fail (no leader) or reuse "
            f"less (the index is refilling); a request counted `after` can still fail if it was sent before a "
            f"kill and timed out after the reuse came back.\n")
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    ts = [x[0] - t0 for x in samples]
    ax.plot(ts, [x[2] / NUM_KEYS if x[1] else float("nan") for x in samples], ".", ms=2, label="reuse (answered)")
    fails = [x[0] - t0 for x in samples if not x[1]]
    ax.plot(fails, [0] * len(fails), "x", color="tab:red", ms=3, label="no answer")
    for t, _, _ in kills:
        ax.axvline(t - t0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("seconds (dashed: kill -9 of the leader)")
    ax.set_ylabel("cached chunks reused")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper right", ncol=2)
    ax.set_title(f"Conductor failover: first answer median {median(first):.2f} s, reuse restored median "
                 f"{median(full):.2f} s")
    fig.tight_layout()
    publish(fig, "cluster", text, ns.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
