"""Same-host detection and the per-node choice of a mover.

Two processes share a host when their host id (``--host-id`` / $CRESCENT_HOST_ID,
default the hostname) and kernel boot id match; a client then still checks that the arena file it opens is the node's very file
(device and inode, see ``shm.py``), which also rules out containers that share
a kernel but not /dev/shm.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from functools import lru_cache

from kvstore.transport.descriptors import Mover

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
HOST_ID_ENV = "CRESCENT_HOST_ID"
"""Names this process's host explicitly: processes in network namespaces on one machine (emulated hosts)
share a hostname, a kernel and /dev/shm, yet must talk as different hosts do (TCP or RDMA, never shm)."""
REQUESTS = ("auto", "shm", "rdma", "tcp", "grpc")
"""What a client may ask for: ``auto`` picks; a named mover is used where it can work."""


@dataclass(frozen=True, slots=True)
class HostIdentity:
    hostname: str
    boot_id: str

    def same_host(self, other: HostIdentity) -> bool:
        return bool(self.boot_id) and self.hostname == other.hostname and self.boot_id == other.boot_id


@lru_cache(maxsize=1)
def host_identity() -> HostIdentity:
    try:
        with open(BOOT_ID_PATH) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""  # never "same host" without a boot id
    return HostIdentity(os.environ.get(HOST_ID_ENV) or socket.gethostname(), boot_id)


@dataclass(frozen=True, slots=True)
class Choice:
    """The one-sided movers to try, best first, and why others were left out."""

    candidates: tuple[Mover, ...]
    notes: tuple[str, ...] = field(default=())


def one_sided_candidates(requested: str, offered: set[Mover], same_host: bool,
                         local_rdma: str | None, node_rdma: str | None) -> Choice:
    """Which one-sided movers a client should try with a node, best first.

    Args:
        requested: ``auto``, ``shm``, ``rdma``, ``tcp`` or ``grpc`` (the client's wish).
        offered: movers the node serves (its ``--transport``).
        same_host: hostname and boot id match.
        local_rdma: None when this host has a usable ibverbs device, else why not.
        node_rdma: None when the node registered its arena for RDMA, else why not.

    Returns:
        shm before rdma on the same host; rdma when both ends have a device;
        nothing for ``tcp``/``grpc``. A streamed mover is always the last resort.
    """
    if requested not in REQUESTS:
        raise ValueError(f"transport must be one of {', '.join(REQUESTS)}, got {requested!r}")
    if requested in ("tcp", "grpc"):
        return Choice(())
    out, notes = [], []
    if requested in ("auto", "shm"):
        if Mover.SHM not in offered:
            notes.append("the node does not offer shm (its --transport)")
        elif not same_host:
            notes.append("shm needs the same host (hostname or boot id differ)")
        else:
            out.append(Mover.SHM)
    if requested in ("auto", "rdma"):
        if Mover.RDMA not in offered or node_rdma is not None:
            notes.append(f"rdma unavailable on the node: {node_rdma or 'not offered (its --transport)'}")
        elif local_rdma is not None:
            notes.append(f"rdma unavailable here: {local_rdma}")
        else:
            out.append(Mover.RDMA)
    return Choice(tuple(out), tuple(notes))
