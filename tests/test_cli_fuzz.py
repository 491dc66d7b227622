"""`crescent ctl` under seeded random command lines: every subcommand, each option given an edge value (empty,
negative, NaN, infinite, huge, not hex, odd separators, unknown names), against a live conductor with two
store nodes or an address nobody serves. Whatever the line, the CLI answers with exit status 0, 1 (the
conductor refused or is unreachable) or 2 (bad input), an error is a message on stderr (never a
traceback), and the conductor keeps serving. A failure names the command line to replay."""

from __future__ import annotations

import argparse
import os
import random

import pytest

from kvstore.cli import build_parser
from tests.conductor.procs import run_cli
from tests.helpers import ROOT, conductor_and_nodes

SEED = int(os.environ.get("CRESCENT_FUZZ_SEED", "20261207"))
LINES = int(os.environ.get("CRESCENT_FUZZ_LINES", "25"))  # per subcommand
TRACE = os.path.join(ROOT, "tests", "data", "synthetic_trace.jsonl")
VALUES = ["", "0", "1", "-1", "2", "64", "100000", str(1 << 31), str(1 << 64), "1e309", "nan", "inf", "-inf",
          "0.5", "abc", "zz", "00" * 16, "ab" * 16 + "," + "cd" * 16, "1,2,3", ",,", "1,,2", "-5,3", "x" * 3000,
          "é", "\x00", "127.0.0.1:1", "[::1", ":", "a:b", "node-a", "https://127.0.0.1:1", "{}", "[]",
          "/nonexistent/file", TRACE]
SKIPPED = {"--tokenizer"}  # (loads a tokenizer by name: a download, not input handling)


def _ctl_subparsers():
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ctl = top.choices["ctl"]
    return next(a for a in ctl._actions if isinstance(a, argparse._SubParsersAction)).choices


SUBCOMMANDS = _ctl_subparsers()


def _line(rng: random.Random, name: str, sub: argparse.ArgumentParser, conductor: str, out: str) -> list[str]:
    argv = ["ctl", name]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings and action.dest == "help":
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in SKIPPED:
            continue
        if flag == "--conductor":
            if rng.random() < 0.8:
                argv += [flag, conductor if rng.random() < 0.85 else rng.choice(VALUES)]
            continue
        if flag == "--timeout":
            argv += [flag, rng.choice(("5", "5", "0", "-1", "nan", "inf", "abc"))]
            continue
        if not action.option_strings:  # a positional
            argv.append(TRACE if name == "replay" and rng.random() < 0.3 else rng.choice(VALUES))
            continue
        if rng.random() < 0.5:
            continue
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices is not None and rng.random() < 0.7:
            argv += [flag, rng.choice(list(action.choices))]
        else:
            argv += [flag, rng.choice(VALUES)]
    if name == "replay":
        argv += ["--limit", str(rng.choice((1, 20))), "--no-progress", "--out", out]
    return argv


@pytest.fixture(scope="module")
def cluster():
    with conductor_and_nodes() as (conductor, nodes):
        yield conductor, nodes


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_ctl_answers_random_command_lines_with_a_status_and_a_message(cluster, capsys, tmp_path, name):
    conductor, nodes = cluster
    rng = random.Random(f"{SEED}/{name}")
    for i in range(LINES):
        argv = _line(rng, name, SUBCOMMANDS[name], conductor.address, str(tmp_path))
        try:
            rc, out, err = run_cli(capsys, *argv)
        except Exception as exc:  # noqa: BLE001 - anything but an exit status is the failure reported
            raise AssertionError(f"seed {SEED}, line {i}: crescent {argv!r} raised {exc!r}") from exc
        assert rc in (0, 1, 2), (argv, rc, err[-2000:])
        assert "Traceback" not in err, (argv, err[-3000:])
        if rc:
            assert err.strip(), (argv, "a failure with nothing on stderr")
            assert err.strip().splitlines()[-1].startswith(("crescent", "usage")), (argv, err[-1000:])
    rc, out, err = run_cli(capsys, "ctl", "nodes", "--conductor", conductor.address)  # still serving
    assert rc == 0 and all(n.config.node_id in out for n in nodes), err
