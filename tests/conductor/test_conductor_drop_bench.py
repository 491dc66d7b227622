"""bench/conductor_drop_bench.py runs at a toy size: both ways drop every chunk of the leaving node."""

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_the_drop_bench_runs_both_ways_and_reports_them():
    r = subprocess.run([sys.executable, "bench/conductor_drop_bench.py", "--big", "5000", "--prompts", "50",
                        "--clients", "2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip() for line in r.stdout.splitlines() if line.startswith("| ")}
    assert rows >= {"eager", "lazy"}
    assert re.search(r"The longest Schedule while a node of 5,000 chunks leaves: \d+ ms swept vs \d+ ms", r.stdout)
