"""bench/prefix_reuse_bench.py end to end on this CPU at a toy size, through each store path it
measures here: the node's arena (shm), another host's reads (tcp: streamed and the staging pool)
and the disk tier. It is the first step of the GPU run (bench/gpu_check.sh) and the figures of
issue 12; a crash in its common code found there would cost the lent minutes."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import run_in_own_session

VARIANTS = {
    "shm": [],
    "tcp": ["--transport", "tcp"],
    # DRAM smaller than one prompt's KV (4 MiB at this size): the prefix is read from disk
    "disk": ["--disk-tier", "--dram", "2MiB", "--disk-size", "64MiB"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_prefix_reuse_bench_runs_and_reports_its_figures(tmp_path, variant):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "bench/prefix_reuse_bench.py", "--quick", "--json", str(out), *VARIANTS[variant]]
    rc, log = run_in_own_session(cmd)
    assert rc == 0, log[-4000:]
    fig = json.loads(out.read_text())
    assert fig["device"] == "cpu" and fig["model"] == "random:small"
    by_target = {r["target"]: r for r in fig["results"]}
    assert set(by_target) == {0.0, 0.5, 0.9}
    assert by_target[0.0]["cached_tokens"] == 0 and by_target[0.0]["bytes"] == 0
    for frac in (0.5, 0.9):  # the store's prefix was loaded, whole chunks of it, not recomputed
        r = by_target[frac]
        assert r["cached_tokens"] == round(frac * 1024 / 256) * 256 and r["bytes"] > 0, r
        assert r["ttft_store"] > 0 and r["ttft_recompute"] > 0
    if variant == "tcp":
        assert by_target[0.9]["ttft_pool"] > 0 and by_target[0.9]["pool_load_s"] > 0
    else:
        assert by_target[0.9]["ttft_pool"] is None
    if variant == "disk":
        assert by_target[0.9]["chunks_from_disk"] == 4
    assert fig["first_load"]["bytes"] == by_target[0.9]["bytes"]
    assert "TTFT is" in log and "figures:" in log
