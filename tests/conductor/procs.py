"""Real processes for the live conductor tests, each stopped by its pid."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.helpers import ROOT, Proc


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
