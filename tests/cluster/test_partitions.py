"""Partitions: a host's link is cut mid-run, and the gateway keeps serving, exact tokens, no failed request.

Four emulated hosts (network namespaces; a cut takes the host's bridge port down, so packets vanish and
nothing refuses a connection, as when a switch port or a host dies):

    h0  10.251.77.1  conductor
    h1  10.251.77.2  prefill engine
    h2  10.251.77.3  decode engine + gateway + the client (the official openai client)
    h3  10.251.77.4  store node

The client sends requests one after another for the whole test, each a shared 64-token system prefix (one
chunk) plus 140 tokens of its own (two chunks the decode engine loads from the store, and a tail). The test cuts the store's host, heals it, cuts the prefill engine's host, heals it, cuts the
conductor's, heals it; after each cut it waits for requests sent during the cut to complete, after each
heal for reuse (or the path it lost) to come back, read from the processes' own Prometheus metrics.
At the end every request must have completed with exactly the tokens a store-less engine computes.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from engine.llm import LLM
from kvstore.procs import stop_process
from tests.netns import WAIT_FOR_GATEWAY, Lab

MODEL = "random:tiny"
why_not = Lab.unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"emulated hosts: {why_not}")
WAIT_S = 240.0
"""Longest wait for any one phase (a loaded 2-core machine is slow; nothing here asserts a duration)."""


def _ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 250) for _ in range(n)]


SHARED = _ids(7, 64)


def prompt(i: int) -> list[int]:
    return SHARED + _ids(1000 + i, 140)


CLIENT = """
import json, os, sys, time, openai
shared = {shared!r}
c = openai.OpenAI(base_url="{gateway}/v1", api_key="unused", timeout=600, max_retries=0)
{wait}
i = 0
while not os.path.exists({stop!r}):
    import random
    r = random.Random(1000 + i)
    p = shared + [r.randrange(3, 250) for _ in range(140)]
    t0 = time.time()
    try:
        out = c.completions.create(model="{model}", prompt=p, max_tokens=4, temperature=0,
                                   extra_body={{"ignore_eos": True}})
        rec = dict(i=i, t0=t0, t1=time.time(), text=out.choices[0].text, n=out.usage.completion_tokens)
    except Exception as exc:
        rec = dict(i=i, t0=t0, t1=time.time(), error=repr(exc))
    print(json.dumps(rec), flush=True)
    i += 1
"""


class Client:
    def __init__(self, lab: Lab, host: int, gateway: str, tmp: str) -> None:
        self.stop_file = os.path.join(tmp, "stop-client")
        self.out_path = os.path.join(tmp, "client.jsonl")
        code = CLIENT.format(shared=SHARED, gateway=gateway, stop=self.stop_file, model=MODEL, wait=WAIT_FOR_GATEWAY)
        self.out = open(self.out_path, "w")
        self.err = open(os.path.join(tmp, "client.err"), "w")
        self.proc = subprocess.Popen(["ip", "netns", "exec", lab.hosts[host], sys.executable, "-c",
                                      textwrap.dedent(code)], stdout=self.out, stderr=self.err,
                                     start_new_session=True)

    def records(self) -> list[dict]:
        with open(self.out_path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def wait(self, what: str, pred) -> list[dict]:
        deadline = time.monotonic() + WAIT_S
        while True:
            recs = self.records()
            if pred(recs):
                return recs
            if self.proc.poll() is not None:
                raise AssertionError(f"the client exited ({self.proc.returncode}) waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {WAIT_S} s: {recs[-5:]}")
            time.sleep(0.2)

    def done_after(self, t: float, n: int) -> list[dict]:
        """Waits for ``n`` requests sent after wall time ``t`` to complete (or fail)."""
        return self.wait(f"{n} requests after the change",
                         lambda recs: sum(r["t0"] > t for r in recs) >= n)

    def stop(self) -> list[dict]:
        open(self.stop_file, "w").close()
        try:
            self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        stop_process(self.proc, 30)
        self.out.close()
        self.err.close()
        return self.records()


def scrape(lab: Lab, url: str) -> str:
    """A process's /metrics, read from host 2 (the namespaces reach only each other)."""
    r = lab.run(2, f"import urllib.request as u; print(u.urlopen('{url}', timeout=30).read().decode())",
                timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def metric(lab: Lab, url: str, name: str, labels: str = "", text: str | None = None) -> float:
    """One sample of a Prometheus metric (0 when absent); ``labels`` as ``a="x",b="y"``, in any order."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for line in (text if text is not None else scrape(lab, url)).splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == want:
            return float(m.group(3))
    return 0.0


def wait_metric(lab: Lab, url: str, name: str, labels: str, pred, what: str) -> float:
    deadline = time.monotonic() + WAIT_S
    while True:
        text = scrape(lab, url)
        v = metric(lab, url, name, labels, text)
        if pred(v):
            return v
        if time.monotonic() > deadline:
            lines = "\n".join(x for x in text.splitlines() if x.startswith(name))
            raise AssertionError(f"{what}: {name}{{{labels}}} = {v} after {WAIT_S} s\n{lines}")
        time.sleep(0.5)


def assert_all_answered_exactly(recs: list[dict]) -> None:
    """No request failed, and each got exactly the tokens a store-less engine computes for its prompt."""
    failed = [r for r in recs if "error" in r]
    assert not failed, failed[:5]
    with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
        ref = llm.generate([prompt(r["i"]) for r in recs], max_tokens=4, ignore_eos=True)
        want = [llm.tokenizer.decode(x.token_ids) for x in ref]
    assert [r["text"] for r in recs] == want


@pytest.fixture
def lab(tmp_path):
    lab = Lab(4, str(tmp_path))
    yield lab
    lab.close()


def test_cuts_of_store_prefill_and_conductor_fail_no_request(lab, tmp_path):
    h0, h1, h2, h3 = (lab.addr(i) for i in range(4))
    t_start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    conductor = lab.start(0, ["conductor", "--listen", f"{h0}:7300", "--chunk-tokens", "64",
                              "--heartbeat-interval", "0.2", "--metrics-port", "9300"]).address
    store = lab.start(3, ["store", "--listen", f"{h3}:7400", "--data-port", "7401", "--dram", "64MiB",
                          "--node-id", "store-h3", "--conductor", conductor, "--metrics-port", "9400"]).address
    engine = ["--model", MODEL, "--dtype", "float32", "--store", store, "--conductor", conductor,
              "--chunk-tokens", "64", "--kv-cache-memory", "64MiB", "--chunk-size", "128",
              "--max-num-batched-tokens", "192"]
    prefill = lab.start(1, ["engine", "prefill", "--listen", f"{h1}:7500", "--metrics-port", "9500",
                            *engine]).address
    decode = lab.start(2, ["engine", "decode", "--listen", f"{h2}:7501", "--metrics-port", "9501",
                           *engine]).address
    gateway = lab.start(2, ["gateway", "--listen", f"{h2}:8000", "--model", MODEL, "--conductor", conductor,
                            "--prefill", prefill, "--decode", decode], banner="http://").address
    decode_m, prefill_m = f"http://{h2}:9501/metrics", f"http://{h1}:9500/metrics"
    gateway_m, conductor_m = f"{gateway}/metrics", f"http://{h0}:9300/metrics"
    loaded = 'role="decode",direction="loaded"'

    client = Client(lab, 2, gateway, str(tmp_path))
    try:
        client.wait("the first requests", lambda recs: len(recs) >= 3)
        wait_metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded, lambda v: v > 0,
                    "the decode engine loads the prefill engine's chunks from the store")
        log("serving")

        # -- the store's host: loads and saves fail; requests go on (recomputed) -------------------------
        t = time.time()
        lab.cut(3)
        log("store cut")
        client.done_after(t, 3)
        wait_metric(lab, decode_m, "crescent_engine_store_failures_total", 'role="decode",op="error"',
                    lambda v: v > 0, "the decode engine counts failed store calls")
        wait_metric(lab, conductor_m, "crescent_conductor_members", 'kind="store",state="alive"',
                    lambda v: v == 0, "the conductor declares the store node dead")
        log("served through the store cut")
        before = metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded)
        lab.heal(3)
        log("store healed")
        wait_metric(lab, conductor_m, "crescent_conductor_members", 'kind="store",state="alive"',
                    lambda v: v == 1, "the store node registers again")
        wait_metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded, lambda v: v > before,
                    "loads from the store resume")
        log("reuse resumed")

        # -- the prefill engine's host: the decode engine prefills locally --------------------------------
        t = time.time()
        lab.cut(1)
        log("prefill cut")
        client.done_after(t, 3)
        wait_metric(lab, gateway_m, "crescent_gateway_prefill_fallbacks_total", "", lambda v: v > 0,
                    "the gateway counts requests the decode engine prefilled")
        wait_metric(lab, conductor_m, "crescent_conductor_members", 'kind="prefill",state="alive"',
                    lambda v: v == 0, "the conductor declares the prefill engine dead")
        log("served through the prefill cut")
        lab.heal(1)
        log("prefill healed")
        wait_metric(lab, conductor_m, "crescent_conductor_members", 'kind="prefill",state="alive"',
                    lambda v: v == 1, "the prefill engine registers again")
        served = metric(lab, prefill_m, "crescent_engine_requests_total", 'role="prefill",reason="length"')
        wait_metric(lab, prefill_m, "crescent_engine_requests_total", 'role="prefill",reason="length"',
                    lambda v: v > served, "the prefill engine serves again")
        log("prefill resumed")

        # -- the conductor's host: the gateway routes without it --------------------------------------------
        t = time.time()
        lab.cut(0)
        log("conductor cut")
        client.done_after(t, 3)
        log("served through the conductor cut")
        lab.heal(0)
        log("conductor healed")
        scheduled = metric(lab, conductor_m, "crescent_conductor_scheduled_total")
        wait_metric(lab, conductor_m, "crescent_conductor_scheduled_total", "", lambda v: v > scheduled,
                    "the conductor schedules again")
        log("conductor resumed")
    finally:
        recs = client.stop()

    assert_all_answered_exactly(recs)
    slow = sorted(recs, key=lambda r: r["t1"] - r["t0"])[-5:]
    log(f"{len(recs)} requests; slowest: {[(r['i'], round(r['t1'] - r['t0'], 1)) for r in slow]}")


def test_a_cut_conductor_leader_is_replaced_and_no_request_fails(lab, tmp_path):
    """Two conductor replicas on etcd (h0, h1); etcd, the store node and the prefill engine on h2;
    decode, gateway and client on h3. The leader's host is cut: the other replica takes over, the
    members register with it and the store node resends its chunk set, so reuse goes on; healed, the
    old leader is a follower."""
    h0, h1, h2, h3 = (lab.addr(i) for i in range(4))
    etcd = lab.start_etcd(2)
    conductors = f"{h0}:7300,{h1}:7300"
    for i in (0, 1):
        lab.start(i, ["conductor", "--listen", f"{lab.addr(i)}:7300", "--etcd", etcd, "--leader-ttl", "2",
                      "--chunk-tokens", "64", "--heartbeat-interval", "0.2", "--metrics-port", "9300"])
    store = lab.start(2, ["store", "--listen", f"{h2}:7400", "--data-port", "7401", "--dram", "64MiB",
                          "--node-id", "store-h2", "--conductor", conductors]).address
    engine = ["--model", MODEL, "--dtype", "float32", "--store", store, "--conductor", conductors,
              "--chunk-tokens", "64", "--kv-cache-memory", "64MiB", "--chunk-size", "128",
              "--max-num-batched-tokens", "192"]
    prefill = lab.start(2, ["engine", "prefill", "--listen", f"{h2}:7500", *engine]).address
    decode = lab.start(3, ["engine", "decode", "--listen", f"{h3}:7501", "--metrics-port", "9501",
                           *engine]).address
    gateway = lab.start(3, ["gateway", "--listen", f"{h3}:8000", "--model", MODEL, "--conductor", conductors,
                            "--prefill", prefill, "--decode", decode], banner="http://").address
    decode_m = f"http://{h3}:9501/metrics"
    conductor_m = [f"http://{h}:9300/metrics" for h in (h0, h1)]
    loaded = 'role="decode",direction="loaded"'

    def leader() -> int | None:
        flags = [metric(lab, u, "crescent_conductor_is_leader") for u in conductor_m]
        return flags.index(1.0) if flags.count(1.0) == 1 else None

    client = Client(lab, 3, gateway, str(tmp_path))
    try:
        client.wait("the first requests", lambda recs: len(recs) >= 3)
        wait_metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded, lambda v: v > 0,
                    "the decode engine loads the prefill engine's chunks from the store")
        old = leader()
        assert old is not None
        new = 1 - old

        t = time.time()
        lab.cut(old)
        client.done_after(t, 3)
        wait_metric(lab, conductor_m[new], "crescent_conductor_is_leader", "", lambda v: v == 1,
                    "the other replica leads")
        for kind in ("store", "prefill", "decode"):
            wait_metric(lab, conductor_m[new], "crescent_conductor_members", f'kind="{kind}",state="alive"',
                        lambda v: v == 1, f"the {kind} member registers with the new leader")
        wait_metric(lab, conductor_m[new], "crescent_conductor_index_chunks", "", lambda v: v > 0,
                    "the store node resends its chunk set to the new leader")
        before = metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded)
        wait_metric(lab, decode_m, "crescent_engine_store_chunks_total", loaded, lambda v: v > before,
                    "loads from the store go on under the new leader")

        t = time.time()
        lab.heal(old)
        wait_metric(lab, conductor_m[old], "crescent_conductor_is_leader", "", lambda v: v == 0,
                    "the healed replica follows")
        client.done_after(t, 3)
        assert leader() == new
    finally:
        recs = client.stop()

    assert_all_answered_exactly(recs)
