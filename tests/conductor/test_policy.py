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


@pytest.mark.parametrize("field", ["local_bandwidth", "network_bandwidth", "disk_bandwidth"])
def test_profile_load_rejects_a_zero_bandwidth(tmp_path, field):
    # A transfer divides by the bandwidth: 0 used to load fine and crash every Schedule / replay later.
    p = tmp_path / "p.json"
    p.write_text(json.dumps({field: 0}))
    with pytest.raises(ValueError, match=f"profile field {field} must be > 0, got 0"):
        HardwareProfile.load(str(p))


@pytest.mark.parametrize("value", [True, "1e9", None, [1], float("nan")])
def test_profile_load_rejects_values_that_are_not_numbers(tmp_path, value):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"transfer_latency_s": value}))
    with pytest.raises(ValueError, match="profile field transfer_latency_s must be a finite number >= 0"):
        HardwareProfile.load(str(p))


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


# ---- hand-computed answers -------------------------------------------------------------------------
# The numbers below are worked out by hand from the default profile in docs/conductor.md ("Cost model"),
# not from the code: c0 = 0.03 s, c1 = 3.5e-5 s/token, c2 = 6.5e-10 s/pair, 327,680 KV bytes per token,
# local 100 GB/s, network 80 GB/s, disk 6 GB/s, 1 ms per transfer, decode 7.5 ms + 3.5e-5 s/seq
# + 1.75e-8 s/context token, capacity 1,400,000 tokens. If a default changes, these must be redone by hand.

EXACT = 1e-9  # relative: the literals carry all the digits of the arithmetic


def test_cost_model_by_hand():
    # prefill(1000 new after 500) = 0.03 + 3.5e-5·1000 + 6.5e-10·(1000·500 + 1000²/2)
    #                             = 0.03 + 0.035 + 6.5e-10·1,000,000 = 0.03 + 0.035 + 0.00065
    assert COST.prefill_s(1000, 500) == pytest.approx(0.06565, rel=EXACT)
    # prefill(2048 new, none cached) = 0.03 + 0.07168 + 6.5e-10·2,097,152 (= 2048²/2) = 0.03 + 0.07168 + 0.0013631488
    assert COST.prefill_s(2048, 0) == pytest.approx(0.1030431488, rel=EXACT)
    # 512 tokens of KV = 512 × 327,680 B = 167,772,160 B
    assert COST.transfer_s(512, D, True) == pytest.approx(0.003097152, rel=EXACT)  # 1 ms + 167,772,160/80e9
    assert COST.transfer_s(512, D, False) == pytest.approx(0.0026777216, rel=EXACT)  # 1 ms + 167,772,160/100e9
    # On disk, local or remote, the disk's 6 GB/s is the cap: 1 ms + 167,772,160/6e9 = 1 ms + 27.962026666… ms
    assert COST.transfer_s(512, K, True) == pytest.approx(0.028962026666666667, rel=EXACT)
    assert COST.transfer_s(512, K, False) == pytest.approx(0.028962026666666667, rel=EXACT)
    # An engine's own KV size replaces the profile's: 1 ms + 512 × 1000 B / 80e9 = 1 ms + 0.0064 ms
    assert COST.transfer_s(512, D, True, kv_bytes_per_token=1000) == pytest.approx(0.0010064, rel=EXACT)
    # queue(1000 queued tokens, 2 waiting) = 2 × 0.03 + 1000 × 3.5e-5 = 0.06 + 0.035
    assert COST.queue_s(1000, 2) == pytest.approx(0.095, rel=EXACT)
    # tbt(3 seqs, 10,000 context) = 0.0075 + 3 × 3.5e-5 + 10,000 × 1.75e-8 = 0.0075 + 0.000105 + 0.000175
    assert COST.tbt_s(3, 10_000) == pytest.approx(0.00778, rel=EXACT)
    # exactly at the capacity it is still finite: 0.0075 + 0.00007 + 1,400,000 × 1.75e-8 (= 0.0245)
    assert COST.tbt_s(2, 1_400_000) == pytest.approx(0.03207, rel=EXACT)
    assert COST.tbt_s(2, 1_400_001) == math.inf


def test_plans_by_hand():
    # Prompt: 4 chunks of 256 + 100 = 1124 tokens. Engine e0 on n0, queue 0.5 s. n0 holds chunk 0, n1 chunks 0-2.
    m = PrefixMatch([{"n0": D, "n1": D}, {"n1": D}, {"n1": D}])
    c = cands(0.5, nodes=["n0"])
    pr = prompt(4)
    # local: chunk 0 from n0 (256 tokens: 1 ms + 83,886,080 B/100e9 = 0.0018388608 s), then prefill 868 after 256:
    #   0.03 + 3.5e-5·868 (0.03038) + 6.5e-10·(868·256 + 868²/2 = 222,208 + 376,712 = 598,920 → 0.000389298)
    #   = 0.060769298; TTFT = 0.5 + 0.0018388608 + 0.060769298 = 0.5626081588
    lp = local_plan(c[0], pr, m, COST)
    assert (lp.num_cached_chunks, lp.source_node, lp.remote) == (1, "n0", False)
    assert lp.ttft_s == pytest.approx(0.5626081588, rel=EXACT)
    # global: chunk 0 locally (0.0018388608) + chunks 1-2 from n1 over the network (512 tokens: 0.003097152),
    #   then prefill 356 after 768: 0.03 + 0.01246 + 6.5e-10·(273,408 + 63,368 = 336,776 → 0.0002189044)
    #   = 0.0426789044; TTFT = 0.5 + 0.0018388608 + 0.003097152 + 0.0426789044 = 0.5476149172
    gp = global_plan(c[0], pr, m, COST)
    assert (gp.num_cached_chunks, gp.source_node, gp.remote) == (3, "n1", True)
    assert gp.ttft_s == pytest.approx(0.5476149172, rel=EXACT)
    # recompute: 0.5 + 0.03 + 3.5e-5·1124 (0.03934) + 6.5e-10·1124²/2 (631,688 → 0.0004105972) = 0.5697505972.
    # cache-aware keeps the smallest of the three (global); cache-local has no global plan (local < recompute).
    d = schedule(make_policy("cache-aware"), pr, c, [], m, COST)
    assert (d.prefill, d.num_cached_chunks, d.num_cached_tokens, d.source_node) == ("e0", 3, 768, "n1")
    assert d.ttft_s == pytest.approx(0.5476149172, rel=EXACT)
    d = schedule(make_policy("cache-local"), pr, c, [], m, COST)
    assert (d.prefill, d.num_cached_chunks, d.num_cached_tokens, d.source_node) == ("e0", 1, 256, "n0")
    assert d.ttft_s == pytest.approx(0.5626081588, rel=EXACT)
    # load and round-robin take the same local plan (they never compare it with recomputing).
    for name in ("load", "round-robin"):
        assert schedule(make_policy(name), pr, c, [], m, COST).ttft_s == pytest.approx(0.5626081588, rel=EXACT)


def test_each_chunk_comes_from_its_fastest_holder_by_hand():
    # 3 chunks + 100 = 868 tokens, e0 on n0 (which holds nothing). Chunks 0-1: n1 on disk, n2 in DRAM → n2;
    # chunk 2: only n1, on disk. Transfers: 512 tokens from DRAM over the network = 0.003097152;
    # 256 tokens from a disk = 1 ms + 83,886,080/6e9 = 0.0149810133333…; prefill 100 after 768:
    # 0.03 + 0.0035 + 6.5e-10·(76,800 + 5,000) = 0.03355317. TTFT = 0.0516313353333…
    # (recompute: 0.03 + 0.03038 + 6.5e-10·376,712 = 0.0606248628 loses). Source: n2, which serves 2 of the 3.
    m = PrefixMatch([{"n1": K, "n2": D}, {"n1": K, "n2": D}, {"n1": K}])
    d = schedule(make_policy("cache-aware"), prompt(3), cands(0.0), [], m, COST)
    assert (d.num_cached_chunks, d.num_cached_tokens, d.source_node) == (3, 768, "n2")
    assert d.ttft_s == pytest.approx(0.05163133533333333, rel=EXACT)


def test_a_local_disk_prefix_slower_than_recomputing_is_recomputed_by_hand():
    # 2 chunks + 100 = 612 tokens; n0 holds both chunks on disk. Local: 1 ms + 167,772,160/6e9 = 0.0289620266…
    # + prefill 100 after 512 (0.03 + 0.0035 + 6.5e-10·56,200 = 0.03353653) = 0.0624985566666…
    # Recompute: 0.03 + 0.02142 + 6.5e-10·187,272 (= 612²/2) = 0.0515417268: cheaper, so cache-aware loads nothing.
    m = PrefixMatch([{"n0": K}, {"n0": K}])
    c = cands(0.0)
    assert local_plan(c[0], prompt(2), m, COST).ttft_s == pytest.approx(0.06249855666666667, rel=EXACT)
    d = schedule(make_policy("cache-aware"), prompt(2), c, [], m, COST)
    assert (d.num_cached_chunks, d.num_cached_tokens, d.source_node) == (0, 0, None)
    assert d.ttft_s == pytest.approx(0.0515417268, rel=EXACT)


def test_engine_choice_by_hand():
    # 8 chunks + 100 = 2148 tokens, all 8 chunks on n1 only; e1 (on n1) has 10 s of queue, e0 and e2 none.
    # e0 and e2 pull 2048 tokens over the network: 1 ms + 671,088,640/80e9 = 0.009388608, then prefill 100
    # after 2048: 0.03 + 0.0035 + 6.5e-10·(204,800 + 5,000) = 0.03363637; TTFT 0.043024978. A tie: the first (e0).
    m = PrefixMatch([{"n1": D}] * 8)
    d = schedule(make_policy("cache-aware"), prompt(8), cands(0.0, 10.0, 0.0), [], m, COST)
    assert (d.prefill, d.source_node, d.num_cached_chunks, d.num_cached_tokens) == ("e0", "n1", 8, 2048)
    assert d.ttft_s == pytest.approx(0.043024978, rel=EXACT)


def test_decode_choice_and_rejections_by_hand():
    pr = prompt(1, out=200)  # 356 prompt tokens, 200 output tokens: the request adds 556 context tokens
    # d0: 41 seqs, 900,556 context: 0.0075 + 0.001435 + 0.01575973 = 0.02469473
    # d1:  3 seqs,  10,556 context: 0.0075 + 0.000105 + 0.00018473 = 0.00778973  → d1
    decs = [DecodeCandidate("d0", 40, 900_000), DecodeCandidate("d1", 2, 10_000)]
    d = schedule(make_policy("load"), pr, cands(0.0), decs, PrefixMatch([]), COST)
    assert d.decode == "d1" and d.tbt_s == pytest.approx(0.00778973, rel=EXACT)
    # 4 chunks + 100 = 1124 tokens, nothing cached, 30 s of queue: TTFT = 30 + 0.0697505972 (see test_plans_by_hand)
    d = schedule(make_policy("load"), prompt(4), cands(30.0), [], PrefixMatch([]), COST, slo_ttft_s=5.0)
    assert d.rejected == "predicted TTFT 30.070 s exceeds the SLO of 5 s"
    assert d.ttft_s == pytest.approx(30.0697505972, rel=EXACT)
    # 101 seqs, 1,000,000 + 1124 + 200 = 1,001,324 context: 0.0075 + 0.003535 + 0.01752317 = 0.02855817 > 0.02
    d = schedule(make_policy("load"), prompt(4, out=200), cands(0.0), [DecodeCandidate("d0", 100, 1_000_000)],
                 PrefixMatch([]), COST, slo_ttft_s=5.0, slo_tbt_s=0.02)
    assert d.rejected == "predicted TBT 0.0286 s exceeds the SLO of 0.02 s"
    assert d.tbt_s == pytest.approx(0.02855817, rel=EXACT)
    # Just under both SLOs: accepted (TTFT 0.0697505972 ≤ 0.07, TBT 0.02855817 ≤ 0.0286).
    d = schedule(make_policy("load"), prompt(4, out=200), cands(0.0), [DecodeCandidate("d0", 100, 1_000_000)],
                 PrefixMatch([]), COST, slo_ttft_s=0.07, slo_tbt_s=0.0286)
    assert d.rejected == ""


def test_tiny_and_fully_cached_prompts_by_hand():
    # Three 2-token chunks, all on n0: local = 1 ms + 6·327,680/100e9 (0.0000196608) + prefill 1 after 6
    # (0.03 + 3.5e-5 + 6.5e-10·6.5) = 0.031054665025; recompute 6 = 0.03 + 0.00021 + 6.5e-10·18 = 0.0302100117.
    d = schedule(make_policy("cache-aware"), Prompt(6, 3, 2), cands(0.0), [], PrefixMatch([{"n0": D}] * 3), COST)
    assert (d.num_cached_chunks, d.ttft_s) == (0, pytest.approx(0.0302100117, rel=EXACT))
    # 512 tokens = 2 full chunks on n0: load 512 (0.0026777216) + prefill 1 after 512 (0.03 + 3.5e-5 + 6.5e-10·512.5)
    # = 0.032713054725, versus recompute 0.03 + 0.01792 + 6.5e-10·131,072 = 0.0480051968.
    d = schedule(make_policy("cache-aware"), Prompt(512, 2, 256), cands(0.0), [], PrefixMatch([{"n0": D}] * 2), COST)
    assert (d.num_cached_chunks, d.num_cached_tokens) == (2, 512)
    assert d.ttft_s == pytest.approx(0.032713054725, rel=EXACT)
