"""Real processes for the live conductor tests, each stopped by its pid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from tests.helpers import ROOT


class Proc:
    """A subprocess whose first stdout line is its banner; ``stop`` ends it by pid."""

    def __init__(self, cmd: list[str], banner: str) -> None:
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.line = self.proc.stdout.readline()
        if banner not in self.line:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"{cmd[3:5]} did not start: {self.line!r} {err!r}")

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=60)
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return self.proc.returncode


class ConductorProcess(Proc):
    def __init__(self, *args: str) -> None:
        super().__init__([sys.executable, "-m", "kvstore.cli", "conductor", "--listen", "127.0.0.1:0", *args],
                         "listening on")
        self.address = re.search(r"listening on (\S+)", self.line).group(1)


class EngineProcess(Proc):
    def __init__(self, conductor: str, member_id: str, *args: str) -> None:
        super().__init__([sys.executable, "-m", "tests.conductor.engine_member", "--conductor", conductor,
                          "--id", member_id, *args], "registered")


def ctl(*args: str, conductor: str | None = None, json_out: bool = False):
    """Runs ``crescent ctl``; returns the CompletedProcess, or the parsed JSON when ``json_out``."""
    cmd = [sys.executable, "-m", "kvstore.cli", "ctl", *args]
    if conductor is not None:
        cmd += ["--conductor", conductor]
    if json_out:
        cmd.append("--json")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if json_out:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    return r


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Runs ``crescent ARGS`` in this process (the real CLI code, no subprocess start-up cost).

    Returns the exit status, stdout and stderr; argparse's exits count as statuses.
    """
    from kvstore.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err
