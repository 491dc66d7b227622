"""Three emulated hosts (network namespaces on this machine), each process at its own address:

    h0  10.251.77.1  conductor
    h1  10.251.77.2  store node + prefill engine   (same host: shared memory between them)
    h2  10.251.77.3  decode engine + gateway       (another host: TCP to the store)

The official openai client on h2 gets, through the gateway, exactly the tokens a store-less
engine computes, prompts sharing a prefix reuse it across hosts, the store node's counters show
both movers, and the conductor lists each member with its host.
"""

import json
import re
import textwrap

import pytest

from engine.llm import LLM
from tests.netns import WAIT_FOR_GATEWAY, Lab

MODEL = "random:tiny"
why_not = Lab.unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"emulated hosts: {why_not}")


@pytest.fixture
def lab(tmp_path):
    lab = Lab(3, str(tmp_path))
    yield lab
    lab.close()


def _ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 250) for _ in range(n)]


def test_three_hosts_serve_exact_tokens_through_the_gateway(lab):
    h0, h1, h2 = (lab.addr(i) for i in range(3))
    conductor = lab.start(0, ["conductor", "--listen", f"{h0}:7300", "--chunk-tokens", "64",
                              "--heartbeat-interval", "0.2"]).address
    store = lab.start(1, ["store", "--listen", f"{h1}:7400", "--data-port", "7401", "--dram", "64MiB",
                          "--node-id", "store-h1", "--conductor", conductor, "--metrics-port", "9400"]).address
    engine = ["--model", MODEL, "--dtype", "float32", "--store", store, "--conductor", conductor,
              "--chunk-tokens", "64", "--kv-cache-memory", "64MiB", "--chunk-size", "128",
              "--max-num-batched-tokens", "192"]
    prefill = lab.start(1, ["engine", "prefill", "--listen", f"{h1}:7500", *engine]).address
    decode = lab.start(2, ["engine", "decode", "--listen", f"{h2}:7501", *engine]).address
    gateway = lab.start(2, ["gateway", "--listen", f"{h2}:8000", "--model", MODEL, "--conductor", conductor,
                            "--prefill", prefill, "--decode", decode], banner="http://").address

    shared = _ids(1, 192)  # three chunks of 64 tokens, then each prompt's own tail
    prompts = [shared + _ids(10 + i, 40) for i in range(3)]
    client = textwrap.dedent(f"""
        import json, time, openai
        c = openai.OpenAI(base_url="{gateway}/v1", api_key="unused", timeout=300, max_retries=0)
        """) + WAIT_FOR_GATEWAY + textwrap.dedent(f"""
        out = []
        for p in {prompts!r}:
            r = c.completions.create(model="{MODEL}", prompt=p, max_tokens=8, temperature=0,
                                     extra_body={{"ignore_eos": True}})
            out.append([r.choices[0].text, r.usage.completion_tokens])
        print(json.dumps(out))
        """)
    r = lab.run(2, client)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
        ref = llm.generate(prompts, max_tokens=8, ignore_eos=True)
        want = [llm.tokenizer.decode(x.token_ids) for x in ref]
    assert [t for t, _ in got] == want
    assert all(n == 8 for _, n in got)

    # The store saw both movers: shared memory from the prefill engine on its host, TCP from the decode
    # engine on the other; the conductor knows each member's host.
    metrics = lab.run(2, f"import urllib.request as u; print(u.urlopen('http://{h1}:9400/metrics', timeout=30)"
                         f".read().decode())")
    assert metrics.returncode == 0, metrics.stderr
    ops = {(m, op): float(v) for m, op, v in
           re.findall(r'crescent_store_mover_ops_total\{mover="(\w+)",op="(\w+)"\} (\S+)', metrics.stdout)}
    assert ops.get(("shm", "write"), 0) > 0, ops  # the prefill engine saved its chunks through shm
    assert ops.get(("tcp", "read"), 0) > 0, ops  # the decode engine loaded them over TCP
    nodes = lab.run(0, f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', 'kvstore.cli', "
                       f"'ctl', 'nodes', '--conductor', '{conductor}', '--json']))")
    assert nodes.returncode == 0, nodes.stderr
    hosts = {m["member_id"]: m["host_id"] for m in json.loads(nodes.stdout)}
    assert hosts == {"store-h1": "h1", f"prefill@{prefill}": "h1", f"decode@{decode}": "h2"}
