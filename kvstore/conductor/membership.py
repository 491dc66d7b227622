"""Cluster membership: who is registered, when each was last heard, its load.

A member is a store node or an engine. It registers (getting a fresh
incarnation), heartbeats every ``heartbeat_interval`` with its load, and is
dead once silent for ``dead_timeout``: ``reap`` removes it. Registering an id
that is already present replaces that member (a restarted process). Not
thread-safe: the conductor guards it by its lock.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

from proto.crescent.v1 import conductor_pb2 as cpb


class MemberKind(enum.IntEnum):
    """What a member is; numbers match ``crescent.v1.MemberKind``."""

    STORE = 1
    PREFILL = 2
    DECODE = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load, as its last heartbeat reported it."""

    num_queued_tokens: int = 0
    """Prompt tokens still to prefill (queued and in progress)."""
    num_waiting: int = 0
    num_running: int = 0
    num_context_tokens: int = 0
    """Context tokens of the running requests."""
    kv_usage: float = 0.0
    num_generated_tokens: int = 0
    """Tokens sampled since the engine started."""
    num_finished: int = 0
    """Requests finished since the engine started."""

    @classmethod
    def from_pb(cls, m: cpb.EngineLoad) -> EngineLoad:
        return cls(m.num_queued_tokens, m.num_waiting, m.num_running, m.num_context_tokens, m.kv_usage,
                   m.num_generated_tokens, m.num_finished)

    def to_pb(self) -> cpb.EngineLoad:
        return cpb.EngineLoad(num_queued_tokens=self.num_queued_tokens, num_waiting=self.num_waiting,
                              num_running=self.num_running, num_context_tokens=self.num_context_tokens,
                              kv_usage=self.kv_usage, num_generated_tokens=self.num_generated_tokens,
                              num_finished=self.num_finished)


@dataclass(slots=True, eq=False)
class Member:
    member_id: str
    kind: MemberKind
    address: str
    incarnation: int
    last_seen: float
    """Clock time of the last registration or heartbeat."""
    store_node: str | None = None
    """Engines: the co-located store node's member id."""
    kv_bytes_per_token: int | None = None
    namespace: bytes = b""
    chunk_tokens: int = 0
    host_id: str = ""
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    """Store nodes: where they publish their KV events (vLLM's format), for the cluster relay."""
    draining: bool = False
    engine_load: EngineLoad = EngineLoad()
    store_load: cpb.StoreLoad | None = None
    """Store nodes: tiers and counters from the last heartbeat."""
    busy_until: float = 0.0
    prefill_tokens: int = 0
    """Engines: new tokens over the prefills they reported, and the seconds those took."""
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    """Engines: tokens over the decode steps they reported (one per sequence per step), and those steps' seconds."""
    decode_seconds: float = 0.0
    num_samples: int = 0
    """Engines: clock time until which the prefills scheduled here since the last heartbeat keep it busy."""
    external: bool = False
    """A vLLM instance the conductor follows through its KV events (``--vllm-kv-events``): registered
    and kept alive by the conductor itself; its prefix cache is its own (the device-cache index)."""

    @property
    def state(self) -> str:
        return "draining" if self.draining else "alive"


class Membership:
    """The live members, by id."""

    def __init__(self, dead_timeout_s: float) -> None:
        self.dead_timeout_s = dead_timeout_s
        self._members: dict[str, Member] = {}
        self.num_dead = 0

    def register(self, member: Member) -> Member | None:
        """Adds ``member`` with a fresh incarnation; returns the member it replaced, if any."""
        member.incarnation = secrets.randbits(63) or 1
        old = self._members.get(member.member_id)
        if old is not None:
            member.draining = old.draining  # an operator's drain survives a restart
        self._members[member.member_id] = member
        return old

    def get(self, member_id: str, incarnation: int | None = None) -> Member | None:
        """The member, or None when unknown (or of another incarnation)."""
        m = self._members.get(member_id)
        if m is None or (incarnation is not None and m.incarnation != incarnation):
            return None
        return m

    def remove(self, member_id: str) -> Member | None:
        return self._members.pop(member_id, None)

    def reap(self, now: float) -> list[Member]:
        """Removes and returns the members silent for longer than the dead timeout."""
        dead = [m for m in self._members.values() if now - m.last_seen > self.dead_timeout_s]
        for m in dead:
            del self._members[m.member_id]
        self.num_dead += len(dead)
        return dead

    def of_kind(self, kind: MemberKind, *, include_draining: bool = True) -> list[Member]:
        """Members of one kind, sorted by id."""
        return sorted((m for m in self._members.values()
                       if m.kind is kind and (include_draining or not m.draining)),
                      key=lambda m: m.member_id)

    def all(self) -> list[Member]:
        return sorted(self._members.values(), key=lambda m: (m.kind, m.member_id))

    def __len__(self) -> int:
        return len(self._members)
