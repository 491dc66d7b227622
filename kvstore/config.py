"""Store node configuration: one dataclass, a docstring per field, validated.

The ``crescent store`` CLI is derived from these fields (kvstore/cli.py), so a
knob is described once, here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def check_address(flag: str, address: str) -> None:
    """Raises ValueError unless ``address`` is ``host:port`` with a port in [0, 65535]."""
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{flag} must be host:port (port 0-65535), got {address!r}")


def check_port(flag: str, port: int | None, off: int | None = None) -> None:
    """Raises ValueError unless ``port`` is None, in [0, 65535], or ``off`` (the value meaning none)."""
    if port is not None and port != off and not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be a port in [0, 65535]{f' (or {off}: none)' if off is not None else ''}, "
                         f"got {port}")


def port_arg(text: str) -> int:
    """argparse type of a port flag: one-line usage error outside [0, 65535]."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {port}")
    return port


def count_arg(text: str) -> int:
    """argparse type of a count that fits the wire's 32 bits (0 allowed: the default's meaning)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= n < 1 << 32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2^32), got {n}")
    return n


def _seconds(text: str, zero: bool) -> float:
    import argparse

    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (0.0 <= s if zero else 0.0 < s) or not s <= 86400.0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be in {'[' if zero else '('}0, 86400] seconds, got {text}")
    return s


def seconds_arg(text: str) -> float:
    """argparse type of a deadline: seconds in (0, 86400]."""
    return _seconds(text, zero=False)


def grace_arg(text: str) -> float:
    """argparse type of a grace period: seconds in [0, 86400] (0: none)."""
    return _seconds(text, zero=True)


def address_arg(text: str) -> str:
    """argparse type of a host:port flag."""
    import argparse

    try:
        check_address("the address", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the address ")) from None
    return text


def check_etcd(endpoints: str | None) -> None:
    """ValueError unless ``endpoints`` is None or ``[https://]host:port[,...]``."""
    if endpoints is not None:
        from kvstore.coord import parse_endpoints
        from kvstore.errors import InvalidArgumentError

        try:
            parse_endpoints(endpoints)
        except InvalidArgumentError as exc:
            raise ValueError(f"--etcd: {exc}") from None


def check_kv_events(endpoint: str | None, replay_endpoint: str | None) -> None:
    """ValueError unless both are None or ZeroMQ endpoints, and a replay endpoint comes with an endpoint."""
    for name, ep in (("kv-events-endpoint", endpoint), ("kv-events-replay-endpoint", replay_endpoint)):
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--{name} must be a ZeroMQ endpoint such as tcp://*:5557, got {ep!r}")
    if replay_endpoint and not endpoint:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")


def parse_size(text: str | int) -> int:
    """``"1GiB"`` → 1073741824; accepts B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (case-insensitive)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 1GiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError


MAX_KEY_BYTES = 1024
"""Largest accepted key. Chunk keys are 16 bytes; other stacks may use longer names."""


@dataclass
class StoreConfig:
    """Configuration of one store node (``crescent store``)."""

    listen: str = "127.0.0.1:7400"
    """gRPC address host:port (port 0 picks a free port)."""
    dram: int = field(default=1 << 30, metadata={"size": True})
    """Capacity of the host DRAM tier (shared-memory arena)."""
    slot_size: int = field(default=64 << 10, metadata={"size": True})
    """Size of one DRAM arena slot; a value occupies ceil(size/slot_size) slots."""
    dram_populate: bool = True
    """Reserve the DRAM arena in /dev/shm and fault it in at start (about 1 s per GiB on the
    development VM): otherwise the first write into each page allocates it, and the first pass of
    puts over a fresh arena ran several times slower than later ones. A /dev/shm too small for
    ``dram`` is then an error at start."""
    disk: str | None = None
    """Folder of the disk tier (a data file of values and its LMDB index), one node's only (a second is
    refused while the first holds its LOCK file); none disables the tier."""
    disk_size: int = field(default=16 << 30, metadata={"size": True})
    """Capacity of the disk tier (the size of its data file)."""
    disk_sync: bool = False
    """fdatasync the data and fsync the index at each disk commit (survives power loss; kill -9
    is safe either way)."""
    disk_preallocate: bool = True
    """Reserve the disk tier's data file at start (``fallocate``) where the file system has room:
    direct writes into reserved blocks allocate nothing and go to the device two at a time (raw
    pairs 1.27x those into a sparse file on ext4, docs/architecture.md), and a file system too small
    for ``disk_size`` is a warning at start. Off, without the room, or on tmpfs (its blocks are
    memory): a sparse file, taken as values land."""
    disk_staging: int = field(default=1 << 30, metadata={"size": True})
    """Bytes of disk-bound values the node holds in memory at once while their puts arrive (a value
    bound for the disk tier is received whole, then written); a put that would pass it is refused
    (RESOURCE_EXHAUSTED: the client stores what it can value by value) until those in flight are
    written. At least ``max_value_size``."""
    disk_read_threads: int = 8
    """Disk reads a batch keeps in flight (each one large direct read of a whole value)."""
    device: int = field(default=0, metadata={"size": True})
    """Capacity of the GPU HBM tier; 0 disables it (needs CUDA)."""
    high_watermark: float = 0.95
    """Eviction starts when a tier's use would pass this fraction of its capacity."""
    low_watermark: float = 0.85
    """Eviction stops once a tier's use is at or below this fraction."""
    promote: bool = True
    """Move a value hit in a slower tier up to the fastest tier with room."""
    promote_after: int = 2
    """Reads from disk that earn a value a place in a full DRAM tier (one that must demote
    others to take it), counted among the last reads from disk; a value that fits without
    demoting anything moves up on its first read. 1: every read promotes (a scan larger
    than DRAM then writes to disk twice what it reads)."""
    disk_copies: bool = True
    """Keep the disk copy of a value promoted from disk (inclusive tiering): demoting it
    again writes nothing, so a working set larger than DRAM does not turn reads into writes.
    The disk drops these copies first when it needs room."""
    write_behind: bool = False
    """Write the coldest DRAM values to disk on a background thread before eviction needs
    their room (they stay in DRAM, now with a disk copy), so that evicting them writes
    nothing. Off by default: on a 2-core machine the writer competes with the puts for
    the cores and the GIL and made their p99 latency worse (bench/write_behind_bench.py)."""
    background_demotion: bool = True
    """Demotions to disk are written by two background threads: once DRAM passes its high
    watermark, its coldest values are written to disk in runs of up to 4 MiB while they stay
    readable in DRAM, then their slots are freed, down to the low watermark. Puts take the room
    left above the watermark meanwhile and wait for a run only when DRAM is full, so copies into DRAM and disk
    writes overlap and no disk write holds the store's lock. Off: the put that passes the high
    watermark writes the run itself (docs/benchmarks.md, "Disk tier")."""
    max_value_size: int = field(default=256 << 20, metadata={"size": True})
    """Largest accepted value."""
    data_port: int = 0
    """TCP port of the bulk data channel (0: a free port); -1 disables it."""
    transport: Literal["auto", "shm", "rdma", "tcp"] = "auto"
    """Data movers offered to clients: auto offers shm (same-host clients map the
    arena) and rdma (where an ibverbs device exists) beside tcp; shm or rdma offers
    only that one beside tcp; tcp offers only the streamed paths (TCP data channel, gRPC)."""
    lease_ttl_s: float = 30.0
    """Lifetime of a read lease or write reservation handed to a client (shm/rdma);
    an expired one fails cleanly and its slots return."""
    drain_s: float = 0.0
    """On SIGTERM, how long Health says serving=false while every call is still served, before
    the node stops taking calls (time for load balancers and readiness probes to look away)."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port; none disables it."""
    kv_events_endpoint: str | None = None
    """Publish KV events in vLLM's format (ZeroMQ PUB, msgpack) on this endpoint, e.g. tcp://*:5557 (port *:
    any free one); none publishes nothing (docs/integrations.md, "KV events in vLLM's format")."""
    kv_events_replay_endpoint: str | None = None
    """ZeroMQ ROUTER endpoint that replays buffered KV-event batches from a sequence number."""
    advertise_host: str | None = None
    """Host that clients and the conductor reach this node at (in its registered address); default: the
    --listen host, or this machine's hostname when that is a wildcard such as 0.0.0.0 (e.g. a pod IP in Kubernetes)."""
    node_id: str = ""
    """Name of this node (default: hostname:port)."""
    conductor: str | None = None
    """Conductor host:port to register with, heartbeat to and stream KV events to (several, comma-separated:
    replicas, of which the node follows the leader); none runs standalone."""
    etcd: str | None = None
    """etcd endpoints [https://]host:port[,...] ($CRESCENT_ETCD; https: mutual TLS) where conductor replicas
    register: with it the conductor addresses come from there (--conductor may then be left out)."""

    def __post_init__(self) -> None:
        for name in ("dram", "slot_size", "disk_size", "disk_staging", "device", "max_value_size"):
            setattr(self, name, parse_size(getattr(self, name)))
        if self.slot_size < 4096 or self.slot_size & (self.slot_size - 1):
            raise ValueError(f"--slot-size must be a power of two >= 4KiB, got {self.slot_size}")
        if self.dram < self.slot_size:
            raise ValueError(f"--dram ({self.dram} B) must hold at least one slot ({self.slot_size} B)")
        if self.disk is not None and self.disk_size < self.slot_size:  # (the tier counts in 4 KiB blocks)
            raise ValueError(f"--disk-size ({self.disk_size} B) must hold at least one slot ({self.slot_size} B)")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks need 0 < --low-watermark <= --high-watermark <= 1")
        if self.promote_after < 1:
            raise ValueError(f"--promote-after must be >= 1, got {self.promote_after}")
        if not 1 <= self.disk_read_threads <= 256:
            raise ValueError(f"--disk-read-threads must be in [1, 256], got {self.disk_read_threads}")
        if self.max_value_size <= 0:
            raise ValueError("--max-value-size must be positive")
        if self.disk_staging < self.max_value_size:
            raise ValueError(f"--disk-staging ({self.disk_staging} B) must hold a value of --max-value-size "
                             f"({self.max_value_size} B)")
        if not 0.0 < self.lease_ttl_s <= 86400.0:  # also rejects NaN
            raise ValueError(f"--lease-ttl-s must be in (0, 86400] seconds, got {self.lease_ttl_s}")
        if not 0.0 <= self.drain_s <= 3600.0:  # also rejects NaN
            raise ValueError(f"--drain-s must be in [0, 3600] seconds, got {self.drain_s}")
        if self.transport not in ("auto", "shm", "rdma", "tcp"):
            raise ValueError(f"--transport must be auto, shm, rdma or tcp, got {self.transport!r}")
        check_address("--listen", self.listen)
        check_port("--data-port", self.data_port, off=-1)
        check_port("--metrics-port", self.metrics_port)
        if self.advertise_host is not None and (not self.advertise_host or any(c.isspace() for c in self.advertise_host)):
            raise ValueError(f"--advertise-host must be a host name or address, got {self.advertise_host!r}")
        check_etcd(self.etcd)
        check_kv_events(self.kv_events_endpoint, self.kv_events_replay_endpoint)
        if self.conductor is not None:
            for c in self.conductor.split(","):
                try:
                    check_address("--conductor", c.strip())
                except ValueError:
                    raise ValueError(f"--conductor must be host:port[,host:port...], got {self.conductor!r}") from None
