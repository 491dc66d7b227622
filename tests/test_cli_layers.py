"""One CLI, imports pointing down: kernels <- kvstore <- engine. Commands outside the store layer
come in through the ``crescent.commands`` entry points, which any installed package can add to."""

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# package -> packages of this project it must never import
FORBIDDEN = {"kernels": {"kvstore", "engine"}, "kvstore": {"engine"}, "proto": {"kvstore", "engine", "kernels"}}


def _imports(path: str) -> set[tuple[str, int]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.name.split(".")[0], node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add((node.module.split(".")[0], node.lineno))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    bad = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                bad += [f"{os.path.relpath(path, ROOT)}:{line} imports {mod}"
                        for mod, line in _imports(path) if mod in FORBIDDEN[package]]
    assert not bad, "\n".join(sorted(bad))


def _crescent(*args, env_extra=None, cwd=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_engine_commands_arrive_through_the_entry_point():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="crescent.commands")}
    assert eps.get("serving") == "engine.serve.cli:register"
    out = _crescent("--help")
    assert out.returncode == 0
    for cmd in ("store", "conductor", "ctl", "engine", "gateway", "up"):
        assert cmd in out.stdout


def _dist(tmp_path, name: str, entry: str, module_src: str | None = None) -> str:
    """An installed-looking distribution on a path of its own: a dist-info with one entry point."""
    site = tmp_path / "site"
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[crescent.commands]\n{name} = {entry}\n")
    if module_src is not None:
        (site / f"{name}.py").write_text(textwrap.dedent(module_src))
    return str(site)


def test_a_third_party_package_adds_a_command(tmp_path):
    site = _dist(tmp_path, "hello_cmd", "hello_cmd:register", """
        def register(sub):
            p = sub.add_parser("hello", help="say hello")
            p.add_argument("--name", default="world")
            p.set_defaults(handler=lambda ns: print(f"hello {ns.name}") or 0)
        """)
    out = _crescent("hello", "--name", "crescent", env_extra={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello crescent\n"


def test_a_broken_entry_point_is_one_line(tmp_path):
    site = _dist(tmp_path, "broken_cmd", "no_such_module_here:register")
    out = _crescent("--help", env_extra={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert out.returncode == 2
    assert out.stderr.startswith("crescent: error: cannot load the crescent.commands entry point 'broken_cmd'")
    assert out.stderr.count("\n") == 1


def _loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_store_conductor_and_ctl_never_load_torch():
    """torch is the engine's alone: importing it costs a store node, a conductor and every `crescent
    ctl` call ~1.7 s at start and ~0.7 s more at exit (the last garbage collection walks its heap)."""
    from tests.conductor.procs import ConductorProcess
    from tests.helpers import StoreProcess

    conductor = ConductorProcess()
    store = StoreProcess("--dram", "8MiB", "--conductor", conductor.address)
    try:
        assert not _loads_torch(store.pid) and not _loads_torch(conductor.pid)
        for args in (["ctl", "nodes", "--json"], ["ctl", "stats"], ["ctl", "lookup", "--keys", "ab" * 16]):
            r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
                import sys
                from kvstore.cli import main
                rc = main({args + ["--conductor", conductor.address]!r})
                print("torch" in sys.modules, rc)""")], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert r.stdout.splitlines()[-1] == "False 0", (args, r.stdout[-2000:], r.stderr[-2000:])
    finally:
        store.stop()
        conductor.stop()
