"""P:D sizing: the simulation agrees with the trace replayer, the recommendation is the smallest
pool that meets the SLOs on a replayed trace, analytic cases, the live RPC, CLI and metric."""

import json
import math
import os
import subprocess
import sys
import urllib.request

import pytest

from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.costmodel import CostModel, DecodeSample, HardwareProfile
from kvstore.conductor.service import Conductor
from kvstore.conductor.simulator import ReplayConfig, replay
from kvstore.conductor.sizing import (RequestSample, prefill_service_s, quantile, recommend, simulate_decode,
                                      simulate_prefill)
from kvstore.conductor.trace import TRACE_BLOCK_TOKENS, load_trace
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc
from tests.helpers import ROOT

TRACE = os.path.join(ROOT, "tests", "data", "synthetic_trace.jsonl")
COST = CostModel()


def _samples(reqs):
    t0 = reqs[0].timestamp_ms / 1000
    return [RequestSample(r.timestamp_ms / 1000 - t0, r.input_length, 0, r.output_length) for r in reqs]


def _ctl(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("num_prefill,num_decode", [(3, 1), (4, 2), (6, 3)])
def test_simulation_is_the_replayers_on_the_same_requests(num_prefill, num_decode):
    """Without reuse and with the load policy, both simulate the same cluster: same TTFT and ITL, request by request."""
    reqs = load_trace(TRACE, limit=500)
    res = replay(reqs, ReplayConfig(policy="load", num_prefill=num_prefill, num_decode=num_decode, cache_blocks=0))
    arrivals = [(s.arrival_s, s) for s in _samples(reqs)]
    ttft = simulate_prefill(arrivals, num_prefill, COST)
    itl = simulate_decode([(t, t + d, r) for (t, r), d in zip(arrivals, ttft)], num_decode, COST)
    assert ttft == pytest.approx(res.ttft_s, rel=1e-9, abs=1e-9)
    assert itl == pytest.approx(res.tbt_s, rel=1e-9, abs=1e-9)


def _smallest(ok) -> int:
    return next(n for n in range(1, 64) if ok(n))


@pytest.fixture
def trace_conductor():
    """A live conductor whose clock the test sets to each trace request's arrival."""
    now = [0.0]
    c = Conductor(ConductorConfig(listen="127.0.0.1:0", dead_timeout=1e9, metrics_port=0),
                  clock=lambda: now[0]).start()
    yield c, now
    c.stop(0)


def _feed(c: Conductor, now: list, reqs) -> None:
    """Registers a prefill and a decode engine and sends every request through Schedule (real gRPC)."""
    import grpc

    with grpc.insecure_channel(c.address) as ch:
        stub = cpb_grpc.ConductorStub(ch)
        for kind in (cpb.MEMBER_KIND_PREFILL, cpb.MEMBER_KIND_DECODE):
            stub.Register(cpb.RegisterRequest(member_id=f"e{kind}", kind=kind, address="127.0.0.1:1"), timeout=30)
        t0 = reqs[0].timestamp_ms / 1000
        for r in reqs:
            now[0] = r.timestamp_ms / 1000 - t0
            n = r.input_length // TRACE_BLOCK_TOKENS
            keys = [h.to_bytes(16, "little") for h in r.hash_ids[:n]]
            stub.Schedule(cpb.ScheduleRequest(keys=keys, num_tokens=r.input_length, chunk_tokens=TRACE_BLOCK_TOKENS,
                                              num_output_tokens=r.output_length), timeout=30)


def test_recommendation_is_the_smallest_pool_that_meets_the_slos_in_replay(trace_conductor):
    """The right answer, found by brute force: the fewest prefill instances whose replayed p90 TTFT meets
    the SLO, then the fewest decode instances whose replayed p90 ITL does. The conductor measures the same
    requests through Schedule, and `crescent ctl sizing` must name exactly those counts."""
    reqs = load_trace(TRACE, limit=2000)
    slo_ttft, slo_itl = 2.0, 0.0086

    def run(p, d):
        return replay(reqs, ReplayConfig(policy="load", num_prefill=p, num_decode=d, cache_blocks=0))

    want_p = _smallest(lambda p: quantile(run(p, 1).ttft_s, 0.9) <= slo_ttft)
    want_d = _smallest(lambda d: quantile(run(want_p, d).tbt_s, 0.9) <= slo_itl)
    assert (want_p, want_d) == (4, 3)  # the trace is fixed (test_replay checks its hash): so is the answer

    c, now = trace_conductor
    _feed(c, now, reqs)
    out = _ctl("sizing", "--conductor", c.address, "--ttft-slo", str(slo_ttft), "--itl-slo", str(slo_itl), "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["num_prefill"], s["num_decode"], s["feasible"]) == (want_p, want_d, True)
    assert s["num_requests"] == 2000
    assert s["predicted_ttft_s"] == pytest.approx(quantile(run(want_p, 1).ttft_s, 0.9), rel=1e-6)
    assert s["predicted_itl_s"] == pytest.approx(quantile(run(want_p, want_d).tbt_s, 0.9), rel=1e-6)
    assert {e["kind"] for e in s["engines"]} == {"prefill", "decode"}

    table = _ctl("sizing", "--conductor", c.address, "--ttft-slo", str(slo_ttft), "--itl-slo", str(slo_itl))
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith(f"prefill {want_p}  decode {want_d}  P:D {want_p / want_d:.2f}")
    assert "with 3:" in table.stdout  # the reasoning shows one fewer prefill instance missing the SLO

    # The same numbers for an autoscaler, at the conductor's own SLOs (defaults: 2 s, 100 ms).
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=30).read().decode()
    default = c.sizing()
    assert f'crescent_conductor_recommended_replicas{{role="prefill"}} {float(default.num_prefill)}' in metrics
    assert f'crescent_conductor_recommended_replicas{{role="decode"}} {float(default.num_decode)}' in metrics
    assert "crescent_conductor_scheduled_total 2000.0" in metrics
    assert 'crescent_conductor_members{kind="prefill",state="alive"} 1.0' in metrics
    assert "crescent_conductor_is_leader 1.0" in metrics


def test_deterministic_load_needs_the_work_rounded_up():
    """Evenly spaced arrivals of identical prompts: nobody waits as long as the instances keep up, so the
    answer is ceil(rate x service time), and the TTFT is the service time itself."""
    prompt = 8192
    service = prefill_service_s(RequestSample(0, prompt, 0, 1), COST)
    rate = 3.5 / service
    samples = [RequestSample(i / rate, prompt, 0, 16) for i in range(400)]
    s = recommend(samples, COST, slo_ttft_s=service * 1.01, slo_itl_s=1.0)
    assert s.num_prefill == 4 and s.feasible
    assert s.predicted_ttft_s == pytest.approx(service)
    assert s.prefill_utilization == pytest.approx(3.5 / 4)
    # Three times the rate: three times the work (10.5 instances' worth), and an instance kept exactly
    # busy (utilization 1) is not enough: any jitter would grow its queue without bound.
    assert recommend(samples, COST, target_rps=3 * rate, slo_ttft_s=service * 1.01, slo_itl_s=1.0).num_prefill == 11
    assert recommend(samples, COST, target_rps=2 * rate, slo_ttft_s=service * 1.01, slo_itl_s=1.0).num_prefill == 8


def test_reuse_shrinks_the_prefill_pool():
    """Half of each prompt served from the store: the prefill work, and the pool, shrink."""
    cold = [RequestSample(i * 0.05, 16384, 0, 64) for i in range(600)]
    warm = [RequestSample(r.arrival_s, r.prompt_tokens, 8192, r.output_tokens) for r in cold]
    a = recommend(cold, COST, slo_ttft_s=5.0, slo_itl_s=1.0)
    b = recommend(warm, COST, slo_ttft_s=5.0, slo_itl_s=1.0)
    assert b.num_prefill < a.num_prefill
    assert b.mean_cached_tokens == 8192 and "50%" in b.reasoning[0]


def test_an_unreachable_slo_is_reported_not_hidden():
    prompt = 32768
    service = prefill_service_s(RequestSample(0, prompt, 0, 1), COST)
    samples = [RequestSample(i * service, prompt, 0, 8) for i in range(100)]
    s = recommend(samples, COST, slo_ttft_s=service / 2, slo_itl_s=1.0)
    assert not s.feasible
    assert any("prefill: INFEASIBLE" in line for line in s.reasoning)
    assert s.num_prefill >= 1
    s = recommend(samples, COST, slo_ttft_s=10.0, slo_itl_s=COST.tbt_s(1, prompt) / 2)
    assert not s.feasible and any("decode: INFEASIBLE" in line for line in s.reasoning)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no requests measured"):
        recommend([], COST)
    one = [RequestSample(0.0, 100, 0, 1)]
    with pytest.raises(ValueError, match="--target-rps"):
        recommend(one, COST)  # one arrival has no rate
    assert recommend(one, COST, target_rps=1.0).num_prefill == 1
    with pytest.raises(ValueError, match="quantile"):
        recommend(one, COST, target_rps=1.0, q=1.0)
    # a finite rate whose work is not (1.7e308 req/s × 1.5 s overflows to inf): a ValueError, not ceil's OverflowError
    long = [RequestSample(0.0, 32768, 0, 1)]
    assert prefill_service_s(long[0], COST) > 1
    with pytest.raises(ValueError, match="instances' worth of work"):
        recommend(long, COST, target_rps=1.7e308)


def test_ctl_sizing_errors_are_one_line(conductor):
    out = _ctl("sizing", "--conductor", conductor.address)
    assert out.returncode == 1
    assert out.stderr.startswith("crescent ctl: error: ") and "no requests measured yet" in out.stderr
    assert out.stderr.count("\n") == 1
    out = _ctl("sizing", "--conductor", conductor.address, "--quantile", "1.5")
    assert out.returncode == 2 and "--quantile must be in (0, 1)" in out.stderr
    out = _ctl("sizing", "--conductor", conductor.address, "--target-rps", "-3")
    assert out.returncode == 2 and "--target-rps must be a number > 0" in out.stderr


def test_decode_fit_recovers_the_step_model():
    truth = (0.004, 2e-5, 3e-8)
    samples = [DecodeSample(b, ctx, truth[0] + truth[1] * b + truth[2] * ctx)
               for b in (1, 4, 16, 64) for ctx in (b * 1000, b * 4000, b * 16000)]
    cost = CostModel()
    assert cost.fit_decode(samples)
    assert cost.decode_coefficients == pytest.approx(truth, rel=1e-6)
    assert cost.tbt_s(8, 80_000) == pytest.approx(truth[0] + truth[1] * 8 + truth[2] * 80_000)
    same = CostModel()
    assert not same.fit_decode(samples[:2])  # too few
    assert same.decode_coefficients == CostModel().decode_coefficients
    assert math.isinf(cost.tbt_s(1, HardwareProfile().decode_kv_capacity_tokens + 1))


def test_engine_decode_reports_refit_the_conductor(conductor):
    """Heartbeats carrying decode steps refit the conductor's decode model and count per engine."""
    import grpc

    truth = (0.002, 1e-4, 5e-8)
    with grpc.insecure_channel(conductor.address) as ch:
        stub = cpb_grpc.ConductorStub(ch)
        inc = stub.Register(cpb.RegisterRequest(member_id="d0", kind=cpb.MEMBER_KIND_DECODE), timeout=30).incarnation
        req = cpb.HeartbeatRequest(member_id="d0", incarnation=inc, engine=cpb.EngineLoad(num_running=4))
        for b, ctx in ((1, 500), (4, 9000), (16, 20000), (32, 90000), (8, 4000), (2, 70000), (24, 1000), (12, 50000)):
            req.decode_samples.add(num_seqs=b, num_context_tokens=ctx, seconds=truth[0] + truth[1] * b + truth[2] * ctx)
        req.decode_samples.add(num_seqs=3, num_context_tokens=10, seconds=float("nan"))  # dropped
        assert stub.Heartbeat(req, timeout=30).known
    assert conductor.cost.decode_coefficients == pytest.approx(truth, rel=1e-6)
    m = conductor.members.get("d0")
    assert m.decode_tokens == 1 + 4 + 16 + 32 + 8 + 2 + 24 + 12
