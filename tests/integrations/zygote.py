"""The test side of vllm_zygote.py: one fork server per test session, started on the first vLLM run and
stopped (with any run in flight) by tests/integrations/conftest.py when the session ends."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

from kvstore.procs import stop_process
from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "tests", "integrations", "vllm_zygote.py")
START_S = 300.0  # importing vLLM: ~7 s idle here, minutes on a loaded machine's cold page cache


class ZygoteError(RuntimeError):
    pass


class Zygote:
    """Forks vllm_run.py runs from a process that imported vLLM once (``python`` is the vLLM venv's)."""

    def __init__(self, python: str, log: str):
        self.log = log
        self._logf = open(log, "w+b")  # (read back through this file: a test's tmp_path may be gone by then)
        # single-process vLLM on the CPU, offline
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.proc = subprocess.Popen([python, SCRIPT], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._logf)
        self._buf = b""
        self.child: int | None = None  # the run in flight
        self.last_child: int | None = None
        try:
            self._read(START_S, "ready")
        except ZygoteError:
            self.stop()
            raise

    def _read(self, timeout_s: float, field: str) -> int:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZygoteError(f"no {field!r} from the vLLM fork server in {timeout_s:.0f} s{self._tail()}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                data = os.read(fd, 4096)
                if not data:
                    raise ZygoteError(f"the vLLM fork server ended (rc {self.proc.wait()}){self._tail()}")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return int(json.loads(line)[field])

    def _tail(self) -> str:
        fd = self._logf.fileno()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 4000, max(0, size - 4000)).decode(errors="replace")
        return f"; its log ({self.log}) ends:\n{tail}" if tail else ""

    def run(self, argv: list[str], log: str, timeout_s: float) -> int:
        """Runs ``vllm_run.py ARGV`` in a fresh child, its output to ``log``; returns its exit code
        (negative: the signal that ended it). A child still running after ``timeout_s`` is killed."""
        req = {"argv": argv, "log": log, "limit_s": int(timeout_s) + 60}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        try:
            self.child = self.last_child = self._read(60.0, "pid")
            rc = self._read(timeout_s, "rc")
        except BaseException:
            # (a timeout, or the test interrupted): the child and the server go, and the next run
            # starts a new server rather than read this run's answer as its own
            self.stop()
            raise
        self.child = None
        return rc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.child = None
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
        self.proc.stdout.close()
        self._logf.close()


_zygote: Zygote | None = None


def zygote(python: str, log: str) -> Zygote:
    """The session's fork server, started (or restarted, if it died) on first use; ``log`` takes what
    a new one prints."""
    global _zygote
    if _zygote is None or not _zygote.alive():
        if _zygote is not None:
            _zygote.stop()
        _zygote = Zygote(python, log)
    return _zygote


def stop() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.stop()
        _zygote = None
