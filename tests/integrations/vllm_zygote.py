"""A fork server for vllm_run.py (run with the vLLM venv's python, by tests/integrations/zygote.py).

Each vLLM run of the integration tests is a fresh process with a fresh engine, but most of a fresh
process's time went to importing vLLM and torch (about 7 s of 13 here), and 2 s more to garbage
collections that walk every object those imports made. This process imports them once, freezes those
objects out of the collector (``gc.freeze``), and then forks one child per run: the child is still a
new process with an empty KV cache and its own engine, connector and store connections.

Protocol, one JSON object per line: stdin gets ``{"argv": [...], "log": PATH, "limit_s": N}`` (vllm_run.py's
arguments, where its output goes); stdout answers ``{"pid": PID}`` once the child is forked, then
``{"rc": CODE}`` when it ended (a negative code: ended by that signal). A child that outlives
``limit_s`` is ended by SIGALRM. EOF on stdin ends the server.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Modules vllm_run.py's engine imports only once it starts (seen with -X importtime): importing them here
# saves each child ~1 s more. A name vLLM drops in another version is skipped, not an error.
WARM = ("vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
        "vllm.v1.worker.cpu_model_runner", "vllm.v1.core.sched.scheduler", "vllm.model_executor.models.llama",
        "vllm.lora.request")


def _child(argv: list[str], log: str, limit_s: int) -> int:
    signal.alarm(limit_s)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    from tests.integrations import vllm_run

    sys.argv = [vllm_run.__file__] + argv
    try:
        vllm_run.main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    sys.path.insert(0, ROOT)
    import importlib

    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import kvstore.integrations.vllm  # noqa: F401
    import tests.integrations.tiny_llama  # noqa: F401
    import tests.integrations.vllm_run  # noqa: F401

    for name in WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(req["argv"], req["log"], int(req.get("limit_s", 600)))
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=out, flush=True)


if __name__ == "__main__":
    main()
