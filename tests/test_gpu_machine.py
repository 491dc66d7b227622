"""The GPU machine (`bench/gpu_check.sh`) has its own Python packages: every third-party module
this project imports at module level — in the code and in every test module, which
`pytest -m gpu tests` collects — must be there or among the wheels `make gpu-wheels` carries.
A module missing there kills the whole run at import (as `grpc_health` once would have).
And the script's bench command lines parse, and those benches run here at toy sizes: a step that
crashes there costs part of the few minutes a GPU is lent."""

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Import names of what the H200 image holds (the device library's KINDS.md package list, as read
# 2026-11-17), of those this project could import.
ON_THE_MACHINE = {"torch", "triton", "numpy", "grpc", "xxhash", "prometheus_client", "safetensors", "tokenizers",
                  "matplotlib", "pytest", "hypothesis", "msgpack", "yaml", "requests", "psutil", "transformers",
                  "tqdm", "httpx", "aiohttp", "jinja2", "attr", "sortedcontainers", "google"}
WHEEL_MODULES = {"lmdb": "lmdb", "grpcio": "grpc", "grpcio-health-checking": "grpc_health", "pyzmq": "zmq",
                 "protobuf": "google", "hypothesis": "hypothesis", "sortedcontainers": "sortedcontainers",
                 "attrs": "attr", "pytest-timeout": "pytest_timeout"}
LOCAL = {"kvstore", "engine", "kernels", "bench", "tests", "proto"}
# Loaded only where their serving stack is installed (their own venvs): never on the GPU run.
ELSEWHERE = ("kvstore/integrations/", "tests/integrations/")


def _carried() -> set[str]:
    recipe = re.search(r"^gpu-wheels:.*?(?=^\S|\Z)", (ROOT / "Makefile").read_text(), re.S | re.M).group(0)
    names = set(re.findall(r"(?<![\w.=$-])([a-z][a-z0-9-]+)(?:==|\b(?=[\s\"\\]))", recipe.split("-d .whl", 1)[1]))
    return {WHEEL_MODULES[n] for n in names if n in WHEEL_MODULES}


def _module_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text()).body:  # inside functions or try blocks: imported lazily
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return {n for n in out if n not in sys.stdlib_module_names and n not in LOCAL and n != "__future__"}


def test_the_wheels_carried_are_parsed_from_the_makefile():
    assert {"lmdb", "grpc", "grpc_health", "zmq", "google"} <= _carried()


def test_every_module_level_import_is_on_the_gpu_machine_or_carried():
    have = ON_THE_MACHINE | _carried()
    missing = {}
    for top in ("kvstore", "engine", "kernels", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ELSEWHERE) and not Path(rel).name.startswith("test_"):
                continue
            for name in _module_level_imports(path) - have:
                missing.setdefault(name, []).append(rel)
    assert missing == {}, f"not on the GPU machine; add its wheel to `make gpu-wheels` or import it lazily: {missing}"


def _bench_invocations() -> list[tuple[str, list[str]]]:
    """Every `python3 bench/X.py ...` command line of bench/gpu_check.sh, its arguments as bash
    would pass them (the script's arrays and $FIG expanded)."""
    import shlex

    text = (ROOT / "bench" / "gpu_check.sh").read_text().replace("\\\n", " ")
    arrays = {m.group(1): shlex.split(m.group(2)) for m in re.finditer(r"^(\w+)=\((.*?)\)", text, re.S | re.M)}
    out = []
    for m in re.finditer(r"python3 (bench/\w+\.py)([^|\n]*?)(?:2>&1|\||$)", text, re.M):
        args = []
        for word in shlex.split(m.group(2)):
            name = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
            args += arrays[name.group(1)] if name else [word.replace("$FIG", "/tmp/gpu_figs")]
        out.append((m.group(1), args))
    return out


def test_every_bench_command_of_the_gpu_run_parses():
    """A flag a bench does not take would cost a step of the few minutes an H200 is lent: every
    command line of the script goes through its bench's own argument parser here (the bench stops
    there, before it computes anything)."""
    import subprocess

    calls = _bench_invocations()
    assert {"bench/prefix_reuse_bench.py", "bench/kernels_bench.py"} <= {path for path, _ in calls}
    assert any("--hf-overrides" in args and "random:llama3-8b" in args for _, args in calls)
    script = """
import argparse, json, runpy, sys
class Parsed(BaseException):
    pass
orig = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    raise Parsed(orig(self, args, namespace))
argparse.ArgumentParser.parse_args = parse_args
for path, args in json.loads(sys.argv[1]):
    sys.argv = [path] + args
    try:
        runpy.run_path(path, run_name="__main__")
    except Parsed:
        print("parsed", path, flush=True)
    else:
        raise SystemExit(f"{path} returned without parsing its arguments")
"""
    import json

    r = subprocess.run([sys.executable, "-c", script, json.dumps(calls)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("parsed ") == len(calls), r.stdout


def _run(cmd: list[str]) -> str:
    import subprocess

    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def test_the_kernels_bench_runs_its_grid_and_sweep_at_toy_shapes(tmp_path):
    """bench/kernels_bench.py --smoke: every kernel of the GPU run's table, checked against its
    PyTorch twin in the Triton interpreter, the targets' lines and the engine ITL rows; then the
    tile-config sweep, which writes the device's config file."""
    out = _run(["bench/kernels_bench.py", "--smoke", "--out", str(tmp_path)])
    assert "CORRECTNESS FAILURES" not in out
    for kind in ("decode", "prefill", "gather", "scatter", "fp8 quantize", "engine decode (eager) B=1"):
        assert f"target: {kind}" in out, kind
    assert (tmp_path / "kernels_bench.md").read_text().count("|") > 50
    out = _run(["bench/kernels_bench.py", "--smoke", "--sweep", "--out", str(tmp_path)])
    configs = json.loads((tmp_path / "configs" / "cpu.json").read_text())
    assert {"prefill", "decode"} <= set(configs), configs


def test_the_speculation_verify_cost_bench_runs(tmp_path):
    """bench/spec_decode_bench.py --verify-cost (a GPU run's step) at a toy size: a row per batch
    and draft count, written to its JSON."""
    _run(["bench/spec_decode_bench.py", "--verify-cost", "--model", "random:tiny", "--context", "64",
          "--batch", "1,2", "--ks", "1,2", "--json", str(tmp_path / "v.json")])
    fig = json.loads((tmp_path / "v.json").read_text())
    assert set(fig["batches"]) == {"1", "2"}
    for batch in fig["batches"].values():  # k = 0 (a plain step), 1, 2: each timed
        assert [k for k, _ in batch["steps"]] == [0, 1, 2] and all(s > 0 for _, s in batch["steps"])
