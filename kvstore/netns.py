"""Emulated hosts on one machine: network namespaces joined by a bridge (Linux, root, iproute2).

``EmulatedHosts(n, tag, subnet)`` creates namespaces ``<tag>-h0`` … ``<tag>-h<n-1>``;
host ``i`` gets ``eth0`` at ``<subnet>.<i + 1>/24`` on a veth pair whose other
end is a port of a bridge in a switch namespace ``<tag>-sw``, so traffic
between hosts never crosses the machine's own firewall. By default nothing is
added to the machine's namespace and the hosts reach only each other (what the
tests use); ``reachable=True`` adds one veth from the machine into the bridge,
at ``<subnet>.254``, so processes on the machine (``crescent up``'s gateway,
the user's shell) reach every host. ``cut(i)``/``heal(i)`` take host ``i``'s bridge port down and up (a
partition: packets vanish, nothing refuses a connection). ``close()`` deletes
the namespaces (their veths and the bridge go with them) and the uplink.

``exec_prefix(i)`` is the command prefix that runs a program on host ``i``
(``ip netns exec`` execs it: the child's pid is the program's own).

Tags end in the creating process's pid (mod 100000). A process killed before
``close()`` leaves its namespaces (and the uplink's address) behind;
``reclaim_stale()`` deletes those whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_TAGGED = re.compile(r"^(cr[a-z]*?)(\d{1,5})-(sw|up|h\d+)$")
"""A name ``EmulatedHosts`` made: ``<letters><pid mod 100000>-<sw|up|h<i>>``."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"crprobe{os.getpid() % 100000}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _running(pid_mod: int) -> bool:
    """Whether some running process's pid is ``pid_mod`` mod 100000 (a tag's owner may still be alive)."""
    return any(p.isdigit() and int(p) % 100000 == pid_mod for p in os.listdir("/proc"))


def reclaim_stale() -> list[str]:
    """Delete the namespaces and uplinks left by ``EmulatedHosts`` whose creating process is gone.

    Returns what was deleted. A name whose pid (mod 100000) some running process has is kept:
    it may be a live cluster's.
    """
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", "show", check=False).stdout.splitlines() if line.count(":") >= 2]
    gone: list[str] = []
    for kind, name in [*(("link", n) for n in links), *(("netns", n) for n in names)]:
        m = _TAGGED.match(name)
        if m is None or (kind == "link" and m.group(3) != "up") or _running(int(m.group(2))):
            continue
        if _ip(kind, "del", name, check=False).returncode == 0:
            gone.append(name)
    return gone


class EmulatedHosts:
    def __init__(self, num_hosts: int, tag: str, subnet: str, reachable: bool = False) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"1..200 hosts, got {num_hosts}")
        self.subnet = subnet
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(num_hosts)]
        self.uplink = f"{tag}-up"[-15:] if reachable else None
        """The machine's own end of a veth into the bridge (interface names: at most 15 characters)."""
        self._made: list[str] = []
        self._uplink_made = False
        sw = ["-n", self.switch]
        try:
            for ns in (self.switch, *self.hosts):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
            for i, ns in enumerate(self.hosts):
                _ip("link", "add", f"p{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip(*sw, "link", "set", f"p{i}", "master", "br0")
                _ip(*sw, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
            if self.uplink:
                _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", self.switch)
                self._uplink_made = True
                _ip(*sw, "link", "set", "up0", "master", "br0")
                _ip(*sw, "link", "set", "up0", "up")
                _ip("addr", "add", f"{self.machine_addr}/24", "dev", self.uplink)
                _ip("link", "set", self.uplink, "up")
        except BaseException:
            self.close()
            raise

    @property
    def machine_addr(self) -> str:
        """The machine's own address on the hosts' network (``reachable=True``)."""
        return f"{self.subnet}.254"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i]]

    def cut(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def close(self) -> None:
        if self._uplink_made:
            _ip("link", "del", self.uplink, check=False)
            self._uplink_made = False
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)  # the veths and the bridge go with them
        self._made.clear()
