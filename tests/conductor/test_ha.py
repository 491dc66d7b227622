"""Conductor high availability on a real etcd: one leader among replicas, followers that name it,
clients and members that follow it, and a kill -9 of the leader that loses neither members nor the
prefix index (the store nodes resend their chunk sets to the new leader)."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.coord import Etcd, LeaderElection, parse_endpoints
from kvstore.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from kvstore.health import NOT_SERVING, SERVING
from tests.conductor.procs import ConductorProcess, EngineProcess, ctl
from tests.helpers import EtcdProcess, StoreProcess, wait_for

TTL = 2.0


@pytest.fixture
def etcd(tmp_path):
    e = EtcdProcess(str(tmp_path / "etcd"))
    yield e
    e.stop()


@pytest.fixture
def replicas(etcd):
    """Two in-process conductor replicas on one etcd; stopped after the test."""
    cs = [Conductor(ConductorConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, leader_ttl=TTL)).start()
          for _ in range(2)]
    yield cs
    for c in cs:
        c.stop(0)


def _leader(cs):
    leaders = [c for c in cs if c.is_leader]
    return leaders[0] if len(leaders) == 1 else None


def _status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def test_one_leader_and_the_follower_names_it(replicas):
    leader = wait_for(lambda: _leader(replicas), what="one leader")
    follower = next(c for c in replicas if c is not leader)
    wait_for(lambda: follower.election.leader() == leader.address, what="the follower to see the leader")

    # The follower answers UNAVAILABLE with the leader's address ...
    raw = ConductorClient(follower.address)
    raw.addresses = [follower.address]
    with grpc.insecure_channel(follower.address) as ch:
        from proto.crescent.v1 import conductor_pb2 as cpb
        from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc

        with pytest.raises(grpc.RpcError) as exc:
            cpb_grpc.ConductorStub(ch).ClusterStats(cpb.ClusterStatsRequest(), timeout=30)
        assert exc.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ("crescent-leader", leader.address) in tuple(exc.value.trailing_metadata())
        assert "is a follower; the leader is at " + leader.address in exc.value.details()
    # ... which clients follow (the CLI too).
    assert raw.stats()["num_members"] == 0 and raw.address == leader.address
    raw.close()
    out = ctl("nodes", conductor=follower.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"conductor leader {leader.address}\n")

    # Readiness is leadership; liveness is the process.
    assert _status(leader.address, "crescent.v1.Conductor") == SERVING
    assert _status(follower.address, "crescent.v1.Conductor") == NOT_SERVING
    assert _status(follower.address, "") == SERVING


def test_a_stopped_leader_resigns_and_the_follower_takes_over(replicas):
    leader = wait_for(lambda: _leader(replicas), what="one leader")
    follower = next(c for c in replicas if c is not leader)
    leader.stop(0)
    wait_for(lambda: follower.is_leader, what="the follower to take over")
    assert follower.election.num_elected == 1
    with ConductorClient(f"{leader.address},{follower.address}", timeout_s=30) as c:
        assert c.stats()["num_members"] == 0  # the dead replica is skipped for the next address


def test_election_needs_a_reachable_etcd_and_sane_settings(tmp_path):
    with pytest.raises(InvalidArgumentError):
        parse_endpoints("localhost")
    with pytest.raises(ValueError, match="--etcd"):
        ConductorConfig(etcd="nohost")
    with pytest.raises(ValueError, match="--leader-ttl"):
        ConductorConfig(leader_ttl=0.5)
    e = Etcd("127.0.0.1:1", timeout_s=1.0)  # nothing listens there
    with pytest.raises(UnavailableError, match="etcd at 127.0.0.1:1 is unreachable"):
        e.get("/x")
    election = LeaderElection(e, "conductor", "me:1", ttl_s=2, poll_s=0.1).start()
    try:
        wait_for(lambda: election.num_elected == 0 and not election.is_leader and election._thread.is_alive(),
                 what="a candidate that keeps trying")
    finally:
        election.stop()
        e.close()


def test_ports_for_children_lie_below_the_ephemeral_range_and_are_free():
    import socket

    from kvstore.procs import port_for_child

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        port = port_for_child("127.0.0.1")
        assert 10000 <= port < low  # no connect() and no bind to port 0 hands it out
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_local_etcd_takes_other_ports_when_its_port_was_taken_first(tmp_path, monkeypatch):
    import socket

    import kvstore.procs

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real, picks = kvstore.procs.port_for_child, [busy]  # the first pick: a port another process holds
    monkeypatch.setattr(kvstore.procs, "port_for_child", lambda host="127.0.0.1": picks.pop() if picks else real(host))
    try:
        e = EtcdProcess(str(tmp_path / "etcd"))
    finally:
        taken.close()
    try:
        assert not picks and e.endpoint != f"127.0.0.1:{busy}"
        client = Etcd(e.endpoint, timeout_s=30)
        client.call(client.client.put, "/crescent/test", "v")
        assert client.get("/crescent/test") == b"v"
        client.close()
    finally:
        e.stop()


def test_kill9_of_the_leader_loses_no_member_and_no_cache_hit(etcd, tmp_path):
    """Real processes: two `crescent conductor --etcd` replicas, a store node holding a prefix and a
    prefill engine, both given both conductor addresses. Schedule's reuse before the kill -9 of
    the leader is the reuse after it, once the store node has resent its chunks to the new leader."""
    common = ("--etcd", etcd.endpoint, "--leader-ttl", str(TTL), "--heartbeat-interval", "0.2",
              "--dead-timeout", "30")
    a, b = ConductorProcess(*common), ConductorProcess(*common)
    both = f"{a.address},{b.address}"
    store = engine = None
    try:
        store = StoreProcess("--dram", "8MiB", "--slot-size", "4KiB", "--node-id", "store-a", "--conductor", both)
        engine = EngineProcess(both, "prefill-a", "--store-node", "store-a")
        keys = [bytes([i]) * 16 for i in range(1, 9)]
        from kvstore.client import StoreClient

        with StoreClient(store.address) as s:
            s.batch_put([(k, b"v" * 100) for k in keys[:6]])  # 6 of the 8 chunks are cached
        client = ConductorClient(both, timeout_s=30)

        def reuse():
            try:
                r = client.schedule(keys, num_tokens=8 * 256, chunk_tokens=256)
            except (UnavailableError, FailedPreconditionError):  # no leader yet; no engine registered yet
                return None
            return r.num_cached_chunks if r.accepted and r.prefill == "prefill-a" else None

        wait_for(lambda: reuse() == 6, what="the index to hold the store's chunks")
        before = client.address
        victim = a if before == a.address else b
        survivor = b if victim is a else a
        victim.kill9()
        # The survivor leads within the lease TTL; members follow it and the store resends its chunks.
        wait_for(lambda: reuse() == 6, timeout_s=120, what="reuse after the failover")
        assert client.address == survivor.address
        nodes = ctl("nodes", conductor=both, json_out=True)
        assert {m["member_id"] for m in nodes} == {"store-a", "prefill-a"}
        client.close()
    finally:
        for p in (engine, store, a, b):
            if p is not None:
                p.stop()


def test_a_member_whose_etcd_lease_ends_leaves_and_rejoins(etcd):
    """Members of an etcd-backed conductor hold members/<id> under a lease. A store node paused
    (SIGSTOP) past the lease, though well within --dead-timeout, leaves scheduling and the index;
    resumed, it registers again and its chunks come back."""
    import os
    import signal

    from kvstore.client import StoreClient

    c = Conductor(ConductorConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, leader_ttl=TTL, member_lease_ttl=2,
                                  heartbeat_interval=0.2, dead_timeout=600)).start()
    store = None
    try:
        wait_for(lambda: c.is_leader, what="the conductor to lead")
        store = StoreProcess("--dram", "8MiB", "--slot-size", "4KiB", "--node-id", "store-p", "--conductor",
                             c.address, host_id="host-p")
        keys = [bytes([i]) * 16 for i in range(1, 5)]
        with StoreClient(store.address) as s:
            s.batch_put([(k, b"v" * 64) for k in keys])
        cc = ConductorClient(c.address, timeout_s=30)
        wait_for(lambda: cc.locate(keys).num_prefix == 4, what="the chunks in the index")
        # the member's lease-held key is written by its agent right after it registers: wait for it
        m = wait_for(lambda: next((x for x in cc.members() if x.lease_ttl_s > 0), None), what="the member's etcd lease")
        assert len(cc.members()) == 1
        assert m.member_id == "store-p" and 0 < m.lease_ttl_s <= 2 and m.host_id == "host-p"
        expired = c.counters["expired"]

        os.kill(store.pid, signal.SIGSTOP)  # no heartbeats, no lease renewals
        try:
            wait_for(lambda: cc.members() == [], what="the lapsed member to leave")
            assert cc.locate(keys).num_prefix == 0 and c.counters["expired"] == expired + 1
        finally:
            os.kill(store.pid, signal.SIGCONT)
        wait_for(lambda: cc.locate(keys).num_prefix == 4, what="the member and its chunks to come back")
        nodes = ctl("nodes", conductor=c.address, json_out=True)
        assert nodes[0]["member_id"] == "store-p" and nodes[0]["lease_ttl_s"] is not None
        cc.close()
    finally:
        if store is not None:
            store.stop()
        c.stop(0)


def test_etcd_alone_finds_the_replicas_for_clients_members_and_ctl(replicas, etcd, tmp_path):
    """Every replica registers conductor/replicas/<address>; a client, a store node and `crescent ctl` given
    only --etcd find them (the leader first) and follow a failover."""
    from kvstore.conductor.client import discover
    from kvstore.config import StoreConfig
    from kvstore.server import StoreNode

    leader = wait_for(lambda: _leader(replicas), what="one leader")
    follower = next(c for c in replicas if c is not leader)
    found = wait_for(lambda: (lambda d: d if len(d) == 2 else None)(discover(etcd.endpoint)),
                     what="both replicas registered")
    assert found == [leader.address, follower.address]
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="8MiB", slot_size="4KiB", node_id="s0",
                                 etcd=etcd.endpoint)).start()
    try:
        with ConductorClient(None, etcd=etcd.endpoint, timeout_s=30) as c:
            wait_for(lambda: [m.member_id for m in c.members()] == ["s0"], what="the node registered via etcd")
            out = ctl("nodes", "--etcd", etcd.endpoint)
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith(f"conductor leader {leader.address}\n") and "s0" in out.stdout
            leader.stop(0)
            wait_for(lambda: follower.is_leader, what="the follower to take over")
            wait_for(lambda: [m.member_id for m in c.members()] == ["s0"], timeout_s=120,
                     what="the node and the client at the new leader")
            assert c.address == follower.address
    finally:
        node.stop(grace=0)
    bad = ctl("nodes", "--etcd", "nohost")  # no port: bad input (2), not an unreachable etcd (1)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "etcd" in bad.stderr


def test_a_client_given_only_etcd_stops_trying_replicas_that_left_it(replicas, etcd):
    """Replicas replaced one by one (as pods are, at new addresses): once none it knows answers, a
    client re-reads etcd and keeps only what is registered now. Before, it kept every address it had
    ever seen and tried each dead one on every failover (a deadline apiece where the host is gone)."""
    from kvstore.conductor.client import discover

    leader = wait_for(lambda: _leader(replicas), what="one leader")
    follower = next(c for c in replicas if c is not leader)
    wait_for(lambda: len(discover(etcd.endpoint)) == 2, what="both replicas registered")
    third = None
    try:
        with ConductorClient(None, etcd=etcd.endpoint, timeout_s=30) as c:
            assert c.addresses == [leader.address, follower.address]
            third = Conductor(ConductorConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, leader_ttl=TTL)).start()
            leader.stop(0)
            follower.stop(0)
            wait_for(lambda: third.is_leader, what="the third replica to lead")
            wait_for(lambda: discover(etcd.endpoint) == [third.address], what="the two to leave etcd")
            assert c.stats()["num_members"] == 0 and c.address == third.address
            assert c.addresses == [third.address]
    finally:
        if third is not None:
            third.stop(0)
