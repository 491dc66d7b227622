"""Real processes: readers racing an evicting node, a reader killed holding a lease, a writer
killed holding a reservation. A store process and client processes, each stopped by its pid."""

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest

from kvstore.client import StoreClient
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import ROOT, StoreProcess, wait_for

# A value names itself: 16-byte key, version, size, then a digest of those repeated. A torn
# read (two versions) or a foreign one (another key) cannot pass the check.
_VALUES = r'''
import hashlib, struct
def make_value(key, version, size):
    hdr = key.ljust(16, b"\0") + struct.pack("<QQ", version, size)
    dig = hashlib.blake2b(hdr, digest_size=32).digest()
    return hdr + (dig * (size // 32 + 1))[: size - len(hdr)]
def check_value(key, buf, size):
    if size < 32 or bytes(buf[:16]) != key.ljust(16, b"\0"):
        return "foreign"
    version, n = struct.unpack("<QQ", bytes(buf[16:32]))
    if n != size or bytes(buf[:size]) != make_value(key, version, size):
        return "torn"
    return None
'''

_WRITER = _VALUES + r'''
import os, random, sys, time
from kvstore.client import StoreClient
addr, transport = sys.argv[1], sys.argv[2]
seconds, seed, nkeys = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
stop, limit = sys.argv[6], float(sys.argv[7])
c = StoreClient(addr, transport=transport)
assert c.transport == transport, c.transport_notes
rng, version, n = random.Random(seed), seed << 32, 0
start = time.monotonic()
# at least `seconds`, then on until the readers are done (the file `stop`), at most `limit`
while time.monotonic() < start + seconds or (not os.path.exists(stop) and time.monotonic() < start + limit):
    items = []
    for _ in range(4):
        version += 1
        key = b"key-%03d" % rng.randrange(nkeys)
        items.append((key, make_value(key, version, rng.randrange(32, 300_000))))
    c.batch_put(items)
    if rng.random() < 0.1:
        c.delete([items[0][0]])
    n += 1
print(n, flush=True)
'''

_READER = _VALUES + r'''
import json, random, sys, time
from kvstore.client import StoreClient
from kvstore.errors import FailedPreconditionError
from kvstore.transport.descriptors import ItemStatus
addr, seconds, ttl = sys.argv[1], float(sys.argv[2]), float(sys.argv[5])
seed, nkeys, limit = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[6])
c = StoreClient(addr, transport="shm")
assert c.transport == "shm", c.transport_notes
session = c.descriptor_session()
rng = random.Random(seed)
# expired: slow reads whose release the node refused; reused: those whose copy also read
# other bytes (the slots had gone to other values: the race the lease guards against)
st = {"hits": 0, "misses": 0, "slow_hits": 0, "expired": 0, "reused": 0, "bad": []}
bufs = [bytearray(300_000) for _ in range(8)]
seen = lambda: st["slow_hits"] and st["reused"] and session.num_local_reads  # noqa: E731
start = time.monotonic()
# at least `seconds`, then on until each kind of read happened, at most `limit`
while time.monotonic() < start + seconds or (not seen() and time.monotonic() < start + limit):
    keys = [b"key-%03d" % rng.randrange(nkeys) for _ in range(8)]
    if rng.random() < 0.25:  # a slow reader: holds its lease, then copies
        overdue = rng.random() < 0.5
        g = session.acquire(keys)
        # overdue: copies after the node's deadline (at most ttl after this grant came back)
        time.sleep(1.5 * ttl if overdue else rng.uniform(0, ttl / 4))
        ok = [d for d in g.items if d.status is ItemStatus.OK]
        for d in ok:
            session.read(d, bufs[d.index])
        if g.lease_id:
            try:
                session.release(g.lease_id)
            except FailedPreconditionError:
                st["expired"] += 1
                if any(check_value(keys[d.index], bufs[d.index], d.size) for d in ok):
                    st["reused"] += 1
                continue
            if overdue:
                st["bad"].append(["released after its deadline", keys[0].decode(), "slow"])
        for d in ok:
            why = check_value(keys[d.index], bufs[d.index], d.size)
            if why:
                st["bad"].append([why, keys[d.index].decode(), "slow"])
            st["slow_hits"] += 1
        continue
    sizes = c.batch_get_into(keys, bufs)  # local reads of remembered values included
    for k, b, n in zip(keys, bufs, sizes):
        if n is None:
            st["misses"] += 1
            continue
        why = check_value(k, b, n)
        if why:
            st["bad"].append([why, k.decode(), "batch"])
        st["hits"] += 1
st["local"] = session.num_local_reads
st["late"] = session.num_invalid_reads
print(json.dumps(st), flush=True)
'''


def _spawn(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture
def store():
    procs = []

    def start(*args, host_id=None):
        p = StoreProcess("--transport", "auto", *args, host_id=host_id)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def test_concurrent_readers_never_see_torn_or_foreign_bytes(store, tmp_path):
    """Writers churn 64 keys through a 32-slot arena (every put evicts) while readers copy
    slots directly; slow readers hold leases past their TTL so that slots are reused under
    them. Each reader runs until that happened to it at least once (and it also read slowly
    within the TTL, and read remembered values locally), within a generous bound; the
    writers churn until the readers are done."""
    ttl, seconds, limit, nkeys = 0.4, 6.0, 120.0, 64
    stop = tmp_path / "readers-done"
    node = store("--dram", "2MiB", "--slot-size", "64KiB", "--lease-ttl-s", str(ttl))
    writers = [_spawn(_WRITER, node.address, "shm", seconds, 1, nkeys, stop, limit + 30),
               _spawn(_WRITER, node.address, "tcp", seconds, 2, nkeys, stop, limit + 30)]
    readers = [_spawn(_READER, node.address, seconds, 3, nkeys, ttl, limit),
               _spawn(_READER, node.address, seconds, 4, nkeys, ttl, limit)]
    try:
        outs = [_finish(p, limit + 60) for p in readers]
        stop.touch()
        outs += [_finish(p, 120) for p in writers]
    finally:
        for p in readers + writers:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=60)
    got = [json.loads(o) for o in outs[:2]]
    assert all(int(o) > 0 for o in outs[2:]), outs
    assert [r["bad"] for r in got] == [[], []], got
    for r in got:  # the race happened, and was caught: every reader copied slots reused under
        # an expired lease (the release refused it), and read slowly but in time, and locally
        assert r["reused"] > 0 and r["expired"] >= r["reused"], got
        assert r["slow_hits"] > 0 and r["hits"] > 0 and r["local"] > 0, got
    with StoreClient(node.address) as c:
        s = c.stats()
        assert s["tiers"]["dram"]["evictions"] > 0
        assert s["num_expired_leases"] >= sum(r["expired"] for r in got), (s, got)
        wait_for(lambda: c.stats()["num_remote_leases"] == 0, what="every lease to end")


_HOLDER = r'''
import sys, time
from kvstore.client import StoreClient
c = StoreClient(sys.argv[1], transport="shm")
session = c.descriptor_session()
if sys.argv[2] == "read":
    g = session.acquire([b"held"])
else:
    g = session.reserve([(b"abandoned", 1 << 20)])
    session.write(g.items[0], b"x" * (1 << 20))  # filled, never committed
print(g.lease_id, flush=True)
time.sleep(600)
'''


def test_client_killed_holding_a_lease(store):
    node = store("--dram", "8MiB", "--lease-ttl-s", "1.5")
    c = StoreClient(node.address, transport="tcp")
    c.put(b"held", os.urandom(1 << 20))
    holder = _spawn(_HOLDER, node.address, "read")
    try:
        assert int(holder.stdout.readline()) > 0
        s = c.stats()  # held, or (a stall longer than the TTL on a loaded machine) already expired
        assert s["num_remote_leases"] + s["num_expired_leases"] == 1
        c.delete([b"held"])  # the value goes; its slots stay while the lease holds them
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=60)
        holder.stdout.close()
        holder.stderr.close()
    wait_for(lambda: c.stats()["tiers"]["dram"]["used_bytes"] == 0, what="the dead reader's slots to return")
    s = c.stats()
    assert s["num_remote_leases"] == 0 and s["num_expired_leases"] == 1
    c.close()


def test_writer_killed_holding_a_reservation(store):
    node = store("--dram", "8MiB", "--lease-ttl-s", "1.0")
    c = StoreClient(node.address, transport="tcp")
    writer = _spawn(_HOLDER, node.address, "write")
    try:
        lease_id = int(writer.stdout.readline())
        assert lease_id > 0
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=60)
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(timeout=60)
        writer.stdout.close()
        writer.stderr.close()
    assert c.exists([b"abandoned"]) == [False]
    wait_for(lambda: c.stats()["num_expired_reservations"] == 1, what="the reservation to expire")
    ch = grpc.insecure_channel(node.address)
    with pytest.raises(grpc.RpcError) as e:  # nobody can commit it any more
        pb_grpc.KVStoreStub(ch).CommitWrite(pb.LeaseRequest(lease_id=lease_id), timeout=30)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    ch.close()
    wait_for(lambda: c.stats()["tiers"]["dram"]["used_bytes"] == 0, what="the quarantined slots to return")
    assert c.exists([b"abandoned"]) == [False]
    with StoreClient(node.address, transport="shm") as w:
        w.put(b"abandoned", b"fresh")
        assert w.get(b"abandoned") == b"fresh"
    c.close()


def test_client_follows_a_restarted_node_to_its_new_arena(store):
    first = store("--dram", "8MiB")
    port = first.address.rpartition(":")[2]
    c = StoreClient(first.address, transport="shm")
    c.put(b"k", b"before")
    old_arena = c.descriptor_session().arena.name
    old_data_port = c._limits.data_port
    assert c.descriptor_session().control_lane == "tcp"
    first.stop()
    second = store("--dram", "8MiB", "--listen", f"127.0.0.1:{port}")
    # DRAM is volatile; the grant calls' channel broke (the new node listens on another data
    # port), so the session asked the node again and re-mapped its new arena
    assert c.get(b"k") is None
    c.put(b"k", b"after")
    assert c.get(b"k") == b"after"
    assert c.transport == "shm" and c.descriptor_session().arena.name != old_arena
    assert c.descriptor_session().control_lane == "tcp" and c._limits.data_port != old_data_port
    c.close()
    second.stop()


def test_a_different_host_id_means_tcp_never_shm(store, monkeypatch):
    """Emulated hosts (network namespaces on one machine) share a hostname, a kernel and /dev/shm;
    `crescent --host-id` makes them talk as different hosts do."""
    from kvstore.client import StoreClient
    from kvstore.transport.identity import HOST_ID_ENV, host_identity

    p = store(host_id="rack1-host7")
    with StoreClient(p.address) as c:  # this process's host id: the hostname
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"
        assert c.transport == "tcp" and "shm needs the same host" in c.transport_notes
    monkeypatch.setenv(HOST_ID_ENV, "rack1-host7")
    host_identity.cache_clear()
    try:
        with StoreClient(p.address) as c:
            assert c.transport == "shm" and c.get(b"k") == b"v"
    finally:
        monkeypatch.delenv(HOST_ID_ENV)
        host_identity.cache_clear()
