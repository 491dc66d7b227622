"""The fork server that runs the vLLM integration tests' engines (tests/integrations/zygote.py): a run
that fails must fail its test, with its own log, and a run that hangs must be killed, not waited on."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers import require_venv, venv_python
from tests.integrations import zygote

pytestmark = pytest.mark.timeout(900)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie is left."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_failing_run_reports_its_exit_code_and_its_own_log(tmp_path):
    require_venv("vllm")
    server = zygote.zygote(venv_python("vllm"), str(tmp_path / "server.log"))
    req = tmp_path / "requests.json"
    req.write_text(json.dumps([{"prompt": "a b c", "cache_salt": None}]))
    log = tmp_path / "run.log"
    rc = server.run([str(tmp_path / "no-such-model"), str(req), str(tmp_path / "out.json")], str(log), timeout_s=300)
    assert rc == 1
    assert "no-such-model" in log.read_text()
    assert not (tmp_path / "out.json").exists()
    assert server.alive()  # the next run goes on in the same server


def test_a_run_past_its_deadline_is_killed_and_the_next_run_gets_a_new_server(tmp_path):
    require_venv("vllm")
    server = zygote.zygote(venv_python("vllm"), str(tmp_path / "server.log"))
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)  # vllm_run.py's open() of its requests file waits for a writer that never comes
    with pytest.raises(zygote.ZygoteError, match="no 'rc'"):
        server.run([str(tmp_path), str(fifo), str(tmp_path / "out.json")], str(tmp_path / "run.log"), timeout_s=5)
    child = server.last_child
    assert child is not None and not server.alive()
    deadline = time.monotonic() + 60
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(child)
    assert zygote.zygote(venv_python("vllm"), str(tmp_path / "server2.log")) is not server
