"""bench/hot_tracker_bench.py runs at a toy size and reports both designs."""

import subprocess
import sys

from tests.helpers import ROOT


def test_the_hot_tracker_bench_runs_both_designs_past_their_size():
    r = subprocess.run([sys.executable, "bench/hot_tracker_bench.py", "--max-entries", "3000", "--touches", "400",
                        "--prompt-chunks", "16"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in r.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"HotTracker", "previous (prune pass)", "design"}
    assert rows["HotTracker"][8].strip() == "3,000"  # full, and held at its size
    assert int(rows["previous (prune pass)"][8].strip().replace(",", "")) <= 3000
    # the shared prefix, touched every time, is counted alike by both
    assert rows["HotTracker"][9] == rows["previous (prune pass)"][9]
    assert "Longest touch:" in r.stdout
