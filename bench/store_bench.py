"""Store throughput and latency on loopback, beside ceilings measured in the same run.

For 64 KiB, 1 MiB and 4 MiB values: put, get, batch_get (new bytes) and batch_get_into against a real
`crescent store` process (``--transport auto``), through the same-host shm
mover (the client maps the node's arena; reads of values it knows checked
against the node's generation table; every read through a grant on the data
channel; the grant calls as gRPC calls), over the raw TCP data channel and
over gRPC alone; beside them, in the same run, the raw TCP loopback ceiling
(one process sendall()s, another recv_into()s a preallocated buffer),
single-thread memcpy (one cache-hot source; and distinct sources, as a store
copying distinct values has), the shm mover's copy engine on distinct sources
with no protocol (the shm path's ceiling), and Redis (redis-server + redis-py) when it is
installed.

    python bench/store_bench.py [--quick] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import OUT, ROOT, median, pct, table, write_docs_section  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.transport.memcopy import DEFAULT_THREADS, CopyEngine, buffer_address  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, MiB, 4 * MiB]


def log(msg: str) -> None:
    print(f"[store_bench] {msg}", flush=True)


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


# ---- ceilings ---------------------------------------------------------------

_SENDER = """
import socket, sys
port, total, block, nbuf = map(int, sys.argv[1:5])
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
bufs = [memoryview(bytearray(b"x" * block)) for _ in range(nbuf)]
sent = i = 0
while sent < total:
    s.sendall(bufs[i % nbuf])
    sent += block
    i += 1
s.close()
"""


def raw_tcp_gbps(total: int, block: int, num_buffers: int = 1) -> float:
    """One process sendall()s ``total`` bytes in ``block`` pieces; this one recv_into()s them.

    With ``num_buffers=1`` both ends reuse one cache-hot buffer (the ceiling);
    with more, they cycle through that many, as a store moving distinct values does.
    """
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(total), str(block), str(num_buffers)])
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    dsts = [memoryview(bytearray(block)) for _ in range(num_buffers)]
    got = i = 0
    t0 = time.perf_counter()
    while got < total:
        view = dsts[i % num_buffers]
        i += 1
        while view.nbytes:
            n = conn.recv_into(view)
            if not n:
                raise RuntimeError("sender closed early")
            view = view[n:]
        got += block
    dt = time.perf_counter() - t0
    conn.close()
    srv.close()
    proc.wait(timeout=60)
    return total / dt / 1e9


WARMUP_S = 0.5
"""Every timed series first runs its own operation untimed this long: this VM's CPUs
copy at about half speed for the first few batches after idling."""


def warm_up(fn) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARMUP_S:
        fn()


def memcpy_gbps(total: int, block: int, distinct_sources: bool = False, threads: int = 1,
                num: int | None = None) -> float:
    """Copies ``total`` bytes in ``block`` pieces into ``num`` cycling destinations, from
    one cache-hot source (the ceiling) or from as many distinct sources; ``threads`` > 1
    runs the shm mover's copy engine on the same moves (its ceiling, no protocol)."""
    num = num or max(1, min(64, (256 * MiB) // block))
    dsts = [memoryview(bytearray(block)) for _ in range(num)]
    srcs = [memoryview(bytearray(os.urandom(block))) for _ in range(num if distinct_sources else 1)]
    n = total // block
    if threads > 1:
        engine = CopyEngine(threads)
        addrs = [buffer_address(b) for b in dsts], [buffer_address(b) for b in srcs]
        batch = [(addrs[0][i], addrs[1][i % len(srcs)], block) for i in range(num)]
        batches = [batch] * (n // num) + ([batch[: n % num]] if n % num else [])

        def run() -> None:
            for b in batches:  # one engine run per batch of ``num`` values, as a batch get does
                engine.run(b)
    else:
        def run() -> None:
            for i in range(n):
                dsts[i % num][:] = srcs[i % len(srcs)]

    warm_up(run)  # also faults the pages in
    t0 = time.perf_counter()
    run()
    return n * block / (time.perf_counter() - t0) / 1e9


# ---- Crescent -----------------------------------------------------------------

class Server:
    """A ``crescent store`` process; with ``tls_dir``, under mTLS with that folder's node certificate."""

    def __init__(self, dram: str, tls_dir: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="crescent-bench-")
        top = (["--tls-cert", f"{tls_dir}/node.pem", "--tls-key", f"{tls_dir}/node-key.pem", "--tls-ca",
                f"{tls_dir}/ca.pem", "--tls-client-auth"] if tls_dir else [])
        cmd = [sys.executable, "-m", "kvstore.cli", *top, "store", "--listen", "127.0.0.1:0", "--dram", dram,
               "--disk", os.path.join(self.dir, "disk"), "--disk-size", "4GiB", "--transport", "auto"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        self.address = line.split("listening on ")[1].split(",")[0].split()[0]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_crescent(address: str, size: int, batch_bytes: int, reps: int, transport: str,
                   grpc_control: bool = False, local_reads: bool = True) -> dict:
    """put / get / batch_get_into through one transport; ``grpc_control``: shm with its
    grant calls as gRPC RPCs instead of on the data channel (the data channel off);
    ``local_reads=False``: every shm read through a grant."""
    c = StoreClient(address, transport=transport, data_channel=not grpc_control, local_reads=local_reads)
    assert c.transport == transport, c.transport_notes
    n = max(4, batch_bytes // size)
    tag = transport.encode()
    keys = [b"%s-%d-%d" % (tag, size, i) for i in range(n)]
    vals = [os.urandom(size) for _ in range(min(n, 8))]
    items = [(k, vals[i % len(vals)]) for i, k in enumerate(keys)]
    res = {}
    # put: single-value latency, then batch throughput
    lat = []
    for k, v in items[: min(n, 32)]:
        t0 = time.perf_counter()
        c.put(k, v)
        lat.append(time.perf_counter() - t0)
    tput = []
    warm_up(lambda: c.batch_put(items))
    for _ in range(reps):
        t0 = time.perf_counter()
        assert all(c.batch_put(items))
        tput.append(n * size / (time.perf_counter() - t0) / 1e9)
    res["put"] = {"gbps": median(tput), "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
    # get: single-value latency and throughput
    lat = []
    warm_up(lambda: c.get(keys[0]))
    for _ in range(max(1, reps // 2)):
        for k in keys[: min(n, 32)]:
            t0 = time.perf_counter()
            assert c.get(k) is not None
            lat.append(time.perf_counter() - t0)
    res["get"] = {"gbps": size / median(lat) / 1e9, "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
    # batch_get_into caller-owned buffers
    bufs = [bytearray(size) for _ in keys]
    warm_up(lambda: c.batch_get_into(keys, bufs))
    lat, tput = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sizes = c.batch_get_into(keys, bufs)
        dt = time.perf_counter() - t0
        assert sizes == [size] * n
        lat.append(dt)
        tput.append(n * size / dt / 1e9)
    assert bytes(bufs[0]) == vals[0]
    res["batch_get_into"] = {"gbps": median(tput), "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
    # batch_get_bytes: the batch as new bytes, one per value (what Redis's MGET gives)
    warm_up(lambda: c.batch_get_bytes(keys))
    lat, tput = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = c.batch_get_bytes(keys)
        dt = time.perf_counter() - t0
        assert got[0] == vals[0] and len(got) == n
        del got
        lat.append(dt)
        tput.append(n * size / dt / 1e9)
    res["batch_get"] = {"gbps": median(tput), "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
    c.delete(keys)
    c.close()
    return res


def bench_lookup(address: str, calls: int = 300) -> dict:
    """p50 ms of ``lookup`` and ``exists`` of 16 keys (12 present), per way of asking: the data
    channel (tcp, shm clients) against the gRPC RPCs (a client with its data channel off)."""
    keys = [b"lookup-%d" % i for i in range(16)]
    out = {}
    for name, kw in (("tcp", {"transport": "tcp"}), ("shm", {"transport": "shm"}),
                     ("grpc", {"transport": "tcp", "data_channel": False})):
        with StoreClient(address, **kw) as c:
            assert c.batch_put([(k, b"v" * 1000) for k in keys[:12]]) == [True] * 12
            res = {}
            for op, fn in (("lookup", lambda: c.lookup(keys)), ("exists", lambda: c.exists(keys))):
                warm_up(fn)
                lat = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    lat.append(time.perf_counter() - t0)
                res[op] = 1e3 * pct(lat, 50)
            assert c.lookup(keys) == 12
            out[name] = res
    return out


# ---- Redis ----------------------------------------------------------------------

def bench_redis(size: int, batch_bytes: int, reps: int) -> dict | None:
    exe = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None
    if exe is None:
        return None
    from kvstore.procs import port_for_child

    port = port_for_child("127.0.0.1")  # redis-server cannot bind port 0 and say which it got
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        n = max(4, batch_bytes // size)
        keys = [b"r-%d-%d" % (size, i) for i in range(n)]
        vals = [os.urandom(size) for _ in range(min(n, 8))]
        res = {}
        lat = []
        for i, k in enumerate(keys[:32]):
            t0 = time.perf_counter()
            r.set(k, vals[i % len(vals)])
            lat.append(time.perf_counter() - t0)
        def pipelined_set() -> None:
            p = r.pipeline(transaction=False)
            for i, k in enumerate(keys):
                p.set(k, vals[i % len(vals)])
            p.execute()

        tput = []
        warm_up(pipelined_set)
        for _ in range(reps):
            t0 = time.perf_counter()
            pipelined_set()
            tput.append(n * size / (time.perf_counter() - t0) / 1e9)
        res["put"] = {"gbps": median(tput), "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
        lat = []
        for k in keys[:32]:
            t0 = time.perf_counter()
            r.get(k)
            lat.append(time.perf_counter() - t0)
        res["get"] = {"gbps": size / median(lat) / 1e9, "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99)}
        lat, tput = [], []
        warm_up(lambda: r.mget(keys))
        for _ in range(reps):
            t0 = time.perf_counter()
            got = r.mget(keys)
            dt = time.perf_counter() - t0
            assert len(got[0]) == size
            lat.append(dt)
            tput.append(n * size / dt / 1e9)
        res["batch_get"] = {"gbps": median(tput), "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99),
                            "note": "MGET (into new bytes)"}
        r.close()
        return res
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- report -----------------------------------------------------------------------

def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [human(s) for s in SIZES]
    series = [("raw TCP ceiling", [results[s]["raw_tcp_gbps"] for s in SIZES]),
              ("memcpy (1 thread)", [results[s]["memcpy_gbps"] for s in SIZES]),
              (f"copy engine ({DEFAULT_THREADS} threads, no protocol)", [results[s]["memcpy_par_gbps"] for s in SIZES]),
              ("Crescent batch_get_into (shm, same host)",
               [results[s]["crescent_shm"]["batch_get_into"]["gbps"] for s in SIZES]),
              ("Crescent batch_get_into (shm, every read granted)",
               [results[s]["crescent_shm_granted"]["batch_get_into"]["gbps"] for s in SIZES]),
              ("Crescent batch_get_into (shm, grants over gRPC)",
               [results[s]["crescent_shm_grpc"]["batch_get_into"]["gbps"] for s in SIZES]),
              ("Crescent batch_get_into (TCP channel)",
               [results[s]["crescent_tcp"]["batch_get_into"]["gbps"] for s in SIZES]),
              ("Crescent batch_get_into (gRPC only)",
               [results[s]["crescent_grpc"]["batch_get_into"]["gbps"] for s in SIZES])]
    if all(results[s].get("redis") for s in SIZES):
        series.append(("Crescent batch_get_bytes (TCP channel)",
                       [results[s]["crescent_tcp"]["batch_get"]["gbps"] for s in SIZES]))
        series.append(("Redis MGET", [results[s]["redis"]["batch_get"]["gbps"] for s in SIZES]))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series):
        ax.bar([x + i * width for x in range(len(SIZES))], vals, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(SIZES))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Batch get throughput, same host (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--write-docs", action="store_true", help="update the store section of docs/benchmarks.md")
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    batch_bytes = (32 if args.quick else 64) * MiB
    os.makedirs(OUT, exist_ok=True)
    results: dict = {}
    from kvstore import tls

    tls_dir = tempfile.mkdtemp(prefix="crescent-bench-tls-")
    tls.init_dir(tls_dir, [])
    server = Server(dram="1GiB")
    tls_server = Server(dram="1GiB", tls_dir=tls_dir)

    def under_tls(fn):
        """``fn()`` with this process's clients on mTLS (the client certificate of ``tls_dir``)."""
        tls.configure(f"{tls_dir}/client.pem", f"{tls_dir}/client-key.pem", f"{tls_dir}/ca.pem")
        try:
            return fn()
        finally:
            tls.configure(None, None, None)

    try:
        for size in SIZES:
            r = results[size] = {}
            log(f"{human(size)}: raw TCP ceiling")
            r["raw_tcp_gbps"] = median([raw_tcp_gbps(256 * MiB, size) for _ in range(3)])
            r["raw_tcp_cold_gbps"] = median([raw_tcp_gbps(256 * MiB, size, max(1, batch_bytes // size))
                                             for _ in range(3)])
            log(f"{human(size)}: memcpy ceiling")
            r["memcpy_gbps"] = median([memcpy_gbps(256 * MiB, size) for _ in range(3)])
            values = max(1, batch_bytes // size)  # the working set of one batch get
            r["memcpy_cold_gbps"] = median([memcpy_gbps(256 * MiB, size, True, num=values) for _ in range(3)])
            r["memcpy_par_gbps"] = median([memcpy_gbps(256 * MiB, size, True, DEFAULT_THREADS, values)
                                           for _ in range(3)])
            log(f"{human(size)}: Crescent through shm (same host)")
            r["crescent_shm"] = bench_crescent(server.address, size, batch_bytes, reps, "shm")
            log(f"{human(size)}: Crescent through shm, every read granted")
            r["crescent_shm_granted"] = bench_crescent(server.address, size, batch_bytes, reps, "shm",
                                                       local_reads=False)
            log(f"{human(size)}: Crescent through shm, grant calls over gRPC")
            r["crescent_shm_grpc"] = bench_crescent(server.address, size, batch_bytes, reps, "shm",
                                                    grpc_control=True, local_reads=False)
            log(f"{human(size)}: Crescent over the TCP data channel")
            r["crescent_tcp"] = bench_crescent(server.address, size, batch_bytes, reps, "tcp")
            log(f"{human(size)}: Crescent over gRPC only")
            r["crescent_grpc"] = bench_crescent(server.address, size, batch_bytes, reps, "grpc")
            log(f"{human(size)}: Crescent over the TCP data channel, mTLS")
            r["crescent_tcp_tls"] = under_tls(lambda: bench_crescent(tls_server.address, size, batch_bytes, reps,
                                                                     "tcp"))
            log(f"{human(size)}: Crescent over gRPC only, mTLS")
            r["crescent_grpc_tls"] = under_tls(lambda: bench_crescent(tls_server.address, size, batch_bytes, reps,
                                                                      "grpc"))
            log(f"{human(size)}: Redis")
            r["redis"] = bench_redis(size, batch_bytes, reps)
        log("lookup and exists of 16 keys: on the data channel and over gRPC")
        lookups = bench_lookup(server.address)
    finally:
        server.stop()
        tls_server.stop()
        shutil.rmtree(tls_dir, ignore_errors=True)

    rows = []
    for size in SIZES:
        r = results[size]
        tcp, mc = r["raw_tcp_gbps"], r["memcpy_gbps"]
        rows.append([human(size), "raw TCP ceiling (1 hot buffer)", "-", f"{tcp:.2f}", "1.00", f"{tcp / mc:.2f}",
                     "", ""])
        rows.append([human(size), "raw TCP, distinct buffers", "-", f"{r['raw_tcp_cold_gbps']:.2f}",
                     f"{r['raw_tcp_cold_gbps'] / tcp:.2f}", f"{r['raw_tcp_cold_gbps'] / mc:.2f}", "", ""])
        rows.append([human(size), "memcpy (1 thread, 1 hot source)", "-", f"{mc:.2f}", f"{mc / tcp:.2f}", "1.00",
                     "", ""])
        rows.append([human(size), "memcpy (1 thread, distinct sources)", "-", f"{r['memcpy_cold_gbps']:.2f}",
                     f"{r['memcpy_cold_gbps'] / tcp:.2f}", f"{r['memcpy_cold_gbps'] / mc:.2f}", "", ""])
        rows.append([human(size), f"copy engine ({DEFAULT_THREADS} threads, distinct sources)", "-",
                     f"{r['memcpy_par_gbps']:.2f}", f"{r['memcpy_par_gbps'] / tcp:.2f}",
                     f"{r['memcpy_par_gbps'] / mc:.2f}", "", ""])
        for name, key in (("Crescent (shm, same host)", "crescent_shm"),
                          ("Crescent (shm, every read granted)", "crescent_shm_granted"),
                          ("Crescent (shm, grants over gRPC)", "crescent_shm_grpc"),
                          ("Crescent (TCP channel)", "crescent_tcp"),
                          ("Crescent (TCP channel, mTLS)", "crescent_tcp_tls"),
                          ("Crescent (gRPC only)", "crescent_grpc"),
                          ("Crescent (gRPC only, mTLS)", "crescent_grpc_tls"), ("Redis", "redis")):
            if not r.get(key):
                continue
            for op in ("put", "get", "batch_get", "batch_get_into"):
                if op not in r[key]:
                    continue
                m = r[key][op]
                rows.append([human(size), name, op, f"{m['gbps']:.2f}", f"{m['gbps'] / tcp:.2f}",
                             f"{m['gbps'] / mc:.2f}", f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}"])
    md = table(["value", "system", "op", "GB/s", "× raw TCP", "× memcpy", "p50 ms", "p99 ms"], rows)
    md_lookup = table(["asked", "lookup p50 ms", "exists p50 ms", "lookup × data channel (TCP)"],
                      [[{"tcp": "data channel (TCP client)", "shm": "data channel (same-host client)",
                         "grpc": "gRPC RPC"}[k], f"{v['lookup']:.3f}", f"{v['exists']:.3f}",
                        f"{v['lookup'] / lookups['tcp']['lookup']:.2f}"] for k, v in lookups.items()])
    target = results[MiB]["crescent_tcp"]["batch_get_into"]["gbps"] / results[MiB]["raw_tcp_gbps"]
    summary = (f"batch_get_into of 1 MiB values: {target:.2f}× the same run's raw TCP ceiling "
               f"(target ≥ 0.60×); gRPC-only batch get: "
               f"{results[MiB]['crescent_grpc']['batch_get_into']['gbps'] / results[MiB]['raw_tcp_gbps']:.2f}×")
    shm = results[MiB]["crescent_shm"]["batch_get_into"]["gbps"]
    shm_grpc = results[MiB]["crescent_shm_grpc"]["batch_get_into"]["gbps"]
    shm_granted = results[MiB]["crescent_shm_granted"]["batch_get_into"]["gbps"]
    m = results[MiB]
    summary += (f"; same-host shm batch_get_into of 1 MiB values: {shm / m['memcpy_gbps']:.2f}× the "
                f"same run's single-thread memcpy (target ≥ 1.00×), "
                f"{shm / m['memcpy_cold_gbps']:.2f}× memcpy from distinct sources, "
                f"{shm / m['memcpy_par_gbps']:.2f}× the {DEFAULT_THREADS}-thread copy engine with no protocol "
                f"(which itself reaches {m['memcpy_par_gbps'] / m['memcpy_gbps']:.2f}× memcpy: the ceiling here); "
                f"{shm_granted / m['memcpy_gbps']:.2f}× memcpy with every read granted, "
                f"{shm_grpc / m['memcpy_gbps']:.2f}× with the grant calls over gRPC")
    t, p_ = m["crescent_tcp_tls"], m["crescent_tcp"]
    summary += (f"; mTLS on the TCP channel, 1 MiB values: batch_get_into {t['batch_get_into']['gbps']:.2f} GB/s = "
                f"{t['batch_get_into']['gbps'] / p_['batch_get_into']['gbps']:.2f}× plaintext, put "
                f"{t['put']['gbps'] / p_['put']['gbps']:.2f}× plaintext (same run)")
    summary += (f"; batch_get (new bytes per value) of 1 MiB values over TCP: "
                f"{p_['batch_get']['gbps']:.2f} GB/s = {p_['batch_get']['gbps'] / p_['batch_get_into']['gbps']:.2f}× "
                f"batch_get_into")
    if results[MiB].get("redis"):
        summary += f", {p_['batch_get']['gbps'] / results[MiB]['redis']['batch_get']['gbps']:.2f}× Redis MGET"
    else:
        summary += "; Redis not installed, no Redis rows"
    lk = lookups
    summary += (f"; lookup of 16 keys: {lk['tcp']['lookup']:.3f} ms on the TCP data channel, "
                f"{lk['shm']['lookup']:.3f} ms from a same-host client, {lk['grpc']['lookup']:.3f} ms over gRPC "
                f"({lk['grpc']['lookup'] / lk['tcp']['lookup']:.1f}× the data channel's)")
    print()
    print(md)
    print()
    print(md_lookup)
    print()
    print(summary)
    png = os.path.join(OUT, "store_bench.png")
    plot(results, png)
    with open(os.path.join(OUT, "store_bench.json"), "w") as f:
        json.dump({**{str(k): v for k, v in results.items()}, "lookups": lookups}, f, indent=1)
    print(f"plot: {png}")
    if args.write_docs:
        shutil.copy(png, os.path.join(ROOT, "docs", "store_bench.png"))
        body = (f"Machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, loopback; "
                f"batches of {batch_bytes // MiB} MiB, {reps} repetitions, medians. "
                "`put` = batch_put throughput, single-put latency; `get` = single get; "
                "`batch_get` = one batch as new bytes per value (`batch_get_bytes`; Redis: MGET); "
                "`batch_get_into` = one batch into preallocated buffers. "
                "shm rows: the client maps the node's arena and copies slots itself "
                f"({DEFAULT_THREADS} copy threads); values it wrote or read before it reads with no call "
                "to the node (checked against the node's slot generation table), the `every read granted` "
                "rows ask for a grant on the data channel for every read (one round trip, the release is "
                "not awaited), the `grants over gRPC` rows make the grant calls gRPC calls; a write is "
                "reserve and commit; "
                "`× memcpy` is against the single-thread, one-hot-source memcpy of the same run. "
                f"Every timed series follows {WARMUP_S} s of the same operation, untimed.\n\n"
                f"{md}\n\nLookups (16 keys, 12 present; 300 calls, p50):\n\n{md_lookup}\n\n"
                f"**{summary}.**\n\n![store bench](store_bench.png)\n")
        write_docs_section("store_bench", body)
        print("docs/benchmarks.md updated")


if __name__ == "__main__":
    main()
