"""A long-lived client outlives its node: restarts under a client on every transport and
under an engine serving requests, and the client's Retry policy and deadlines against a
real gRPC server that fails on purpose."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from kvstore.client import Retry, StoreClient
from kvstore.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from kvstore.transport.rdma import probe
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import StoreProcess, arena_fds, wait_for

# a short policy for the calls made while the node is down (the default's sleeps add up to ~1.5 s)
FAST = Retry(attempts=3, backoff_s=0.02, max_backoff_s=0.1)


@pytest.fixture
def nodes():
    """Starts ``crescent store`` processes (stopped by pid after the test)."""
    procs = []

    def start(*args):
        p = StoreProcess("--dram", "8MiB", "--transport", "auto", *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def _recovered(call):
    """call()'s result once it stops failing with UnavailableError (the client's gRPC channel
    may still be backing off its reconnects when the node returns); fails after 60 s."""
    box = []

    def attempt():
        try:
            box.append(call())
            return True
        except UnavailableError:
            return False

    wait_for(attempt, what="the client to reach the restarted node")
    return box[0]


def _restart(nodes, old, how: str):
    port = old.address.rpartition(":")[2]
    (old.kill9 if how == "kill9" else old.stop)()
    return nodes("--listen", f"127.0.0.1:{port}")


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm", "rdma"])
def test_client_follows_its_node_through_a_restart(nodes, transport, how):
    if transport == "rdma" and (reason := probe()) is not None:
        pytest.skip(f"rdma: {reason}")
    node = nodes()
    c = StoreClient(node.address, transport=transport, retry=FAST, timeout_s=30)
    assert c.transport == transport
    values = {f"k{i}".encode(): bytes([i]) * (70_000 + i) for i in range(4)}  # two slots each
    c.batch_put(list(values.items()))
    assert c.batch_get(list(values)) == list(values.values())
    c.health()
    old_token = c._limits.data_token
    port = node.address.rpartition(":")[2]
    (node.kill9 if how == "kill9" else node.stop)()
    if transport == "shm" and how == "kill9":
        # local reads: the dead node's arena file stays until a new node reaps it, and the
        # values this client saw there are read from it without a call (they cannot change)
        assert c.batch_get(list(values)) == list(values.values())
    else:
        with pytest.raises(UnavailableError):  # down: a clear error once the retries are spent, no hang
            c.batch_get(list(values))
    node = nodes("--listen", f"127.0.0.1:{port}")
    # DRAM is volatile: the restarted node is empty, and says so through the same client
    assert _recovered(lambda: c.batch_get(list(values))) == [None] * len(values)
    c.batch_put(list(values.items()))
    assert c.batch_get(list(values)) == list(values.values())
    bufs = [bytearray(80_000) for _ in values]
    assert c.batch_get_into(list(values), bufs) == [len(v) for v in values.values()]
    assert [bytes(b[: len(v)]) for b, v in zip(bufs, values.values())] == list(values.values())
    assert c.transport == transport
    if transport != "grpc":  # the data channel (bytes, or the grant calls) follows the new node
        assert c._limits.data_token != old_token
    stats = c.stats()
    assert stats["tiers"]["dram"]["num_entries"] == len(values)
    c.close()


def test_a_tcp_client_survives_many_restarts_and_a_node_without_a_data_channel(nodes):
    node = nodes()
    c = StoreClient(node.address, transport="tcp", retry=FAST, timeout_s=30)
    for i in range(3):
        c.put(b"k", b"v%d" % i)
        assert c.get(b"k") == b"v%d" % i
        node = _restart(nodes, node, "kill9" if i % 2 else "sigterm")
        assert _recovered(lambda: c.get(b"k")) is None
    # the node comes back with no data channel at all: values then travel in gRPC frames
    port = node.address.rpartition(":")[2]
    node.stop()
    nodes("--listen", f"127.0.0.1:{port}", "--data-port", "-1")
    _recovered(lambda: c.put(b"k", b"framed"))
    assert c.get(b"k") == b"framed"
    assert c.transport == "grpc" and c._limits.data_port == 0
    c.close()


def test_threads_that_first_use_an_shm_client_together_share_one_mapping_and_close_leaves_none(nodes):
    """Eight threads make their first call through one new shm client at once. Before, each that
    found no transport chosen yet chose one: eight mappings of the arena, seven of them never
    closed (a file descriptor and the node's whole arena mapped each, for the client's life)."""
    node = nodes()
    before = arena_fds()
    with StoreClient(node.address, transport="shm") as one:  # what one thread's client holds
        one.put(b"k", b"v")
        mapped = len(arena_fds()) - len(before)
    assert mapped >= 1 and arena_fds() == before
    c = StoreClient(node.address, transport="shm")
    barrier = threading.Barrier(8)
    sessions = []

    def first_call(i):
        barrier.wait(timeout=60)
        c.put(b"k%d" % i, b"v")
        sessions.append(c.descriptor_session())

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(sessions) == 8 and len({id(s) for s in sessions}) == 1
    assert len(arena_fds()) == len(before) + mapped  # one mapping's
    c.close()
    assert arena_fds() == before


def test_a_node_gone_while_its_arena_is_mapped_leaves_no_mapping(nodes):
    """select() maps the node's arena, then reads its data port (Health) for the grant channel. A node
    that goes away between the two (here: the Health call fails as it then does) left the mapping open for
    good; found by four threads putting through a client whose node restarted eight times (one or two
    arenas mapped after close())."""
    from kvstore.errors import UnavailableError as Gone
    from kvstore.transport.session import select

    node = nodes()
    before = arena_fds()
    with StoreClient(node.address, transport="shm") as c:
        def gone():
            raise Gone("Health: the node went away")

        with pytest.raises(Gone):
            select(c._stub, c._call, 30, "shm", gone)
        assert arena_fds() == before


def test_a_client_closed_while_a_call_remaps_a_restarted_node_leaves_no_mapping(nodes):
    """A put finds the node restarted (a new arena) and maps the new one; close() runs meanwhile. The
    close retired the handle it found, so the new mapping, put in place after it, stayed open for
    good. Now the put sees the close, unmaps what it mapped and fails as FailedPreconditionError."""
    import threading as th

    from kvstore.errors import FailedPreconditionError

    node = nodes()
    port = node.address.rpartition(":")[2]
    before = arena_fds()
    c = StoreClient(node.address, transport="shm", retry=FAST, timeout_s=30)
    c.put(b"k", b"v")
    session = c.descriptor_session()
    node.stop()
    nodes("--listen", f"127.0.0.1:{port}")
    reached, go, out = th.Event(), th.Event(), []
    real = session._channel

    def paused_channel():  # the remap's grant channel: held here while the client closes
        reached.set()
        go.wait(120)
        return real()

    session._channel = paused_channel

    def put():
        try:
            out.append(c.put(b"k2", b"w" * 10_000))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)

    t = th.Thread(target=put)
    t.start()
    assert reached.wait(120), "the put did not remap"
    c.close()
    go.set()
    t.join(120)
    assert not t.is_alive() and isinstance(out[0], FailedPreconditionError), out
    assert arena_fds() == before


def test_an_engine_keeps_reusing_the_store_after_it_restarts(nodes):
    """An engine whose store goes away under it recomputes (same tokens) while the store is
    down or empty, then saves and reuses chunks again through the same client."""
    from engine.llm import LLM

    node = nodes()
    prompt = [(i * 37 + 11) % 500 + 3 for i in range(100)]  # 3 full chunks of 32 tokens, 4 recomputed
    with LLM(model="random:tiny", store=node.address, chunk_tokens=32, store_transport="tcp",
             enable_prefix_caching=False) as llm:
        client = llm.engine.connector.client
        client.retry = FAST
        assert client.transport == "tcp"

        def run():
            out = llm.generate(prompt, max_tokens=6)[0]
            return out.token_ids, out.num_cached_tokens

        want, cached = run()
        assert cached == 0
        assert run() == (want, 96)
        port = node.address.rpartition(":")[2]
        node.kill9()
        errors = llm.engine.connector.stats.store_errors
        assert run() == (want, 0)  # the store is down: recomputed
        assert llm.engine.connector.stats.store_errors > errors
        nodes("--listen", f"127.0.0.1:{port}")
        _recovered(client.health)
        assert run() == (want, 0)  # empty store: recomputed, and saved again
        assert run() == (want, 96), "the engine no longer reuses the restarted store"
        assert client.transport == "tcp"


# ---- Retry and deadlines, against a real gRPC server that fails on purpose -------------


class _Failing(pb_grpc.KVStoreServicer):
    """A KVStore whose Lookup fails ``fail`` times with ``code``, then answers; Stats blocks
    until released (for deadlines)."""

    def __init__(self, code: grpc.StatusCode, fail: int) -> None:
        self.code, self.fail, self.calls = code, fail, 0
        self.release = threading.Event()

    def Lookup(self, request, context):
        self.calls += 1
        if self.calls <= self.fail:
            context.abort(self.code, f"planned failure {self.calls}")
        return pb.LookupResponse(num_prefix=len(request.keys))

    def Stats(self, request, context):
        self.release.wait(60)
        return pb.StatsResponse(node_id="slow")


@pytest.fixture
def failing():
    servers = []

    def start(code=grpc.StatusCode.UNAVAILABLE, fail=0):
        svc = _Failing(code, fail)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KVStoreServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, svc))
        return f"127.0.0.1:{port}", svc

    yield start
    for server, svc in servers:
        svc.release.set()
        server.stop(0).wait()


def test_retry_rides_out_transient_unavailable(failing):
    addr, svc = failing(grpc.StatusCode.UNAVAILABLE, fail=2)
    with StoreClient(addr, transport="grpc", retry=Retry(attempts=3, backoff_s=0.01)) as c:
        assert c.lookup([b"a", b"b"]) == 2
    assert svc.calls == 3


def test_a_call_the_server_cancels_is_retried_like_an_unavailable_one(failing):
    """A node that stops mid-call resets its calls: the client sees CANCELLED, which it did not ask
    for. Retried like UNAVAILABLE (seen as a bare CrescentError under a node restarting under load,
    and not retried before); the client's own close still answers FailedPreconditionError."""
    addr, svc = failing(grpc.StatusCode.CANCELLED, fail=2)
    with StoreClient(addr, transport="grpc", retry=Retry(attempts=3, backoff_s=0.01)) as c:
        assert c.lookup([b"a", b"b"]) == 2
    assert svc.calls == 3
    addr, svc = failing(grpc.StatusCode.CANCELLED, fail=10)
    with StoreClient(addr, transport="grpc", retry=Retry(attempts=2, backoff_s=0.01)) as c:
        with pytest.raises(UnavailableError, match="CANCELLED by the server: planned failure 2"):
            c.lookup([b"a"])


def test_retry_gives_up_after_its_attempts(failing):
    addr, svc = failing(grpc.StatusCode.UNAVAILABLE, fail=10)
    with StoreClient(addr, transport="grpc", retry=Retry(attempts=4, backoff_s=0.01)) as c:
        with pytest.raises(UnavailableError, match="planned failure 4"):
            c.lookup([b"a"])
    assert svc.calls == 4


@pytest.mark.parametrize("code, exc", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
                                       (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError)])
def test_no_retry_for_other_errors(failing, code, exc):
    addr, svc = failing(code, fail=1)
    with StoreClient(addr, transport="grpc", retry=Retry(attempts=5, backoff_s=0.01)) as c:
        with pytest.raises(exc, match="planned failure 1"):
            c.lookup([b"a"])
    assert svc.calls == 1


def test_timeout_s_is_each_calls_deadline(failing):
    addr, svc = failing()
    with StoreClient(addr, transport="grpc", timeout_s=0.5, retry=Retry(attempts=5, backoff_s=0.01)) as c:
        with pytest.raises(DeadlineExceededError):  # the server blocks until the test ends
            c.stats()
    svc.release.set()
