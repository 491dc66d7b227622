"""Chaos soak: a `crescent up --restart` cluster under steady load while a seeded loop injects faults.

    python -m bench.soak --minutes 10 [--seed 0] [--out bench/out/soak] [--docs]

The cluster, on two hosts (network namespaces where they can be made, as root; else loopback ports):
two conductors (leader-elected through a local etcd, where `etcd` is installed), two store nodes with
disk tiers (the first on a tiny tmpfs that fills, where one can be mounted: it takes the prefill
engine's saves), a prefill engine (host 0) and a decode engine (host 1), the gateway (on the machine).
Load: trace-derived prompts
(tests/data/synthetic_trace.jsonl: shared prefixes, picked Zipf(0.9)) streamed through the gateway
with the official `openai` client, greedy, a few at a time, as two tenants (API keys): one with a
concurrency quota of 1 that two of the threads share, so it is answered 429 now and then. A request
answered 429/503 (which must carry Retry-After) or cut mid-stream is retried after that pause.

Faults, in a seeded order, one every ``--fault-every`` seconds:
    kill:<part>       kill -9 of the second store node, the prefill or decode engine, the first conductor (up
                      restarts it); the first store node is never killed, so its memory can be compared
    freeze:store-2    SIGSTOP for a few seconds, then SIGCONT (a member that stops answering)
    partition:h1      the second host's link cut for 6 s (its store node, decode engine, a conductor),
                      where the hosts are network namespaces (``--netns``, the default as root)
    corrupt:arena     bytes flipped across the first store node's DRAM arena (/dev/shm), then a probe
    corrupt:disk      bytes flipped in the first store node's disk values file, then a probe
    slow-client       a client takes read leases on the first store node over shm, never releasing them
    cut-transfer      a client announces a 2 MiB put on store-2's data channel, sends part, disconnects

Checked (each a line of the report, PASS or FAIL; exit status 1 on any FAIL):
    zero wrong outputs: every completed request's text equals a store-less reference engine's on
      the same prompt (computed after the cluster stops);
    every request completed, or its last answer was a 429/503 with Retry-After (or a cut stream);
      every 429/503 carried Retry-After;
    no leak once load stops: no read lease, remote lease or reservation held on any store node, every
      engine's KV pages free, nothing running;
    store RSS (anonymous memory) within 10% of its pre-load value, for nodes that were not restarted;
    flipped values never pass as good: each corrupt fault also probes values whose place it knows
      (arena: canary chunks found through a shm read lease; disk: values the node's LMDB index
      places), flips a byte in each and reads them back at once: every one must fail the chunk check,
      read as a miss (the disk checksum failed, counted by the node) or come back intact (a kept DRAM
      copy), and at least one must be caught. The random flips meet the engines or not (a value no one
      reads again is never seen): what they counted is reported; zero wrong outputs covers them.

Writes ``soak.json``, ``soak.md`` and ``soak.png`` (TTFT of every request over time, faults marked)
under ``--out``; ``--docs`` puts the table in docs/benchmarks.md and the plot in docs/soak.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from bench.common import OUT, ROOT, pct, table, write_docs_section

MODEL = "random:tiny"
KINDS = ["kill:store-2", "kill:prefill", "kill:decode", "kill:conductor", "freeze:store-2", "partition:h1",
         "corrupt:arena", "corrupt:disk", "slow-client", "cut-transfer"]
KEYS = ("sk-soak-bounded-0000", "sk-soak-free-000000")
"""The load's API keys: a tenant with a concurrency quota of 1 (two threads share it: some of its
requests get 429 + Retry-After and are retried), and one without."""
ZIPF_S = 0.9
"""Prompt popularity: the i-th most popular is picked with weight 1 / i**ZIPF_S."""
FAULT_WINDOW_S = 5.0
"""A request that starts within this long after a fault counts as 'during faults'."""
PARTITION_S = 6.0
"""How long partition:h1 keeps the host cut off (longer than the keepalive's ~6 s detection)."""
DOCS_INTRO = (
    "Machine: the 2-core development VM. `sudo .venv/bin/python -m bench.soak --minutes 10 --fault-every 15 "
    "--docs`: `crescent up --restart --netns` with two emulated hosts (network namespaces), two conductors "
    "(etcd), two store nodes (8 MiB DRAM; the first's disk tier on a 6 MiB tmpfs that fills), a prefill and a "
    "decode engine (random:tiny, 8 MiB KV pools, so chunks move through the store all the time), the gateway; "
    "three client threads stream 8-token greedy completions of 256 trace prompts (Zipf 0.9) as two API-key "
    "tenants, one with a concurrency quota of 1 (its 429s are the quota's, retried after Retry-After). "
    "'During faults' is a request that started within 5 s after a fault. Every output is compared with a "
    "store-less engine's afterwards. Not every randomly flipped byte is read again (free slots, values evicted "
    "before their next read), so what the engines and stores counted is less than what was injected; each "
    "corrupt fault's probe reads back values it flipped on purpose, and none passed as good.")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Cluster:
    def __init__(self, data: str, tmpfs_mb: int, conductors: int, slo_ttft: float | None, api_keys: str,
                 netns: bool) -> None:
        self.data = data
        self.tmpfs = None
        os.makedirs(os.path.join(data, "store"), exist_ok=True)
        self.disk_fill = "not mounted: not root" if os.geteuid() != 0 else None
        if os.geteuid() == 0:  # the first node's disk tier on a tmpfs much smaller than the tier it is told it has
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_mb}m", "tmpfs",
                                os.path.join(data, "store")], capture_output=True, text=True)
            if r.returncode == 0:
                self.tmpfs = os.path.join(data, "store")
            else:
                self.disk_fill = f"not mounted: {r.stderr.strip()}"
        self.out = open(os.path.join(data, "up.out"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "up", "--data", data, "--model", MODEL, "--nodes", "2",
             "--netns" if netns else "--no-netns", "--restart", "--store-port", "0", "--prefill-port", "0", "--decode-port", "0",
             "--gateway-port", "0", "--conductor-port", "0", "--dram", "8MiB", "--disk-size", "96MiB",
             "--chunk-tokens", "64", "--kv-cache-memory", "8MiB", "--conductors", str(conductors),
             "--api-keys", api_keys, *(["--slo-ttft", str(slo_ttft)] if slo_ttft else [])],
            cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 420
        while not os.path.exists(self.state_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("crescent up did not come up:\n" + open(os.path.join(data, "up.out")).read())
            time.sleep(0.2)

    @property
    def state_path(self) -> str:
        return os.path.join(self.data, "up.json")

    def state(self) -> dict:
        for _ in range(50):
            try:
                with open(self.state_path) as f:
                    return json.load(f)
            except (OSError, json.JSONDecodeError):  # being replaced
                time.sleep(0.1)
        raise RuntimeError("up.json unreadable")

    def metric(self, part: str, name: str, labels: str = "") -> float:
        """Sum of a metric's samples (whose label text contains ``labels``) on a part's /metrics."""
        try:
            text = urllib.request.urlopen(self.state()["metrics"][part], timeout=10).read().decode()
        except OSError:
            return float("nan")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and labels in line)

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.out.close()
        if self.tmpfs:
            subprocess.run(["umount", self.tmpfs], capture_output=True)
        return self.proc.returncode


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


# ---- load ---------------------------------------------------------------------------------------


class Load:
    """Streams requests through the gateway until ``stop``; every attempt is recorded."""

    def __init__(self, base_url: str, work: list, concurrency: int, max_tokens: int, seed: int) -> None:
        import itertools

        import openai

        self.openai = openai
        self.clients = [openai.OpenAI(base_url=base_url, api_key=k, timeout=300, max_retries=0) for k in KEYS]
        self.work, self.max_tokens = work, max_tokens
        self.records: list[dict] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._cum = list(itertools.accumulate(1 / (rank + 1) ** ZIPF_S for rank in range(len(work))))
        self.threads = [threading.Thread(target=self._worker, daemon=True,
                                         args=(random.Random(seed * 1000 + k), self.clients[k % 3 == 2]))
                        for k in range(concurrency)]  # threads 0, 1 (and 3, 4, ...) share the bounded tenant

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)

    def _worker(self, rng: random.Random, client) -> None:
        while not self.stop.is_set():
            i = rng.choices(range(len(self.work)), cum_weights=self._cum)[0]  # Zipf: hot prefixes, a long tail
            rec = {"prompt_index": i, "start": time.time(), "attempts": [], "text": None}
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                a = self._attempt(client, self.work[i])
                rec["attempts"].append(a)
                if a["outcome"] == "ok":
                    rec["text"], rec["ttft"], rec["itl"] = a.pop("text"), a["ttft"], a.pop("itl")
                    break
                time.sleep(a.get("retry_after") or 1.0)
            with self._lock:
                self.records.append(rec)

    def _attempt(self, client, prompt: list[int]) -> dict:
        openai = self.openai
        t0 = time.perf_counter()
        out = {"t": time.time()}
        try:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, first, last, gaps = [], None, None, []
            for ch in stream:
                now = time.perf_counter()
                if ch.choices:
                    text.append(ch.choices[0].text)
                    if first is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
            out.update(outcome="ok", text="".join(text), ttft=first or 0.0, itl=gaps)
        except openai.APIStatusError as exc:
            ra = exc.response.headers.get("retry-after")
            out.update(outcome=str(exc.status_code), retry_after=float(ra) if ra else None,
                       has_retry_after=ra is not None)
        except openai.APIConnectionError as exc:
            out.update(outcome="connection", error=str(exc)[:200])
        except openai.APIError as exc:  # an error event: the stream was cut (its engine went away)
            out.update(outcome="cut", error=str(exc)[:200])
        return out


# ---- faults -------------------------------------------------------------------------------------


class Chaos:
    def __init__(self, cluster: Cluster, seed: int, every_s: float) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.rng = random.Random(seed)
        order = KINDS[:]
        self.rng.shuffle(order)
        self.order = order
        self.events: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self._held = []  # the slow client's channels, closed at the end
        self.probes: list[dict] = []  # what each corrupt fault's probe read back (_corrupt)

    def start(self) -> Chaos:
        self.thread.start()
        return self

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)

    def _loop(self) -> None:
        k = 0
        while not self.stop.wait(self.every_s * self.rng.uniform(0.8, 1.2)):
            kind = self.order[k % len(self.order)]
            k += 1
            t = time.time()
            try:
                detail = getattr(self, "_" + kind.split(":")[0].replace("-", "_"))(kind.partition(":")[2])
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                detail = f"not injected: {type(exc).__name__}: {exc}"
            self.events.append({"t": t, "kind": kind, "detail": detail})
            log(f"fault {kind}: {detail}")

    def _kill(self, part: str) -> str:
        pid = self.cluster.state()["pids"][part]
        os.kill(pid, signal.SIGKILL)
        return f"pid {pid}"

    def _partition(self, host: str) -> str:
        hosts = self.cluster.state().get("hosts")
        if not hosts:
            return "not injected: the cluster runs without network namespaces (--no-netns, or not root)"
        ns = hosts[host]["namespace"]  # <tag>-h<i>, on the bridge in <tag>-sw at port p<i> (kvstore/netns.py)
        tag, i = ns.rsplit("-h", 1)
        link = ["ip", "-n", f"{tag}-sw", "link", "set", f"p{i}"]
        subprocess.run([*link, "down"], check=True, capture_output=True)
        try:
            self.stop.wait(PARTITION_S)
        finally:
            subprocess.run([*link, "up"], check=True, capture_output=True)
        return f"{host} ({hosts[host]['address']}: store-2, decode, a conductor) cut off for {PARTITION_S:g} s"

    def _freeze(self, part: str) -> str:
        pid = self.cluster.state()["pids"][part]
        os.kill(pid, signal.SIGSTOP)
        self.stop.wait(4.0)
        os.kill(pid, signal.SIGCONT)
        return f"pid {pid} stopped 4 s"

    def _flip(self, path: str, offsets: list[int]) -> int:
        fd = os.open(path, os.O_RDWR)
        try:
            for off in offsets:
                b = os.pread(fd, 1, off)
                if b:
                    os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
            return len(offsets)
        finally:
            os.close(fd)

    def _corrupt(self, where: str) -> str:
        """Flips random bytes (for the engines to meet, or not) and probes: values whose place is known
        get a flipped byte each and are read back at once; each must read as a miss, a verification
        failure or an intact copy, never as good bytes that are not (``self.probes``)."""
        st = self.cluster.state()
        if where == "arena":
            pid = st["pids"]["store"]
            paths = glob.glob(f"/dev/shm/crescent-{pid}-*")
            if not paths:
                return "no arena file found"
            size = os.path.getsize(paths[0])
            offs = [self.rng.randrange(size) for _ in range(256)]
            flipped = self._flip(paths[0], offs)
            probe = self._probe_arena(st["store"], paths[0])
            self.probes.append({"where": where, **probe})
            return f"{flipped} bytes of {os.path.basename(paths[0])}; probe {probe}"
        folder = os.path.join(self.cluster.data, "store")
        path = os.path.join(folder, "values.dat")
        fd = os.open(path, os.O_RDONLY)
        try:  # only where values were written (the file is sparse)
            regions, off = [], 0
            while len(regions) < 64:
                try:
                    start = os.lseek(fd, off, os.SEEK_DATA)
                except OSError:
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                regions.append((start, end))
                off = end
        finally:
            os.close(fd)
        if not regions:
            return "the disk tier holds nothing yet"
        offs = [self.rng.randrange(*self.rng.choice(regions)) for _ in range(64)]
        flipped = self._flip(path, offs)
        probe = self._probe_disk(st["store"], folder)
        self.probes.append({"where": where, **probe})
        return f"{flipped} bytes of values.dat; probe {probe}"

    def _probe_arena(self, address: str, path: str) -> dict:
        """Canary chunks (the engines' format) put on the first node, found through a shm read lease,
        one byte flipped in each while leased, then read back: each must fail the chunk check."""
        import grpc
        import numpy as np
        import torch
        import xxhash

        from kvstore.arena import SECRET_BYTES, shm_proof
        from kvstore.chunk import encode_chunk, verify_chunk
        from kvstore.client import StoreClient
        from kvstore.errors import ChunkVerificationError
        from kvstore.keys import ROOT_KEY, Namespace, chunk_key
        from kvstore.transport.descriptors import SHM_PROOF_HEADER
        from proto.crescent.v1 import kvstore_pb2 as pb
        from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

        ns = Namespace(xxhash.xxh3_128_digest(b"soak-canary"))
        canaries = []
        for _ in range(8):
            tokens = np.array([self.rng.randrange(1 << 30) for _ in range(16)], dtype=np.int32)
            kv = torch.randn(1, 2, 1, 16, 64)
            canaries.append((chunk_key(ROOT_KEY, ns, tokens), tokens, b"".join(bytes(s) for s in encode_chunk(kv, ns, ROOT_KEY, tokens))))
        out = {"probed": len(canaries), "caught": 0, "gone": 0, "served_corrupt": 0}
        with StoreClient(address, timeout_s=30) as c:
            c.batch_put([(k, v) for k, _, v in canaries])
            with grpc.insecure_channel(address) as ch:
                stub = pb_grpc.KVStoreStub(ch)
                arena = stub.Transports(pb.TransportsRequest(), timeout=30).arena
                with open(path, "rb") as f:
                    f.seek(-SECRET_BYTES, os.SEEK_END)
                    proof = shm_proof(f.read())
                r = stub.AcquireRead(pb.AcquireReadRequest(keys=[k for k, _, _ in canaries], mover=pb.MOVER_SHM),
                                     timeout=30, metadata=[(SHM_PROOF_HEADER, proof.hex())])
                try:
                    offs = [it.slots[0] * arena.slot_bytes + self.rng.randrange(min(it.size, arena.slot_bytes))
                            for it in r.items if it.slots]
                    self._flip(path, offs)
                finally:
                    if r.lease_id:
                        stub.ReleaseRead(pb.LeaseRequest(lease_id=r.lease_id), timeout=30)
            got = c.batch_get([k for k, _, _ in canaries])
        for (key, tokens, _), data in zip(canaries, got):
            if data is None:
                out["gone"] += 1
                continue
            try:
                verify_chunk(data, key=key, namespace=ns, parent=ROOT_KEY, tokens=tokens)
                out["served_corrupt"] += 1
            except ChunkVerificationError:
                out["caught"] += 1
        out["flipped"] = len(offs)
        return out

    def _probe_disk(self, address: str, folder: str) -> dict:
        """Values the first node's disk index (LMDB, opened read-only beside the node) places: one byte
        flipped in each, then read back through the node: each must read as a miss (its checksum
        failed, counted) or as its intact bytes (a kept DRAM copy), never as other bytes."""
        import lmdb
        import xxhash

        from kvstore.client import StoreClient
        from kvstore.disk import DATA_FILE, Loc

        env = lmdb.open(folder, readonly=True, lock=True, subdir=True, max_dbs=2)
        try:
            db = env.open_db(b"extents", create=False)
            with env.begin(db=db) as txn:
                records = [(bytes(k), Loc.decode(bytes(v))) for k, v in txn.cursor()]
        finally:
            env.close()
        picked = self.rng.sample(records, min(16, len(records)))
        path = os.path.join(folder, DATA_FILE)
        offs, probed = [], []
        fd = os.open(path, os.O_RDONLY)
        try:
            for key, loc in picked:
                data = b"".join(os.pread(fd, n, o) for o, n in loc.extents)[:loc.size]
                if loc.size and xxhash.xxh3_64_intdigest(data) == loc.digest:  # whole (not being rewritten)
                    o, n = loc.extents[0]
                    offs.append(o + self.rng.randrange(min(n, loc.size)))
                    probed.append((key, loc))
        finally:
            os.close(fd)
        self._flip(path, offs)
        before = self.cluster.metric("store", "crescent_store_corrupt_total")
        with StoreClient(address, timeout_s=30) as c:
            got = c.batch_get([k for k, _ in probed])
        out = {"probed": len(probed), "missed": 0, "intact": 0, "served_corrupt": 0}
        for (_, loc), data in zip(probed, got):
            if data is None:
                out["missed"] += 1
            elif xxhash.xxh3_64_intdigest(bytes(data)) == loc.digest:
                out["intact"] += 1
            else:
                out["served_corrupt"] += 1
        out["counted"] = self.cluster.metric("store", "crescent_store_corrupt_total") - before
        return out

    def _slow_client(self, _: str) -> str:
        import grpc

        from kvstore.arena import SECRET_BYTES, shm_proof
        from kvstore.client import StoreClient
        from kvstore.transport.descriptors import SHM_PROOF_HEADER
        from proto.crescent.v1 import kvstore_pb2 as pb
        from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

        address = self.cluster.state()["store"]
        keys = [b"soak-slow-%d" % i for i in range(8)]
        with StoreClient(address, timeout_s=30) as c:
            c.batch_put([(k, os.urandom(256 << 10)) for k in keys])
        ch = grpc.insecure_channel(address)
        self._held.append(ch)
        paths = glob.glob(f"/dev/shm/crescent-{self.cluster.state()['pids']['store']}-*")
        with open(paths[0], "rb") as f:  # a same-host client proves it can open the arena (kvstore/arena.py)
            f.seek(-SECRET_BYTES, os.SEEK_END)
            proof = shm_proof(f.read())
        r = pb_grpc.KVStoreStub(ch).AcquireRead(pb.AcquireReadRequest(keys=keys, mover=pb.MOVER_SHM), timeout=30,
                                                metadata=[(SHM_PROOF_HEADER, proof.hex())])
        return f"lease {r.lease_id} on {len(keys)} values, never released"

    def _cut_transfer(self, _: str) -> str:
        from kvstore.client import StoreClient
        from kvstore.datachannel import HELLO, Op, encode_request

        address = self.cluster.state()["stores"][1]
        with StoreClient(address, timeout_s=30) as c:
            h = c._read_health(None)
        s = socket.create_connection((address.rpartition(":")[0], h.data_port), timeout=30)
        try:
            s.sendall(HELLO + h.data_token)
            s.sendall(encode_request(Op.PUT, [b"soak-cut-0", b"soak-cut-1"], [1 << 20, 1 << 20]))
            s.sendall(os.urandom(300 << 10))
        finally:
            s.close()
        return "PUT of 2 MiB cut after 300 KiB"

    def close(self) -> None:
        for ch in self._held:
            ch.close()


# ---- checks -------------------------------------------------------------------------------------


def quiescent(cluster: Cluster, timeout_s: float) -> tuple[bool, dict]:
    """Waits until no store holds a lease or reservation and every engine is idle with its pages free."""
    import grpc

    from proto.crescent.v1 import engine_pb2 as epb
    from proto.crescent.v1 import engine_pb2_grpc as epb_grpc
    from proto.crescent.v1 import kvstore_pb2 as pb
    from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

    deadline, last = time.monotonic() + timeout_s, {}
    while True:
        st, last, ok = cluster.state(), {}, True
        for i, a in enumerate(st["stores"]):
            try:
                with grpc.insecure_channel(a) as ch:
                    r = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=10)
                last[f"store-{i}"] = {"leases": r.num_leases, "remote_leases": r.num_remote_leases,
                                      "remote_reservations": r.num_remote_reservations}
                ok &= r.num_leases == 0 and r.num_remote_leases == 0 and r.num_remote_reservations == 0
            except grpc.RpcError as exc:
                last[f"store-{i}"], ok = exc.code().name, False
        for name in ("prefill", "decode"):
            try:
                with grpc.insecure_channel(st[f"{name}_engine"]) as ch:
                    r = epb_grpc.EngineStub(ch).Stats(epb.EngineStatsRequest(), timeout=10)
                last[name] = {"running": r.num_running, "waiting": r.num_waiting,
                              "pages_in_use": r.num_pages - r.num_free_pages}
                ok &= r.num_running == 0 and r.num_waiting == 0 and r.num_free_pages == r.num_pages
            except grpc.RpcError as exc:
                last[name], ok = exc.code().name, False
        if ok or time.monotonic() > deadline:
            return ok, last
        time.sleep(1.0)


def reference_texts(work: list, indices: set[int], max_tokens: int) -> dict[int, str]:
    from engine.llm import LLM

    order = sorted(indices)
    with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
        outs = llm.generate([work[i] for i in order], max_tokens=max_tokens, ignore_eos=True)
    return {i: o.text for i, o in zip(order, outs)}


def plot(path: str, records: list, events: list, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    ok = [(r["start"] - t0, r["ttft"] * 1e3) for r in records if r["text"] is not None and len(r["attempts"]) == 1]
    retried = [(r["start"] - t0, r["ttft"] * 1e3) for r in records if r["text"] is not None and len(r["attempts"]) > 1]
    failed = [(a["t"] - t0, 1.0) for r in records for a in r["attempts"] if a["outcome"] != "ok"]
    if ok:
        ax.scatter(*zip(*ok), s=8, c="tab:green", label="served first time")
    if retried:
        ax.scatter(*zip(*retried), s=14, c="tab:orange", label="served after a retry")
    if failed:
        ax.scatter(*zip(*failed), s=18, c="tab:red", marker="x", label="429/503/cut attempt (at 1 ms)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    kinds = sorted({e["kind"] for e in events})
    for e in events:
        c = colors[kinds.index(e["kind"]) % len(colors)]
        ax.axvline(e["t"] - t0, color=c, ls="--", lw=1)
        ax.text(e["t"] - t0, ax.get_ylim()[1] if ok else 1, e["kind"], rotation=90, va="top", ha="right",
                fontsize=7, color=c)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since load started")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Chaos soak: every request's TTFT, faults marked")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="load duration (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="fault order and timing (default: 0)")
    p.add_argument("--fault-every", type=float, default=12.0, help="seconds between faults (default: 12)")
    p.add_argument("--concurrency", type=int, default=3, help="requests in flight (default: 3)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default: 8)")
    p.add_argument("--prompts", type=int, default=256,
                   help="distinct trace prompts, picked Zipf(0.9) (default: 256)")
    p.add_argument("--max-prompt", type=int, default=640, help="prompt tokens at most (default: 640)")
    p.add_argument("--tmpfs-mb", type=int, default=6, help="the first node's disk tier tmpfs size (default: 6)")
    p.add_argument("--slo-ttft", type=float, default=0.5,
                   help="the conductor rejects (429) requests it predicts to miss this TTFT (default: 0.5 s; 0: none)")
    p.add_argument("--netns", action=argparse.BooleanOptionalAction, default=None,
                   help="the two hosts as network namespaces, so that partition:h1 can cut one off (default: "
                        "where they can be made: root)")
    p.add_argument("--conductors", type=int, default=0,
                   help="conductor replicas (default: 2, leader-elected through a local etcd, where `etcd` is "
                        "installed; else 1)")
    p.add_argument("--out", default=os.path.join(OUT, "soak"), help="report folder (default: bench/out/soak)")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)

    from engine.model_runner import load_model_config
    from engine.serve.workload import load_workload

    vocab = load_model_config(MODEL).vocab_size
    rows, source = load_workload(args.prompts, 1, 64, args.max_tokens, vocab)
    work = [prompt[: args.max_prompt] for _, prompt, _ in rows][: args.prompts]
    os.makedirs(args.out, exist_ok=True)
    data = tempfile.mkdtemp(prefix="crescent-soak-")
    log(f"starting crescent up in {data} ({len(work)} prompts from the {source})")
    conductors = args.conductors if args.conductors else (2 if shutil.which("etcd") else 1)
    api_keys = os.path.join(data, "api-keys.json")
    with open(api_keys, "w") as f:  # two of the load's threads share a tenant allowed one request at a time
        json.dump({"keys": [{"key": KEYS[0], "tenant": "bounded", "max_concurrent": 1},
                            {"key": KEYS[1], "tenant": "free"}]}, f)
    netns = args.netns
    if netns is None:
        from kvstore.netns import unavailable

        netns = unavailable() is None
    cluster = Cluster(data, args.tmpfs_mb, conductors, args.slo_ttft, api_keys, netns)
    chaos = None
    try:
        st = cluster.state()
        store_pids = {n: st["pids"][n] for n in ("store", "store-2")}  # the first is never killed
        rss_before = {n: rss_anon(pid) for n, pid in store_pids.items()}
        load = Load(st["openai_base_url"], work, args.concurrency, args.max_tokens, args.seed).start()
        t0 = time.time()
        chaos = Chaos(cluster, args.seed, args.fault_every).start()
        end = t0 + args.minutes * 60
        while time.time() < end:
            time.sleep(min(10.0, max(0.0, end - time.time())))
            recs = list(load.records)
            log(f"t={time.time() - t0:5.0f}s served={sum(r['text'] is not None for r in recs)} "
                f"retried={sum(len(r['attempts']) > 1 for r in recs)} faults={len(chaos.events)}")
        chaos.join()
        log("load stopping; waiting for in-flight requests")
        load.join()
        log("waiting for quiescence (leases expire after the node's lease TTL)")
        quiet, leftovers = quiescent(cluster, 90)
        st = cluster.state()
        same = {n: pid for n, pid in store_pids.items() if st["pids"][n] == pid}
        rss_after = {n: rss_anon(pid) for n, pid in same.items()}
        detected = {"store_corrupt": sum(cluster.metric(n, "crescent_store_corrupt_total") for n in ("store", "store-2")),
                    "engine_verify": sum(cluster.metric(n, "crescent_engine_store_failures_total", 'op="verify"')
                                         for n in ("prefill", "decode"))}
        disk_full = cluster.metric("store", "crescent_store_disk_full_total")
        restarts = st.get("restarts", {})
    finally:
        if chaos is not None:
            chaos.close()
        status = cluster.close()
        shutil.rmtree(data, ignore_errors=True)
    log(f"cluster stopped ({status}); computing reference outputs with a store-less engine")
    records = load.records
    served = [r for r in records if r["text"] is not None]
    want = reference_texts(work, {r["prompt_index"] for r in served}, args.max_tokens)
    wrong = [r for r in served if r["text"] != want[r["prompt_index"]]]
    attempts = [a for r in records for a in r["attempts"]]
    refused = [a for a in attempts if a["outcome"] in ("429", "503")]
    unfinished = [r for r in records if r["text"] is None]
    bad_unfinished = [r for r in unfinished if r["attempts"][-1]["outcome"] not in ("429", "503", "cut")]
    faults = {}
    for e in chaos.events:
        faults[e["kind"]] = faults.get(e["kind"], 0) + (0 if e["detail"].startswith("not injected") else 1)
    fault_times = [e["t"] for e in chaos.events]
    during = lambda t: any(0 <= t - f <= FAULT_WINDOW_S for f in fault_times)  # noqa: E731
    split = {"outside faults": [r for r in served if not during(r["start"])],
             "during faults": [r for r in served if during(r["start"])]}
    corrupted = faults.get("corrupt:arena", 0) + faults.get("corrupt:disk", 0)
    probe = {k: sum(p.get(k, 0) for p in chaos.probes)
             for k in ("probed", "caught", "missed", "counted", "intact", "gone", "served_corrupt")}
    checks = [
        ("zero wrong outputs (vs a store-less engine)", not wrong, f"{len(wrong)} of {len(served)}"),
        ("every request completed or ended 429/503/cut", not bad_unfinished,
         f"{len(served)} completed, {len(unfinished)} unfinished, {len(bad_unfinished)} otherwise"),
        ("every 429/503 carried Retry-After", all(a["has_retry_after"] for a in refused), f"{len(refused)} answers"),
        ("no lease, reservation, page or request left", quiet, json.dumps(leftovers)),
        ("store RSS within 10% of pre-load (nodes not restarted)",
         all(rss_after[n] <= 1.1 * rss_before[n] for n in rss_after),
         ", ".join(f"{n} {rss_before[n] >> 20}→{rss_after[n] >> 20} MiB" for n in rss_after) or "all restarted"),
        ("flipped values read back never pass as good (probes)",
         probe["served_corrupt"] == 0 and (probe["probed"] == 0 or probe["caught"] + probe["missed"] > 0),
         ", ".join(f"{k} {v:.0f}" for k, v in probe.items())),
    ]
    if cluster.tmpfs:
        checks.append(("a full disk tier refuses writes, counted, and the node serves on", disk_full > 0,
                       f"{disk_full:.0f} disk writes refused for room"))
    report = {"minutes": args.minutes, "seed": args.seed, "conductors": conductors, "requests": len(records), "served": len(served),
              "attempts": len(attempts), "outcomes": {o: sum(a["outcome"] == o for a in attempts)
                                                      for o in sorted({a["outcome"] for a in attempts})},
              "faults": faults, "fault_events": chaos.events, "restarts": restarts,
              "corruption": {"injected_faults": corrupted, **detected, "probes": chaos.probes}, "disk_fill": cluster.disk_fill or
              f"tmpfs {args.tmpfs_mb} MiB under a 96 MiB tier: {disk_full:.0f} writes refused for room",
              "wrong": len(wrong), "checks": [{"check": c, "pass": bool(ok), "detail": d} for c, ok, d in checks],
              "latency": {k: {"n": len(v), "ttft_p50_ms": pct([r["ttft"] for r in v], 50) * 1e3,
                              "ttft_p99_ms": pct([r["ttft"] for r in v], 99) * 1e3,
                              "itl_p50_ms": pct([g for r in v for g in r["itl"]], 50) * 1e3,
                              "itl_p99_ms": pct([g for r in v for g in r["itl"]], 99) * 1e3}
                          for k, v in split.items()}}
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(os.path.join(args.out, "soak.png"), records, chaos.events, t0)
    md = [f"Chaos soak, {args.minutes:g} min, seed {args.seed}, {conductors} conductor(s): {len(records)} requests ({len(served)} served, "
          f"{len(attempts)} attempts: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()) + ").",
          "", table(["fault", "injected"], [[k, v] for k, v in sorted(faults.items())]), "",
          f"Restarts by `crescent up --restart`: {json.dumps(restarts)}. Corruption: {corrupted} corrupting faults; "
          f"counted {detected['store_corrupt']:.0f} disk checksum failures (stores), "
          f"{detected['engine_verify']:.0f} chunk verification failures (engines). Disk fill: {report['disk_fill']}.",
          "", table(["requests", "n", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
                    [[k, v["n"], f"{v['ttft_p50_ms']:.0f}", f"{v['ttft_p99_ms']:.0f}", f"{v['itl_p50_ms']:.1f}",
                      f"{v['itl_p99_ms']:.1f}"] for k, v in report["latency"].items()]), "",
          table(["check", "result", "detail"], [[c, "PASS" if ok else "FAIL", d] for c, ok, d in checks])]
    text = "\n".join(md)
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    if args.docs:
        shutil.copy(os.path.join(args.out, "soak.png"), os.path.join(ROOT, "docs", "soak.png"))
        write_docs_section("soak", "### Chaos soak (`bench/soak.py`)\n\n" + DOCS_INTRO + "\n\n" + text
                           + "\n\n![chaos soak timeline](soak.png)")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
