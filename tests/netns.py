"""Emulated hosts for tests: ``kvstore.netns.EmulatedHosts`` with processes on them.

``Lab(n)`` makes ``n`` hosts at ``10.251.77.(i + 1)``; nothing is added to the
machine's own namespace: the hosts reach only each other (and their own
loopback). ``cut(i)`` takes host ``i``'s bridge port down (a partition: packets
vanish, nothing refuses a connection), ``heal(i)`` brings it back. ``close()``
stops every process it started, by pid, and deletes the namespaces.

Needs root and ``ip`` (iproute2); ``Lab.unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from kvstore.netns import EmulatedHosts, reclaim_stale, unavailable
from kvstore.procs import stop_process
from tests.helpers import ROOT

SUBNET = "10.251.77"
WAIT_FOR_GATEWAY = """
deadline = time.monotonic() + 300
while True:  # the gateway is up before every engine has registered with the conductor
    try:
        c.models.list()
        break
    except openai.APIConnectionError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
"""
"""Client code (``c``: an openai.OpenAI on the gateway; ``time`` and ``openai`` imported) that waits
until the gateway answers."""


class HostProcess:
    """``python -m kvstore.cli ARGS`` inside a namespace; the first stdout line is its banner.

    With ``argv``, that command instead, its output to the log and no banner awaited.
    """

    def __init__(self, ns: str, args: list[str], banner: str, log_path: str, host_id: str,
                 argv: list[str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = ["ip", "netns", "exec", ns,
               *(argv or [sys.executable, "-m", "kvstore.cli", "--host-id", host_id, *args])]
        # `ip netns exec` execs the command: the pid is the Python process's own.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log if argv else subprocess.PIPE, stderr=self.log,
                                     text=True, start_new_session=True)
        self.pid = self.proc.pid
        self.address = ""
        if argv:
            return
        self.line = self.proc.stdout.readline()
        if banner not in self.line:
            self.stop()
            with open(log_path) as f:
                raise RuntimeError(f"{args[0]} in {ns} did not start: {self.line!r}\n{f.read()[-3000:]}")
        m = re.search(r"listening on ([^\s,]+)", self.line) or re.search(r"on (http://\S+?)/v1", self.line)
        self.address = m.group(1) if m else ""

    def stop(self) -> None:
        stop_process(self.proc, 60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


class Lab:
    def __init__(self, num_hosts: int, log_dir: str) -> None:
        reclaim_stale()  # what a killed run left (its pid gone) goes first
        self.net = EmulatedHosts(num_hosts, f"cr{os.getpid() % 100000}", SUBNET)
        self.hosts = self.net.hosts
        self.log_dir = log_dir
        self.procs: list[HostProcess] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        return unavailable()

    def addr(self, i: int) -> str:
        return self.net.addr(i)

    def start(self, i: int, args: list[str], banner: str = "listening on") -> HostProcess:
        """Runs ``crescent ARGS`` on host ``i`` (its host id: ``h<i>``)."""
        log = os.path.join(self.log_dir, f"h{i}-{args[0]}-{len(self.procs)}.log")
        p = HostProcess(self.hosts[i], args, banner, log, host_id=f"h{i}")
        self.procs.append(p)
        return p

    def start_etcd(self, i: int, timeout_s: float = 120.0) -> str:
        """A one-member etcd on host ``i`` (port 2379); returns its client endpoint once it serves."""
        exe = shutil.which("etcd")
        if exe is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        endpoint, peer = f"{self.addr(i)}:2379", f"http://{self.addr(i)}:2380"
        argv = [exe, "--name", "lab", "--data-dir", os.path.join(self.log_dir, f"etcd-h{i}"),
                "--listen-client-urls", f"http://{endpoint}", "--advertise-client-urls", f"http://{endpoint}",
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"lab={peer}"]
        p = HostProcess(self.hosts[i], [], "", os.path.join(self.log_dir, f"h{i}-etcd.log"), f"h{i}", argv=argv)
        self.procs.append(p)
        probe = (f"import time, urllib.request as u\nt = time.monotonic() + {timeout_s}\nwhile True:\n"
                 f"    try:\n        u.urlopen('http://{endpoint}/health', timeout=5).read(); break\n"
                 f"    except OSError:\n        assert time.monotonic() < t, 'etcd did not serve'\n"
                 f"        time.sleep(0.1)\n")
        r = self.run(i, probe, timeout=timeout_s + 30)
        if r.returncode != 0:
            with open(p.log_path) as f:
                raise RuntimeError(f"etcd on h{i} did not start: {r.stderr[-500:]}\n{f.read()[-2000:]}")
        return endpoint

    def run(self, i: int, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Runs Python ``code`` on host ``i`` (a client there) and returns its result."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[i], sys.executable, "-c", code], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def cut(self, i: int) -> None:
        self.net.cut(i)

    def heal(self, i: int) -> None:
        self.net.heal(i)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        self.net.close()
