"""Processes: children are stopped by their own pid (SIGTERM first, SIGKILL when it does not end);
a server's main thread waits for its own SIGTERM/SIGINT in a way that always sees them."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Callable

_SLICE_S = 0.2
"""How long a main thread's wait lasts before it runs bytecode again (and with it any signal handler)."""

HTTP_POLL_S = 0.05
"""How often an HTTP server's loop (``serve_forever``) looks for a stop. ``socketserver``'s default,
0.5 s, is how long ``shutdown()`` waited: each HTTP listener made its process stop ~0.5 s later."""
HTTP_IDLE_S = 60.0
"""How long the metrics and console listeners wait on a silent client (for its request, or for it to
read the answer) before closing its connection: without it, each such connection held a thread for good."""


FD_LIMIT = 1 << 20
"""The most open descriptors a Crescent process asks for (``raise_fd_limit``)."""


def raise_fd_limit() -> int:
    """Raises this process's soft limit on open descriptors to its hard limit (at most ``FD_LIMIT``), as
    servers do: every client connection takes one (a data-channel connection, a gRPC connection), and
    1024, the soft limit services get by default (systemd without ``LimitNOFILE``, many shells), ran a
    node out of them at a few hundred clients. Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


class QuietDrops:
    """A ``socketserver`` mixin: a client gone (reset, broken pipe) or silent past its handler's timeout
    is no news; any other error of a connection is still reported as ``socketserver`` does (a traceback
    on stderr)."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def say(text: str) -> None:
    """Prints a server's status line; a stdout that went away (a closed pipe, a gone terminal) is
    no reason to skip its graceful stop."""
    try:
        print(text, flush=True)
    except OSError:  # BrokenPipeError
        pass


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """Asks ``proc`` to stop (SIGTERM), kills it after ``grace_s``; returns its exit status."""
    return stop_processes([proc], grace_s)[0]


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0) -> list[int]:
    """Asks every process of ``procs`` to stop (SIGTERM) at once, kills those still running
    ``grace_s`` later; returns their exit statuses. They drain side by side, not one after another."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return [proc.returncode for proc in procs]


def wait_in_slices(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)`` for a process's main thread, in slices of ``_SLICE_S``.

    The kernel hands a signal sent to a process to any one of its threads, and passes the main
    thread over when that one already has a signal pending (as it has right after a SIGCONT). gRPC's
    threads then take SIGTERM; CPython's C handler only flags it, and the Python handler runs once
    the main thread executes bytecode again. In an untimed wait that is never: the process ignores
    SIGTERM until it is killed. Waiting in slices runs the handler within ``_SLICE_S``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return event.is_set()
        if event.wait(left):
            return True


class StopSignals:
    """SIGTERM and SIGINT ask a server to stop: install before printing the banner, then ``wait()``.

    ``on_again`` runs on every signal after the first (a store node: cut its drain short).
    """

    def __init__(self, on_again: Callable[[], None] | None = None) -> None:
        self.event = threading.Event()
        self._on_again = on_again
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_) -> None:
        if self.event.is_set() and self._on_again is not None:
            self._on_again()
        self.event.set()

    def wait(self) -> None:
        wait_in_slices(self.event)


def port_for_child(host: str = "127.0.0.1") -> int:
    """A free port for a child process that cannot bind port 0 and say which it got (etcd, vLLM's
    ZeroMQ endpoints): one below the kernel's ephemeral range, so no outgoing connection and no
    port-0 bind on the machine can take it before the child binds it. Only an explicit bind of the
    same number can; a caller that sees its child fail to bind picks again."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    below = range(10000, low)
    for port in random.sample(below, min(200, len(below))):
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(family) as s:  # everything below the range busy: any free port
        s.bind((host, 0))
        return s.getsockname()[1]
