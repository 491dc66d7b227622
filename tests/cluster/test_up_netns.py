"""`crescent up --nodes 3 --conductors 2` as root (namespaces by default; `--netns`): a three-host cluster on this machine, each host a
network namespace with a store node and an engine, two conductor replicas on etcd. The official openai
client (on the machine itself) gets the tokens a store-less engine computes, a repeated prompt reuses
its prefix, the decode engine loads chunks stored on other hosts, `crescent ctl nodes` shows each member's host and the leader, and a
SIGTERM leaves no namespace or interface behind."""

import json
import subprocess
import sys

import pytest

from engine.llm import LLM
from kvstore.netns import unavailable
from tests.helpers import ROOT
from tests.serving.conftest import Cluster

MODEL = "random:tiny"
why_not = unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"emulated hosts: {why_not}")


def _ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 250) for _ in range(n)]


def _killed_up_leaves_hosts() -> str:
    """What a SIGKILLed `crescent up --netns` leaves: its namespaces and the uplink holding the subnet's .254."""
    from engine.serve.up import NETNS_SUBNET

    child = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
from kvstore.netns import EmulatedHosts
EmulatedHosts(2, f"crup{{os.getpid() % 100000}}", "{NETNS_SUBNET}", reachable=True)
print(os.getpid() % 100000, flush=True)
time.sleep(600)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    tag = "crup" + child.stdout.readline().strip()
    child.kill()
    child.wait(timeout=60)
    return tag


def test_up_netns_three_hosts_two_conductors(tmp_path):
    import openai

    from kvstore.netns import reclaim_stale

    stale = _killed_up_leaves_hosts()  # the subnet is taken by hosts nobody will close
    assert stale in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    try:
        cl = Cluster(str(tmp_path), "--nodes", "3", "--conductors", "2")  # as root: namespaces by default
    finally:
        reclaim_stale()  # had `crescent up` not come up, the leftovers would be gone all the same
    assert f"removed emulated hosts left by a process no longer running: {stale}-up" in cl.output()
    try:
        st = cl.state
        tag = st["hosts"]["h0"]["namespace"].rsplit("-", 1)[0]
        assert sorted(st["hosts"]) == ["h0", "h1", "h2"]
        assert len(st["stores"]) == 3 and len({a.split(":")[0] for a in st["stores"]}) == 3  # an address each

        nodes = subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", "nodes", "--conductor", st["conductor"],
                                "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert nodes.returncode == 0, nodes.stderr
        members = json.loads(nodes.stdout)
        hosts = {m["member_id"]: m["host_id"] for m in members}
        assert hosts == {"store-0": "h0", "store-1": "h1", "store-2": "h2",
                         f"prefill@{st['prefill_engine']}": "h0", f"decode@{st['decode_engine']}": "h1",
                         f"prefill@{st['prefill-2_engine']}": "h2"}
        table = subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", "nodes", "--conductor", st["conductor"]],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert table.stdout.startswith("conductor leader ")

        c = openai.OpenAI(base_url=st["openai_base_url"], api_key="unused", timeout=300, max_retries=0)
        prompts = [_ids(5, 200), _ids(5, 200), _ids(6, 150)]
        out = [c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}) for p in prompts]
        with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
            ref = llm.generate(prompts, max_tokens=6, ignore_eos=True)
            want = [llm.tokenizer.decode(x.token_ids) for x in ref]
        assert [r.choices[0].text for r in out] == want
        assert out[1].usage.prompt_tokens_details.cached_tokens == 192  # three chunks of 64 reused
        # The decode engine (h1) loaded the chunks the prefill engines saved on their own hosts' store nodes.
        import re
        import urllib.request

        text = urllib.request.urlopen(st["metrics"]["decode"], timeout=60).read().decode()
        loaded = re.search(r'crescent_engine_store_chunks_total\{direction="loaded",role="decode"\} (\S+)', text)
        assert loaded and float(loaded.group(1)) > 0, text[-2000:]
    finally:
        assert cl.stop() == 0, cl.output()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in left and tag not in links
    assert stale not in left and stale not in links
