"""Conductor configuration: one dataclass, a docstring per field, validated.

``crescent conductor``'s flags are derived from these fields (kvstore/cli.py's
``add_config_args``), so a knob is described once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.config import check_address, check_port

PolicyName = Literal["random", "round-robin", "load", "cache-local", "cache-aware"]
POLICY_NAMES: tuple[str, ...] = ("random", "round-robin", "load", "cache-local", "cache-aware")


@dataclass
class ConductorConfig:
    """Configuration of the conductor (``crescent conductor``)."""

    listen: str = "127.0.0.1:7300"
    """gRPC address host:port (port 0 picks a free port)."""
    heartbeat_interval: float = 1.0
    """Seconds between a member's heartbeats (told to members when they register)."""
    dead_timeout: float = 5.0
    """A member silent for this many seconds is dead: it leaves the member list and its chunks leave the index."""
    policy: PolicyName = "cache-aware"
    """Scheduling policy of Schedule calls that name none."""
    chunk_tokens: int = 256
    """Tokens per chunk when a Schedule call does not say."""
    slo_ttft: float | None = None
    """Time-to-first-token SLO in seconds; a request predicted to miss it is rejected early. None: no TTFT SLO."""
    slo_tbt: float | None = None
    """Time-between-tokens SLO in seconds; a request predicted to miss it is rejected early. None: no TBT SLO."""
    hot_threshold: float = 3.0
    """A prefix used at least this often (decayed count) is hot: Schedule asks to replicate it to where it is used."""
    hot_half_life: float = 60.0
    """Half-life in seconds of a prefix's use count."""
    profile: str | None = None
    """JSON file of HardwareProfile fields for the cost model (default: the built-in 8xH800 profile)."""
    seed: int = 0
    """Seed of the random policy."""
    sizing_window: int = 2048
    """Recent Schedule requests kept for P:D sizing (`crescent ctl sizing`, the recommended-replicas metric)."""
    sizing_target_rps: float | None = None
    """Request rate the recommended-replicas metric sizes for; None: the measured rate."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port (membership, scheduling, P:D sizing); none disables it."""
    etcd: str | None = None
    """etcd endpoints [https://]host:port[,...] (default: $CRESCENT_ETCD; https: mutual TLS): run as one of
    several conductor replicas, the leader elected through etcd, the others answering with its address; none: the
    only conductor."""
    member_lease_ttl: float | None = None
    """With --etcd: seconds of the lease each member keeps its registration under (members/<id>); when it
    ends the member leaves scheduling and the index at once. None: --dead-timeout."""
    leader_ttl: float = 5.0
    """With --etcd: seconds of the leader's lease; a leader that dies is replaced within about this long."""
    advertise_host: str | None = None
    """Host other processes reach this conductor at (what followers hand out as the leader's address);
    default: the --listen host, or the hostname when that is a wildcard such as 0.0.0.0."""

    kv_events_endpoint: str | None = None
    """Publish the whole cluster's KV events in vLLM's format on this ZeroMQ endpoint (e.g. tcp://*:5557):
    every store node's that publishes its own (store --kv-events-endpoint), relayed under the node's id
    as the topic; none publishes nothing (docs/integrations.md, "The whole cluster's KV events")."""
    kv_events_replay_endpoint: str | None = None
    """ZeroMQ ROUTER endpoint that replays the relay's buffered batches from a sequence number."""
    vllm_kv_events: list[str] | None = None
    """A vLLM instance to schedule cache-aware from its own KV events: ID=tcp://HOST:PORT (its
    --kv-events-config endpoint)[,tcp://HOST:PORT (its replay endpoint)][,http://HOST:PORT (its
    OpenAI server: callers are sent there, and it is alive while /health answers)]."""
    vllm_namespace: str | None = None
    """Namespace (32 hex digits) the chunk keys of vLLM instances are computed under; default: a fixed
    one, shown by `crescent ctl nodes`."""

    def __post_init__(self) -> None:
        check_address("--listen", self.listen)
        check_port("--metrics-port", self.metrics_port)
        if not self.heartbeat_interval > 0:
            raise ValueError(f"--heartbeat-interval must be > 0, got {self.heartbeat_interval}")
        if not self.dead_timeout > self.heartbeat_interval:
            raise ValueError(f"--dead-timeout ({self.dead_timeout}) must exceed "
                             f"--heartbeat-interval ({self.heartbeat_interval})")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"--policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"--chunk-tokens must be positive, got {self.chunk_tokens}")
        for name in ("slo_ttft", "slo_tbt"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        if self.etcd is not None:
            from kvstore.coord import parse_endpoints
            from kvstore.errors import InvalidArgumentError

            try:
                parse_endpoints(self.etcd)
            except InvalidArgumentError as exc:
                raise ValueError(f"--etcd: {exc}") from None
        if self.member_lease_ttl is not None and not 2 <= self.member_lease_ttl <= 3600:
            raise ValueError(f"--member-lease-ttl must be in [2, 3600] seconds, got {self.member_lease_ttl}")
        if not 2 <= self.leader_ttl <= 3600:
            raise ValueError(f"--leader-ttl must be in [2, 3600] seconds, got {self.leader_ttl}")
        if self.sizing_window < 2:
            raise ValueError(f"--sizing-window must be >= 2, got {self.sizing_window}")
        if self.sizing_target_rps is not None and not (self.sizing_target_rps > 0 and
                                                       self.sizing_target_rps < float("inf")):
            raise ValueError(f"--sizing-target-rps must be > 0, got {self.sizing_target_rps}")
        if not self.hot_threshold > 0 or not self.hot_half_life > 0:
            raise ValueError("--hot-threshold and --hot-half-life must be > 0")
        from kvstore.config import check_kv_events

        check_kv_events(self.kv_events_endpoint, self.kv_events_replay_endpoint)
        if self.vllm_kv_events:
            from kvstore.conductor.vllm_events import VllmSource

            ids = [VllmSource.parse(spec).member_id for spec in self.vllm_kv_events]
            if len(set(ids)) != len(ids):
                raise ValueError(f"--vllm-kv-events names an instance twice: {', '.join(ids)}")
        if self.vllm_namespace is not None:
            try:
                ok = len(bytes.fromhex(self.vllm_namespace)) == 16
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--vllm-namespace must be 32 hex digits, got {self.vllm_namespace!r}")
