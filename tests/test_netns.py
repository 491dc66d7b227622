"""kvstore.netns.reclaim_stale: the namespaces and uplink a killed process left are deleted; a running
process's are kept."""

import os
import subprocess
import sys

import pytest

from kvstore.netns import EmulatedHosts, _running, reclaim_stale, unavailable
from tests.helpers import ROOT

why_not = unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"emulated hosts: {why_not}")


def _names() -> str:
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            + subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout)


def test_reclaim_deletes_a_killed_process_hosts_and_keeps_a_running_ones():
    child = subprocess.Popen([sys.executable, "-c", """
import os, time
from kvstore.netns import EmulatedHosts
EmulatedHosts(2, f"crtst{os.getpid() % 100000}", "10.251.75", reachable=True)
print(os.getpid() % 100000, flush=True)
time.sleep(600)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    dead = "crtst" + child.stdout.readline().strip()
    live = EmulatedHosts(1, f"crtst{os.getpid() % 100000}", "10.251.74", reachable=True)
    try:
        assert f"{dead}-sw" in _names() and f"{dead}-up" in _names()
        assert not [n for n in reclaim_stale() if n.startswith(dead)]  # its maker is still running
        child.kill()
        child.wait(timeout=60)
        if _running(child.pid % 100000):
            pytest.skip("another process already took the dead child's pid (mod 100000)")
        gone = reclaim_stale()
        assert {f"{dead}-up", f"{dead}-sw", f"{dead}-h0", f"{dead}-h1"} <= set(gone)
        names = _names()
        assert dead not in names
        assert f"{live.switch}" in names and live.uplink in names  # ours: this process is running
        ok = subprocess.run(["ip", "-o", "addr", "show", "to", "10.251.75.254"], capture_output=True, text=True)
        assert ok.stdout.strip() == ""  # the subnet is free again
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
        live.close()
        reclaim_stale()
