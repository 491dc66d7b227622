"""A typed client of the conductor: results are dataclasses, failures ``CrescentError``s.

Used by ``crescent ctl``, ``ClusterClient`` and (later) the gateway. Member-side
calls (register, heartbeat, events) belong to ``MemberAgent``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvstore import tls
from kvstore.conductor.membership import EngineLoad, MemberKind
from kvstore.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError, call_grpc
from kvstore.liveness import channel_options
from kvstore.store import Tier
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc

T = TypeVar("T")
CHANNEL_OPTIONS = channel_options(64 << 20)
"""A cut conductor noticed within seconds, a returning one found within ~2 s (kvstore/liveness.py)."""


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    accepted: bool
    reject_reason: str
    prefill: str | None
    prefill_address: str
    decode: str | None
    decode_address: str
    source_node: str | None
    source_address: str
    num_cached_chunks: int
    num_cached_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    replicate_to: str | None
    policy: str


@dataclass(frozen=True, slots=True)
class NodePrefix:
    node_id: str
    address: str
    num_prefix: int


@dataclass(frozen=True, slots=True)
class Location:
    """Where keys live, per ``Locate``."""

    holders: list[dict[str, Tier]]
    """One per requested key: node id → tier (empty: absent)."""
    num_prefix: int
    """Leading keys held by at least one node."""
    nodes: list[NodePrefix]
    """Nodes holding the first key, longest own prefix first."""


@dataclass(frozen=True, slots=True)
class MemberInfo:
    member_id: str
    kind: MemberKind
    address: str
    state: str
    last_seen_s: float
    num_chunks: int
    store_node: str | None
    namespace: bytes
    chunk_tokens: int
    engine: EngineLoad | None
    store: dict | None
    """Store nodes: ``{"tiers": {name: {...}}, "misses", "bytes_in", "bytes_out", ...}``."""
    predicted_queue_s: float = 0.0
    """Engines: the wait Schedule predicts for a new request there."""
    lease_ttl_s: float = -1.0
    """Seconds left on its etcd registration's lease (-1: none, e.g. a conductor without --etcd)."""
    host_id: str = ""
    """The member's host (``crescent --host-id``, else its hostname)."""
    vllm: bool = False
    """A vLLM instance the conductor follows through its KV events (``--vllm-kv-events``)."""


def split_addresses(text: str | None) -> list[str]:
    """``host:port[,host:port...]``: conductor replicas, in the order given."""
    return [a.strip() for a in (text or "").split(",") if a.strip()]


def discover(etcd: str) -> list[str]:
    """Conductor replicas registered in etcd (each keeps ``conductor/replicas/<address>`` under a lease),
    the leader first. Raises UnavailableError when etcd cannot be reached."""
    from kvstore.coord import Etcd

    e = Etcd(etcd, timeout_s=5.0)
    try:
        leader = e.get(e.key("conductor", "leader"))
        replicas = sorted(v.decode() for v, _ in e.call(e.client.get_prefix, e.key("conductor", "replicas", "")))
    finally:
        e.close()
    first = [leader.decode()] if leader else []
    return first + [a for a in replicas if a not in first]


def conductor_addresses(conductor: str | None, etcd: str | None) -> list[str]:
    """The addresses given, then (with ``etcd``) the replicas registered there that were not given."""
    given = split_addresses(conductor)
    if not etcd:
        return given
    return given + [a for a in discover(etcd) if a not in given]


def store_load_dict(s: cpb.StoreLoad) -> dict:
    return {"tiers": {Tier(t.tier).name.lower(): {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                                                  "num_entries": t.num_entries, "hits": t.hits,
                                                  "evictions": t.evictions} for t in s.tiers},
            "misses": s.misses, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
            "num_leases": s.num_leases, "num_pinned": s.num_pinned}


class ConductorClient:
    """Client of one conductor.

    Args:
        address: the conductor's ``host:port`` (replicas: ``host:port,host:port``; may be empty with ``etcd``).
        timeout_s: deadline of each call.
        retry: a ``kvstore.client.Retry`` for UNAVAILABLE; default: one attempt.
        etcd: etcd endpoints where the replicas register: they are added to the addresses, and read
            again when none of the known ones answers (a replica started later, at a new address);
            then the addresses are those given and those registered now (a replica gone from etcd
            is no longer tried).
    """

    def __init__(self, address: str | None, *, timeout_s: float = 10.0, retry=None, etcd: str | None = None) -> None:
        self.etcd = etcd
        self.addresses = split_addresses(address)
        self._given = list(self.addresses)  # kept; those etcd named are replaced by what it names next
        if not self.addresses and not etcd:
            raise InvalidArgumentError("no conductor address given")
        if etcd:
            try:
                self.addresses = conductor_addresses(address, etcd)
            except UnavailableError:
                pass  # etcd is down now: read again when the addresses given fail
        self.timeout_s = timeout_s
        self.retry = retry
        self._channels: dict[str, grpc.Channel] = {}
        """One per address talked to; all closed by close() (another thread may be mid-call on one)."""
        self.address = ""
        self._stub = None
        if self.addresses:
            self._connect(self.addresses[0])

    def _connect(self, address: str) -> None:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = tls.channel(address, CHANNEL_OPTIONS)
        self.address = address
        self._stub = cpb_grpc.ConductorStub(ch)

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` against the leader: a follower's answer names it (followed, at most twice); an
        unreachable (or silent past the deadline) replica is skipped for the next address given; when
        none is left, the replicas registered in etcd (if given) are read again, once."""
        tried, hops, rediscovered = {self.address}, 0, False
        if self._stub is None:  # none known yet: only etcd can name one
            rediscovered = True
            self.addresses = conductor_addresses(None, self.etcd)
            if not self.addresses:
                raise UnavailableError(f"no conductor is registered in etcd at {self.etcd}")
            self._connect(self.addresses[0])
            tried = {self.address}
        while True:
            try:
                return call_grpc(fn, self.retry)
            except (UnavailableError, DeadlineExceededError) as exc:
                if exc.leader and exc.leader != self.address and hops < 2:
                    hops += 1
                    self._connect(exc.leader)
                    continue
                rest = [a for a in self.addresses if a not in tried]
                if not rest and self.etcd and not rediscovered:
                    rediscovered = True
                    try:  # (replicas etcd no longer names are dropped: each would cost a try per failover)
                        self.addresses = conductor_addresses(",".join(self._given), self.etcd)
                    except UnavailableError:
                        raise exc from None
                    rest = [a for a in self.addresses if a not in tried]
                if not rest:
                    raise
                tried.add(rest[0])
                self._connect(rest[0])

    def schedule(self, keys: Sequence[bytes], num_tokens: int, *, chunk_tokens: int = 0, policy: str = "",
                 num_output_tokens: int = 0, vllm: bool = False) -> ScheduleResult:
        """Where to run a prompt of ``num_tokens`` tokens whose full chunks have ``keys``; with ``vllm``,
        which of the vLLM instances the conductor follows (``--vllm-kv-events``) should take it."""
        r = self._call(lambda: self._stub.Schedule(cpb.ScheduleRequest(
            keys=list(keys), num_tokens=num_tokens, chunk_tokens=chunk_tokens, policy=policy,
            num_output_tokens=num_output_tokens, vllm=vllm), timeout=self.timeout_s))
        return ScheduleResult(r.accepted, r.reject_reason, r.prefill.member_id or None, r.prefill.address,
                              r.decode.member_id or None, r.decode.address, r.source_node or None,
                              r.source_address, r.num_cached_chunks, r.num_cached_tokens, r.predicted_ttft_s,
                              r.predicted_tbt_s, r.replicate_to or None, r.policy)

    def locate(self, keys: Sequence[bytes]) -> Location:
        r = self._call(lambda: self._stub.Locate(cpb.LocateRequest(keys=list(keys)), timeout=self.timeout_s))
        return Location([{h.node_id: Tier(h.tier) for h in k.holders} for k in r.keys], r.num_prefix,
                        [NodePrefix(n.node_id, n.address, n.num_prefix) for n in r.nodes])

    def members(self) -> list[MemberInfo]:
        r = self._call(lambda: self._stub.ListMembers(cpb.ListMembersRequest(), timeout=self.timeout_s))
        out = []
        for m in r.members:
            kind = MemberKind(m.kind)
            out.append(MemberInfo(m.member_id, kind, m.address, m.state, m.last_seen_s, m.num_chunks,
                                  m.store_node or None, m.namespace, m.chunk_tokens,
                                  EngineLoad.from_pb(m.engine) if kind is not MemberKind.STORE else None,
                                  store_load_dict(m.store) if kind is MemberKind.STORE else None,
                                  m.predicted_queue_s, m.lease_ttl_s, m.host_id, m.vllm))
        return out

    def stats(self) -> dict:
        r = self._call(lambda: self._stub.ClusterStats(cpb.ClusterStatsRequest(), timeout=self.timeout_s))
        lookups = sum(t.hits for t in r.tiers) + r.misses
        return {
            "num_members": r.num_members, "num_chunks": r.num_chunks, "num_copies": r.num_copies,
            "tiers": {Tier(t.tier).name.lower(): {
                "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "num_entries": t.num_entries,
                "hits": t.hits, "evictions": t.evictions,
                "hit_rate": t.hits / lookups if lookups else 0.0} for t in r.tiers},
            "misses": r.misses, "hit_rate": (lookups - r.misses) / lookups if lookups else 0.0,
            "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
            "schedule": {"policy": r.policy, "num_scheduled": r.num_scheduled, "num_rejected": r.num_rejected,
                         "num_replications": r.num_replications,
                         "num_scheduled_chunks": r.num_scheduled_chunks, "num_cached_chunks": r.num_cached_chunks,
                         "cached_fraction": (r.num_cached_chunks / r.num_scheduled_chunks
                                             if r.num_scheduled_chunks else 0.0)},
            "num_dead": r.num_dead,
            "cost_model": {"coefficients": list(r.cost_coefficients), "num_samples": r.num_cost_samples,
                           "num_samples_received": r.num_prefill_samples_received},
        }

    def drain(self, member_id: str, undo: bool = False) -> str:
        """Drains a member (``undo``: takes it back); returns its new state."""
        r = self._call(lambda: self._stub.Drain(cpb.DrainRequest(member_id=member_id, undo=undo),
                                                timeout=self.timeout_s))
        return r.state

    def pin(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, int]:
        """Pins keys on every holder (``ttl_s`` 0 unpins); returns (copies, nodes)."""
        r = self._call(lambda: self._stub.PinChunks(cpb.PinChunksRequest(keys=list(keys), ttl_s=ttl_s),
                                                    timeout=self.timeout_s))
        return r.num_pinned, r.num_nodes

    def evict(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Deletes keys from every holder; returns (copies, nodes)."""
        r = self._call(lambda: self._stub.EvictChunks(cpb.EvictChunksRequest(keys=list(keys)),
                                                      timeout=self.timeout_s))
        return r.num_evicted, r.num_nodes

    def sizing(self, *, target_rps: float = 0.0, slo_ttft_s: float = 0.0, slo_itl_s: float = 0.0,
               quantile: float = 0.0) -> dict:
        """Recommended prefill and decode instances and what they rest on (0: the conductor's defaults)."""
        r = self._call(lambda: self._stub.Sizing(cpb.SizingRequest(
            target_rps=target_rps, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s, quantile=quantile),
            timeout=self.timeout_s))
        out = {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields if f.name not in ("reasoning", "engines")}
        out["reasoning"] = list(r.reasoning)
        out["engines"] = [{"member_id": e.member_id, "kind": MemberKind(e.kind).label,
                           "prefill_tokens_per_s": e.prefill_tokens_per_s,
                           "decode_tokens_per_s": e.decode_tokens_per_s, "num_samples": e.num_samples}
                          for e in r.engines]
        return out

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    def __enter__(self) -> ConductorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
