"""Child processes are stopped by their own pid: SIGTERM first, SIGKILL when it does not end."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """Asks ``proc`` to stop (SIGTERM), kills it after ``grace_s``; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode
