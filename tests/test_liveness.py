"""A peer that goes silent (here: a real process frozen with SIGSTOP, whose kernel still holds its
sockets open, so nothing is refused or reset) fails calls with UNAVAILABLE within the keepalive
figures, not at the call's deadline; a conductor client moves on to the next replica; a thawed
peer is used again. (Cut links between hosts: tests/cluster/test_partitions.py.)"""

import os
import subprocess
import sys
import threading

import pytest

from kvstore import liveness
from kvstore.client import StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.errors import FailedPreconditionError, UnavailableError
from tests.conductor.procs import ConductorProcess
from tests.helpers import ROOT, Frozen, StoreProcess, waiting_on_a_socket, wait_for

DEADLINE_S = 600.0
"""Far beyond the keepalive figures: a call that waited for it would make the test run for minutes."""


def test_a_frozen_store_node_fails_calls_as_unavailable_not_at_the_deadline():
    node = StoreProcess("--dram", "16MiB")
    try:
        with StoreClient(node.address, timeout_s=DEADLINE_S, data_channel=False) as c:
            c.put(b"k", b"v")
            with Frozen(node.pid):
                with pytest.raises(UnavailableError):
                    c.exists([b"k"])
            assert c.exists([b"k"]) == [True]  # thawed: the client reconnects
    finally:
        node.stop()


def _call_in_thread(c: StoreClient, call: str, nbytes: int) -> tuple[threading.Thread, list]:
    """A started thread that gets ``k`` or puts ``nbytes`` under ``k2``; its result or error lands in the list."""
    out = []

    def caller():
        try:
            out.append(c.get(b"k") if call == "get" else c.put(b"k2", b"w" * nbytes))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=caller)
    t.start()
    return t, out


@pytest.mark.parametrize("call", ["get", "put"])
def test_a_data_channel_call_to_a_frozen_node_ends_at_the_clients_deadline(call):
    """Over the TCP data channel a frozen node's kernel still takes the request and acknowledges it,
    so no keepalive notices anything: the call ends at the client's ``timeout_s`` (here 2 s, one
    attempt), as UNAVAILABLE. Before, the data channel's sockets waited 60 s whatever the client's
    deadline, twice (the call reconnects once), and again under each retry."""
    from kvstore.client import Retry

    node = StoreProcess("--dram", "16MiB")
    try:
        c = StoreClient(node.address, transport="tcp", timeout_s=2.0, retry=Retry(attempts=1))
        c.put(b"k", b"v")
        with Frozen(node.pid):
            t, out = _call_in_thread(c, call, 1000)
            t.join(timeout=60)
            assert not t.is_alive(), f"the {call} still waits for the frozen node past its deadline"
        assert len(out) == 1 and isinstance(out[0], UnavailableError), out
        assert c.get(b"k") == b"v"  # thawed: the client reconnects
        c.close()
    finally:
        node.stop()


@pytest.mark.parametrize("transport,call", [("tcp", "get"), ("tcp", "put"), ("shm", "put")])
def test_close_ends_a_call_that_waits_on_a_frozen_node(transport, call):
    """A thread waits in a call for a node that says nothing; another thread closes the client. The
    call fails as FailedPreconditionError, well before its deadline. Before, the tcp data channel's
    socket was closed under the blocked recv, which does not wake it: the call waited out its
    deadline (here 10 minutes; 60 s by default), and the socket's number, free again, could be
    reused by a new connection that the recv would then read. An shm session's close waited for
    its calls' grants with no limit. (Over gRPC, closing the channel cancels the call: already so.)"""
    node = StoreProcess("--dram", "16MiB")
    try:
        c = StoreClient(node.address, transport=transport, timeout_s=DEADLINE_S)
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"
        with Frozen(node.pid):
            t, out = _call_in_thread(c, call, 100_000)
            wait_for(lambda: waiting_on_a_socket(t.native_id), what=f"the {call} to wait for the node")
            c.close()  # (an shm session first gives its calls CLOSE_WAIT_S to finish)
            t.join(timeout=120)
            assert not t.is_alive(), f"the {call} still waits for the frozen node after close()"
        assert len(out) == 1 and isinstance(out[0], FailedPreconditionError), out
        assert "closed" in str(out[0])
    finally:
        node.stop()


def test_closing_an_shm_client_of_a_frozen_node_waits_once_not_once_per_thread(monkeypatch):
    """Eight threads read through one shm client from a frozen node: the reads are local (known
    descriptors), and each thread's connection sends its REPORT of them without waiting. close() then
    waits for the node's answers CLOSE_WAIT_S (5 s) in all, where it waited 5 s per connection (40 s)."""
    import time

    from kvstore.transport import session

    monkeypatch.setattr(session, "REPORT_EVERY_S", 0.0)  # each read reports
    node = StoreProcess("--dram", "16MiB")
    try:
        c = StoreClient(node.address, transport="shm", timeout_s=DEADLINE_S)
        c.put(b"k", b"v")
        barrier = threading.Barrier(9)
        got = []

        def reader():
            assert c.get(b"k") == b"v"  # (its grant, on the live node, leaves the key's descriptor known)
            c.descriptor_session().settle()
            barrier.wait(timeout=120)  # the node freezes
            barrier.wait(timeout=120)
            got.append(c.get(b"k"))  # local, its REPORT unanswered

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        barrier.wait(timeout=120)
        with Frozen(node.pid):
            barrier.wait(timeout=120)
            for t in threads:
                t.join(timeout=120)
            assert got == [b"v"] * 8
            started = time.monotonic()
            c.close()
            took = time.monotonic() - started
        assert took < 30, f"close() took {took:.1f} s"  # one 5 s wait; eight of them took 40 s
    finally:
        node.stop()


def test_a_conductor_client_skips_a_frozen_replica():
    frozen, live = ConductorProcess(), ConductorProcess()
    try:
        with ConductorClient(f"{frozen.address},{live.address}", timeout_s=DEADLINE_S) as c:
            assert c.members() == [] and c.address == frozen.address
            with Frozen(frozen.pid):
                assert c.stats()["num_members"] == 0
                assert c.address == live.address
    finally:
        frozen.stop()
        live.stop()


def test_options_let_servers_accept_the_clients_pings():
    client = dict(liveness.channel_options(1 << 20))
    server = dict(liveness.server_options(1 << 20))
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.http2.max_pings_without_data"] == 0  # pings go on during a long silent call
    assert client["grpc.http2.ping_timeout_ms"] == client["grpc.keepalive_timeout_ms"]  # not 60 s
    assert client["grpc.max_receive_message_length"] == server["grpc.max_send_message_length"] == 1 << 20


@pytest.mark.parametrize("value", ["soon", "0", "-1", "1e9"])
def test_a_bad_keepalive_setting_is_a_warning_and_the_default(value):
    r = subprocess.run([sys.executable, "-c", "from kvstore import liveness; print(liveness.KEEPALIVE_TIME_S)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CRESCENT_KEEPALIVE_TIME_S": value})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2.0"
    assert "CRESCENT_KEEPALIVE_TIME_S" in r.stderr and "ignored" in r.stderr
