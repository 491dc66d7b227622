"""`crescent store` as a real process: kill -9 and restart, start-up errors, graceful stop."""

import ast
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

from kvstore.chunk import decode_chunk, encode_chunk
from kvstore.client import StoreClient
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
from kvstore.store import Tier
from tests.helpers import ROOT, Proc, StoreProcess

NS = make_namespace(ModelFingerprint("tiny", "float32", 2, 2, 64, 64))


def _chunks(n):
    tokens = list(range(n * 64))
    keys = chunk_keys(tokens, NS, 64)
    out, parent = [], ROOT_KEY
    for i, k in enumerate(keys):
        kv = torch.randn(2, 2, 2, 64, 64)  # 128 KiB payload
        out.append((k, parent, tokens[i * 64 : (i + 1) * 64], kv))
        parent = k
    return out


def test_kill9_then_restart_keeps_every_disk_value(tmp_path):
    disk = str(tmp_path / "disk")
    proc = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        c = StoreClient(proc.address)
        chunks = _chunks(24)  # ~3 MiB: most get demoted to disk
        for k, parent, toks, kv in chunks:
            c.put(k, encode_chunk(kv, NS, parent, toks))
        n, tiers = c.lookup_tiers([k for k, *_ in chunks])
        assert n == len(chunks)
        on_disk = [ch for ch, t in zip(chunks, tiers) if t is Tier.DISK]
        assert len(on_disk) >= 10
        c.close()
        proc.kill9()
    finally:
        proc.stop()
    proc = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        c = StoreClient(proc.address)
        for k, parent, toks, kv in on_disk:
            buf = c.batch_get([k])[0]
            assert buf is not None
            got = decode_chunk(buf, key=k, namespace=NS, parent=parent, tokens=toks)
            assert torch.equal(got, kv)
        c.close()
    finally:
        assert proc.stop() == 0


def _run_store(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "store", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_corrupt_lmdb_file_is_a_one_line_startup_error(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    (d / "data.mdb").write_bytes(os.urandom(128 << 10))
    r = _run_store("--listen", "127.0.0.1:0", "--disk", str(d))
    assert r.returncode == 2
    assert r.stderr.startswith("crescent store: error: ") and "disk tier" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_flags_and_busy_port_are_clear_errors(tmp_path):
    r = _run_store("--dram", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = _run_store("--listen", "127.0.0.1:0", "--low-watermark", "0.99", "--high-watermark", "0.5")
    assert r.returncode == 2 and "watermark" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run_store("--listen", f"127.0.0.1:{s.getsockname()[1]}")
    assert r.returncode == 2 and "cannot listen" in r.stderr
    assert "Traceback" not in r.stderr
    for path, says in (("/etc/passwd", "--disk must be a folder"), ("/etc/passwd/x", "--disk: cannot make the folder")):
        r = _run_store("--listen", "127.0.0.1:0", "--disk", path)  # before: "[Errno 17] File exists: ..."
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = _run_store("--listen", "127.0.0.1:0", "--disk", str(tmp_path / "d"), "--disk-size", "1")  # (it started)
    assert r.returncode == 2 and "--disk-size (1 B) must hold at least one slot" in r.stderr, r.stderr
    for flag, value in (("--listen", "127.0.0.1:99999"), ("--data-port", "-7"), ("--metrics-port", "99999")):
        r = _run_store("--listen", "127.0.0.1:0", flag, value) if flag != "--listen" else _run_store(flag, value)
        assert r.returncode == 2 and f"{flag} must be" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_second_node_on_a_disk_folder_in_use_is_refused_and_the_first_serves_on(tmp_path):
    disk = str(tmp_path / "disk")
    first = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        r = _run_store("--listen", "127.0.0.1:0", "--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
        assert r.returncode == 2, r.stderr
        assert r.stderr == (f"crescent store: error: --disk {disk} is in use by another store node "
                            f"(pid {first.pid} on its host): give each node a folder of its own\n"), r.stderr
        c = StoreClient(first.address)
        c.put(b"k", b"v" * 100_000)
        assert c.get(b"k") == b"v" * 100_000
        c.close()
    finally:
        assert first.stop() == 0
    second = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")  # the folder is free again
    assert second.stop() == 0


def test_a_node_that_cannot_start_says_which_port_and_leaves_no_arena():
    """A busy --data-port or --metrics-port: one line naming the flag, and the arena (--dram of
    shared memory) removed, not left for a later node to reap."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = str(s.getsockname()[1])
        for flag in ("--data-port", "--metrics-port"):
            p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0",
                                  "--dram", "64MiB", flag, busy], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            try:
                _, err = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            assert p.returncode == 2 and err.startswith("crescent store: error: cannot") and flag in err, err
            assert len(err.strip().splitlines()) == 1
            assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"crescent-{p.pid}-")]


def test_sigterm_stops_gracefully_and_frees_the_arena():
    proc = StoreProcess("--dram", "8MiB")
    try:
        segs = [f for f in os.listdir("/dev/shm") if f.startswith(f"crescent-{proc.pid}-")]
        assert len(segs) == 1
        c = StoreClient(proc.address)
        c.put(b"k", b"v")
        c.close()
    finally:
        code = proc.stop()
    assert code == 0
    assert not os.path.exists(f"/dev/shm/{segs[0]}")


def _help_options(text: str) -> dict[str, str]:
    """``--help`` output's options section: each option string (``--disk``, ``--no-promote``) → its help text."""
    section = re.split(r"^options:$", text, flags=re.M)[1]
    opts, names = {}, []
    for line in section.splitlines()[1:]:
        if not line.strip():
            break  # the end of the section
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m:  # "  --flag METAVAR   help", "  --x, --no-x": a new entry
            names = [part.split(" ")[0] for part in m.group(1).split(", ")]
            for n in names:
                opts[n] = m.group(2) or ""
        else:  # a continuation of the last entry's help
            for n in names:
                opts[n] = (opts[n] + " " + line.strip()).strip()
    return opts


def _field_docs() -> dict[str, str]:
    """The docstring under each ``StoreConfig`` field, read from kvstore/config.py (not via kvstore.cli)."""
    tree = ast.parse(open(os.path.join(ROOT, "kvstore", "config.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StoreConfig")
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(cls.body, cls.body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def _squash(text: str) -> str:
    """Without whitespace: argparse wraps lines at spaces and after hyphens ("same-" / "host")."""
    return re.sub(r"\s+", "", text)


def test_help_documents_every_flag():
    import dataclasses

    from kvstore.config import StoreConfig

    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "store", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    opts = _help_options(r.stdout)
    docs = _field_docs()
    rows = {}  # docs/cli.md's flag table: each flag → its "meaning" cell
    for line in open(os.path.join(ROOT, "docs", "cli.md")):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `--") and len(cells) >= 3:
            for flag in re.findall(r"`(--[a-z0-9-]+)`", cells[0]):
                rows[flag] = cells[-1]
    fields = dataclasses.fields(StoreConfig)
    expected = {"-h", "--help"}
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        expected.add(flag)
        assert flag in opts, f"{flag} is not an option of `crescent store --help`"
        doc = docs.get(f.name, "")
        assert len(doc.split()) >= 3, f"StoreConfig.{f.name} has no docstring to use as help"
        assert _squash(opts[flag]).startswith(_squash(doc)), (
            f"help of {flag} is {opts[flag]!r}, not its field's docstring {doc!r}")
        if f.type in ("bool", bool):
            no = "--no-" + flag[2:]
            expected.add(no)
            assert opts.get(no) == opts[flag], f"{no} is missing or described differently"
        elif f.metadata.get("size"):
            assert "(default: " in opts[flag], f"help of {flag} does not give its default"
        assert flag in rows, f"{flag} is missing from docs/cli.md's flag table"
        assert len(rows[flag].split()) >= 3, f"docs/cli.md says nothing about {flag}: {rows[flag]!r}"
    assert set(opts) == expected, f"options that are no StoreConfig field, or missing: {set(opts) ^ expected}"
    for choice in ("auto", "shm", "rdma", "tcp"):
        assert choice in r.stdout.split("--transport {", 1)[1].split("}", 1)[0]


def _segments(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"crescent-{pid}-")]


def test_a_new_node_reaps_the_arena_file_of_a_node_killed_by_sigkill():
    alive = StoreProcess("--dram", "1MiB")
    try:
        [alive_seg] = _segments(alive.pid)
        dead = StoreProcess("--dram", "1MiB")
        try:
            [dead_seg] = _segments(dead.pid)
            dead.kill9()
        finally:
            dead.stop()
        assert os.path.exists(f"/dev/shm/{dead_seg}"), "kill -9 ran no cleanup: the file must still be there"
        new = StoreProcess("--dram", "1MiB")
        try:
            assert not os.path.exists(f"/dev/shm/{dead_seg}"), "the new node left the dead node's arena file"
            assert len(_segments(new.pid)) == 1
            assert os.path.exists(f"/dev/shm/{alive_seg}"), "the new node removed a live node's arena file"
            c = StoreClient(alive.address, transport="shm")  # and the live node still serves through it
            assert c.transport == "shm", c.transport_notes
            c.put(b"k", b"v" * 1000)
            assert c.get(b"k") == b"v" * 1000
            c.close()
        finally:
            assert new.stop() == 0
    finally:
        assert alive.stop() == 0



def test_a_live_arena_file_is_kept_whatever_pid_its_name_carries():
    """A node in another pid namespace sharing /dev/shm (containers of one pod) has a pid this process
    cannot see: its arena file's name says a dead pid. Its lock says it lives."""
    from kvstore.arena import HostArena, reap_stale_segments

    gone = subprocess.Popen(["true"])
    gone.wait()
    alias = f"crescent-{gone.pid}-0ddba11"
    arena = HostArena(1 << 20, 4096)
    try:
        os.link(arena.path, f"/dev/shm/{alias}")  # the live arena's inode, under a dead pid's name
        assert alias not in reap_stale_segments()
        assert os.path.exists(f"/dev/shm/{alias}") and os.path.exists(arena.path), "a live arena was reaped"
        arena.close()  # its owner lets go: now the file is no one's
        assert alias in reap_stale_segments()
        assert not os.path.exists(f"/dev/shm/{alias}")
    finally:
        arena.close()
        if os.path.exists(f"/dev/shm/{alias}"):
            os.unlink(f"/dev/shm/{alias}")


_EMBEDDED = """
import os, sys
from kvstore.config import StoreConfig
from kvstore.server import StoreNode
node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
mine = lambda: sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"crescent-{os.getpid()}-"))
print(mine(), flush=True)
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: the child runs the exit hooks it inherited
os.waitpid(child, 0)
print(mine(), flush=True)
"""  # and exits without node.stop()


def test_a_program_that_never_stops_its_node_leaves_no_arena_file_and_its_forked_child_keeps_it():
    """An embedding program (or a test) that exits without ``stop()`` left its node's arena in
    /dev/shm, holding host RAM until some later node's start reaped it. The file goes with the
    process now, and only with the process that made it: a child forked from it that exits normally
    runs the same exit hooks, and must not take a live node's file away."""
    out = subprocess.run([sys.executable, "-c", _EMBEDDED], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after_child = (ast.literal_eval(line) for line in out.stdout.splitlines())
    assert len(before) == 1 and after_child == before, out.stdout
    assert not os.path.exists(f"/dev/shm/{before[0]}"), "the exited program's arena file is still there"


def _unshare_or_skip() -> None:
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        reason = probe.stderr.strip() if probe else "no unshare binary"
        pytest.skip(f"cannot start a process in a new pid namespace here: {reason}")


def _in_new_pid_namespace(*args: str) -> tuple[Proc, int]:
    """``crescent store`` as pid 1 of a fresh pid namespace, as the entrypoint of a container is;
    returns the ``unshare`` process and the node's pid as this namespace sees it."""
    p = Proc(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "kvstore.cli", "store",
              "--listen", "127.0.0.1:0", *args], "listening on")
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        [node_pid] = [int(x) for x in f.read().split()]
    return p, node_pid


def test_a_restarted_container_reaps_its_killed_node_arena_though_the_new_node_has_the_same_pid():
    """A store container killed (OOM, liveness probe) and restarted in its pod: the new node is pid 1
    again, and the dead one's arena file, ``crescent-1-*``, still fills the pod's memory-backed
    /dev/shm. A pid check took it for the new node's own and kept it; every restart then held one
    more arena, until /dev/shm or the pod's memory limit ran out."""
    _unshare_or_skip()
    before = set(_segments(1))
    first, node_pid = _in_new_pid_namespace("--dram", "1MiB")
    try:
        [dead_seg] = set(_segments(1)) - before
        os.kill(node_pid, signal.SIGKILL)
        first.proc.wait(timeout=60)  # unshare ends once its child has ended and been reaped
    finally:
        first.stop()
    assert os.path.exists(f"/dev/shm/{dead_seg}"), "kill -9 ran no cleanup: the file must still be there"
    second, node_pid = _in_new_pid_namespace("--dram", "1MiB")
    try:
        address = re.search(r"listening on ([^\s,]+)", second.line).group(1)
        assert not os.path.exists(f"/dev/shm/{dead_seg}"), "the restarted node kept the killed node's arena"
        assert len(set(_segments(1)) - before) == 1
        c = StoreClient(address)
        c.put(b"k", b"v" * 1000)
        assert c.get(b"k") == b"v" * 1000
        c.close()
        os.kill(node_pid, signal.SIGTERM)  # pid 1 of its namespace: it has a handler, so this reaches it
        assert second.proc.wait(timeout=60) == 0
    finally:
        second.stop()
    assert not set(_segments(1)) - before, "a node stopped cleanly leaves no arena file"


def test_sigterm_drains_then_a_second_sigterm_stops():
    """``--drain-s``: after SIGTERM the node says serving=false and still serves; a second
    SIGTERM ends the drain early and the process exits cleanly."""
    from kvstore.errors import UnavailableError
    from tests.helpers import wait_for

    proc = StoreProcess("--dram", "8MiB", "--drain-s", "600")
    c = StoreClient(proc.address, transport="tcp")
    try:
        c.put(b"k", b"v")
        assert c.health()["serving"] is True
        os.kill(proc.pid, signal.SIGTERM)
        wait_for(lambda: c.health()["serving"] is False, what="serving=false after SIGTERM")
        assert c.get(b"k") == b"v"  # draining: still served
        assert proc.proc.poll() is None
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.proc.wait(timeout=120) == 0
        try:
            c.health()
            raise AssertionError("a stopped node answered")
        except UnavailableError:
            pass
    finally:
        c.close()
        proc.stop()


def _nofile(soft: int, hard: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    return int(line.split()[3]), int(line.split()[4])


def test_a_node_raises_its_descriptor_limit_and_accepts_again_once_descriptors_free(tmp_path):
    """Started with a soft limit of 200 and a hard one of 4096, the node takes 4096 (a soft limit of
    1024, services' default, ran a node out at a few hundred clients). Then, at a hard limit of 120,
    clients exhaust its descriptors: once they close, the data channel takes new clients again.
    Before, its accept loop ended at the first EMFILE, and no data-channel client got in for the
    node's life (while its gRPC port still answered)."""
    import time

    from kvstore.client import Retry
    from proto.crescent.v1 import kvstore_pb2 as pb

    def node(soft, hard):
        p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0", "--dram", "16MiB"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=_nofile(soft, hard))
        line = p.stdout.readline()
        assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
        return p, re.search(r"listening on ([^\s,]+)", line).group(1)

    from kvstore.procs import stop_process

    p, _ = node(200, 4096)
    try:
        assert _limits(p.pid) == (4096, 4096)
    finally:
        stop_process(p, 60)
    p, address = node(120, 120)
    socks = []
    try:
        with StoreClient(address, transport="tcp") as c:
            c.put(b"before", b"x" * 1000)
            port = c._stub.Health(pb.HealthRequest(), timeout=30).data_port
        for _ in range(200):  # more than the node can take: the kernel queues what it cannot accept
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        deadline = time.monotonic() + 60
        while len(os.listdir(f"/proc/{p.pid}/fd")) < 118 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{p.pid}/fd")) >= 118  # out of descriptors
        for s in socks:
            s.close()
        socks.clear()
        with StoreClient(address, transport="tcp", timeout_s=30, retry=Retry(attempts=3)) as c:
            c.put(b"after", b"y" * 1000)
            assert c.transport == "tcp" and c.get(b"after") == b"y" * 1000 and c.get(b"before") == b"x" * 1000
    finally:
        for s in socks:
            s.close()
        stop_process(p, 60)
