"""P:D sizing: how many prefill and decode instances a load needs to meet its SLOs.

Prefill is compute-bound and decode memory-bound, so the two pools are sized
apart (DistServe, Splitwise): prefill instances by the time-to-first-token SLO,
decode instances by the inter-token-latency SLO.

The inputs are what the conductor measured: the requests ``Schedule`` saw
(arrival time, prompt tokens, tokens its decision reused, output tokens), and
the cost model fitted to the prefill and decode times engines reported. The
recommendation replays that sample on a simulated pool of ``n`` instances (the
way ``kvstore.conductor.simulator`` replays traces, with the ``load`` policy)
and takes the smallest ``n`` whose quantile meets the SLO:

- **prefill**: arrivals rescaled to the target rate (the measured gaps keep
  their burstiness); each request goes to the instance that frees first and
  holds it for transfer + prefill; TTFT = wait + transfer + prefill.
- **decode**: each request joins, at its first token, the decode instance with
  the lowest predicted step time; its inter-token latency is the step time of
  the batch it joins (``CostModel.tbt_s``: fixed cost + per sequence + per
  context token; infinite past the KV capacity).

A sample shorter than ``min_requests`` is repeated end to end, so that queues
reach the steady state the target rate implies.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.conductor.costmodel import CostModel
from kvstore.store import Tier

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_ITL_S = 0.1
DEFAULT_QUANTILE = 0.9
MAX_INSTANCES = 4096
MIN_RPS = 1e-6
"""Slower targets (one request in 11+ days) are no load to size for."""


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request as the conductor saw it."""

    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens its scheduling decision reused from the store."""
    output_tokens: int


@dataclass
class Recommendation:
    """A recommendation and what it rests on."""

    num_prefill: int
    num_decode: int
    feasible: bool
    target_rps: float
    slo_ttft_s: float
    slo_itl_s: float
    quantile: float
    num_requests: int
    measured_rps: float
    mean_prompt_tokens: float
    mean_cached_tokens: float
    mean_output_tokens: float
    predicted_ttft_s: float
    predicted_itl_s: float
    prefill_utilization: float
    decode_batch: float
    reasoning: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Prefill instances per decode instance."""
        return self.num_prefill / self.num_decode if self.num_decode else math.inf


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank: the smallest value with at least ``q`` of them at or below)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def measured_rps(samples: Sequence[RequestSample]) -> float:
    """Arrivals per second over the sample's span ((n - 1) gaps); 0 with fewer than two arrivals."""
    if len(samples) < 2:
        return 0.0
    span = samples[-1].arrival_s - samples[0].arrival_s
    return (len(samples) - 1) / span if span > 0 else 0.0


def arrivals_at(samples: Sequence[RequestSample], rps: float, min_requests: int = 2000,
                seed: int = 0) -> list[tuple[float, RequestSample]]:
    """``(arrival, request)`` at ``rps``: the measured gaps scaled to the target rate, the sample
    repeated to ``min_requests``. A sample without a measurable rate gets Poisson gaps (seeded)."""
    if not samples or not rps > 0:
        return []
    rate = measured_rps(samples)
    if rate > 0:
        gaps = [(b.arrival_s - a.arrival_s) * rate / rps for a, b in zip(samples, samples[1:])]
        gaps.append(1.0 / rps)  # between one repetition's last request and the next one's first
    else:
        rng = random.Random(seed)
        gaps = [rng.expovariate(rps) for _ in samples]
    out, t = [], 0.0
    reps = max(1, math.ceil(min_requests / len(samples)))
    for _ in range(reps):
        for r, gap in zip(samples, gaps):
            out.append((t, r))
            t += gap
    return out


def prefill_service_s(r: RequestSample, cost: CostModel) -> float:
    """Transfer of the reused prefix (local DRAM) + prefill of the rest, as ``policy.local_plan`` predicts."""
    cached = min(r.cached_tokens, r.prompt_tokens)
    return cost.transfer_s(cached, Tier.DRAM, False) + cost.prefill_s(max(r.prompt_tokens - cached, 1), cached)


def simulate_prefill(arrivals: Sequence[tuple[float, RequestSample]], n: int, cost: CostModel) -> list[float]:
    """TTFT of each request on ``n`` prefill instances, each request to the instance free first."""
    free = [(0.0, i) for i in range(n)]
    out = []
    for t, r in arrivals:
        at, i = heapq.heappop(free)
        done = max(at, t) + prefill_service_s(r, cost)
        heapq.heappush(free, (done, i))
        out.append(done - t)
    return out


def simulate_decode(requests: Sequence[tuple[float, float, RequestSample]], n: int, cost: CostModel) -> list[float]:
    """Inter-token latency of each request on ``n`` decode instances.

    ``requests``: (arrival, first-token time, request), in arrival order. As the
    live conductor does, the decode instance is chosen at arrival (lowest
    predicted step time with the sequences not yet finished there); the request
    joins its batch at the first token, and its latency is the step time of the
    batch it joins, held for its ``output_tokens`` steps.
    """
    active: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]  # per instance: (start, end, context)
    out = []
    for now, start, r in requests:
        ctx = r.prompt_tokens + r.output_tokens
        best, best_tbt = 0, math.inf
        for j in range(n):
            act = active[j] = [a for a in active[j] if a[1] > now]
            tbt = cost.tbt_s(len(act) + 1, sum(a[2] for a in act) + ctx)
            if tbt < best_tbt:
                best, best_tbt = j, tbt
        overlap = [a for a in active[best] if a[0] <= start < a[1]]
        tbt = cost.tbt_s(len(overlap) + 1, sum(a[2] for a in overlap) + ctx)
        end = start + r.output_tokens * tbt if math.isfinite(tbt) else start
        active[best].append((start, end, ctx))
        out.append(tbt)
    return out


def _smallest(meets, lo: int, hi: int = MAX_INSTANCES) -> int | None:
    """The smallest n in [lo, hi] with ``meets(n)`` (assumed monotone: more instances never hurt);
    None if none up to ``hi`` does. Gallops up from ``lo``, then bisects."""
    step, n = 1, lo
    while not meets(n):
        if n >= hi:
            return None
        lo, n, step = n + 1, min(hi, n + step), step * 2
    while lo < n:
        mid = (lo + n) // 2
        if meets(mid):
            n = mid
        else:
            lo = mid + 1
    return n


def recommend(samples: Sequence[RequestSample], cost: CostModel, *, target_rps: float | None = None,
              slo_ttft_s: float = DEFAULT_SLO_TTFT_S, slo_itl_s: float = DEFAULT_SLO_ITL_S,
              q: float = DEFAULT_QUANTILE, min_requests: int = 2000) -> Recommendation:
    """The fewest prefill and decode instances whose simulated ``q`` quantiles meet the SLOs.

    Raises:
        ValueError: no requests, or a target rate, SLO or quantile out of range.
    """
    if not samples:
        raise ValueError("no requests measured yet: Schedule some requests (or replay a trace) first")
    if not 0 < q < 1:
        raise ValueError(f"the quantile must be in (0, 1), got {q}")
    if not slo_ttft_s > 0 or not slo_itl_s > 0:
        raise ValueError("the SLOs must be > 0 seconds")
    samples = sorted(samples, key=lambda r: r.arrival_s)
    rate = measured_rps(samples)
    rps = target_rps if target_rps else rate
    if not rps > 0 or not math.isfinite(rps):
        raise ValueError("no target rate: give --target-rps (the measured requests have no measurable rate)")
    if rps < MIN_RPS:
        raise ValueError(f"a target rate of {rps:.3g} req/s is below the {MIN_RPS:g} req/s sizing considers")
    arrivals = arrivals_at(samples, rps, min_requests)
    n = len(samples)
    mean_prompt = sum(r.prompt_tokens for r in samples) / n
    mean_cached = sum(min(r.cached_tokens, r.prompt_tokens) for r in samples) / n
    mean_out = sum(r.output_tokens for r in samples) / n
    services = [prefill_service_s(r, cost) for r in samples]
    mean_service = sum(services) / n
    why = [f"load: {rps:.3g} req/s (measured {rate:.3g} req/s over {n} requests); prompts {mean_prompt:.0f} "
           f"tokens, {mean_cached:.0f} reused from the store ({mean_cached / mean_prompt:.0%}); outputs "
           f"{mean_out:.0f} tokens"]

    # Prefill: no fewer than the work needs (utilization < 1), then the TTFT quantile.
    @functools.cache
    def ttfts(k: int) -> list[float]:
        return simulate_prefill(arrivals, k, cost)

    @functools.cache
    def ttft_q(k: int) -> float:
        return quantile(ttfts(k), q)

    work = rps * mean_service  # (inf when both are huge, where ceil would raise)
    floor_p = max(1, math.ceil(work * (1 + 1e-9))) if work <= MAX_INSTANCES else MAX_INSTANCES + 1
    if floor_p > MAX_INSTANCES:  # (simulating that many would take the memory of as many instances' queues)
        raise ValueError(f"{rps:.3g} req/s is {work:.3g} prefill instances' worth of work, more than "
                         f"the {MAX_INSTANCES} sizing considers")
    feasible = True
    # With enough instances no request waits: its TTFT is its own service time.
    alone = quantile(services, q)
    num_prefill = _smallest(lambda k: ttft_q(k) <= slo_ttft_s, floor_p) if alone <= slo_ttft_s else None
    why.append(f"prefill: {mean_service * 1e3:.1f} ms per request on average (transfer + compute, cost model "
               f"{'fitted to engine reports' if cost.num_samples else 'from the profile'}): {rps * mean_service:.2f} "
               f"instances' worth of work")
    if num_prefill is None:
        feasible = False
        num_prefill = _smallest(lambda k: ttft_q(k) <= alone * 1.05 + 1e-9, floor_p) or MAX_INSTANCES
        why.append(f"prefill: INFEASIBLE: p{q * 100:g} prefill time alone is {alone:.3f} s > TTFT SLO "
                   f"{slo_ttft_s:g} s; {num_prefill} instances remove queueing (shorter chunks, a faster "
                   f"model or more reuse are needed)")
    else:
        fewer = f"; with {num_prefill - 1}: {ttft_q(num_prefill - 1):.3f} s" if num_prefill > 1 else ""
        why.append(f"prefill: {num_prefill} instances: p{q * 100:g} TTFT {ttft_q(num_prefill):.3f} s <= SLO "
                   f"{slo_ttft_s:g} s{fewer}")

    # Decode: requests start at their first token on the chosen prefill pool.
    starts = [(t, t + d, r) for (t, r), d in zip(arrivals, ttfts(num_prefill))]

    @functools.cache
    def itls(k: int) -> list[float]:
        return simulate_decode(starts, k, cost)

    @functools.cache
    def itl_q(k: int) -> float:
        return quantile(itls(k), q)

    # With enough instances every sequence decodes alone.
    single = quantile([cost.tbt_s(1, r.prompt_tokens + r.output_tokens) for r in samples], q)
    num_decode = _smallest(lambda k: itl_q(k) <= slo_itl_s, 1) if single <= slo_itl_s else None
    if num_decode is None:
        feasible = False
        num_decode = _smallest(lambda k: itl_q(k) <= single * 1.05, 1) or MAX_INSTANCES
        why.append(f"decode: INFEASIBLE: p{q * 100:g} of sequences alone step in {single * 1e3:.1f} ms > ITL SLO "
                   f"{slo_itl_s * 1e3:g} ms; {num_decode} instances keep batches small")
    else:
        fewer = f"; with {num_decode - 1}: {itl_q(num_decode - 1) * 1e3:.1f} ms" if num_decode > 1 else ""
        why.append(f"decode: {num_decode} instances: p{q * 100:g} inter-token latency "
                   f"{itl_q(num_decode) * 1e3:.1f} ms <= SLO {slo_itl_s * 1e3:g} ms{fewer}")
    steps = itls(num_decode)
    busy = sum(r.output_tokens * t for (_, _, r), t in zip(starts, steps) if math.isfinite(t))
    span = max((s + r.output_tokens * t for (_, s, r), t in zip(starts, steps) if math.isfinite(t)), default=0.0)
    batch = busy / (span * num_decode) if span > 0 else 0.0
    why.append(f"P:D = {num_prefill}:{num_decode} ({num_prefill / num_decode:.2f}); decode batches average "
               f"{batch:.1f} sequences")
    return Recommendation(num_prefill, num_decode, feasible, rps, slo_ttft_s, slo_itl_s, q, n, rate, mean_prompt,
                          mean_cached, mean_out, ttft_q(num_prefill), itl_q(num_decode),
                          rps * mean_service / num_prefill, batch, why)
