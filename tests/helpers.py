"""Test helpers: store nodes in-process or as real processes, always stopped by pid."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvstore.procs import stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def store_nodes(tmp_path, with_disk: bool, **defaults):
    """Yields ``make(**config)`` starting in-process store nodes on 127.0.0.1:0; stops them all after.

    A node has 16 MiB of DRAM unless told otherwise, and a 64 MiB disk tier under
    ``tmp_path`` when ``with_disk`` (overridable per call with ``with_disk=``).
    """
    from kvstore.config import StoreConfig
    from kvstore.server import StoreNode

    nodes = []

    def make(**kw):
        kw = {"listen": "127.0.0.1:0", "dram": 16 * MiB, **defaults, **kw}
        if kw.pop("with_disk", with_disk):
            kw.setdefault("disk", str(tmp_path / f"disk{len(nodes)}"))
            kw.setdefault("disk_size", 64 * MiB)
        node = StoreNode(StoreConfig(**kw)).start()
        nodes.append(node)
        return node

    try:
        yield make
    finally:  # also when a test closes the generator itself (gen.close() raises GeneratorExit here)
        for n in nodes:
            n.stop(grace=0)


def fragment_arena(address: str, values: int) -> None:
    """Puts ``values`` small values in a node and deletes every other one: its free list then
    starts with holes of one slot, and a larger value put next gets slots with gaps between them."""
    from kvstore.client import StoreClient

    with StoreClient(address) as c:
        fill = [b"fill%d" % i for i in range(values)]
        c.batch_put([(k, b"x" * 100) for k in fill])
        c.delete(fill[::2])


def run_in_own_session(cmd: list[str], timeout_s: float = 900) -> tuple[int, str]:
    """Runs ``cmd`` in ``ROOT`` in a session of its own: ``(exit status, stdout and stderr)``. On a
    timeout it and every process it started (a bench's cluster) are ended together, by its pid."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    return proc.returncode, out


def wait_for(cond, timeout_s: float = 60.0, interval_s: float = 0.05, what: str = "condition"):
    """Polls ``cond`` until truthy; generous deadline for a loaded 2-core machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


def _threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/TID/stat)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise AssertionError(f"process {pid} is gone") from None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            continue  # the thread ended
        if state != "T":
            return False
    return True


def freeze(pid: int) -> None:
    """SIGSTOPs ``pid`` and returns once every one of its threads has stopped.

    ``kill`` returns before the stop is complete: the kernel wakes one thread, and that one stops
    the others when it next runs. On a loaded machine the rest (a gRPC poller) can meanwhile answer
    a call sent right after ``kill`` returned, which a test of a silent peer must not see.
    """
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: _threads_stopped(pid), what=f"every thread of {pid} to stop", interval_s=0.01)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def arena_fds() -> list[str]:
    """This process's open descriptors of nodes' shm arena files (a removed one ends in "(deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/crescent-"):
            out.append(target)
    return out


def waiting_on_a_socket(tid: int) -> bool:
    """Whether thread ``tid`` of this process sleeps in the kernel waiting on a socket (a poll, or a
    recv/send that blocks), not on a lock."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            wchan = f.read()
    except FileNotFoundError:
        return False
    return any(w in wchan for w in ("poll", "wait_woken", "sk_wait", "sock_"))


class Frozen:
    """``with Frozen(pid):`` the process is stopped (all its threads) inside the block, running after."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self):
        freeze(self.pid)
        return self

    def __exit__(self, *exc):
        thaw(self.pid)


class Proc:
    """A subprocess whose first stdout line is its banner; ``stop`` ends it by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, cmd: list[str], banner: str) -> None:
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.line = self.proc.stdout.readline()
        if banner not in self.line:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"{cmd[3:5]} did not start: {self.line!r} {err!r}")

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> int:
        rc = stop_process(self.proc, 60)
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return rc


class StoreProcess(Proc):
    """``crescent store`` as a real subprocess on 127.0.0.1:0; the address is read from its banner."""

    def __init__(self, *args: str, host_id: str | None = None, top: list[str] | tuple = ()) -> None:
        top = (["--host-id", host_id] if host_id else []) + list(top)
        super().__init__([sys.executable, "-m", "kvstore.cli", *top, "store", "--listen", "127.0.0.1:0", *args],
                         "listening on")
        self.address = re.search(r"listening on ([^\s,]+)", self.line).group(1)


class EtcdProcess:
    """``kvstore.coord.LocalEtcd`` for tests: skips, with the reason, when the binary is missing
    (``make test`` installs it); under CI that is a failure instead, so a broken install cannot land green."""

    def __init__(self, data_dir: str, tls: bool = False, ports: tuple[int, int] | None = None) -> None:
        import pytest

        from kvstore.coord import LocalEtcd

        try:
            self._etcd = LocalEtcd(data_dir, tls=tls, ports=ports)
        except FileNotFoundError as exc:
            msg = f"{exc}; `make test` installs it"
            if os.environ.get("CI") == "true":
                pytest.fail(msg)
            pytest.skip(msg)
        self.endpoint = self._etcd.endpoint
        self.ports = self._etcd.ports
        self.pid = self._etcd.pid

    def stop(self) -> None:
        self._etcd.stop()


def venv_python(name: str) -> str:
    """The python of an integration's own venv, ``.venv-NAME`` (``make setup-NAME``)."""
    return os.path.join(ROOT, f".venv-{name}", "bin", "python")


def require_venv(name: str) -> str:
    """``venv_python(name)``; skips the test when that venv is missing or its install failed (with the
    reason ``make setup-NAME`` left in ``.venv-NAME/.unavailable``). Under CI that is a failure instead."""
    python = venv_python(name)
    marker = os.path.join(ROOT, f".venv-{name}", ".unavailable")
    reason = None
    if os.path.exists(marker):
        with open(marker) as f:
            reason = f.read().strip()
    elif not os.path.exists(python):
        reason = f"no {name} venv at .venv-{name} (create it with `make setup-{name}`)"
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"under CI the {name} integration must run: {reason}")
    if reason:
        pytest.skip(reason)
    return python


def run_json_script(python: str, script: str, args: list[str], out: str, log: str, *, env: dict | None = None,
                    timeout_s: float = 600) -> dict:
    """Runs ``python script *args out`` (an integration's driver, in its own venv), its output to ``log``;
    returns the JSON it wrote to ``out`` plus ``"log"``: the output. Fails the test with the log's tail
    when it exits non-zero."""
    with open(log, "w") as logf:
        rc = subprocess.run([python, script, *args, out], cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            timeout=timeout_s, check=False).returncode
    with open(log) as f:
        text = f.read()
    if rc != 0:
        pytest.fail(f"{os.path.basename(script)} {' '.join(args)} exited with {rc}; log tail:\n{text[-6000:]}")
    with open(out) as f:
        return {**json.load(f), "log": text}


@contextlib.contextmanager
def conductor_and_nodes(node_ids=("a", "b"), dram: str = "16MiB"):
    """An in-process conductor (heartbeat 0.2 s) and store nodes registered with it:
    ``(conductor, nodes)``; all stopped on exit."""
    from kvstore.conductor.client import ConductorClient
    from kvstore.conductor.config import ConductorConfig
    from kvstore.conductor.service import Conductor
    from kvstore.config import StoreConfig
    from kvstore.server import StoreNode

    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.2)).start()
    nodes = []
    try:
        for n in node_ids:
            nodes.append(StoreNode(StoreConfig(listen="127.0.0.1:0", node_id=n, conductor=conductor.address,
                                               dram=dram)).start())
        with ConductorClient(conductor.address) as cc:
            wait_for(lambda: len(cc.members()) == len(nodes), what=f"{len(nodes)} store nodes registered")
        yield conductor, nodes
    finally:
        for n in nodes:
            n.stop(grace=0)
        conductor.stop(0)


@contextlib.contextmanager
def restored_env(*names: str):
    """Puts the environment variables ``names`` back as they were on exit (process-wide settings
    such as TLS and tokens live there)."""
    saved = {n: os.environ.get(n) for n in names}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v

