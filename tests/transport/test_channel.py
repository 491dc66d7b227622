"""The descriptor calls on the node's data channel: every answer and refusal at the wire,
and releases sent without waiting. (A client following its restarted node to a new data
port: tests/transport/test_processes.py.)"""

import os
import socket
import struct

from kvstore.client import StoreClient
from kvstore.datachannel import (HELLO, Op, Status, decode_grant, encode_request, read_grant_response,
                                 read_response)
from kvstore.store import Tier
from kvstore.transport import Mover
from kvstore.transport import session as session_module
from proto.crescent.v1 import kvstore_pb2 as pb
from tests.helpers import wait_for

SLOT = 64 << 10


def _conn(node, prove=True):
    """A raw data-channel connection; ``prove``: it sends the node's shm proof first (a same-host
    client read it from the arena file), as the project's clients do."""
    s = socket.create_connection(("127.0.0.1", node.data_server.port), timeout=30)
    s.sendall(HELLO + node.data_server.token)
    if prove:
        s.sendall(encode_request(Op.PROVE, [node.transport.shm_proof], [0]))
        assert read_response(s) == ([(Status.OK, 0)], "")
    return s


def test_shm_grants_need_the_proof_that_only_a_reader_of_the_arena_file_has(make_node):
    import grpc

    from kvstore.arena import SECRET_BYTES, shm_proof
    from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

    node = make_node()
    StoreClient(node.address).put(b"k", b"v")
    s = _conn(node, prove=False)
    s.sendall(encode_request(Op.ACQUIRE, [b"k"], [0], pb.MOVER_SHM))
    items, msg, _ = read_grant_response(s)
    assert items == [(Status.FAILED_PRECONDITION, 0)] and "shm grants need proof" in msg
    s.sendall(encode_request(Op.PROVE, [b"x" * 16], [0]))  # a guess
    assert read_response(s) == ([(Status.FAILED_PRECONDITION, 0)], "wrong shm proof")
    s.sendall(encode_request(Op.RESERVE, [b"w"], [10], pb.MOVER_SHM))
    items, msg, _ = read_grant_response(s)
    assert items == [(Status.FAILED_PRECONDITION, 0)]
    with open(node.store.dram.path, "rb") as f:  # what a client that can open the file (0600) reads
        assert os.stat(f.fileno()).st_mode & 0o777 == 0o600
        f.seek(-SECRET_BYTES, os.SEEK_END)
        proof = shm_proof(f.read())
    s.sendall(encode_request(Op.PROVE, [proof], [0]))
    assert read_response(s) == ([(Status.OK, 0)], "")
    s.sendall(encode_request(Op.ACQUIRE, [b"k"], [0], pb.MOVER_SHM))
    items, _, blob = read_grant_response(s)
    assert items == [(Status.OK, 1)]
    s.sendall(_end(Op.RELEASE, decode_grant(blob, 1)[0]))
    assert read_response(s)[0] == [(Status.OK, 1)]
    s.close()
    with grpc.insecure_channel(node.address) as ch:  # the same over gRPC, in the call's metadata
        stub = pb_grpc.KVStoreStub(ch)
        for meta in (None, [("crescent-shm-proof", "00" * 16)], [("crescent-shm-proof", "not hex")]):
            try:
                stub.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=pb.MOVER_SHM), timeout=30, metadata=meta)
                raise AssertionError("granted without the proof")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "proof" in exc.details()
        r = stub.AcquireRead(pb.AcquireReadRequest(keys=[b"k"], mover=pb.MOVER_SHM), timeout=30,
                             metadata=[("crescent-shm-proof", proof.hex())])
        stub.ReleaseRead(pb.LeaseRequest(lease_id=r.lease_id), timeout=30)
    assert _leases(node)["num_remote_leases"] == 0
    c = StoreClient(node.address, transport="shm")  # the project's client proves on its own
    assert c.get(b"k") == b"v" and c.transport == "shm"
    c.close()


def _end(op, *lease_ids):
    body = b"".join(struct.pack("<Hq", 0, i) for i in lease_ids)
    return struct.pack("<4sBBHII", b"CRRQ", op, 0, 0, len(lease_ids), len(body)) + body


def _leases(node):
    return node.transport.leases.stats()


def test_grants_at_the_wire_match_the_rpcs(make_node):
    node = make_node(dram=1 << 22)
    c = StoreClient(node.address)
    value = os.urandom(3 * SLOT + 5)
    c.put(b"k", value)
    s = _conn(node)
    s.sendall(encode_request(Op.ACQUIRE, [b"k", b"missing"], [0, 0], pb.MOVER_SHM))
    items, msg, blob = read_grant_response(s)
    assert items == [(Status.OK, len(value)), (Status.NOT_FOUND, 0)] and msg == ""
    lease_id, ttl_s, arena, slots, gens = decode_grant(blob, 2)
    assert arena == node.store.dram.name and ttl_s == node.config.lease_ttl_s
    assert len(slots[0]) == 4 and slots[1] == [] and len(gens[0]) == 4
    sb = node.store.dram.slot_bytes
    got = b"".join(bytes(node.store.dram.buf[x * sb:(x + 1) * sb]) for x in slots[0])[: len(value)]
    assert got == value  # the descriptors name the value's bytes, in order
    assert _leases(node)["num_remote_leases"] == 1
    s.sendall(_end(Op.RELEASE, lease_id, 12345))  # one release, two ids: one good, one unknown
    items, msg = read_response(s)
    assert items == [(Status.OK, len(value)), (Status.FAILED_PRECONDITION, 0)] and "expired or unknown" in msg
    assert _leases(node)["num_remote_leases"] == 0
    # a write: reserve, fill through the node's own arena view, commit once
    s.sendall(encode_request(Op.RESERVE, [b"w"], [SLOT + 1], pb.MOVER_SHM))
    items, msg, blob = read_grant_response(s)
    assert items == [(Status.OK, SLOT + 1)]
    lease_id, _, _, slots, _ = decode_grant(blob, 1)
    new = os.urandom(SLOT + 1)
    for i, x in enumerate(slots[0]):
        part = new[i * sb:(i + 1) * sb]
        node.store.dram.buf[x * sb: x * sb + len(part)] = part
    assert c.exists([b"w"]) == [False]  # invisible until the commit
    s.sendall(_end(Op.COMMIT, lease_id))
    assert read_response(s) == ([(Status.OK, SLOT + 1)], "")
    assert c.get(b"w") == new
    s.sendall(_end(Op.COMMIT, lease_id))
    items, msg = read_response(s)
    assert items == [(Status.FAILED_PRECONDITION, 0)] and "already ended" in msg
    s.close()
    c.close()


def test_bad_descriptor_requests_get_precise_statuses_and_keep_the_connection(make_node):
    node = make_node()
    s = _conn(node)

    def ask(req, n=1):
        s.sendall(req)
        items, msg, _ = read_grant_response(s)
        assert len(items) == n
        return items[0][0], msg

    assert ask(encode_request(Op.ACQUIRE, [b"k"], [0], pb.MOVER_TCP)) == (
        Status.INVALID, "descriptors are for shm, rdma and cuda_ipc, not tcp")
    status, msg = ask(encode_request(Op.ACQUIRE, [b"k"], [0], 99))
    assert status is Status.INVALID and "unknown mover" in msg
    status, msg = ask(encode_request(Op.ACQUIRE, [b"ok", b""], [0, 0], pb.MOVER_SHM), n=2)
    assert status is Status.INVALID and "key" in msg
    status, msg = ask(encode_request(Op.RESERVE, [b"k"], [1 << 40], pb.MOVER_SHM))
    assert status is Status.INVALID and "exceeds the limit" in msg
    status, msg = ask(encode_request(Op.RESERVE, [b"k"], [-1], pb.MOVER_SHM))
    assert status is Status.INVALID
    status, msg = ask(_end(Op.COMMIT, 777))
    assert status is Status.FAILED_PRECONDITION
    status, msg = ask(_end(Op.COMMIT, 1, 2), n=2)
    assert status is Status.INVALID and "one lease id" in msg
    assert ask(_end(Op.ABORT, 777)) == (Status.OK, "")  # idempotent: nothing to abort
    # the connection still serves: a good grant after all the refusals
    s.sendall(encode_request(Op.ACQUIRE, [b"nothing-here"], [0], pb.MOVER_SHM))
    items, _, blob = read_grant_response(s)
    assert items == [(Status.NOT_FOUND, 0)] and decode_grant(blob, 1)[0] == 0
    assert _leases(node)["num_remote_leases"] == 0 and _leases(node)["num_remote_reservations"] == 0
    s.close()
    tcp_only = make_node(transport="tcp")
    s = _conn(tcp_only, prove=False)
    s.sendall(encode_request(Op.ACQUIRE, [b"k"], [0], pb.MOVER_SHM))
    items, msg, _ = read_grant_response(s)
    assert items == [(Status.FAILED_PRECONDITION, 0)] and "--transport tcp" in msg
    s.close()


def test_a_malformed_descriptor_request_closes_only_its_connection(make_node):
    node = make_node()
    for bad in (struct.pack("<4sBBHII", b"CRRQ", Op.ACQUIRE, pb.MOVER_SHM, 0, 3, 4) + b"\x01\x00ab",  # short body
                encode_request(Op.ACQUIRE, [b"k" * 2000], [0], pb.MOVER_SHM),  # key over the limit
                struct.pack("<4sBBHII", b"CRRQ", 99, 0, 0, 0, 0)):  # unknown op
        s = _conn(node)
        s.sendall(bad)
        assert s.recv(100) == b""  # closed, no answer
        s.close()
    c = StoreClient(node.address)
    c.put(b"k", b"v")
    assert c.get(b"k") == b"v" and c.descriptor_session().control_lane == "tcp"
    c.close()


def test_a_connection_that_stalls_before_its_hello_is_dropped_and_an_idle_session_is_not(make_node, monkeypatch):
    """A client that connects and says nothing, or part of its hello, loses the connection (and the node
    its thread) after HELLO_TIMEOUT_S; a session that said its hello may idle for as long as it likes."""
    import time

    from kvstore import dataserver

    monkeypatch.setattr(dataserver, "HELLO_TIMEOUT_S", 1.0)
    node = make_node()
    StoreClient(node.address).put(b"k", b"v")
    idle = _conn(node)
    silent = socket.create_connection(("127.0.0.1", node.data_server.port), timeout=30)
    partial = socket.create_connection(("127.0.0.1", node.data_server.port), timeout=30)
    partial.sendall(HELLO[:3])
    assert silent.recv(100) == b"" and partial.recv(100) == b""  # closed by the node, no answer
    silent.close()
    partial.close()
    time.sleep(2.5)  # well past the hello deadline: the session that said its hello is still served
    idle.sendall(encode_request(Op.EXISTS, [b"k", b"nope"], [0, 0]))
    assert read_response(idle) == ([(Status.OK, 0), (Status.NOT_FOUND, 0)], "")
    idle.close()


def test_a_request_that_stalls_midway_loses_its_connection_and_what_it_held(make_node, monkeypatch):
    """A PUT whose bytes stop coming held its reservations, and a GET whose answer is never read its
    leases, for as long as the connection stayed open (the node's room with them); now for STALL_S
    without progress. A session idle between requests keeps its connection."""
    from kvstore import dataserver

    monkeypatch.setattr(dataserver, "STALL_S", 1.0)
    node = make_node(dram=64 * 2**20)
    store = node.store
    StoreClient(node.address).batch_put([(b"v%d" % i, bytes([i]) * (2 << 20)) for i in range(24)])
    idle = _conn(node)
    put = _conn(node)
    put.sendall(encode_request(Op.PUT, [b"big"], [12 << 20]) + b"x" * 1024)  # 12 MiB promised, 1 KiB sent
    wait_for(lambda: store.stats()["tiers"][Tier.DRAM]["used_bytes"] > 48 << 20, what="the PUT's reservation")
    get = _conn(node)
    get.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    get.sendall(encode_request(Op.GET, [b"v%d" % i for i in range(24)], [-1] * 24))  # 48 MiB, never read
    wait_for(lambda: store.stats()["num_leases"] == 24, what="the GET's leases")
    assert put.recv(100) == b""  # (closed by the node, after STALL_S)
    wait_for(lambda: store.stats()["num_leases"] == 0, what="the unread GET's leases released")
    wait_for(lambda: store.stats()["tiers"][Tier.DRAM]["used_bytes"] <= (48 << 20) + (1 << 20),
             what="the stalled PUT's reservation given back")
    assert len(store) == 24
    idle.sendall(encode_request(Op.EXISTS, [b"v0", b"big"], [0, 0]))  # the idle session is still served
    assert read_response(idle) == ([(Status.OK, 0), (Status.NOT_FOUND, 0)], "")
    for s in (idle, put, get):
        s.close()


def test_a_get_naming_a_disk_value_many_times_reads_it_once(tmp_path):
    """A key named 64 times in one GET was leased (and its disk value read into memory) 64 times
    before anything was sent; now once, and its bytes go out as often as it is named."""
    from tests.helpers import store_nodes

    gen = store_nodes(tmp_path, with_disk=True)
    make = next(gen)
    try:
        node = make(dram=1 << 20, promote=False)
        value = os.urandom(4 << 20)
        with StoreClient(node.address, transport="grpc") as c:
            c.put(b"d", value)
        wait_for(lambda: node.store.stats()["tiers"][Tier.DISK]["num_entries"] == 1, what="the value on disk")
        read0 = node.store.stats()["disk_bytes_read"]
        s = _conn(node, prove=False)
        s.sendall(encode_request(Op.GET, [b"d"] * 64 + [b"nope"], [-1] * 65))
        items, _ = read_response(s)
        assert items == [(Status.OK, len(value))] * 64 + [(Status.NOT_FOUND, 0)]
        for _ in range(64):
            got = bytearray()
            while len(got) < len(value):
                got += s.recv(len(value) - len(got))
            assert got == value
        s.close()
        assert node.store.stats()["disk_bytes_read"] - read0 == len(value)
        assert node.store.stats()["num_leases"] == 0
    finally:
        gen.close()


def test_reads_release_without_waiting_and_leave_nothing_leased(make_node):
    node = make_node()
    c = StoreClient(node.address)
    session = c.descriptor_session()
    assert session.control_lane == "tcp"
    vals = {b"k%d" % i: os.urandom(SLOT * (i % 3) + i) for i in range(40)}
    c.batch_put(list(vals.items()))
    bufs = [bytearray(3 * SLOT) for _ in vals]
    for _ in range(5):
        assert c.batch_get_into(list(vals), bufs) == [len(v) for v in vals.values()]
    assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, vals.values()))
    # the last release was sent, not waited for: the node ends it on arrival all the same
    wait_for(lambda: _leases(node)["num_remote_leases"] == 0, what="the deferred release")
    c.delete([b"k0"])  # the next request reads (and checks) the deferred answers first
    assert session.num_late_release_failures == 0 and session.num_invalid_reads == 0
    assert node.store.stats()["tiers"][Tier.DRAM]["used_bytes"] > 0
    c.close()


def test_closing_a_client_waits_for_its_deferred_releases(make_node):
    node = make_node()
    with StoreClient(node.address) as w:
        w.put(b"k", b"v" * 1000)
    c = StoreClient(node.address)
    for _ in range(3):  # one grant (released later), then local reads
        assert c.get(b"k") == b"v" * 1000
    answered = []
    c.descriptor_session()._handle.control.release_later([424242], lambda items, msg: answered.append(items))
    c.close()  # no wait_for: the node has ended every lease by the time close returns
    assert _leases(node)["num_remote_leases"] == 0
    assert answered == [[(Status.FAILED_PRECONDITION, 0)]]  # the unknown lease's refusal was read
    assert node.transport.mover_counts()[Mover.SHM][0] == 3  # the grant's read, and two local ones reported



def _shm_reads(node):
    return node.transport.mover_counts()[Mover.SHM][0]


def _round_trip(session):
    """One answered request on the session's data-channel connection: by its answer the node
    has handled everything the session sent there without waiting (releases, REPORTs)."""
    assert session.control_lane == "tcp"
    assert session.abort(0) == 0  # no such reservation: nothing happens but the round trip


def test_remembered_values_are_read_locally_only_while_the_generation_table_confirms_them(make_node,
                                                                                           reports_only_at_close):
    node = make_node()
    c = StoreClient(node.address, transport="shm")
    other = StoreClient(node.address, transport="shm")  # changes values behind c's back
    session = c.descriptor_session()
    keys = [b"a", b"b", b"c", b"d"]
    first = {k: os.urandom(2 * SLOT + 9) for k in keys}
    other.batch_put(list(first.items()))
    bufs = [bytearray(4 * SLOT) for _ in keys]
    assert c.batch_get_into(keys, bufs) == [2 * SLOT + 9] * 4  # c learns the descriptors
    assert session.num_local_reads == 0
    wait_for(lambda: _shm_reads(node) == 1, what="the node to count the read (its release is not awaited)")
    assert c.batch_get_into(keys, bufs) == [2 * SLOT + 9] * 4
    _round_trip(session)
    assert session.num_local_reads == 4 and _shm_reads(node) == 1  # no call to the node (no REPORT: the fixture)
    assert [bytes(b[: len(first[k])]) for b, k in zip(bufs, keys)] == [first[k] for k in keys]

    def slots_of(key):
        g = other.descriptor_session().acquire([key])
        other.descriptor_session().release(g.lease_id)
        return g.items[0].slots, g.items[0].generations

    new_a = os.urandom(2 * SLOT + 9)
    other.put(b"a", new_a)  # replaced: new slots
    old_b = slots_of(b"b")
    other.delete([b"b"])
    new_b = os.urandom(2 * SLOT + 9)
    other.put(b"b", new_b)  # the same slots again (freed slots come back in order), new generations
    assert slots_of(b"b")[0] == old_b[0] and slots_of(b"b")[1] != old_b[1]
    other.delete([b"c"])
    # d is replaced while a third reader leases its old value: the old slots are neither
    # freed nor rewritten, but they no longer hold d's value
    held = StoreClient(node.address, transport="shm", local_reads=False).descriptor_session()
    lease = held.acquire([b"d"])
    new_d = os.urandom(SLOT)
    other.put(b"d", new_d)
    sizes = c.batch_get_into(keys, bufs)
    assert sizes == [len(new_a), len(new_b), None, len(new_d)]
    assert bytes(bufs[0][: len(new_a)]) == new_a and bytes(bufs[1][: len(new_b)]) == new_b
    assert bytes(bufs[3][: len(new_d)]) == new_d
    assert session.num_local_reads == 4 and session.num_local_misses == 0  # all four asked the node
    held.release(lease.lease_id)
    assert c.get(b"b") == new_b and c.get(b"c") is None and c.get(b"d") == new_d
    assert session.num_local_reads == 6
    c.close()
    other.close()


def test_local_reads_are_reported_to_the_node(make_node, reports_only_at_close):
    node = make_node()
    c = StoreClient(node.address, transport="shm")
    c.put(b"k", b"v" * 1000)
    dram = lambda: node.store.stats()["tiers"][Tier.DRAM]["hits"]  # noqa: E731
    hits, out = dram(), node.store.stats()["bytes_out"]
    for _ in range(5):
        assert c.get(b"k") == b"v" * 1000
    assert c.descriptor_session().num_local_reads == 5
    _round_trip(c.descriptor_session())
    assert dram() == hits and _shm_reads(node) == 0  # not told yet (the fixture)
    c.close()  # reports what the periodic report has not, and waits for the node's answer
    assert dram() == hits + 5 and node.store.stats()["bytes_out"] == out + 5000
    assert node.transport.mover_counts()[Mover.SHM][0::2] == [5, 5000]  # batches, bytes
    s = _conn(node)
    # wrong count; more batches than values; negative; more values or bytes than any second's reads
    for args in ([1, 2], [1, 10, 2], [-1, 0, 0], [(1 << 32) + 1, 0, 0], [1, (1 << 50) + 1, 1]):
        s.sendall(_end(Op.REPORT, *args))
        items, msg = read_response(s)
        assert items == [(Status.INVALID, 0)] * len(args) and "REPORT takes" in msg
    assert dram() == hits + 5
    s.close()
    # the counters saturate at what Stats (uint64) carries instead of breaking it for good
    from kvstore.store import U64_MAX

    for _ in range(3):
        node.transport.local_reads(1 << 63, 1 << 63, 1 << 63)
    with StoreClient(node.address, transport="grpc") as g:
        st = g.stats()
        assert st["tiers"]["dram"]["hits"] == U64_MAX and st["movers"]["shm"]["bytes_read"] == U64_MAX
        assert g.get(b"k") == b"v" * 1000  # a read the node serves adds to them: still a u64 (it failed Stats)
        st = g.stats()
    assert st["tiers"]["dram"]["hits"] == U64_MAX and node.store.stats()["bytes_out"] == U64_MAX


def test_local_reads_are_reported_while_the_session_runs(make_node, monkeypatch):
    monkeypatch.setattr(session_module, "REPORT_EVERY_S", 0.0)  # the timer is always due: each batch reports
    node = make_node()
    c = StoreClient(node.address, transport="shm")
    c.put(b"k", b"v" * 1000)
    dram = lambda: node.store.stats()["tiers"][Tier.DRAM]["hits"]  # noqa: E731
    hits = dram()
    for i in range(1, 4):
        assert c.get(b"k") == b"v" * 1000
        # sent without waiting for the answer: the node counts it on arrival
        wait_for(lambda: dram() == hits + i and _shm_reads(node) == i, what=f"the report of local read {i}")
    assert c.descriptor_session().num_local_reads == 3
    assert node.transport.mover_counts()[Mover.SHM][0::2] == [3, 3000]  # batches, bytes
    c.close()  # nothing left to report
    assert dram() == hits + 3


def test_a_local_read_whose_slots_are_rewritten_mid_copy_is_refused(make_node):
    node = make_node()
    r = StoreClient(node.address, transport="shm")
    w = StoreClient(node.address, transport="shm")
    w.put(b"k", b"k" * (2 * SLOT))
    assert r.get(b"k") == b"k" * (2 * SLOT)  # r remembers k's slots
    session = r.descriptor_session()
    mover = session._handle.mover
    real_read = mover.read

    def read_after_a_rewrite(ops, bufs=()):  # the real copy, after k's slots went to another key
        mover.read = real_read
        w.delete([b"k"])
        w.put(b"other", b"o" * (2 * SLOT))  # freed slots come back in order: the same two
        real_read(ops, bufs)

    assert r.get(b"k") is not None  # a local read
    mover.read = read_after_a_rewrite
    buf = bytearray(2 * SLOT)
    assert r.batch_get_into([b"k"], [buf]) == [None]  # the copy read "o"s: refused, then a miss
    assert buf == b"o" * (2 * SLOT) and session.num_local_misses == 1
    r.close()
    w.close()


def test_a_value_read_locally_gets_a_second_chance_at_eviction(make_node, reports_only_at_close):
    node = make_node(dram=16 * SLOT)
    w = StoreClient(node.address, transport="shm", local_reads=False)  # every read through the node
    r = StoreClient(node.address, transport="shm")
    for i in range(6):
        w.put(b"k%d" % i, bytes([i]) * (2 * SLOT))
    assert r.get(b"k0") == bytes([0]) * (2 * SLOT)  # r learns k0 (a grant: k0 is now the most recent)
    assert all(w.batch_get([b"k%d" % i for i in range(1, 6)]))  # k1..k5 more recent than k0 for the node
    assert r.get(b"k0") == bytes([0]) * (2 * SLOT)  # read locally: the node sees only the touched mark
    assert r.descriptor_session().num_local_reads == 1
    hits = node.store.stats()["tiers"][Tier.DRAM]["hits"]
    w.put(b"k6", b"x" * (2 * SLOT))
    w.put(b"k7", b"x" * (2 * SLOT))  # past the high watermark: eviction down to the low one
    assert w.exists([b"k0", b"k1"]) == [True, False]  # k0 survived, the oldest untouched went
    _round_trip(r.descriptor_session())
    assert node.store.stats()["tiers"][Tier.DRAM]["hits"] == hits  # r reports its read itself, at close
    r.close()
    assert node.store.stats()["tiers"][Tier.DRAM]["hits"] == hits + 1  # ...and once: eviction did not count it
    w.close()


def test_remembered_descriptors_never_return_a_stale_or_foreign_value(make_node):
    """Random puts, replaces and deletes (often re-created at once) by one client, some under
    a third client's lease, reads by another that reads remembered values locally; a 16-slot
    arena keeps evicting and handing the slots to other keys. (A copy racing a rewrite of its
    slots needs real concurrency: test_processes.py; the same-slots-new-generation and the
    replaced-under-a-lease cases: the test above.)"""
    import random

    node = make_node(dram=16 * SLOT)
    reader = StoreClient(node.address, transport="shm")
    writer = StoreClient(node.address, transport="shm")
    holder = StoreClient(node.address, transport="shm", local_reads=False).descriptor_session()
    rng = random.Random(8)
    keys = [b"key%d" % i for i in range(8)]
    latest: dict[bytes, bytes] = {}
    bufs = [bytearray(4 * SLOT) for _ in keys]
    held: list[int] = []
    hits = 0
    for step in range(300):
        op = rng.random()
        k = rng.choice(keys)
        if op < 0.3:
            v = bytes([step % 251]) * rng.choice([SLOT, 2 * SLOT, 2 * SLOT + 7, 3 * SLOT])
            writer.put(k, v)
            latest[k] = v
        elif op < 0.4:  # a delete, often re-created at once: freed slots come back to the same key
            writer.delete([k])
            latest.pop(k, None)
            if rng.random() < 0.5:
                v = bytes([step % 251]) * (2 * SLOT)
                writer.put(k, v)
                latest[k] = v
        elif op < 0.5:  # a lease held across later replaces (its slots stay, retired)
            g = holder.acquire([k])
            if g.lease_id:
                held.append(g.lease_id)
            if len(held) > 2:
                holder.release(held.pop(0))
        else:
            want = rng.sample(keys, 6)
            for key, buf, n in zip(want, bufs, reader.batch_get_into(want, bufs[:6])):
                if n is not None:  # evicted values may miss; a hit is always the latest value
                    assert key in latest and bytes(buf[:n]) == latest[key], (step, key)
                    hits += 1
    session = reader.descriptor_session()
    assert hits > 100 and session.num_local_reads > 0
    assert node.store.stats()["tiers"][Tier.DRAM]["evictions"] > 0
    reader.close()
    writer.close()
