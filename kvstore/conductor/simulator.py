"""Trace replay in simulated time, through the conductor's own policy code.

The cluster: ``num_prefill`` prefill instances, each with a store node on its
host holding up to ``cache_blocks`` trace blocks (LRU), and ``num_decode``
decode instances. For each request, in arrival order:

1. Finished prefills publish their blocks to their node (an LRU insert; an
   eviction is a "removed" event), exactly as store nodes feed the conductor's
   ``GlobalIndex``.
2. ``policy.schedule`` picks the prefill and decode instances from the same
   candidates the live conductor builds: queue time = until the instance's
   prefill FIFO drains; decode load = sequences and context tokens whose decode
   has not ended.
3. Rejected requests (predicted TTFT or TBT past the SLO) cost nothing.
   Accepted ones occupy the prefill instance for transfer + prefill; their
   TTFT is queue + transfer + prefill (the cost model's times); their decode
   starts at the first token, and its TBT is the cost model's step time for the
   decode batch it joins.
4. When the prefill ends, the instance's node stores the prompt's blocks it
   computed and the ones it had; blocks loaded from another node are stored
   too only when the policy asked to replicate them (a hot prefix).

Hit rate: prompt blocks loaded instead of computed / prompt blocks, over
accepted requests.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.conductor.costmodel import CostModel, HardwareProfile, PrefillSample
from kvstore.conductor.index import GlobalIndex, HotTracker
from kvstore.conductor.policy import DecodeCandidate, PrefillCandidate, Prompt, make_policy, schedule
from kvstore.conductor.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvstore.store import Tier


@dataclass
class ReplayConfig:
    """One simulated cluster and policy."""

    policy: str = "cache-aware"
    """Scheduling policy (kvstore.conductor.policy)."""
    num_prefill: int = 8
    """Prefill instances, each with its own store node."""
    num_decode: int = 8
    """Decode instances."""
    cache_blocks: int = 50_000
    """Capacity of each prefill node's store in trace blocks (512 tokens each)."""
    slo_ttft: float | None = None
    """TTFT SLO in seconds (early rejection and goodput); None: none."""
    slo_tbt: float | None = None
    """TBT SLO in seconds (early rejection and goodput); None: none."""
    hot_threshold: float = 3.0
    """Decayed use count from which a prefix is hot (replicated toward its user)."""
    hot_half_life: float = 60.0
    """Half-life in seconds of a prefix's use count."""
    seed: int = 0
    """Seed of the random policy."""
    profile: HardwareProfile = field(default_factory=HardwareProfile)
    """Cost-model profile."""
    prefill_samples: tuple[PrefillSample, ...] = ()
    """Measured prefills; when given, the prefill model is fitted to them (as the live conductor does)."""

    def __post_init__(self) -> None:
        make_policy(self.policy)  # raises ValueError naming the choices
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("--prefill and --decode must be at least 1")
        if self.cache_blocks < 0:
            raise ValueError("--cache-blocks must be >= 0")
        for name in ("slo_ttft", "slo_tbt"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")


@dataclass
class ReplayResult:
    policy: str
    num_requests: int
    num_accepted: int
    num_rejected: int
    num_slo_met: int
    """Accepted requests whose TTFT and TBT met the SLOs (all accepted ones when no SLO)."""
    hit_rate: float
    num_remote_loads: int
    """Accepted requests that loaded part of their prefix from another node."""
    num_replications: int
    ttft_s: list[float]
    tbt_s: list[float]
    duration_s: float
    """Simulated seconds from the first arrival to the last request's end."""
    trace_span_s: float
    prefill_busy_s: float
    """Simulated seconds the prefill instances spent transferring and computing, summed."""
    wall_s: float

    @property
    def goodput(self) -> float:
        """Fraction of all requests served within the SLOs."""
        return self.num_slo_met / self.num_requests if self.num_requests else 0.0

    @property
    def goodput_rps(self) -> float:
        """Requests per second served within the SLOs, over the trace's arrival span."""
        return self.num_slo_met / self.trace_span_s if self.trace_span_s > 0 else float("nan")


class _NodeCache:
    """A node's block store: LRU with a capacity; feeds the index."""

    def __init__(self, node: str, capacity: int, index: GlobalIndex) -> None:
        self.node, self.capacity, self.index = node, capacity, index
        self.lru: OrderedDict[int, None] = OrderedDict()

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b in self.lru:
                self.lru.move_to_end(b)

    def store(self, blocks: Sequence[int]) -> None:
        if self.capacity == 0:
            return
        for b in blocks:
            if b in self.lru:
                self.lru.move_to_end(b)
                continue
            self.lru[b] = None
            self.index.stored(self.node, b, Tier.DRAM)
            if len(self.lru) > self.capacity:
                old, _ = self.lru.popitem(last=False)
                self.index.removed(self.node, old)


def replay(requests: Sequence[TraceRequest], cfg: ReplayConfig,
           progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replays ``requests`` (sorted by timestamp) on the simulated cluster of ``cfg``."""
    t_wall = time.perf_counter()
    cost = CostModel(cfg.profile)
    if cfg.prefill_samples and not cost.fit(cfg.prefill_samples):
        raise ValueError("the prefill samples do not determine a cost model (need 3 or more, varied in length)")
    policy = make_policy(cfg.policy, cfg.seed)
    index = GlobalIndex()
    hot = HotTracker(cfg.hot_half_life)
    caches = [_NodeCache(f"node-{i}", cfg.cache_blocks, index) for i in range(cfg.num_prefill)]
    node_pos = {c.node: i for i, c in enumerate(caches)}
    prefill_ids = [f"prefill-{i}" for i in range(cfg.num_prefill)]
    decode_ids = [f"decode-{i}" for i in range(cfg.num_decode)]
    prefill_pos = {p: i for i, p in enumerate(prefill_ids)}
    decode_pos = {p: j for j, p in enumerate(decode_ids)}
    free_at = [0.0] * cfg.num_prefill
    # Per decode instance: (start, end, context tokens) of decodes not yet over.
    active: list[list[tuple[float, float, int]]] = [[] for _ in range(cfg.num_decode)]
    publish: list[tuple[float, int, int, tuple[int, ...]]] = []  # (time, seq, prefill index, blocks)
    ttfts: list[float] = []
    tbts: list[float] = []
    num_rejected = num_met = hit_blocks = total_blocks = remote = replications = 0
    last_end = busy = 0.0
    t0 = requests[0].timestamp_ms / 1000 if requests else 0.0
    for n, r in enumerate(requests):
        now = r.timestamp_ms / 1000 - t0
        while publish and publish[0][0] <= now:
            _, _, i, blocks = heapq.heappop(publish)
            caches[i].store(blocks)
        ids = r.hash_ids
        prompt = Prompt(r.input_length, len(ids), TRACE_BLOCK_TOKENS, r.output_length)
        prefills = [PrefillCandidate(prefill_ids[i], caches[i].node, max(0.0, free_at[i] - now))
                    for i in range(cfg.num_prefill)]
        decodes = []
        for j in range(cfg.num_decode):
            act = active[j] = [a for a in active[j] if a[1] > now]
            decodes.append(DecodeCandidate(decode_ids[j], len(act), sum(a[2] for a in act)))
        match = index.match(ids)
        d = schedule(policy, prompt, prefills, decodes, match, cost, slo_ttft_s=cfg.slo_ttft,
                     slo_tbt_s=cfg.slo_tbt,
                     is_hot=lambda k: k > 0 and hot.count(ids[k - 1], now) >= cfg.hot_threshold)
        hot.touch(ids, now)
        if progress is not None and (n % 64 == 0 or n == len(requests) - 1):
            progress(n + 1, len(requests))
        if d.rejected:
            num_rejected += 1
            continue
        i = prefill_pos[d.prefill]
        k = d.num_cached_chunks
        own = caches[i]
        local = [b for b in ids[:k] if index.has(own.node, b)]
        if len(local) < k:
            remote += 1
            for b in ids[:k]:  # a read is a use at the node that serves it
                if not index.has(own.node, b):
                    src = d.source_node if index.has(d.source_node, b) else next(iter(index.holders(b)))
                    caches[node_pos[src]].touch((b,))
        own.touch(local)
        kept = ids if (d.replicate_to is not None or len(local) == k) else tuple(local) + ids[k:]
        if d.replicate_to is not None:
            replications += 1
        ttft = d.ttft_s
        busy += ttft - max(0.0, free_at[i] - now)
        free_at[i] = now + ttft
        heapq.heappush(publish, (now + ttft, n, i, tuple(kept)))
        # Decode: joins the batch of instance j at its first token.
        j = decode_pos[d.decode]
        start = now + ttft
        ctx = r.input_length + r.output_length
        overlap = [a for a in active[j] if a[0] <= start < a[1]]
        tbt = cost.tbt_s(len(overlap) + 1, sum(a[2] for a in overlap) + ctx)
        end = start + r.output_length * tbt if math.isfinite(tbt) else start
        active[j].append((start, end, ctx))
        last_end = max(last_end, end)
        ttfts.append(ttft)
        tbts.append(tbt)
        hit_blocks += k
        total_blocks += len(ids)
        if (cfg.slo_ttft is None or ttft <= cfg.slo_ttft) and (cfg.slo_tbt is None or tbt <= cfg.slo_tbt):
            num_met += 1
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    return ReplayResult(cfg.policy, len(requests), len(ttfts), num_rejected, num_met,
                        hit_blocks / total_blocks if total_blocks else 0.0, remote, replications,
                        ttfts, tbts, last_end, span, busy, time.perf_counter() - t_wall)
