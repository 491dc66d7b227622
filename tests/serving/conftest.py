import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, wait_for


class Cluster:
    """`crescent up` as a real process on free ports; stopped (SIGTERM, by pid) at teardown."""

    def __init__(self, data: str, *args: str) -> None:
        self.data = data
        self.log = open(os.path.join(data, "up.out"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "up", "--data", data, "--model", "random:tiny",
             "--store-port", "0", "--prefill-port", "0", "--decode-port", "0", "--gateway-port", "0", "--conductor-port", "0",
             "--dram", "256MiB", "--disk-size", "512MiB", "--chunk-tokens", "64", "--kv-cache-memory", "64MiB",
             *args], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        state_path = os.path.join(data, "up.json")

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(open(os.path.join(data, "up.out")).read())
            return os.path.exists(state_path)

        wait_for(ready, timeout_s=300, interval_s=0.2, what="crescent up")
        with open(state_path) as f:
            self.state = json.load(f)
        self.base_url = self.state["openai_base_url"]

    def output(self) -> str:
        with open(os.path.join(self.data, "up.out")) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("cluster")))
    yield c
    assert c.stop() == 0, c.output()
