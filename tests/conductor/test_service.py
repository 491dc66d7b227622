"""The conductor's gRPC service with in-process store nodes and engine agents (real gRPC on loopback)."""

import logging

import grpc
import pytest

from kvstore.client import StoreClient
from kvstore.conductor.agent import MemberAgent
from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.membership import EngineLoad, MemberKind
from kvstore.conductor.service import Conductor
from kvstore.config import StoreConfig
from kvstore.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from kvstore.server import StoreNode
from kvstore.store import Tier
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc
from tests.conductor.conftest import DEAD_S, HEARTBEAT_S
from tests.helpers import wait_for

KEYS = [bytes([i]) * 16 for i in range(6)]


@pytest.fixture
def cc(conductor):
    with ConductorClient(conductor.address) as c:
        yield c


@pytest.fixture
def engines(conductor):
    agents = []

    def make(member_id, store_node=None, kind=MemberKind.PREFILL, **kw):
        a = MemberAgent(conductor.address, member_id, kind, store_node=store_node, **kw).start()
        agents.append(a)
        assert a.registered.wait(30)
        return a

    yield make
    for a in agents:
        a.stop()


def test_a_heartbeat_whose_load_cannot_be_built_still_keeps_the_member_alive(engines, cc, caplog):
    """Before, one exception while building a heartbeat's load (a node's counters past the u64 a
    client's reports had pushed them to) ended the heartbeat thread for good: the member was
    declared dead, silently, and left the cluster while it kept serving."""
    caplog.set_level(logging.ERROR, logger="kvstore.conductor.agent")
    a = engines("p")

    class Broken:
        def to_pb(self):
            raise ValueError("Value out of range: 18446744073709551715")

    a._load = Broken()
    wait_for(lambda: sum("sent without its load" in r.getMessage() for r in caplog.records) >= 3,
             what="three heartbeats sent without their load")
    m = next(m for m in cc.members() if m.member_id == "p")
    assert m.state == "alive" and m.last_seen_s < DEAD_S


def holders(cc, keys):
    return cc.locate(keys).holders


def test_store_events_feed_the_index(make_node, cc):
    a = make_node("a")
    wait_for(lambda: [m.member_id for m in cc.members()] == ["a"], what="a registered")
    with StoreClient(a.address) as s:
        s.batch_put([(k, b"v" * 100) for k in KEYS[:3]])
        wait_for(lambda: cc.locate(KEYS).num_prefix == 3, what="3 chunks indexed")
        assert holders(cc, KEYS[:3]) == [{"a": Tier.DRAM}] * 3
        s.delete([KEYS[1]])
        wait_for(lambda: cc.locate(KEYS).num_prefix == 1, what="the deleted chunk left the index")
    assert cc.locate(KEYS).nodes[0].node_id == "a"
    assert next(m for m in cc.members() if m.member_id == "a").num_chunks == 2


def test_demotion_to_disk_is_a_move(make_node, cc, tmp_path):
    a = make_node("a", dram="64KiB", disk=str(tmp_path / "d"), disk_size="16MiB")
    with StoreClient(a.address) as s:
        keys = [bytes([i]) * 16 for i in range(40)]
        for k in keys:
            s.put(k, b"x" * 4000)
    wait_for(lambda: cc.locate(keys).num_prefix == 40, what="40 chunks indexed")
    tiers = [next(iter(h.values())) for h in holders(cc, keys)]
    assert tiers[0] is Tier.DISK and tiers[-1] is Tier.DRAM


def test_graceful_stop_drops_the_nodes_chunks_at_once(make_node, cc):
    a, b = make_node("a"), make_node("b")
    for n in (a, b):
        with StoreClient(n.address) as s:
            s.put(KEYS[0], b"v")
    wait_for(lambda: holders(cc, KEYS[:1])[0].keys() == {"a", "b"}, what="both copies indexed")
    b.stop(0)
    wait_for(lambda: holders(cc, KEYS[:1]) == [{"a": Tier.DRAM}], what="b's copy gone")
    assert [m.member_id for m in cc.members()] == ["a"]


def test_silent_member_is_dead_after_the_timeout(make_node, cc, conductor):
    a, b = make_node("a"), make_node("b")
    with StoreClient(b.address) as s:
        s.batch_put([(k, b"v") for k in KEYS])
    wait_for(lambda: cc.locate(KEYS).num_prefix == len(KEYS), what="b's chunks indexed")
    b.agent.stop(deregister=False)  # b stays up but goes silent, as if partitioned
    wait_for(lambda: [m.member_id for m in cc.members()] == ["a"], timeout_s=60, what="b declared dead")
    assert cc.locate(KEYS).num_prefix == 0
    assert cc.stats()["num_dead"] == 1


def test_a_superseded_agent_registers_again_and_resyncs_keeping_its_drain(make_node, cc, conductor):
    """A registration under a node's id (what a restarted process sends) supersedes the running agent: the
    agent's next heartbeat, of the old incarnation, is refused, so it registers again and resends its chunks."""
    a = make_node("a")
    with StoreClient(a.address) as s:
        s.batch_put([(k, b"v") for k in KEYS[:3]])
    wait_for(lambda: cc.locate(KEYS).num_prefix == 3, what="a's chunks indexed")
    assert cc.drain("a") == "draining"
    channel = grpc.insecure_channel(conductor.address)
    stub = cpb_grpc.ConductorStub(channel)

    def incarnation():
        return next((m.incarnation for m in stub.ListMembers(cpb.ListMembersRequest(), timeout=10).members
                     if m.member_id == "a"), None)

    first = incarnation()
    taken = stub.Register(cpb.RegisterRequest(member_id="a", kind=cpb.MEMBER_KIND_STORE, address=a.address),
                          timeout=10).incarnation
    assert taken != first
    wait_for(lambda: incarnation() not in (None, first, taken), what="the agent registered again")
    assert not stub.Heartbeat(cpb.HeartbeatRequest(member_id="a", incarnation=taken), timeout=10).known
    wait_for(lambda: cc.locate(KEYS).num_prefix == 3, what="a's chunks resent by its new incarnation")
    assert holders(cc, KEYS[:3]) == [{"a": Tier.DRAM}] * 3
    assert next(m for m in cc.members() if m.member_id == "a").state == "draining"
    wait_for(lambda: a.agent.draining, what="the agent told it is draining")
    channel.close()


def test_conductor_restart_resyncs_members_and_chunks(make_node, conductor):
    a = make_node("a")
    with StoreClient(a.address) as s:
        s.batch_put([(k, b"v") for k in KEYS])
    with ConductorClient(conductor.address) as cc:
        wait_for(lambda: cc.locate(KEYS).num_prefix == len(KEYS), what="indexed")
    address = conductor.address
    conductor.stop(0)
    again = Conductor(ConductorConfig(listen=address, heartbeat_interval=HEARTBEAT_S, dead_timeout=DEAD_S)).start()
    try:
        with ConductorClient(address) as cc:
            wait_for(lambda: cc.locate(KEYS).num_prefix == len(KEYS), timeout_s=60, what="resynced after restart")
            assert [m.member_id for m in cc.members()] == ["a"]
    finally:
        a.stop(0)
        again.stop(0)


def test_disk_contents_are_announced_after_a_node_restart(conductor, cc, tmp_path):
    def cfg(**kw):
        return StoreConfig(listen="127.0.0.1:0", node_id="b", dram="4KiB", slot_size="4KiB",
                           disk=str(tmp_path / "d"), disk_size="16MiB", **kw)

    first = StoreNode(cfg()).start()  # standalone
    with StoreClient(first.address) as s:
        s.batch_put([(k, b"y" * 3000) for k in KEYS])  # one DRAM slot: the rest goes to disk
    first.stop(0)
    again = StoreNode(cfg(conductor=conductor.address)).start()
    try:
        on_disk = [k for k in KEYS if again.store.tier_of(k) is Tier.DISK]
        assert on_disk
        wait_for(lambda: holders(cc, on_disk) == [{"b": Tier.DISK}] * len(on_disk), what="disk keys indexed")
    finally:
        again.stop(0)


def test_schedule_goes_where_the_prefix_is(make_node, engines, cc):
    a, b = make_node("a"), make_node("b")
    engines("pa", "a")
    engines("pb", "b")
    with StoreClient(b.address) as s:
        s.batch_put([(k, b"v") for k in KEYS[:4]])
    wait_for(lambda: cc.locate(KEYS).num_prefix == 4, what="indexed")
    r = cc.schedule(KEYS, num_tokens=6 * 256 + 7)
    assert (r.accepted, r.prefill, r.source_node, r.source_address) == (True, "pb", "b", b.address)
    assert (r.num_cached_chunks, r.num_cached_tokens, r.decode, r.policy) == (4, 1024, None, "cache-aware")
    # Cache-blind policies ignore the index: round-robin takes the engines in id order (pa, then pb), and
    # each reuses only what its own node holds: nothing on a, all 4 chunks on b.
    rr = [cc.schedule(KEYS, 6 * 256, policy="round-robin") for _ in range(3)]
    assert [(r.prefill, r.num_cached_chunks, r.num_cached_tokens, r.source_node) for r in rr] == [
        ("pa", 0, 0, None), ("pb", 4, 1024, "b"), ("pa", 0, 0, None)]
    # The stats count what Schedule reused: 4 chunks (cache-aware) + 0 + 4 + 0, of 4 × 6 scheduled.
    st = cc.stats()["schedule"]
    assert (st["num_scheduled"], st["num_scheduled_chunks"], st["num_cached_chunks"]) == (4, 24, 8)
    assert (st["num_rejected"], st["num_replications"]) == (0, 0)


def test_drain_excludes_an_engine(make_node, engines, cc):
    make_node("a")
    engines("pa", "a")
    engines("pb", "b")
    assert cc.drain("pa") == "draining"
    for _ in range(3):
        assert cc.schedule(KEYS[:1], 300, policy="round-robin").prefill == "pb"
    assert next(m for m in cc.members() if m.member_id == "pa").state == "draining"
    assert cc.drain("pa", undo=True) == "alive"
    assert {cc.schedule(KEYS[:1], 300, policy="round-robin").prefill for _ in range(2)} == {"pa", "pb"}
    with pytest.raises(NotFoundError, match="no live member 'nobody'"):
        cc.drain("nobody")


def test_load_reports_and_decode_choice(engines, cc):
    e0 = engines("p0")
    engines("p1")
    engines("d0", kind=MemberKind.DECODE).report_load(EngineLoad(num_running=50, num_context_tokens=800_000))
    engines("d1", kind=MemberKind.DECODE)
    e0.report_load(EngineLoad(num_queued_tokens=100_000, num_waiting=3))
    e0.heartbeat_now()
    wait_for(lambda: next(m for m in cc.members() if m.member_id == "p0").engine.num_queued_tokens == 100_000,
             what="load reported")
    wait_for(lambda: next(m for m in cc.members() if m.member_id == "d0").engine.num_running == 50,
             what="decode load reported")
    r = cc.schedule(KEYS[:2], 600, policy="load")
    assert (r.prefill, r.decode, r.prefill_address) == ("p1", "d1", "")
    assert r.predicted_tbt_s > 0


def test_measured_prefills_refit_the_cost_model(engines, cc):
    e = engines("p0")
    for n in (100, 1000, 2000, 4000, 8000, 500, 3000, 6000):
        e.record_prefill(n, 0, 0.01 + 2e-5 * n)
    e.heartbeat_now()
    wait_for(lambda: cc.stats()["cost_model"]["num_samples"] == 8, what="refit")
    c0, c1, c2 = cc.stats()["cost_model"]["coefficients"]
    assert c0 == pytest.approx(0.01, rel=1e-3) and c1 == pytest.approx(2e-5, rel=1e-3)
    assert c2 == pytest.approx(0, abs=1e-12)


def test_bad_requests_get_precise_statuses(conductor, engines, cc):
    with pytest.raises(FailedPreconditionError, match="no live prefill engine"):
        cc.schedule(KEYS[:1], 300)
    engines("p0")
    with pytest.raises(InvalidArgumentError, match="empty key"):
        cc.schedule([b""], 300)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        cc.schedule(KEYS[:2], 300)
    with pytest.raises(InvalidArgumentError, match="unknown policy 'best'"):
        cc.schedule(KEYS[:1], 300, policy="best")
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        cc.pin(KEYS[:1], -1.0)
    with pytest.raises(InvalidArgumentError, match="exceeds the limit"):
        cc.locate([b"k" * 2000])
    stub = cpb_grpc.ConductorStub(grpc.insecure_channel(conductor.address))
    bad = [cpb.RegisterRequest(member_id="", kind=cpb.MEMBER_KIND_STORE, address="h:1"),
           cpb.RegisterRequest(member_id="s", kind=cpb.MEMBER_KIND_STORE, address="nohost"),
           cpb.RegisterRequest(member_id="s", kind=9),
           cpb.RegisterRequest(member_id="e", kind=cpb.MEMBER_KIND_PREFILL, namespace=b"short")]
    for req in bad:
        with pytest.raises(grpc.RpcError) as exc:
            stub.Register(req, timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:
        stub.StreamEvents(iter([cpb.EventBatch(member_id="ghost", incarnation=1)]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not stub.Heartbeat(cpb.HeartbeatRequest(member_id="ghost", incarnation=1), timeout=10).known


def test_a_profile_with_a_zero_bandwidth_is_refused_at_start(tmp_path):
    # It used to start, then fail every Schedule that moves KV with UNKNOWN (a ZeroDivisionError).
    p = tmp_path / "zero.json"
    p.write_text('{"local_bandwidth": 0}')
    with pytest.raises(ValueError, match="profile field local_bandwidth must be > 0"):
        Conductor(ConductorConfig(listen="127.0.0.1:0", profile=str(p)))


def test_pin_and_evict_reach_every_holder(make_node, cc):
    a, b = make_node("a"), make_node("b")
    for n in (a, b):
        with StoreClient(n.address) as s:
            s.batch_put([(k, b"v") for k in KEYS[:3]])
    wait_for(lambda: all(len(h) == 2 for h in holders(cc, KEYS[:3])), what="both copies indexed")
    assert cc.pin(KEYS[:3], 60.0) == (6, 2)
    assert a.store.stats()["num_pinned"] == 3 and b.store.stats()["num_pinned"] == 3
    assert cc.pin(KEYS[:3], 0.0) == (6, 2)
    assert a.store.stats()["num_pinned"] == 0
    assert cc.evict(KEYS[:2]) == (4, 2)
    assert cc.locate(KEYS[:3]).num_prefix == 0
    assert a.store.exists(KEYS[:3]) == [False, False, True]
    assert cc.evict([b"absent-key"]) == (0, 0)


def test_standard_health_service_serves_until_stop():
    """grpc.health.v1 (what Kubernetes' gRPC probes call): SERVING while up, NOT_SERVING from stop()."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.health import NOT_SERVING, SERVING

    c = Conductor(ConductorConfig(listen="127.0.0.1:0")).start()
    with grpc.insecure_channel(c.address) as ch:
        std = health_pb2_grpc.HealthStub(ch)
        for service in ("", "crescent.v1.Conductor"):
            assert std.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == SERVING
        c.health.stop()  # the first thing stop() does
        assert std.Check(health_pb2.HealthCheckRequest(), timeout=30).status == NOT_SERVING
    c.stop(0)


def test_member_expiries_are_counted(conductor):
    """A member silent past the dead timeout is reaped and counted (crescent_conductor_member_expiries_total)."""
    with grpc.insecure_channel(conductor.address) as ch:
        cpb_grpc.ConductorStub(ch).Register(cpb.RegisterRequest(member_id="gone", kind=cpb.MEMBER_KIND_PREFILL),
                                            timeout=30)
    wait_for(lambda: conductor.counters["expired"] == 1, what="the silent member to expire")
    assert conductor.members.get("gone") is None


def test_an_idle_nodes_event_stream_ends_and_its_next_events_carry_on_without_a_snapshot(make_node, cc, conductor):
    """A node with no event for ``stream_idle_s`` ends its stream: an open stream holds one of the
    conductor's call threads, so nodes that are idle hold none (before, every node held one for its
    whole life). Its next events open a stream that carries on where the last ended: no snapshot
    (the conductor does not drop and re-add the node's chunks), and nothing lost."""
    a = make_node("a")
    a.agent.stream_idle_s = 0.5
    streams = lambda: conductor.counters["event_streams_open"]  # noqa: E731
    with StoreClient(a.address) as s:
        s.batch_put([(k, b"v" * 100) for k in KEYS[:3]])
        wait_for(lambda: cc.locate(KEYS).num_prefix == 3, what="3 chunks indexed")
        wait_for(lambda: streams() == 0 and a.agent._resumable, what="the idle stream to end")
        drops = []
        real = conductor.index.drop_node
        conductor.index.drop_node = lambda node, lazy=False: drops.append(node) or real(node, lazy)
        for round_ in range(3):  # each time: events open a stream, carry on, and it ends again
            s.put(KEYS[3 + round_], b"w" * 100)
            s.delete([KEYS[round_]])
            wait_for(lambda: [bool(h) for h in holders(cc, KEYS)] == [i > round_ for i in range(4 + round_)]
                     + [False] * (2 - round_), what=f"round {round_}'s put and delete indexed")
            wait_for(lambda: streams() == 0, what="the stream to end again")
        assert drops == []  # no snapshot: the node's chunks were never dropped and re-added
        assert holders(cc, KEYS) == [{}, {}, {}, {"a": Tier.DRAM}, {"a": Tier.DRAM}, {"a": Tier.DRAM}]
        # the conductor forgets the node while its stream is closed: the next events' stream is refused,
        # the node registers again, and its stream starts over with a snapshot of everything it holds
        incarnation = conductor.members.get("a").incarnation
        with grpc.insecure_channel(conductor.address) as ch:
            cpb_grpc.ConductorStub(ch).Deregister(cpb.DeregisterRequest(member_id="a", incarnation=incarnation),
                                                  timeout=30)
        assert holders(cc, KEYS[3:]) == [{}, {}, {}]
        s.put(KEYS[0], b"v" * 100)
        wait_for(lambda: holders(cc, KEYS) == [{"a": Tier.DRAM}, {}, {}] + [{"a": Tier.DRAM}] * 3,
                 what="the node's snapshot after it registered again")
