"""Scheduling policies, over plain candidates: no gRPC, no clock, no tensors.

The live conductor and the trace simulator build the same inputs (prefill and
decode candidates, a ``PrefixMatch`` from the global index, a ``CostModel``)
and call ``schedule``, so a replay measures the code that serves.

Policies:

- ``random``: a prefill engine and a decode engine uniformly at random.
- ``round-robin``: the next prefill engine and the next decode engine in turn.
- ``load``: the prefill engine with the least queued work, the decode engine
  with the lowest predicted TBT.
- ``cache-local``: the prefill engine minimising predicted TTFT when it may
  reuse only what its own store node holds (Mooncake's "local cache-aware").
- ``cache-aware``: Mooncake's Algorithm 1 — for each prefill engine, TTFT =
  queue time + transfer time of the prefix it would load (from its own node,
  or the longest prefix anywhere from the best holders) + prefill time of the
  uncached suffix; the minimum wins; decode by predicted TBT.

The cache-aware policies also weigh loading nothing at all, so a prefix too
short to be worth its transfer latency is recomputed.

The cache-blind policies (random, round-robin, load) reuse what the chosen
engine's own store node holds: they do not consult the index for other nodes.
Every policy's choice goes through the same SLO check (early rejection) and
replication rule (``schedule``).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.conductor.costmodel import CostModel
from kvstore.store import Tier


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    member_id: str
    local_node: str | None
    """The store node on the engine's host; its chunks load without the network."""
    queue_s: float
    """Predicted wait before this engine starts a new prefill."""
    kv_bytes_per_token: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    member_id: str
    num_running: int
    num_context_tokens: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the scheduler knows of a request."""

    num_tokens: int
    num_chunks: int
    chunk_tokens: int
    num_output_tokens: int = 0


@dataclass(slots=True)
class PrefixMatch:
    """The leading chunks held by at least one store node, each with its holders' tiers."""

    holders: Sequence[Mapping[str, Tier]]
    _fastest: list[tuple[str, Tier]] | None = field(default=None, compare=False, repr=False)

    def fastest(self) -> list[tuple[str, Tier]]:
        """Each chunk's fastest holder (lowest tier, then name): computed once, for every engine's plan."""
        if self._fastest is None:
            self._fastest = [_fastest(h, None) for h in self.holders]
        return self._fastest

    @property
    def num_global(self) -> int:
        return len(self.holders)

    def local_prefix(self, node: str | None) -> int:
        """Leading chunks ``node`` holds by itself."""
        if node is None:
            return 0
        n = 0
        for h in self.holders:
            if node not in h:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class Plan:
    """How one prefill engine would serve a prompt."""

    member_id: str
    local_node: str | None
    num_cached_chunks: int
    source_node: str | None
    """The node most of the loaded prefix comes from (None: nothing loaded)."""
    remote: bool
    """Part of the prefix comes from another node."""
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: str
    decode: str | None
    source_node: str | None
    num_cached_chunks: int
    num_cached_tokens: int
    ttft_s: float
    tbt_s: float
    rejected: str = ""
    """Why the request is rejected; empty when accepted."""
    replicate_to: str | None = None
    """Store node that should keep a copy of the loaded prefix (it is hot there)."""


def _fastest(holders: Mapping[str, Tier], exclude: str | None) -> tuple[str, Tier] | None:
    best = None
    for node, tier in holders.items():
        if node != exclude and (best is None or tier < best[1] or (tier == best[1] and node < best[0])):
            best = (node, tier)
    return best


def _prefill_tokens(prompt: Prompt, num_cached_chunks: int) -> tuple[int, int]:
    cached = min(num_cached_chunks * prompt.chunk_tokens, prompt.num_tokens)
    return max(prompt.num_tokens - cached, 1), cached


def recompute_plan(c: PrefillCandidate, prompt: Prompt, cost: CostModel) -> Plan:
    """Load nothing: prefill the whole prompt (wins when a prefix is too short to be worth its transfer)."""
    new, cached = _prefill_tokens(prompt, 0)
    return Plan(c.member_id, c.local_node, 0, None, False, c.queue_s + cost.prefill_s(new, cached))


def local_plan(c: PrefillCandidate, prompt: Prompt, match: PrefixMatch, cost: CostModel) -> Plan:
    """Reuse only the chunks on the engine's own store node."""
    k = match.local_prefix(c.local_node)
    num_disk = sum(1 for h in match.holders[:k] if h[c.local_node] is Tier.DISK) if k else 0
    ct = prompt.chunk_tokens
    xfer = (cost.transfer_s((k - num_disk) * ct, Tier.DRAM, False, c.kv_bytes_per_token)
            + cost.transfer_s(num_disk * ct, Tier.DISK, False, c.kv_bytes_per_token))
    new, cached = _prefill_tokens(prompt, k)
    return Plan(c.member_id, c.local_node, k, c.local_node if k else None, False,
                c.queue_s + xfer + cost.prefill_s(new, cached))


def global_plan(c: PrefillCandidate, prompt: Prompt, match: PrefixMatch, cost: CostModel) -> Plan:
    """Reuse the longest prefix anywhere: own chunks locally, the rest from the fastest other holder."""
    k = match.num_global
    if k == 0:
        return local_plan(c, prompt, match, cost)
    tokens = {(False, Tier.DRAM): 0, (False, Tier.DISK): 0, (True, Tier.DRAM): 0, (True, Tier.DISK): 0}
    by_source: dict[str, int] = {}
    ct = prompt.chunk_tokens
    for h, (node, tier) in zip(match.holders, match.fastest()):
        own = h.get(c.local_node) if c.local_node is not None else None
        if own is not None:
            tokens[(False, Tier.DISK if own is Tier.DISK else Tier.DRAM)] += ct
            continue
        # (the engine's own node does not hold this chunk: the fastest holder is another node)
        tokens[(True, Tier.DISK if tier is Tier.DISK else Tier.DRAM)] += ct
        by_source[node] = by_source.get(node, 0) + 1
    xfer = sum(cost.transfer_s(n, tier, remote, c.kv_bytes_per_token) for (remote, tier), n in tokens.items())
    source = max(by_source, key=lambda n: (by_source[n], n)) if by_source else c.local_node
    new, cached = _prefill_tokens(prompt, k)
    return Plan(c.member_id, c.local_node, k, source, bool(by_source),
                c.queue_s + xfer + cost.prefill_s(new, cached))


def device_plan(c: PrefillCandidate, prompt: Prompt, num_cached_chunks: int, cost: CostModel) -> Plan:
    """An engine with its own prefix cache (a vLLM instance): ``num_cached_chunks`` are on its GPU
    already, the rest it computes; it loads nothing from the store."""
    new, cached = _prefill_tokens(prompt, num_cached_chunks)
    return Plan(c.member_id, None, num_cached_chunks, None, False, c.queue_s + cost.prefill_s(new, cached))


def decode_tbt(d: DecodeCandidate, prompt: Prompt, cost: CostModel) -> float:
    """Predicted TBT on ``d`` once this request joins its batch."""
    return cost.tbt_s(d.num_running + 1, d.num_context_tokens + prompt.num_tokens + prompt.num_output_tokens)


class Policy(ABC):
    name: str

    @abstractmethod
    def choose_prefill(self, prompt: Prompt, cands: Sequence[PrefillCandidate], match: PrefixMatch,
                       cost: CostModel) -> Plan: ...

    def choose_decode(self, prompt: Prompt, decodes: Sequence[DecodeCandidate],
                      cost: CostModel) -> DecodeCandidate:
        """Default: the lowest predicted TBT (ties: the first)."""
        return min(decodes, key=lambda d: decode_tbt(d, prompt, cost))


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose_prefill(self, prompt, cands, match, cost):
        return local_plan(self._rng.choice(cands), prompt, match, cost)

    def choose_decode(self, prompt, decodes, cost):
        return self._rng.choice(decodes)


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def choose_prefill(self, prompt, cands, match, cost):
        c = cands[self._next_prefill % len(cands)]
        self._next_prefill += 1
        return local_plan(c, prompt, match, cost)

    def choose_decode(self, prompt, decodes, cost):
        d = decodes[self._next_decode % len(decodes)]
        self._next_decode += 1
        return d


class LoadPolicy(Policy):
    name = "load"

    def choose_prefill(self, prompt, cands, match, cost):
        return local_plan(min(cands, key=lambda c: c.queue_s), prompt, match, cost)


class CacheLocalPolicy(Policy):
    name = "cache-local"

    def choose_prefill(self, prompt, cands, match, cost):
        plans = [p for c in cands for p in (local_plan(c, prompt, match, cost), recompute_plan(c, prompt, cost))]
        return min(plans, key=lambda p: p.ttft_s)


class CacheAwarePolicy(Policy):
    name = "cache-aware"

    def choose_prefill(self, prompt, cands, match, cost):
        best = None
        for c in cands:
            for plan in (local_plan(c, prompt, match, cost), global_plan(c, prompt, match, cost),
                         recompute_plan(c, prompt, cost)):
                if best is None or plan.ttft_s < best.ttft_s:
                    best = plan
        return best


def make_policy(name: str, seed: int = 0) -> Policy:
    """The policy called ``name``; raises ValueError for an unknown name."""
    if name == "random":
        return RandomPolicy(seed)
    factories = {"round-robin": RoundRobinPolicy, "load": LoadPolicy, "cache-local": CacheLocalPolicy,
                 "cache-aware": CacheAwarePolicy}
    if name not in factories:
        raise ValueError(f"unknown policy {name!r} (choose from random, {', '.join(factories)})")
    return factories[name]()


def schedule(policy: Policy, prompt: Prompt, prefills: Sequence[PrefillCandidate],
             decodes: Sequence[DecodeCandidate], match: PrefixMatch, cost: CostModel, *,
             slo_ttft_s: float | None = None, slo_tbt_s: float | None = None,
             is_hot: Callable[[int], bool] = lambda _n: False,
             cache_engines: Sequence[tuple[PrefillCandidate, int]] = ()) -> Decision:
    """One scheduling decision: the policy's pick, then early rejection and replication.

    Args:
        prefills: live, non-draining prefill engines (at least one, or a cache engine).
        decodes: live, non-draining decode engines (may be empty: the prefill
            engine then decodes itself, and no TBT is predicted).
        is_hot: whether the first ``n`` chunks form a hot prefix.
        cache_engines: engines that keep their own prefix cache and load nothing (vLLM instances
            followed through their KV events), each with the leading chunks it holds. They compete
            with the policy's pick by predicted TTFT, and decode what they prefill.
    """
    assert prefills or cache_engines, "schedule needs a prefill candidate"
    plan = policy.choose_prefill(prompt, prefills, match, cost) if prefills else None
    cache_engine = False
    for c, k in cache_engines:
        p = device_plan(c, prompt, k, cost)
        if plan is None or p.ttft_s < plan.ttft_s:
            plan, cache_engine = p, True
    tbt = 0.0
    decode = None
    if decodes and not cache_engine:
        d = policy.choose_decode(prompt, decodes, cost)
        decode, tbt = d.member_id, decode_tbt(d, prompt, cost)
    rejected = ""
    if slo_ttft_s is not None and plan.ttft_s > slo_ttft_s:
        rejected = f"predicted TTFT {plan.ttft_s:.3f} s exceeds the SLO of {slo_ttft_s:g} s"
    elif slo_tbt_s is not None and decode is not None and tbt > slo_tbt_s:
        shown = "inf (KV capacity)" if math.isinf(tbt) else f"{tbt:.4f} s"
        rejected = f"predicted TBT {shown} exceeds the SLO of {slo_tbt_s:g} s"
    replicate = None
    if not rejected and plan.remote and plan.local_node is not None and is_hot(plan.num_cached_chunks):
        replicate = plan.local_node
    _, cached_tokens = _prefill_tokens(prompt, plan.num_cached_chunks)
    return Decision(plan.member_id, decode, plan.source_node, plan.num_cached_chunks, cached_tokens,
                    plan.ttft_s, tbt, rejected, replicate)
