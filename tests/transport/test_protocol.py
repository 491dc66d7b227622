"""The descriptor protocol: grants, expiry, reuse, and every bad request, on a real node."""

import math
import os

import grpc
import pytest

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.errors import FailedPreconditionError
from kvstore.store import Tier
from kvstore.transport.descriptors import ItemStatus
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import wait_for

SLOT = 64 << 10


def _stub(node):
    ch = grpc.insecure_channel(node.address)
    return ch, pb_grpc.KVStoreStub(ch)


def _code(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _dram_used(node):
    return node.store.stats()["tiers"][Tier.DRAM]["used_bytes"]


def test_bad_requests_get_precise_statuses(make_node):
    node = make_node()
    ch, s = _stub(node)
    code, _ = _code(lambda: s.AcquireRead(pb.AcquireReadRequest(keys=[b""]), timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    code, _ = _code(lambda: s.AcquireRead(pb.AcquireReadRequest(keys=[b"k" * 1025]), timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    code, msg = _code(lambda: s.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=pb.MOVER_TCP), timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "shm, rdma and cuda_ipc" in msg
    # cuda_ipc reads a device tier, which this node lacks: said, with why
    code, msg = _code(lambda: s.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=pb.MOVER_CUDA_IPC), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "cuda_ipc: no device tier (--device)" in msg
    code, msg = _code(lambda: s.ReserveWrite(pb.ReserveWriteRequest(
        values=[pb.ValueHeader(key=b"k", size=10)], mover=pb.MOVER_CUDA_IPC), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "does not offer cuda_ipc" in msg
    code, _ = _code(lambda: s.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=99), timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    code, msg = _code(lambda: s.ReleaseRead(pb.LeaseRequest(lease_id=12345), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "expired or unknown" in msg
    code, _ = _code(lambda: s.CommitWrite(pb.LeaseRequest(lease_id=12345), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert s.AbortWrite(pb.LeaseRequest(lease_id=12345), timeout=30).num_aborted == 0
    code, msg = _code(lambda: s.ReserveWrite(pb.ReserveWriteRequest(
        values=[pb.ValueHeader(key=b"k", size=1 << 40)]), timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in msg
    code, msg = _code(lambda: s.ConnectRdma(pb.RdmaConnectRequest(), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "RDMA" in msg
    code, msg = _code(lambda: s.DisconnectRdma(pb.RdmaDisconnectRequest(qp_num=7), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "RDMA" in msg
    # nothing was left behind by the refused requests
    assert node.transport.leases.stats()["num_remote_reservations"] == 0 and _dram_used(node) == 0
    tcp_only = make_node(transport="tcp")
    ch2, s2 = _stub(tcp_only)
    code, msg = _code(lambda: s2.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=pb.MOVER_SHM), timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "--transport tcp" in msg
    ch.close()
    ch2.close()


def test_lease_ttl_is_validated():
    for bad in (0.0, -1.0, math.nan, 1e9):
        with pytest.raises(ValueError, match="--lease-ttl-s"):
            StoreConfig(lease_ttl_s=bad)
    with pytest.raises(ValueError, match="--transport"):
        StoreConfig(transport="smoke-signals")


def test_reservation_is_invisible_until_commit_and_commits_once(mover, make_node):
    node = make_node()
    c = StoreClient(node.address, transport=mover)
    session = c.descriptor_session()
    value = os.urandom(3 * SLOT + 5)
    grant = session.reserve([(b"w", len(value)), (b"w2", 10)])
    assert [d.status for d in grant.items] == [ItemStatus.OK, ItemStatus.OK]
    session.write(grant.items[0], value)
    session.write(grant.items[1], b"0123456789")
    assert c.exists([b"w", b"w2"]) == [False, False]
    session.commit(grant.lease_id)
    assert c.get(b"w") == value and c.get(b"w2") == b"0123456789"
    with pytest.raises(FailedPreconditionError):
        session.commit(grant.lease_id)
    grant = session.reserve([(b"gone", 100)])
    assert session.abort(grant.lease_id) == 1
    assert c.exists([b"gone"]) == [False]
    assert c.stats()["num_remote_reservations"] == 0
    c.close()


def test_expired_lease_fails_release_even_after_the_slots_hold_another_key(mover, make_node):
    node = make_node(dram=1 << 20, lease_ttl_s=0.3)  # 16 slots, no disk: eviction drops
    c = StoreClient(node.address, transport=mover)
    session = c.descriptor_session()
    mine = os.urandom(4 * SLOT)
    c.put(b"mine", mine)
    grant = session.acquire([b"mine"])
    wait_for(lambda: node.transport.leases.stats()["num_expired_leases"] == 1, what="the lease to expire")
    assert c.stats()["num_remote_leases"] == 0
    c.delete([b"mine"])  # the expired lease no longer holds the slots: they are free...
    fill = {b"other%d" % i: bytes([i + 1]) * (4 * SLOT) for i in range(3)}
    c.batch_put(list(fill.items()))  # ...and reused by other keys
    buf = bytearray(len(mine))
    session.read(grant.items[0], buf)  # a slow reader copies only now: foreign bytes
    assert bytes(buf) != mine
    with pytest.raises(FailedPreconditionError, match="expired"):
        session.release(grant.lease_id)  # so the read is invalid: the caller sees a miss
    assert c.batch_get_into([b"mine"], [buf]) == [None]
    c.close()


@pytest.mark.parametrize("lane", ["tcp", "grpc"])
def test_get_reports_a_miss_when_its_lease_expired_during_the_copy(make_node, lane):
    node = make_node(lease_ttl_s=0.2)
    c = StoreClient(node.address, data_channel=lane == "tcp", local_reads=False)
    assert c.descriptor_session().control_lane == lane
    c.put(b"k", os.urandom(SLOT))
    session = c.descriptor_session()
    slow = session._handle.mover.read

    def read_slowly(ops, bufs):
        wait_for(lambda: node.transport.leases.stats()["num_expired_leases"] >= 1, what="expiry")
        slow(ops, bufs)

    session._handle.mover.read = read_slowly  # a stalled copier (the real mover, delayed)
    # the node ended the lease before the copy began, so the client's own deadline (earlier
    # than the node's) had passed too: no race, whatever the machine's load
    assert c.batch_get_into([b"k"], [bytearray(SLOT)]) == [None]
    assert session.num_invalid_reads == 1
    session._handle.mover.read = slow
    # the session still reads once copies are fast again; the next grant gets a TTL that no
    # loaded machine outlasts (a 0.2 s one could run out during this healthy read, too)
    node.transport.leases.ttl_s = 3600.0
    assert c.batch_get_into([b"k"], [bytearray(SLOT)]) == [SLOT]
    assert session.num_invalid_reads == 1
    c.close()


def test_expired_reservation_cannot_commit_and_its_slots_return_after_quarantine(mover, make_node, node_clock):
    ttl = 0.3  # the node's sweeper runs every ttl/4 s of real time; its deadlines move only with `clock`
    node = make_node(lease_ttl_s=ttl)
    clock = node_clock(node)
    leases = node.transport.leases
    c = StoreClient(node.address, transport=mover)
    session = c.descriptor_session()
    grant = session.reserve([(b"late", 2 * SLOT)])
    assert _dram_used(node) == 2 * SLOT
    clock.advance(ttl)  # at the deadline, not past it: still live
    leases.sweep()
    assert leases.stats()["num_expired_reservations"] == 0 and leases.stats()["num_remote_reservations"] == 1
    clock.advance(0.01)
    wait_for(lambda: leases.stats()["num_expired_reservations"] == 1, what="the sweeper to expire it")
    assert leases.stats()["num_remote_reservations"] == 0 and leases.stats()["num_quarantined"] == 1
    assert _dram_used(node) == 2 * SLOT  # quarantined: a stalled writer may still be copying
    with pytest.raises(FailedPreconditionError):
        session.commit(grant.lease_id)
    clock.advance(ttl / 2)  # half the quarantine: the slots stay out of use
    leases.sweep()
    assert _dram_used(node) == 2 * SLOT and leases.stats()["num_quarantined"] == 1
    clock.advance(ttl / 2 + 0.01)  # (past the end: two halves need not add up to ttl exactly)
    wait_for(lambda: _dram_used(node) == 0, what="the quarantined slots to return")
    assert leases.stats()["num_quarantined"] == 0
    assert c.exists([b"late"]) == [False]
    c.close()


def test_put_whose_reservation_expires_is_stored_another_way(make_node):
    node = make_node(lease_ttl_s=0.2)
    c = StoreClient(node.address)
    session = c.descriptor_session()
    slow = session._handle.mover.write

    def write_late(ops, bufs):
        wait_for(lambda: node.transport.leases.stats()["num_expired_reservations"] >= 1, what="expiry")
        slow(ops, bufs)

    session._handle.mover.write = write_late
    value = os.urandom(SLOT + 1)
    assert c.batch_put([(b"k", value)]) == [True]  # the commit failed; the TCP path stored it
    node.transport.leases.ttl_s = 3600.0  # the read below must not race a 0.2 s lease
    assert c.get(b"k") == value
    assert c.stats()["movers"]["tcp"]["num_writes"] == 1
    c.close()


def test_stopping_the_node_ends_every_grant(make_node):
    node = make_node()
    c = StoreClient(node.address)
    c.put(b"k", b"v")
    session = c.descriptor_session()
    session.acquire([b"k"])
    session.reserve([(b"w", 100)])
    assert node.transport.leases.stats()["num_remote_leases"] == 1
    c.close()
    node.stop(grace=0)
    assert node.transport.leases.stats() == {"num_remote_leases": 0, "num_remote_reservations": 0,
                                             "num_quarantined": 0, "num_expired_leases": 0,
                                             "num_expired_reservations": 0}


def test_store_acquire_in_place(tmp_path):
    from kvstore.store import TieredStore

    store = TieredStore(StoreConfig(dram=4 * SLOT, disk=str(tmp_path / "d"), disk_size=1 << 26,
                                    high_watermark=1.0, low_watermark=0.5, promote=False, write_behind=False))
    try:
        store.put(b"old", b"o" * SLOT)
        store.put(b"a", b"a" * (2 * SLOT))
        store.pin([b"a"], 600)
        store.put(b"b", b"b" * (2 * SLOT))  # demotes "old" (the only unpinned value) to disk
        assert store.tier_of(b"old") is Tier.DISK
        got = store.acquire_in_place([b"a", b"nope", b"old"])
        (lease_a, slots_a), missing, (lease_old, slots_old) = got
        assert missing is None and len(slots_a) == 2 and slots_old is None
        assert lease_old.tier is Tier.DISK and lease_old.size == SLOT
        assert bytes(store.dram.buf[slots_a[0] * SLOT: slots_a[0] * SLOT + 3]) == b"aaa"
        store.delete([b"a"])
        assert store.stats()["tiers"][Tier.DRAM]["used_bytes"] == 4 * SLOT  # leased: kept
        for lease in (lease_a, lease_old):
            store.release(lease)
        assert store.stats()["num_leases"] == 0
        assert store.stats()["tiers"][Tier.DRAM]["used_bytes"] == 2 * SLOT
        assert store.stats()["misses"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("data_channel", [True, False])
def test_the_step_by_step_calls_refuse_bad_arguments_before_sending(make_node, data_channel):
    """They raised TypeError or struct.error from the encoders, and a 2000-byte key on the data
    channel broke the connection (DataLossError)."""
    from kvstore.errors import InvalidArgumentError

    node = make_node()
    with StoreClient(node.address, data_channel=data_channel) as c:
        s = c.descriptor_session()
        for call, why in ((lambda: s.acquire(["k1"]), "must be bytes"), (lambda: s.acquire(None), "list of bytes"),
                          (lambda: s.acquire([b"k" * 2000]), "exceeds the limit"),
                          (lambda: s.reserve([(b"r", 1 << 64)]), "byte count"),
                          (lambda: s.reserve([(b"r", 1.5)]), "byte count"), (lambda: s.reserve(None), "pairs"),
                          (lambda: s.release(1 << 64), "lease id"), (lambda: s.commit(-1), "lease id")):
            with pytest.raises(InvalidArgumentError, match=why):
                call()
        assert s.acquire([b"absent"]).lease_id == 0  # the session still works
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"
