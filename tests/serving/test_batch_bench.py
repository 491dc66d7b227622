"""bench/batch_bench.py end to end at a toy size: a `crescent up` cluster, each task sent the three
ways, the batch's answers checked against the prompts alone (in the bench), the table printed."""

import sys

from tests.helpers import run_in_own_session


def test_the_batch_bench_sends_each_task_three_ways():
    rc, out = run_in_own_session([sys.executable, "bench/batch_bench.py", "--prompts", "4", "--prompt-tokens", "16",
                                  "--concurrency", "2"])
    assert rc == 0, out[-4000:]
    rows = [line for line in out.splitlines() if line.startswith("| ") and "×" in line and "task" not in line]
    assert len(rows) == 6 and sum("one request of 4 prompts" in row for row in rows) == 2, out
    assert "batch_bench.png" in out
