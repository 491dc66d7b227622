"""Every server stops on SIGTERM whichever of its threads the kernel hands the signal to.

A signal sent to a process goes to one of its threads, and Linux passes the main thread over when
that one has a signal pending already (right after a SIGCONT, for one). Here the signal is sent to
one chosen gRPC/worker thread with tgkill(2), so the case is made every time, not by chance: a main
thread parked in an untimed wait never ran the handler and the process ignored SIGTERM until killed.
"""

import ctypes
import os
import signal
import sys

import pytest

from kvstore.client import StoreClient
from tests.helpers import Proc, StoreProcess, wait_for

_libc = ctypes.CDLL(None, use_errno=True)


def _blocks(tid_status: str, sig: int) -> bool:
    for line in tid_status.splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def signal_a_side_thread(pid: int, sig: int = signal.SIGTERM) -> int:
    """Sends ``sig`` to one thread of ``pid`` other than its main thread (one that does not block
    it); returns that thread's id."""
    for name in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        tid = int(name)
        if tid == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if _blocks(status, sig):
            continue
        if _libc.tgkill(pid, tid, sig) == 0:
            return tid
    raise AssertionError(f"pid {pid} has no thread besides its main one that takes signal {sig}")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli", *args]


SERVERS = {
    "store": (_cli("store", "--listen", "127.0.0.1:0", "--dram", "8MiB"), "listening on", "crescent store: stopping"),
    "conductor": (_cli("conductor", "--listen", "127.0.0.1:0"), "listening on", "crescent conductor: stopping"),
    "engine": (_cli("engine", "both", "--listen", "127.0.0.1:0", "--model", "random:tiny"), "listening on",
               "crescent engine both: stopping"),
    "gateway": (_cli("gateway", "--listen", "127.0.0.1:0", "--decode", "127.0.0.1:1"), "serving",
                "crescent gateway: stopping"),
}


@pytest.mark.parametrize("server", list(SERVERS))
def test_sigterm_taken_by_a_side_thread_stops_the_server(server):
    cmd, banner, stopping = SERVERS[server]
    p = Proc(cmd, banner)
    try:
        signal_a_side_thread(p.pid)
        assert p.proc.wait(timeout=120) == 0, p.proc.stderr.read()[-2000:]
        assert stopping in p.proc.stdout.read()
        err = p.proc.stderr.read()
        assert "leaked" not in err and "Traceback" not in err, err[-2000:]  # a clean stop says nothing more
    finally:
        p.stop()


def test_a_second_sigterm_taken_by_a_side_thread_ends_the_drain():
    p = StoreProcess("--dram", "8MiB", "--drain-s", "600")
    c = StoreClient(p.address, transport="tcp")
    try:
        os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: c.health()["serving"] is False, what="serving=false after SIGTERM")
        assert p.proc.poll() is None  # draining
        signal_a_side_thread(p.pid)
        assert p.proc.wait(timeout=120) == 0, p.proc.stderr.read()[-2000:]
    finally:
        c.close()
        p.stop()


def _generate(address: str, max_tokens: int):
    import grpc

    from proto.crescent.v1 import engine_pb2 as pb
    from proto.crescent.v1 import engine_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingOptions(max_tokens=max_tokens,
                                                                                       ignore_eos=True))
    return channel, pb_grpc.EngineStub(channel).Generate(req, timeout=600)


def _engine(*args: str) -> Proc:
    return Proc(_cli("engine", "decode", "--listen", "127.0.0.1:0", "--model", "random:tiny",
                     "--kv-cache-memory", "64MiB", *args), "listening on")


def _refused(address: str) -> bool:
    import grpc

    channel, stream = _generate(address, 1)
    try:
        list(stream)
        return False
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()


def test_sigterm_lets_an_engines_stream_in_flight_finish_and_refuses_new_calls():
    """A rolling restart of an engine: SIGTERM mid-generation, the stream still gets all 6,000 tokens
    (~10 s here) while new calls are refused (UNAVAILABLE, so that a caller goes elsewhere), then the
    process exits 0. Before, the calls in flight got 2 s and were cancelled."""
    p = _engine("--shutdown-grace", "300")
    address = p.line.split("listening on ")[1].split(",")[0].strip()
    channel, stream = _generate(address, 6000)
    try:
        got = len(next(stream).token_ids)
        os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: _refused(address), what="new calls refused while draining")
        got += sum(len(r.token_ids) for r in stream)
        assert got == 6000
        assert p.proc.wait(timeout=120) == 0, p.proc.stderr.read()[-2000:]
        assert "the calls in flight get up to 300 s" in p.proc.stdout.read()
    finally:
        channel.close()
        p.stop()


def test_a_second_sigterm_ends_an_engines_drain():
    import grpc

    p = _engine("--shutdown-grace", "600")
    address = p.line.split("listening on ")[1].split(",")[0].strip()
    channel, stream = _generate(address, 8000)
    try:
        next(stream)
        os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: _refused(address), what="new calls refused while draining")
        signal_a_side_thread(p.pid)
        with pytest.raises(grpc.RpcError):
            for _ in stream:  # cut short: cancelled (or the connection gone), not 8,000 tokens
                pass
        assert p.proc.wait(timeout=120) == 0, p.proc.stderr.read()[-2000:]
    finally:
        channel.close()
        p.stop()
