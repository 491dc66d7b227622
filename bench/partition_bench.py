"""Partitions under a live workload: what a cut host costs the requests, and how fast reuse comes back.

Four emulated hosts (network namespaces, kvstore/netns.py; root only): h0 the
conductor, h1 the prefill engine, h2 the decode engine and the gateway, h3 the
store node. This process is the client, on the machine's own end of the hosts'
network: it sends completions one after another (a shared 64-token prefix, then
140 tokens of its own) for the whole run. Phases of ``--phase-s`` seconds each:
baseline, then for the store's, the prefill engine's and the conductor's host
in turn a cut (its bridge port down: packets vanish) and a heal.

Per phase: requests, failed ones, wrong ones (tokens compared afterwards with a
store-less engine's), median and max latency and the median's ratio to the
baseline's, and the chunks the decode engine loaded from the store per request
(its /metrics at the phase's edges): the reuse. A plot shows every request's
latency over time, with the cuts shaded.

    sudo .venv/bin/python bench/partition_bench.py [--phase-s 20] [--write-docs]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, median, publish, table  # noqa: E402
from kvstore.netns import EmulatedHosts, unavailable  # noqa: E402
from kvstore.procs import stop_process  # noqa: E402

MODEL = "random:tiny"
SHARED = [random.Random(7).randrange(3, 250) for _ in range(64)]


def prompt(i: int) -> list[int]:
    r = random.Random(1000 + i)
    return SHARED + [r.randrange(3, 250) for _ in range(140)]


class HostProc:
    def __init__(self, hosts: EmulatedHosts, i: int, args: list[str], log_dir: str, banner: str = "listening on"):
        self.log = open(os.path.join(log_dir, f"h{i}-{args[0]}.log"), "w")
        cmd = hosts.exec_prefix(i) + [sys.executable, "-m", "kvstore.cli", "--host-id", f"h{i}", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if banner not in line:
            self.stop()
            raise RuntimeError(f"{args[0]} on h{i} did not start: {line!r} (log: {self.log.name})")
        m = re.search(r"listening on ([^\s,]+)", line) or re.search(r"on (http://\S+?)/v1", line)
        self.address = m.group(1)

    def stop(self) -> None:
        stop_process(self.proc, 60)
        self.proc.stdout.close()
        self.log.close()


def loaded_chunks(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    m = re.search(r'crescent_engine_store_chunks_total\{direction="loaded",role="decode"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default: 20)")
    ap.add_argument("--write-docs", action="store_true", help="write the figures into docs/benchmarks.md")
    ns = ap.parse_args()
    why = unavailable()
    if why:
        print(f"partition_bench: {why}", file=sys.stderr)
        return 2

    tmp = tempfile.mkdtemp(prefix="crescent-partition-bench-")
    hosts = EmulatedHosts(4, f"crpb{os.getpid() % 100000}", "10.251.79", reachable=True)
    procs: list[HostProc] = []
    records: list[dict] = []  # i, t0, t1, text or error
    marks: list[tuple[str, float, float]] = []  # (phase, start, loaded chunks at start)
    stop = threading.Event()
    try:
        a = [hosts.addr(i) for i in range(4)]

        def start(i, args, **kw) -> str:
            procs.append(HostProc(hosts, i, args, tmp, **kw))
            return procs[-1].address

        conductor = start(0, ["conductor", "--listen", f"{a[0]}:7300", "--chunk-tokens", "64",
                              "--heartbeat-interval", "0.2"])
        store = start(3, ["store", "--listen", f"{a[3]}:7400", "--dram", "256MiB", "--node-id", "store-h3",
                          "--conductor", conductor])
        engine = ["--model", MODEL, "--dtype", "float32", "--store", store, "--conductor", conductor,
                  "--chunk-tokens", "64", "--kv-cache-memory", "64MiB", "--chunk-size", "128",
                  "--max-num-batched-tokens", "192"]
        prefill = start(1, ["engine", "prefill", "--listen", f"{a[1]}:7500", *engine])
        decode = start(2, ["engine", "decode", "--listen", f"{a[2]}:7501", "--metrics-port", "9501", *engine])
        gateway = start(2, ["gateway", "--listen", f"{a[2]}:8000", "--model", MODEL, "--conductor", conductor,
                            "--prefill", prefill, "--decode", decode], banner="http://")
        metrics = f"http://{a[2]}:9501/metrics"
        host, port = gateway.removeprefix("http://").split(":")

        def workload() -> None:
            i = 0
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            while not stop.is_set():
                body = json.dumps({"model": MODEL, "prompt": prompt(i), "max_tokens": 4, "temperature": 0,
                                   "ignore_eos": True})
                t0 = time.monotonic()
                try:
                    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    data = json.loads(r.read())
                    rec = {"i": i, "t0": t0, "t1": time.monotonic()}
                    if r.status == 200:
                        rec["text"] = data["choices"][0]["text"]
                    else:
                        rec["error"] = f"{r.status}: {data}"
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    rec = {"i": i, "t0": t0, "t1": time.monotonic(), "error": repr(exc)}
                    conn.close()
                    conn = http.client.HTTPConnection(host, int(port), timeout=600)
                records.append(rec)
                i += 1
            conn.close()

        deadline = time.monotonic() + 300
        while True:  # the gateway answers once an engine has registered with the conductor
            try:
                with urllib.request.urlopen(f"{gateway}/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become healthy")
            time.sleep(0.5)
        worker = threading.Thread(target=workload, daemon=True)
        worker.start()
        time.sleep(ns.phase_s / 2)  # warm-up: first compilations, the shared prefix stored
        plan = [("baseline", None), ("store cut", ("cut", 3)), ("store healed", ("heal", 3)),
                ("prefill cut", ("cut", 1)), ("prefill healed", ("heal", 1)),
                ("conductor cut", ("cut", 0)), ("conductor healed", ("heal", 0))]
        for k, (name, action) in enumerate(plan):
            if action:
                getattr(hosts, action[0])(action[1])
            marks.append((name, time.monotonic(), loaded_chunks(metrics)))
            print(f"[{k + 1}/{len(plan)}] {name} ({len(records)} requests so far)", flush=True)
            time.sleep(ns.phase_s)
        marks.append(("end", time.monotonic(), loaded_chunks(metrics)))
    finally:
        stop.set()
        for p in reversed(procs):
            p.stop()
        hosts.close()

    from engine.llm import LLM

    with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
        ref = llm.generate([prompt(r["i"]) for r in records], max_tokens=4, ignore_eos=True)
        want = [llm.tokenizer.decode(x.token_ids) for x in ref]
    for r, w in zip(records, want):
        r["wrong"] = "text" in r and r["text"] != w

    rows, base = [], None
    spans = []
    for (name, t_a, l_a), (_, t_b, l_b) in zip(marks, marks[1:]):
        xs = [r for r in records if t_a <= r["t0"] < t_b]
        lat = [r["t1"] - r["t0"] for r in xs if "text" in r]
        med = median(lat)
        base = base if base is not None else med
        spans.append((name, t_a, t_b))
        rows.append([name, len(xs), sum("error" in r for r in xs), sum(r["wrong"] for r in xs),
                     f"{med:.2f} s", f"{max(lat):.2f} s" if lat else "-", f"{med / base:.1f}×",
                     f"{(l_b - l_a) / len(xs):.2f}" if xs else "-"])
    total_failed = sum("error" in r for r in records)
    for r in records:
        if "error" in r:
            print(f"request {r['i']} failed at +{r['t0'] - marks[0][1]:.1f} s: {r['error']}", flush=True)
    total_wrong = sum(r["wrong"] for r in records)
    text = (f"Four emulated hosts (network namespaces: conductor; prefill engine; decode engine + gateway; store "
            f"node), random:tiny on CPU, one client sending requests back to back (64 shared + 140 own prompt "
            f"tokens, 4 output tokens); each phase {ns.phase_s:g} s, a cut takes the host's bridge port down. "
            f"{len(records)} requests: **{total_failed} failed, {total_wrong} with wrong tokens**.\n\n"
            + table(["phase", "requests", "failed", "wrong tokens", "median latency", "max latency",
                     "median vs baseline", "chunks loaded per request"], rows)
            + "\n\nA request counts in the phase it was sent in: the one that met a cut (waiting on the silent "
            "peer until the keepalive figures, 2 s + 4 s, kvstore/liveness.py, end it) is the max of its phase "
            "or of the one before. With the store cut, requests wait the decode engine's 2 s fetch timeout "
            "until the prefill engine's saves have failed, then go straight to a local prefill. With the "
            "conductor cut the engines read and write their own store node directly, and every 2 s one call "
            "asks the conductor again (about 1 s with its retries). Chunks loaded per request: the decode "
            "engine's loads from the store (2 when the prefill engine's chunks arrive in time).\n")
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = marks[0][1]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    colors = {"store": "tab:orange", "prefill": "tab:green", "conductor": "tab:purple"}
    for name, a_, b_ in spans:
        if name.endswith("cut"):
            ax.axvspan(a_ - t0, b_ - t0, color=colors[name.split()[0]], alpha=0.15, label=name)
    ok = [r for r in records if "text" in r and r["t0"] >= t0]
    ax.plot([r["t0"] - t0 for r in ok], [r["t1"] - r["t0"] for r in ok], ".", ms=3, color="tab:blue",
            label="request latency")
    bad = [r for r in records if "error" in r and r["t0"] >= t0]
    if bad:
        ax.plot([r["t0"] - t0 for r in bad], [0] * len(bad), "x", color="tab:red", label="failed")
    ax.set_xlabel("seconds since the baseline began (shaded: a host cut off)")
    ax.set_ylabel("latency (s)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    ax.set_title(f"Partitions: {len(records)} requests, {total_failed} failed, {total_wrong} wrong")
    fig.tight_layout()
    publish(fig, "partitions", text, ns.write_docs)
    return 0 if total_failed == 0 and total_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
