"""The member protocol at the wire: re-registration, stale incarnations, bad event streams.

A real conductor on loopback, driven by raw gRPC stubs so each test controls
incarnations and batches exactly. The conductor reads time from a clock the
test sets (its ``clock`` parameter), so liveness is checked without sleeps:
the reaper thread runs for real, but a member only ages when the test says so.
"""

import queue
import threading

import grpc
import pytest

from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc
from tests.helpers import wait_for

DEAD_S = 30.0
KEYS = [b"chunk-%02d" % i for i in range(4)]
STORE, PREFILL = cpb.MEMBER_KIND_STORE, cpb.MEMBER_KIND_PREFILL


class Clock:
    """The conductor's time source; moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def conductor(clock):
    c = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.1, dead_timeout=DEAD_S),
                  clock=clock).start()
    yield c
    c.stop(0)


@pytest.fixture
def stub(conductor):
    channel = grpc.insecure_channel(conductor.address)
    yield cpb_grpc.ConductorStub(channel)
    channel.close()


def register(stub, member_id, kind=STORE, address="127.0.0.1:1") -> int:
    return stub.Register(cpb.RegisterRequest(member_id=member_id, kind=kind, address=address),
                         timeout=30).incarnation


def stored(key, tier=2, kind=cpb.EVENT_KIND_STORED):
    return cpb.ChunkEvent(kind=kind, key=key, tier=tier)


def stream(stub, *batches):
    return stub.StreamEvents(iter(batches), timeout=30)


def members(stub) -> dict:
    return {m.member_id: m for m in stub.ListMembers(cpb.ListMembersRequest(), timeout=30).members}


def holders(stub, keys) -> list[set[str]]:
    return [{h.node_id for h in k.holders} for k in stub.Locate(cpb.LocateRequest(keys=keys), timeout=30).keys]


def heartbeat(stub, member_id, incarnation, **kw):
    return stub.Heartbeat(cpb.HeartbeatRequest(member_id=member_id, incarnation=incarnation, **kw), timeout=30)


def test_reregistration_drops_the_nodes_chunks_and_keeps_its_drain(stub):
    s1 = register(stub, "s")
    t = register(stub, "t", address="127.0.0.1:2")
    assert stream(stub, cpb.EventBatch(member_id="s", incarnation=s1, reset=True,
                                       events=[stored(k) for k in KEYS[:3]])).num_events == 3
    stream(stub, cpb.EventBatch(member_id="t", incarnation=t, reset=True, events=[stored(KEYS[0])]))
    assert holders(stub, KEYS[:3]) == [{"s", "t"}, {"s"}, {"s"}]
    assert stub.Drain(cpb.DrainRequest(member_id="s"), timeout=30).state == "draining"

    s2 = register(stub, "s")  # the same node, restarted
    assert s2 != s1
    assert holders(stub, KEYS[:3]) == [{"t"}, set(), set()]  # its chunks wait for its snapshot; t's stay
    m = members(stub)
    assert (m["s"].incarnation, m["s"].state, m["s"].num_chunks) == (s2, "draining", 0)
    assert (m["t"].state, m["t"].num_chunks) == ("alive", 1)
    r = heartbeat(stub, "s", s2)
    assert (r.known, r.draining) == (True, True)
    # The new incarnation's snapshot brings its chunks back; the drain is still there until undone.
    stream(stub, cpb.EventBatch(member_id="s", incarnation=s2, reset=True, events=[stored(KEYS[1])]))
    assert holders(stub, KEYS[:3]) == [{"t"}, {"s"}, set()]
    assert stub.Drain(cpb.DrainRequest(member_id="s", undo=True), timeout=30).state == "alive"
    assert (heartbeat(stub, "s", s2).draining, members(stub)["s"].state) == (False, "alive")


def test_a_restarted_engine_stays_drained_for_schedule(stub):
    register(stub, "p0", PREFILL, "")
    register(stub, "p1", PREFILL, "")
    stub.Drain(cpb.DrainRequest(member_id="p0"), timeout=30)
    register(stub, "p0", PREFILL, "")
    picks = [stub.Schedule(cpb.ScheduleRequest(keys=KEYS[:1], num_tokens=300, policy="round-robin"),
                           timeout=30).prefill.member_id for _ in range(3)]
    assert picks == ["p1", "p1", "p1"]
    assert members(stub)["p0"].state == "draining"


def test_an_old_incarnation_is_refused_everywhere(stub, conductor, clock):
    s1 = register(stub, "s")
    stream(stub, cpb.EventBatch(member_id="s", incarnation=s1, reset=True, events=[stored(KEYS[0])]))
    p1 = register(stub, "p", PREFILL, "")
    s2, p2 = register(stub, "s"), register(stub, "p", PREFILL, "")
    assert heartbeat(stub, "s", s2).known and heartbeat(stub, "p", p2).known

    clock.now += 5
    # Heartbeats of the old processes: not known, and they change nothing (liveness, load, cost samples).
    assert not heartbeat(stub, "s", s1).known
    stale = heartbeat(stub, "p", p1, engine=cpb.EngineLoad(num_queued_tokens=100_000, num_waiting=3),
                      prefill_samples=[cpb.PrefillSample(num_new_tokens=n, num_cached_tokens=0, seconds=1.0)
                                       for n in range(1, 9)])
    assert not stale.known
    m = members(stub)
    assert (m["s"].last_seen_s, m["p"].last_seen_s) == (5.0, 5.0)
    assert (m["p"].engine.num_queued_tokens, m["p"].engine.num_waiting, m["p"].predicted_queue_s) == (0, 0, 0.0)
    stats = stub.ClusterStats(cpb.ClusterStatsRequest(), timeout=30)
    assert (stats.num_prefill_samples_received, stats.num_cost_samples) == (0, 0)

    # Its event stream is refused and its events are not indexed.
    with pytest.raises(grpc.RpcError) as exc:
        stream(stub, cpb.EventBatch(member_id="s", incarnation=s1, events=[stored(KEYS[1])]))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'s' is not a registered store node" in exc.value.details()
    assert holders(stub, KEYS[:2]) == [set(), set()]
    # Its deregistration does not remove the new process.
    stub.Deregister(cpb.DeregisterRequest(member_id="s", incarnation=s1), timeout=30)
    assert members(stub)["s"].incarnation == s2

    # The current incarnation's heartbeat counts.
    assert heartbeat(stub, "p", p2).known
    assert members(stub)["p"].last_seen_s == 0.0
    # Old heartbeats do not keep a member alive: 31 s after its last real heartbeat, s is dead; p is not.
    clock.now += DEAD_S - 4
    assert not heartbeat(stub, "s", s1).known
    wait_for(lambda: "s" not in members(stub), what="s declared dead")
    assert list(members(stub)) == ["p"]
    assert stub.ClusterStats(cpb.ClusterStatsRequest(), timeout=30).num_dead == 1


@pytest.mark.parametrize("events, code, message", [
    ([stored(b"")], grpc.StatusCode.INVALID_ARGUMENT, "an event with an empty or oversized key"),
    ([stored(b"k" * 1025)], grpc.StatusCode.INVALID_ARGUMENT, "an event with an empty or oversized key"),
    ([stored(KEYS[0], tier=0)], grpc.StatusCode.INVALID_ARGUMENT, "an event with tier 0"),
    ([stored(KEYS[0], tier=4, kind=cpb.EVENT_KIND_MOVED)], grpc.StatusCode.INVALID_ARGUMENT, "an event with tier 4"),
    ([stored(KEYS[0], kind=cpb.EVENT_KIND_UNSPECIFIED)], grpc.StatusCode.INVALID_ARGUMENT,
     "an event of unknown kind 0"),
    ([stored(KEYS[0], kind=7)], grpc.StatusCode.INVALID_ARGUMENT, "an event of unknown kind 7"),
])
def test_bad_events_get_a_precise_status_and_the_member_resyncs(stub, events, code, message):
    s = register(stub, "s")
    with pytest.raises(grpc.RpcError) as exc:
        stream(stub, cpb.EventBatch(member_id="s", incarnation=s, reset=True, events=events))
    assert exc.value.code() == code
    assert exc.value.details() == message
    # The member is still registered, and its next stream (a snapshot, as the agent sends) is applied.
    assert heartbeat(stub, "s", s).known
    ack = stream(stub, cpb.EventBatch(member_id="s", incarnation=s, reset=True,
                                      events=[stored(KEYS[0]), stored(b"k" * 1024, tier=3)]),
                 cpb.EventBatch(member_id="s", incarnation=s, events=[stored(KEYS[1], kind=cpb.EVENT_KIND_REMOVED)]))
    assert ack.num_events == 3
    loc = stub.Locate(cpb.LocateRequest(keys=[KEYS[0], b"k" * 1024, KEYS[1]]), timeout=30)
    assert [[(h.node_id, h.tier) for h in k.holders] for k in loc.keys] == [[("s", 2)], [("s", 3)], []]


def test_event_streams_from_non_store_members_are_refused(stub):
    p = register(stub, "p", PREFILL, "")
    for batch in (cpb.EventBatch(member_id="p", incarnation=p, reset=True, events=[stored(KEYS[0])]),
                  cpb.EventBatch(member_id="ghost", incarnation=1, events=[stored(KEYS[0])])):
        with pytest.raises(grpc.RpcError) as exc:
            stream(stub, batch)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert exc.value.details() == f"{batch.member_id!r} is not a registered store node (register again)"
    assert holders(stub, KEYS[:1]) == [set()]
    assert heartbeat(stub, "p", p).known  # the engine itself is unharmed


def test_a_bad_batch_ends_only_its_own_stream(stub):
    """A stream that breaks mid-way leaves another node's open stream working."""
    a, b = register(stub, "a"), register(stub, "b", address="127.0.0.1:2")
    q: queue.Queue = queue.Queue()

    def feed():
        yield cpb.EventBatch(member_id="a", incarnation=a, reset=True, events=[stored(KEYS[0])])
        while (batch := q.get()) is not None:
            yield batch

    result = {}

    def run():
        result["ack"] = stub.StreamEvents(feed(), timeout=120)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_for(lambda: holders(stub, KEYS[:1]) == [{"a"}], what="a's first batch")
        with pytest.raises(grpc.RpcError) as exc:
            stream(stub, cpb.EventBatch(member_id="b", incarnation=b, reset=True, events=[stored(KEYS[1])]),
                   cpb.EventBatch(member_id="b", incarnation=b, events=[stored(KEYS[2], tier=9)]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        q.put(cpb.EventBatch(member_id="a", incarnation=a, events=[stored(KEYS[3])]))
        wait_for(lambda: holders(stub, [KEYS[3]]) == [{"a"}], what="a's stream still applied")
    finally:
        q.put(None)
        t.join(60)
    assert result["ack"].num_events == 2


def test_loads_and_requests_no_member_measures_are_refused_and_state_stays_sane(stub):
    """Before: a tier 99 or a NaN kv_usage was kept and broke the console and ctl; capacities
    summed past 64 bits failed ClusterStats (UNKNOWN); an hour-plus prefill sample or a
    2^32-token Schedule skewed the cost model so that Sizing simulated millions of instances
    (MemoryError); a store port beyond 65535 was registered, then failed PinChunks for all."""
    from kvstore.conductor.service import MAX_PROMPT_TOKENS
    from proto.crescent.v1 import kvstore_pb2 as pb

    def code(fn):
        with pytest.raises(grpc.RpcError) as e:
            fn()
        return e.value.code(), e.value.details()

    s1, s2 = register(stub, "s1"), register(stub, "s2")
    p1 = register(stub, "p1", kind=PREFILL, address="127.0.0.1:2")
    for load, why in ((dict(store=cpb.StoreLoad(tiers=[pb.TierStats(tier=99)])), "unknown tier"),
                      (dict(store=cpb.StoreLoad(tiers=[pb.TierStats(tier=2, capacity_bytes=(1 << 64) - 1)])), "bytes"),
                      (dict(engine=cpb.EngineLoad(kv_usage=float("nan"))), "kv_usage")):
        c, msg = code(lambda: heartbeat(stub, "s1" if "store" in load else "p1", s1 if "store" in load else p1, **load))
        assert c is grpc.StatusCode.INVALID_ARGUMENT and why in msg
    big = cpb.StoreLoad(tiers=[pb.TierStats(tier=2, capacity_bytes=1 << 60, hits=(1 << 64) - 1)], misses=(1 << 64) - 1)
    assert heartbeat(stub, "s1", s1, store=big).known and heartbeat(stub, "s2", s2, store=big).known
    stats = stub.ClusterStats(cpb.ClusterStatsRequest(), timeout=30)  # sums saturate instead of failing
    assert stats.misses == (1 << 64) - 1 and stats.tiers[0].capacity_bytes == 1 << 61
    assert {m.member_id for m in members(stub).values()} >= {"s1", "s2", "p1"}
    c, msg = code(lambda: stub.Schedule(cpb.ScheduleRequest(num_tokens=MAX_PROMPT_TOKENS + 1), timeout=30))
    assert c is grpc.StatusCode.INVALID_ARGUMENT and "at most" in msg
    absurd = [cpb.PrefillSample(num_new_tokens=1 + i, seconds=1e7 * (1 + i)) for i in range(8)]
    assert heartbeat(stub, "p1", p1, prefill_samples=absurd).known  # taken, not believed
    for _ in range(4):
        stub.Schedule(cpb.ScheduleRequest(num_tokens=500), timeout=30)
    for rps in (1e9, 5e-324):
        c, msg = code(lambda: stub.Sizing(cpb.SizingRequest(target_rps=rps), timeout=30))
        assert c is grpc.StatusCode.INVALID_ARGUMENT and "sizing considers" in msg
    assert stub.Sizing(cpb.SizingRequest(target_rps=2), timeout=30).num_prefill >= 1
    c, msg = code(lambda: register(stub, "s3", address="127.0.0.1:99999999999"))
    assert c is grpc.StatusCode.INVALID_ARGUMENT


def test_a_leaving_nodes_chunks_go_at_once_and_are_swept_off_the_lock_in_batches(stub, conductor, monkeypatch):
    """A node of 20,000 chunks deregisters (as one that dies is reaped): its chunks leave every answer
    as the call returns, and the sweeper clears them from the index in batches of SWEEP_KEYS, each
    its own hold of the conductor's lock. Before, Deregister cleared them all in one hold (0.47 s
    under the lock for a node of 500,000 chunks: every Schedule, heartbeat and event batch waited)."""
    import kvstore.conductor.service as service

    monkeypatch.setattr(service, "SWEEP_KEYS", 1000)
    big = [b"big-%05d" % i for i in range(20_000)]
    s, t = register(stub, "s"), register(stub, "t", address="127.0.0.1:2")
    stream(stub, *[cpb.EventBatch(member_id="s", incarnation=s, reset=i == 0,
                                  events=[stored(k) for k in big[i:i + 4096]]) for i in range(0, len(big), 4096)])
    stream(stub, cpb.EventBatch(member_id="t", incarnation=t, reset=True, events=[stored(k) for k in big[:10]]))
    stats = lambda: stub.ClusterStats(cpb.ClusterStatsRequest(), timeout=30)  # noqa: E731
    assert stats().num_chunks == 20_000

    holds, real = [], conductor._lock

    class Counting:  # the conductor's lock, each hold by the sweeper counted with the keys it cleared
        def __enter__(self):
            real.acquire()
            if threading.current_thread().name == "conductor-sweeper":
                holds.append(conductor.index.num_chunks())

        def __exit__(self, *exc):
            real.release()

    monkeypatch.setattr(conductor, "_lock", Counting())
    stub.Deregister(cpb.DeregisterRequest(member_id="s", incarnation=s), timeout=30)
    assert holders(stub, big[:12]) == [{"t"}] * 10 + [set(), set()]  # at once, before the sweep ends
    wait_for(lambda: stats().num_chunks == 10, what="the sweep to clear the node's 19,990 chunks of its own")
    assert len(holds) >= 20 and all(b - a <= 1000 for a, b in zip(holds[1:], holds))



def test_forty_store_nodes_streaming_events_leave_every_other_call_answered(stub, conductor):
    """Each store node keeps its KV-event stream open at the conductor for its whole life, and each such
    call holds one of the server's threads. With 32 threads, 32 nodes took them all: from then on no
    Register, heartbeat, Schedule or health probe was answered (DEADLINE_EXCEEDED), and the nodes past
    32 could not even open their streams. Now 40 nodes stream, and every other call is answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stop, opened = threading.Event(), queue.Queue()

    def node(i: int) -> None:
        inc = register(stub, f"n{i}", address=f"10.0.0.{i + 1}:7000")

        def batches():
            yield cpb.EventBatch(member_id=f"n{i}", incarnation=inc, reset=True, events=[stored(b"k%d" % i)])
            opened.put(i)
            stop.wait(300)  # (the stream stays open, as a node's does)

        try:
            stub.StreamEvents(batches(), timeout=600)
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(40)]
    for t in threads:
        t.start()
    channel = grpc.insecure_channel(conductor.address)
    try:
        wait_for(lambda: opened.qsize() == 40, timeout_s=120, what="40 store nodes, each with its event stream open")
        wait_for(lambda: all(holders(stub, [b"k%d" % i]) == [{f"n{i}"}] for i in range(40)), timeout_s=120,
                 what="every node's first batch indexed")
        e = register(stub, "prefill-0", PREFILL, address="127.0.0.1:9")
        assert heartbeat(stub, "prefill-0", e).known
        assert len(members(stub)) == 41
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert _gauge(conductor, "crescent_conductor_rpcs_in_flight") >= 40
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        channel.close()
    wait_for(lambda: _gauge(conductor, "crescent_conductor_rpcs_in_flight") == 0, timeout_s=120,
             what="the ended streams out of the gauge of calls in flight")


def _gauge(conductor, name: str) -> float:
    from kvstore.conductor.metrics import ConductorCollector

    return next(s.value for m in ConductorCollector(conductor).collect() for s in m.samples if s.name == name)
