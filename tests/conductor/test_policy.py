"""Policies and the cost model on tiny, exact inputs."""

import json
import math

import pytest

from kvstore.conductor.costmodel import CostModel, HardwareProfile, PrefillSample
from kvstore.conductor.policy import (DecodeCandidate, PrefillCandidate, PrefixMatch, Prompt, global_plan,
                                      local_plan, make_policy, schedule)
from kvstore.store import Tier

D, K = Tier.DRAM, Tier.DISK
COST = CostModel()
P = COST.profile


def prompt(chunks=4, ct=256, extra=100, out=0):
    return Prompt(chunks * ct + extra, chunks, ct, out)


def cands(*queues, nodes=None):
    nodes = nodes or [f"n{i}" for i in range(len(queues))]
    return [PrefillCandidate(f"e{i}", nodes[i], q) for i, q in enumerate(queues)]


def test_cost_model_formulas():
    c0, c1, c2 = COST.coefficients
    assert COST.prefill_s(1000, 500) == pytest.approx(c0 + c1 * 1000 + c2 * (1000 * 500 + 0.5 * 1000 * 1000))
    assert COST.transfer_s(0, D, True) == 0.0
    assert COST.transfer_s(512, D, True) == pytest.approx(P.transfer_latency_s + 512 * P.kv_bytes_per_token
                                                          / P.network_bandwidth)
    assert COST.transfer_s(512, D, False) < COST.transfer_s(512, D, True) < COST.transfer_s(512, K, True)
    assert COST.tbt_s(2, P.decode_kv_capacity_tokens + 1) == math.inf
    assert COST.queue_s(1000, 2) == pytest.approx(2 * c0 + 1000 * c1)


def test_fit_recovers_the_coefficients_and_refuses_too_few_samples():
    truth = (0.02, 4e-5, 1e-9)
    samples = [PrefillSample(n, c, truth[0] + truth[1] * n + truth[2] * (n * c + n * n / 2))
               for n, c in [(100, 0), (2000, 0), (8000, 1000), (500, 30000), (16000, 0)]]
    m = CostModel()
    assert not m.fit(samples[:2])
    assert m.fit(samples)
    assert m.coefficients == pytest.approx(truth, rel=1e-6)
    assert m.num_samples == 5


def test_fit_keeps_coefficients_non_negative():
    # Flat times: the per-pair term would come out negative unconstrained.
    samples = [PrefillSample(n, 0, 0.01 + 1e-5 * n - 1e-12 * n * n) for n in (100, 1000, 5000, 9000)]
    m = CostModel()
    assert m.fit(samples)
    assert all(c >= 0 for c in m.coefficients)


def test_profile_load_rejects_unknown_and_bad_fields(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"name": "tiny", "network_bandwidth": 1e9}))
    assert HardwareProfile.load(str(p)).network_bandwidth == 1e9
    p.write_text(json.dumps({"netwrk_bandwidth": 1}))
    with pytest.raises(ValueError, match="unknown fields: netwrk_bandwidth"):
        HardwareProfile.load(str(p))
    p.write_text(json.dumps({"disk_bandwidth": -1}))
    with pytest.raises(ValueError, match="disk_bandwidth"):
        HardwareProfile.load(str(p))
    with pytest.raises(ValueError, match="cannot read"):
        HardwareProfile.load(str(tmp_path / "missing.json"))


def test_prefix_match_local_prefix():
    m = PrefixMatch([{"a": D, "b": D}, {"a": D}, {"b": K}])
    assert m.num_global == 3
    assert m.local_prefix("a") == 2
    assert m.local_prefix("b") == 1
    assert m.local_prefix("c") == 0
    assert m.local_prefix(None) == 0


def test_local_and_global_plans():
    m = PrefixMatch([{"n0": D, "n1": D}, {"n1": D}, {"n1": D}])
    c = cands(0.5, nodes=["n0"])[0]
    pr = prompt(4)
    lp = local_plan(c, pr, m, COST)
    assert (lp.num_cached_chunks, lp.source_node, lp.remote) == (1, "n0", False)
    assert lp.ttft_s == pytest.approx(0.5 + COST.transfer_s(256, D, False) + COST.prefill_s(pr.num_tokens - 256, 256))
    gp = global_plan(c, pr, m, COST)
    assert (gp.num_cached_chunks, gp.source_node, gp.remote) == (3, "n1", True)
    assert gp.ttft_s == pytest.approx(0.5 + COST.transfer_s(256, D, False) + COST.transfer_s(512, D, True)
                                      + COST.prefill_s(pr.num_tokens - 768, 768))


def test_a_fully_cached_prompt_still_computes_one_token():
    m = PrefixMatch([{"n0": D}] * 2)
    p = Prompt(512, 2, 256)
    plan = local_plan(cands(0.0)[0], p, m, COST)
    assert plan.ttft_s == pytest.approx(COST.transfer_s(512, D, False) + COST.prefill_s(1, 512))
    assert schedule(make_policy("cache-aware"), p, cands(0.0), [], m, COST).num_cached_tokens == 512


def test_cache_aware_goes_where_the_prefix_is_and_weighs_queues():
    m = PrefixMatch([{"n1": D}] * 8)
    pol = make_policy("cache-aware")
    d = schedule(pol, prompt(8), cands(0.0, 0.0, 0.0), [], m, COST)
    assert (d.prefill, d.source_node, d.num_cached_chunks) == ("e1", "n1", 8)
    # The holder's engine is busy for 10 s: another engine pulls the prefix over the network.
    d = schedule(pol, prompt(8), cands(0.0, 10.0, 0.0), [], m, COST)
    assert d.prefill == "e0" and d.source_node == "n1" and d.num_cached_chunks == 8


def test_cache_blind_policies_use_only_the_local_node():
    m = PrefixMatch([{"n1": D}] * 8)
    d = schedule(make_policy("load"), prompt(8), cands(0.2, 0.3, 0.1), [], m, COST)
    assert (d.prefill, d.num_cached_chunks, d.source_node) == ("e2", 0, None)
    d = schedule(make_policy("cache-local"), prompt(8), cands(0.0, 0.0, 0.0), [], m, COST)
    assert (d.prefill, d.num_cached_chunks) == ("e1", 8)


def test_round_robin_and_random_are_deterministic():
    rr = make_policy("round-robin")
    m = PrefixMatch([])
    decs = [DecodeCandidate("d0", 0, 0), DecodeCandidate("d1", 0, 0)]
    picks = [schedule(rr, prompt(1), cands(0, 0, 0), decs, m, COST) for _ in range(4)]
    assert [p.prefill for p in picks] == ["e0", "e1", "e2", "e0"]
    assert [p.decode for p in picks] == ["d0", "d1", "d0", "d1"]
    a = [schedule(make_policy("random", 7), prompt(1), cands(0, 0, 0), decs, m, COST).prefill for _ in range(1)]
    r1, r2 = make_policy("random", 7), make_policy("random", 7)
    seq1 = [schedule(r1, prompt(1), cands(0, 0, 0), decs, m, COST).prefill for _ in range(20)]
    seq2 = [schedule(r2, prompt(1), cands(0, 0, 0), decs, m, COST).prefill for _ in range(20)]
    assert seq1 == seq2 and seq1[0] == a[0] and len(set(seq1)) == 3


def test_decode_by_predicted_tbt():
    decs = [DecodeCandidate("d0", 40, 900_000), DecodeCandidate("d1", 2, 10_000)]
    d = schedule(make_policy("cache-aware"), prompt(1), cands(0.0), decs, PrefixMatch([]), COST)
    assert d.decode == "d1"
    assert d.tbt_s == pytest.approx(COST.tbt_s(3, 10_000 + prompt(1).num_tokens))


def test_early_rejection_names_the_slo():
    m = PrefixMatch([])
    d = schedule(make_policy("load"), prompt(4), cands(30.0), [], m, COST, slo_ttft_s=5.0)
    assert d.rejected.startswith("predicted TTFT") and "SLO of 5 s" in d.rejected
    full = [DecodeCandidate("d0", 10, P.decode_kv_capacity_tokens)]
    d = schedule(make_policy("load"), prompt(4), cands(0.0), full, m, COST, slo_tbt_s=0.1)
    assert d.rejected == "predicted TBT inf (KV capacity) exceeds the SLO of 0.1 s"
    d = schedule(make_policy("load"), prompt(4), cands(0.0), [], m, COST, slo_ttft_s=5.0, slo_tbt_s=0.1)
    assert d.rejected == ""


def test_hot_remote_prefix_is_replicated_to_the_user():
    m = PrefixMatch([{"n1": D}] * 4)
    pol = make_policy("cache-aware")
    busy = cands(0.0, 10.0)
    cold = schedule(pol, prompt(4), busy, [], m, COST, is_hot=lambda n: False)
    hot = schedule(pol, prompt(4), busy, [], m, COST, is_hot=lambda n: n == 4)
    assert cold.prefill == hot.prefill == "e0"
    assert cold.replicate_to is None and hot.replicate_to == "n0"
    local = schedule(pol, prompt(4), cands(0.0, 0.0), [], m, COST, is_hot=lambda n: True)
    assert local.prefill == "e1" and local.replicate_to is None  # already where it is used


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")


def test_a_prefix_too_short_to_pay_for_its_transfer_is_recomputed():
    tiny = Prompt(6, 3, 2)  # three 2-token chunks: 1 ms of transfer latency beats 0.2 ms of compute
    m = PrefixMatch([{"n0": D}] * 3)
    for name in ("cache-aware", "cache-local"):
        d = schedule(make_policy(name), tiny, cands(0.0), [], m, COST)
        assert (d.num_cached_chunks, d.source_node) == (0, None), name
    big = schedule(make_policy("cache-aware"), prompt(3), cands(0.0), [], m, COST)
    assert (big.num_cached_chunks, big.source_node) == (3, "n0")
