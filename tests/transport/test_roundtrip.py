"""One-sided movers end to end on a real node: round trips, fallbacks, the choice and its visibility."""

import os
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from kvstore.client import StoreClient
from kvstore.errors import FailedPreconditionError, InvalidArgumentError
from kvstore.store import Tier
from kvstore.transport.descriptors import ArenaRef
from kvstore.transport.rdma import probe
from kvstore.transport.shm import ShmMover, ShmUnavailableError
from tests.helpers import wait_for
from tests.transport.simulated_hca import simulate_rdma

MiB = 1 << 20
SLOT = 64 << 10


@pytest.fixture
def node(make_node):
    return make_node()


@pytest.fixture(params=["tcp", "grpc"])
def client(request, mover, node):
    """A client of each mover, its grant calls on the data channel (tcp) or as RPCs (grpc)."""
    c = StoreClient(node.address, transport=mover, data_channel=request.param == "tcp")
    assert c.transport == mover, c.transport_notes
    assert c.descriptor_session().control_lane == request.param
    yield c
    c.close()


def test_round_trip_sizes(client, node):
    sizes = [0, 1, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 7, 9 * MiB + 3]
    vals = {b"v%d" % i: os.urandom(n) for i, n in enumerate(sizes)}
    assert client.batch_put(list(vals.items())) == [True] * len(vals)
    assert all(node.store.tier_of(k) is Tier.DRAM for k in vals)
    got = client.batch_get(list(vals) + [b"missing"])
    assert [bytes(g) for g in got[:-1]] == list(vals.values()) and got[-1] is None
    bufs = [bytearray(10 * MiB) for _ in vals]
    assert client.batch_get_into(list(vals), bufs) == sizes
    assert all(bytes(b[:n]) == v for b, n, v in zip(bufs, sizes, vals.values()))
    assert client.get(b"missing") is None
    s = client.stats()
    assert s["num_remote_leases"] == 0 and s["num_remote_reservations"] == 0
    if client.transport == "shm":  # the writer remembers its values' slots: every read was local
        assert client.descriptor_session().num_local_reads == 2 * len(vals)
    else:
        assert s["movers"][client.transport]["num_reads"] >= 2
    assert s["movers"][client.transport]["num_writes"] == 1
    assert s["movers"][client.transport]["bytes_written"] == sum(sizes)


def test_buffers_of_every_kind_and_multi_part_values(client):
    header, payload = b"H" * 100, torch.arange(200_000, dtype=torch.int32)
    client.put(b"parts", [header, payload])  # a chunk's shape: header bytes + tensor payload
    want = header + payload.numpy().tobytes()
    assert client.get(b"parts") == want
    n = len(want)
    ba, mv = bytearray(n), memoryview(bytearray(n + 5))
    t = torch.zeros(n + 3, dtype=torch.uint8)
    arr = np.zeros(n, dtype=np.uint8)
    assert client.batch_get_into([b"parts"] * 4, [ba, mv, t, arr]) == [n] * 4
    assert bytes(ba) == want and bytes(mv[:n]) == want
    assert t[:n].numpy().tobytes() == want and arr.tobytes() == want


def test_value_larger_than_its_buffer_is_refused_and_the_lease_ends(client):
    client.put(b"big", os.urandom(SLOT * 2))
    with pytest.raises(InvalidArgumentError, match="exceeds its buffer"):
        client.batch_get_into([b"big"], [bytearray(10)])
    assert client.stats()["num_remote_leases"] == 0
    with pytest.raises(InvalidArgumentError, match="writable"):
        client.batch_get_into([b"big"], [b"read-only"])


def test_stats_count_every_read_this_client_made(mover, node, monkeypatch):
    """On the data channel a read's release is sent without waiting, and local reads are reported
    once a second: ``stats()`` settles both first, so it counts the reads just made and no lease is
    left. The node's release is slowed down here so that a stats call that did not wait would
    overtake it."""
    c = StoreClient(node.address, transport=mover)
    assert c.descriptor_session().control_lane == "tcp"
    try:
        c.put(b"w", b"x" * 1000)  # shm: remembered, read with no call to the node, reported later
        other = StoreClient(node.address, transport="tcp")
        other.put(b"r", b"y" * 2000)  # not known to c: read through a grant, released without waiting
        other.close()
        leases, release = node.transport.leases, node.transport.leases.release
        released = threading.Event()

        def slow_release(lease_id):
            time.sleep(0.5)
            try:
                return release(lease_id)
            finally:
                released.set()

        monkeypatch.setattr(leases, "release", slow_release)
        before = node.store.stats()["tiers"][Tier.DRAM]["hits"]
        assert c.get(b"w") == b"x" * 1000 and c.get(b"r") == b"y" * 2000
        s = c.stats()
        assert released.is_set() and s["num_remote_leases"] == 0
        # shm: one granted read, one batch of local reads (checked against the generation table
        # in the mapped arena); rdma reads that table through no mapping: two granted reads
        assert s["movers"][mover]["num_reads"] == 2
        assert s["tiers"]["dram"]["hits"] - before == 2
        assert c.descriptor_session().num_local_reads == (1 if mover == "shm" else 0)
    finally:
        c.close()


def test_replace_and_delete_under_a_lease_keep_the_leased_bytes(client, node):
    old = os.urandom(5 * SLOT)
    client.put(b"k", old)
    session = client.descriptor_session()
    grant = session.acquire([b"k"])
    client.put(b"k", os.urandom(5 * SLOT))  # replace: the old slots stay until the release
    client.delete([b"k"])
    buf = bytearray(len(old))
    session.read(grant.items[0], buf)
    session.release(grant.lease_id)
    assert bytes(buf) == old
    assert node.store.stats()["tiers"][Tier.DRAM]["used_bytes"] == 0  # freed at the release


@pytest.mark.parametrize("promote", [True, False])
def test_values_outside_the_arena_are_read_and_written_another_way(mover, make_node, promote):
    node = make_node(dram=1 * MiB, with_disk=True, high_watermark=1.0, low_watermark=0.5, promote=promote)
    c = StoreClient(node.address, transport=mover)
    vals = {b"d%d" % i: os.urandom(200_000) for i in range(12)}  # 12 × 4 slots > 16 slots: demotions
    assert c.batch_put(list(vals.items())) == [True] * 12
    assert node.store.stats()["demotions"] > 0
    on_disk = [k for k in vals if node.store.tier_of(k) is Tier.DISK]
    assert on_disk
    before = node.store.stats()
    for k in on_disk:  # promoted into the arena and read in place, or read over TCP
        buf = bytearray(200_000)
        assert c.batch_get_into([k], [buf]) == [200_000] and bytes(buf) == vals[k]
    movers = c.stats()["movers"]
    st = node.store.stats()
    promoted = st["promotions"] - before["promotions"]
    deferred = st["promotions_deferred"] - before["promotions_deferred"]
    if promote:  # DRAM is full: one read has not earned a place (served over TCP) ...
        assert (promoted, deferred) == (0, len(on_disk)) and movers["tcp"]["num_reads"] == len(on_disk)
        for k in on_disk:  # ... a second one has: promoted, and read in place
            buf = bytearray(200_000)
            assert c.batch_get_into([k], [buf]) == [200_000] and bytes(buf) == vals[k]
        movers = c.stats()["movers"]
        assert node.store.stats()["promotions"] - before["promotions"] == len(on_disk)
        assert movers[mover]["num_reads"] == len(on_disk) and movers["tcp"]["num_reads"] == len(on_disk)
    else:
        assert movers["tcp"]["num_reads"] == len(on_disk) and promoted == 0
    bufs = [bytearray(200_000) for _ in vals]
    assert c.batch_get_into(list(vals), bufs) == [200_000] * 12
    assert [bytes(b) for b in bufs] == list(vals.values())
    huge = os.urandom(2 * MiB)  # larger than the whole arena: the streamed put lands on disk
    assert c.batch_put([(b"huge", huge)]) == [True]
    assert node.store.tier_of(b"huge") is Tier.DISK and c.get(b"huge") == huge
    c.close()


@pytest.mark.parametrize("transport", ["shm", "rdma", "tcp", "grpc"])
def test_get_returns_bytes_of_its_own_from_every_path(make_node, monkeypatch, transport):
    """``get`` and ``batch_get_bytes`` read into a buffer the client keeps per thread and make the
    ``bytes`` from there: each result must be a ``bytes`` object of its own, which later reads (of
    smaller, larger, missing values, from the arena or the disk tier, or above the kept buffer's
    limit) leave alone. ``batch_get`` reads into the caller's ``alloc``."""
    import kvstore.client as client_module

    if transport == "rdma" and probe() is not None:
        simulate_rdma(monkeypatch)  # (as the mover fixture: before the node starts)
    monkeypatch.setattr(client_module, "_SLAB_MAX", 3 * MiB)  # (the limit's path at a small size)
    node = make_node(dram=4 * MiB, with_disk=True, high_watermark=1.0, low_watermark=0.5, promote=False)
    with StoreClient(node.address, transport=transport) as c:
        assert c.transport == transport, c.transport_notes
        vals = {b"small": os.urandom(1000), b"mid": os.urandom(MiB + 7), b"big": os.urandom(2 * MiB + 3)}
        assert c.batch_put(list(vals.items())) == [True] * 3
        huge = os.urandom(5 * MiB)  # larger than the arena (on disk) and than the kept buffer
        assert c.batch_put([(b"huge", huge)]) == [True]
        assert node.store.tier_of(b"huge") is Tier.DISK
        vals[b"huge"] = huge
        order = [b"mid", b"small", b"big", b"missing", b"huge", b"mid", b"small"]
        got = [c.get(k) for k in order]
        for k, g in zip(order, got):
            assert g is None if k == b"missing" else (type(g) is bytes and g == vals[k]), k
        results = {}

        def other_thread():  # a buffer of its own: this thread's results stay as they were
            results["mid"] = c.get(b"mid")

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(timeout=60)
        assert results["mid"] == vals[b"mid"] and got[0] == vals[b"mid"]
        # batch_get_bytes: a batch into the same kept buffer, values past its room or its limit
        # in buffers of their own; a later batch leaves an earlier one's results alone
        batches = [[b"small", b"mid", b"missing", b"small"], [b"mid", b"small", b"big", b"huge", b"missing"],
                   [b"small", b"mid", b"missing", b"small"], [b"big", b"mid"]]
        seen = []
        for batch in batches:
            out = c.batch_get_bytes(batch)
            seen.append(out)
            assert len(out) == len(batch)
            for k, g in zip(batch, out):
                assert g is None if k == b"missing" else (type(g) is bytes and g == vals[k]), k
        for batch, out in zip(batches, seen):
            assert [g if g is None else bytes(g) for g in out] == [vals.get(k) for k in batch]
        # batch_get with a destination of the caller's: asked once per value found, by its index
        class Mine(bytearray):
            pass

        asked = []

        def alloc(i, size):
            asked.append((i, size))
            return Mine(size)

        out = c.batch_get([b"missing", b"big", b"small", b"huge"], alloc)
        assert out[0] is None and all(type(v) is Mine for v in out[1:])
        assert [bytes(v) for v in out[1:]] == [vals[b"big"], vals[b"small"], vals[b"huge"]]
        assert sorted(set(asked)) == [(1, len(vals[b"big"])), (2, 1000), (3, len(huge))]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_threads_reading_new_bytes_through_one_client_never_share_a_buffer(make_node, transport):
    """Four threads read overlapping batches as new bytes through one client at once: each
    caller's values land in a kept buffer of its own, so every result is its key's value."""
    node = make_node(dram=32 * MiB)
    with StoreClient(node.address, transport=transport) as c:
        vals = {b"v%02d" % i: os.urandom(100_000 + 37 * i) for i in range(24)}
        assert c.batch_put(list(vals.items())) == [True] * len(vals)
        keys, wrong, errors = list(vals), [], []

        def reader(t: int) -> None:
            try:
                for r in range(40):
                    batch = keys[(t * 5 + r) % 12:][: 4 + (r + t) % 9] + [b"nope"]
                    got = c.batch_get_bytes(batch) if r % 3 else [c.get(k) for k in batch]
                    wrong.extend(k for k, g in zip(batch, got) if g != vals.get(k))
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and wrong == [] and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_lookup_and_exists_on_the_data_channel_answer_as_the_rpcs_do(make_node, monkeypatch, transport):
    """lookup/exists go over the data channel when the node says it answers them there
    (``data_ops``): the same answers as the RPCs (tiers, prefixes, misses, bad keys), on one
    connection kept open, counted in the node's metrics; a node that does not say so (one of
    an earlier version) is asked over gRPC."""
    import kvstore.server as server_module

    def counts(node) -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=30).read().decode()
        return {(op, path): float(line.rsplit(" ", 1)[1]) for op in ("lookup", "exists") for path in ("tcp", "grpc")
                for line in text.splitlines()
                if line.startswith(f'crescent_store_op_seconds_count{{op="{op}",path="{path}"}}')}

    node = make_node(dram=4 * MiB, with_disk=True, high_watermark=1.0, low_watermark=0.5, promote=False, metrics_port=0)
    with StoreClient(node.address, transport=transport) as c, StoreClient(node.address, data_channel=False) as g:
        keys = [b"q%d" % i for i in range(6)]
        assert c.batch_put([(k, os.urandom(200_000)) for k in keys[:4]]) == [True] * 4
        assert c.batch_put([(b"huge", os.urandom(5 * MiB))]) == [True]  # larger than the arena: on disk
        keys.insert(2, b"huge")
        for q in (keys, keys[::-1], [b"q0", b"huge"], [b"missing"] + keys, [b"q1"], []):
            assert c.lookup_tiers(q) == g.lookup_tiers(q), q
            assert c.exists(q) == g.exists(q), q
        n, tiers = c.lookup_tiers(keys)
        assert n == 5 and tiers == [Tier.DRAM] * 2 + [Tier.DISK] + [Tier.DRAM] * 2
        assert c.exists(keys) == [True] * 5 + [False, False] and c.lookup([b"missing", b"q0"]) == 0
        with pytest.raises(InvalidArgumentError, match="key"):
            c.lookup([b"q0", b"x" * 5000])
        conn = c._data_channel().current() if transport != "grpc" else None
        before = counts(node)
        for _ in range(3):
            assert c.lookup(keys) == 5 and c.exists([b"q0"]) == [True]
        if conn is not None:
            assert c._data_channel().current() is conn  # the node kept the connection open
        got = counts(node)
        path = "grpc" if transport == "grpc" else "tcp"
        assert got[("lookup", path)] - before.get(("lookup", path), 0) == 3
        assert got[("exists", path)] - before.get(("exists", path), 0) == 3
    monkeypatch.setattr(server_module, "DATA_OPS", 0)  # a node that predates the queries on its data channel
    old = make_node(metrics_port=0)
    with StoreClient(old.address, transport=transport) as c:
        c.put(b"k", b"v")
        assert c.lookup([b"k", b"nope"]) == 1 and c.exists([b"nope", b"k"]) == [False, True]
    assert counts(old) == {("lookup", "grpc"): 1.0, ("exists", "grpc"): 1.0}


def test_choice_follows_the_node_and_the_request(make_node):
    auto = make_node()
    with StoreClient(auto.address) as c:
        assert c.transport == "shm" and "rdma" in c.transport_notes
        c.put(b"k", b"v")
        assert c.stats()["transport"] == "shm" and c.stats()["node_transport"] == "auto"
    with StoreClient(auto.address, transport="tcp") as c:
        assert c.transport == "tcp" and c.get(b"k") == b"v"
    with StoreClient(auto.address, transport="grpc") as c:
        assert c.transport == "grpc" and c.get(b"k") == b"v"
    tcp_only = make_node(transport="tcp")
    with StoreClient(tcp_only.address, transport="shm") as c:
        assert c.transport == "tcp" and "does not offer shm" in c.transport_notes
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"
        assert c.stats()["movers"]["shm"]["num_writes"] == 0
    with pytest.raises(InvalidArgumentError, match="transport must be one of"):
        StoreClient(auto.address, transport="carrier-pigeon")


def test_rdma_without_a_device_falls_back_and_says_why(make_node):
    reason = probe()
    if reason is None:
        pytest.skip("an ibverbs device exists here: the fallback is not reachable")
    node = make_node(transport="rdma")
    with StoreClient(node.address, transport="rdma") as c:
        assert c.transport == "tcp"
        assert reason in c.transport_notes
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"


def test_shm_refuses_a_file_that_is_not_the_nodes(node):
    with StoreClient(node.address) as c:
        real = c.descriptor_session().arena
    with pytest.raises(ShmUnavailableError, match="not the node's arena"):
        ShmMover(ArenaRef(real.name, real.size, real.slot_bytes, real.file_dev, real.file_ino + 1))
    with pytest.raises(ShmUnavailableError, match="cannot open"):
        ShmMover(ArenaRef("crescent-0-nothere", real.size, real.slot_bytes, 0, 0))
    with pytest.raises(ShmUnavailableError, match="bad arena name"):
        ShmMover(ArenaRef("../etc/passwd", real.size, real.slot_bytes, 0, 0))


def test_metrics_show_the_movers(make_node):
    node = make_node(metrics_port=0)
    port = node.metrics_port
    with StoreClient(node.address, local_reads=False) as c:
        c.put(b"k", b"v" * 1000)
        assert c.get(b"k") == b"v" * 1000
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert 'crescent_store_mover_ops_total{mover="shm",op="read"} 1.0' in text
    assert 'crescent_store_mover_bytes_total{mover="shm",op="write"} 1000.0' in text
    assert 'crescent_store_op_seconds_count{op="acquire_read",path="shm"} 1.0' in text
    assert "crescent_store_remote_leases 0.0" in text
    assert "crescent_store_rdma_queue_pairs 0.0" in text  # no RDMA endpoint here: none held


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_closed_client_refuses_every_call_and_a_close_under_puts_is_clean(node, transport):
    """Before, an shm client used after close() copied through its unmapped arena (SIGSEGV: the
    whole process died), a second close() raised EBADF, grpc raised gRPC's own ValueError and
    tcp reopened its sockets."""
    c = StoreClient(node.address, transport=transport)
    c.put(b"k", b"v")
    c.close()
    c.close()
    for call in (lambda: c.put(b"k2", b"x"), lambda: c.get(b"k"), lambda: c.stats(), lambda: c.health(),
                 lambda: c.batch_get_into([b"k"], [bytearray(4)]), lambda: c.exists([b"k"])):
        with pytest.raises(FailedPreconditionError, match="closed"):
            call()
    c = StoreClient(node.address, transport=transport)
    stop, errors = threading.Event(), []

    def writer(t: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                c.put(b"w%d-%d" % (t, i % 20), os.urandom(3 * SLOT))
            except FailedPreconditionError:
                pass  # closed under it: refused cleanly
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))
                return
            i += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: node.store.stats()["tiers"][Tier.DRAM]["num_entries"] >= 5, what="puts under way")
    c.close()  # while they put
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert node.transport.leases.stats()["num_remote_reservations"] == 0  # nothing left reserved
