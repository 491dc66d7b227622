"""Trace replay: the trace reader, the acceptance figures on the synthetic trace, the CLI."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from kvstore.conductor.simulator import ReplayConfig, replay
from kvstore.conductor.trace import infinite_cache_hit_rate, load_trace
from tests.conductor.procs import run_cli
from tests.helpers import ROOT

# Mooncake's public synthetic trace, kept in the repository (tests/data/SOURCES.md) so no test here skips.
TRACE = os.path.join(ROOT, "tests", "data", "synthetic_trace.jsonl")
TRACE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


def _ctl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_bundled_trace_is_mooncakes_synthetic_trace():
    """The copy is intact (tests/data/SOURCES.md): the acceptance figures below are about this exact file."""
    with open(TRACE, "rb") as f:
        data = f.read()
    assert hashlib.sha256(data).hexdigest() == TRACE_SHA256
    assert (len(data), data.count(b"\n")) == (1_136_313, 3993)


def test_trace_errors_name_the_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 5, "input_length": 10, "output_length": 3}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: 'hash_ids' must be a list of integers"):
        load_trace(str(p))
    p.write_text('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}\n')
    with pytest.raises(ValueError, match=r":1: 'timestamp' must be an integer >= 0"):
        load_trace(str(p))
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=r":1: not JSON"):
        load_trace(str(p))
    p.write_text("\n")
    with pytest.raises(ValueError, match="holds no requests"):
        load_trace(str(p))


def test_small_trace_exact_hits(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [(0, [1, 2, 3]), (10_000, [1, 2, 4]), (20_000, [1, 5]), (30_000, [6])]
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(h), "output_length": 2,
                                     "hash_ids": h}) + "\n" for t, h in rows))
    reqs = load_trace(str(p))
    assert infinite_cache_hit_rate(reqs) == pytest.approx(3 / 9)
    r = replay(reqs, ReplayConfig(policy="cache-aware", num_prefill=2, num_decode=1, cache_blocks=100))
    assert r.hit_rate == pytest.approx(3 / 9)
    assert (r.num_accepted, r.num_rejected, r.num_slo_met) == (4, 0, 4)
    # No capacity at all: nothing is ever reused.
    r = replay(reqs, ReplayConfig(policy="cache-aware", num_prefill=2, num_decode=1, cache_blocks=0))
    assert r.hit_rate == 0.0


def test_replay_config_errors():
    with pytest.raises(ValueError, match="unknown policy"):
        ReplayConfig(policy="nope")
    with pytest.raises(ValueError, match="--prefill and --decode"):
        ReplayConfig(num_prefill=0)
    with pytest.raises(ValueError, match="--slo-ttft must be > 0"):
        ReplayConfig(slo_ttft=0)


def test_synthetic_trace_acceptance():
    """Ample capacity: cache-aware reaches the infinite-cache hit rate; TTFT and goodput order as in Fig. 5."""
    reqs = load_trace(TRACE)
    assert len(reqs) == 3993
    ideal = infinite_cache_hit_rate(reqs)
    assert ideal == pytest.approx(0.64, abs=0.005)
    res = {}
    for pol in ("random", "round-robin", "load", "cache-aware"):
        r = replay(reqs, ReplayConfig(policy=pol, num_prefill=2, num_decode=2, cache_blocks=50_000,
                                      slo_ttft=5.0, slo_tbt=0.1))
        res[pol] = r
    ca = res["cache-aware"]
    assert ca.hit_rate >= ideal - 0.01
    mean = {p: sum(r.ttft_s) / len(r.ttft_s) for p, r in res.items()}
    assert mean["cache-aware"] < mean["load"] < min(mean["round-robin"], mean["random"])
    good = {p: r.goodput for p, r in res.items()}
    assert good["cache-aware"] >= good["load"] > max(good["round-robin"], good["random"])


def test_ctl_replay_compare_writes_table_and_plot(tmp_path):
    r = _ctl("replay", TRACE, "--limit", "300", "--compare", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["policy"] for x in out["results"]] == ["random", "round-robin", "load", "cache-local", "cache-aware"]
    assert out["num_requests"] == 300
    assert (tmp_path / "replay_compare.png").stat().st_size > 1000
    assert "| cache-aware |" in (tmp_path / "replay_compare.md").read_text()
    assert "cache-aware" in r.stderr and "300/300" in r.stderr  # the progress bar


def test_ctl_replay_table(capsys):
    rc, out, err = run_cli(capsys, "ctl", "replay", TRACE, "--limit", "200", "--policy", "load", "--prefill", "3",
                           "--no-progress")
    assert rc == 0, err
    assert "200 requests" in out and "\nload " in out
    assert err == ""


def test_ctl_replay_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "zero.json").write_text('{"network_bandwidth": 0}')
    (tmp_path / "a-file").write_text("")
    for args, msg in [((TRACE, "--profile", str(tmp_path / "zero.json")), "network_bandwidth must be > 0"),
                      ((str(tmp_path / "missing.jsonl"),), "cannot read the trace"),
                      ((TRACE, "--prefill", "0"), "--prefill and --decode must be at least 1"),
                      ((TRACE, "--profile", str(tmp_path / "nope.json")), "cannot read the profile"),
                      ((TRACE, "--limit", "0"), "--limit must be >= 1"),
                      # checked before the replays (it failed after every policy had run)
                      ((TRACE, "--compare", "--out", str(tmp_path / "a-file" / "out")), "cannot write there")]:
        rc, _, err = run_cli(capsys, "ctl", "replay", *args, "--no-progress")
        assert rc == 2, (args, err)
        assert err.startswith("crescent ctl: error: ") and msg in err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_replay_fits_measured_prefill_samples(tmp_path, capsys):
    # A machine twice as slow as the profile: the fitted model makes every TTFT longer.
    c0, c1, c2 = 0.06, 7e-5, 1.3e-9
    p = tmp_path / "samples.jsonl"
    p.write_text("".join(json.dumps({"num_new_tokens": n, "num_cached_tokens": c,
                                     "seconds": c0 + c1 * n + c2 * (n * c + n * n / 2)}) + "\n"
                         for n, c in [(512, 0), (4096, 0), (16384, 2048), (1000, 30000), (60000, 0)]))
    args = ["ctl", "replay", TRACE, "--limit", "300", "--policy", "load", "--no-progress", "--json"]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    rc, out2, err = run_cli(capsys, *args, "--prefill-samples", str(p))
    assert rc == 0, err
    base, slow = json.loads(out)["results"][0], json.loads(out2)["results"][0]
    assert slow["ttft_p50_s"] > 1.5 * base["ttft_p50_s"]
    p.write_text('{"num_new_tokens": 5}\n')
    rc, _, err = run_cli(capsys, *args, "--prefill-samples", str(p))
    assert rc == 2 and "samples.jsonl:1: expected" in err
