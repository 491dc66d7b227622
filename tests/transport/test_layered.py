"""GET_LAYERED on the data channel: a KV chunk's head, then layer 0 of every chunk, layer 1, …
from one request: the parts in that order and with their bytes, misses and values of another
layout as None with no bytes, values spanning slots and on the disk tier, and a stream a
callback breaks off or a node that goes away mid-stream."""

import random
import time

import pytest

from kvstore.client import StoreClient
from kvstore.datachannel import layered_arg, layered_parts
from kvstore.errors import UnavailableError
from kvstore.transport.memcopy import buffer_address

HEAD, LAYER = 100, 50_000  # 64 KiB slots: a value spans four, and layers straddle them


def _value(seed: int, layers: int) -> bytes:
    return random.Random(seed).randbytes(HEAD + layers * LAYER)


def _read(client, keys, head=HEAD, layer=LAYER):
    sizes, order, bufs = [], [], {}

    def dest(j, part):
        bufs[j, part] = bytearray(head if part < 0 else layer)
        return memoryview(bufs[j, part])

    def arrived(j, part):
        order.append((j, part))

    assert client.batch_get_layered(keys, head, layer, sizes.extend, dest, arrived)
    return sizes, order, {k: bytes(v) for k, v in bufs.items()}


def test_parts_come_head_first_then_layer_major_with_their_bytes(make_node):
    node = make_node()
    c = StoreClient(node.address, transport="tcp")
    vals = {b"a": _value(1, 4), b"b": _value(2, 4), b"short": _value(3, 2), b"odd": b"x" * (HEAD + LAYER + 7)}
    for k, v in vals.items():
        c.put(k, v)
    keys = [b"a", b"missing", b"short", b"odd", b"b"]
    sizes, order, got = _read(c, keys)
    assert sizes == [len(vals[b"a"]), None, len(vals[b"short"]), None, len(vals[b"b"])]
    assert order == [(0, -1), (2, -1), (4, -1), (0, 0), (2, 0), (4, 0), (0, 1), (2, 1), (4, 1), (0, 2), (4, 2),
                     (0, 3), (4, 3)]
    assert order == [(j, p) for j, p, _, _ in layered_parts(sizes, HEAD, LAYER)]
    for (j, part), data in got.items():
        v = vals[keys[j]]
        assert data == (v[:HEAD] if part < 0 else v[HEAD + part * LAYER : HEAD + (part + 1) * LAYER])
    assert c.get(b"odd") == vals[b"odd"]  # the connection is in step after the stream
    assert _read(c, [b"a"])[0] == [len(vals[b"a"])]
    c.close()


def test_a_layout_no_client_can_ask_for_is_invalid_and_sends_no_bytes(make_node):
    """A raw GET_LAYERED whose arg decodes to a negative head (or a head beyond the value) is INVALID,
    not a stream of parts at negative offsets; the connection stays in step."""
    import socket

    from kvstore.datachannel import HELLO, LAYER_BITS, Op, Status, encode_request, read_response

    node = make_node()
    with StoreClient(node.address, transport="tcp") as c:
        c.put(b"a", _value(1, 2))
    size = HEAD + 2 * LAYER
    with socket.create_connection(("127.0.0.1", node.data_server.port), timeout=30) as s:
        s.sendall(HELLO + node.data_server.token)
        for arg in ((-1 << LAYER_BITS) | 1, (-HEAD << LAYER_BITS) | LAYER, layered_arg(size + LAYER, LAYER)):
            s.sendall(encode_request(Op.GET_LAYERED, [b"a"], [arg]))
            items, msg = read_response(s)
            assert items == [(Status.INVALID, size)] and "is not" in msg
        s.sendall(encode_request(Op.GET_LAYERED, [b"a"], [layered_arg(HEAD, LAYER)]))
        items, _ = read_response(s)
        assert items == [(Status.OK, size)]
        got = b""
        while len(got) < size:
            got += s.recv(size - len(got))
        assert got == _value(1, 2)


def test_a_layered_read_of_more_layers_than_a_model_has_is_invalid(make_node):
    """Before, 1-byte layers of a 1 MiB value made the node build a part (and a view) per byte: 400
    MiB of memory and 17 s for that one read, a 256 MiB value would have taken ~100 GiB. Now at most
    MAX_LAYERS layers a value; that many are sent, in order."""
    import socket

    from kvstore.datachannel import HELLO, MAX_LAYERS, Op, Status, encode_request, read_response

    node = make_node()
    value = random.Random(7).randbytes(MAX_LAYERS * 1024)
    with StoreClient(node.address, transport="tcp") as c:
        c.put(b"big", value)
    with socket.create_connection(("127.0.0.1", node.data_server.port), timeout=30) as s:
        s.sendall(HELLO + node.data_server.token)
        s.sendall(encode_request(Op.GET_LAYERED, [b"big"], [layered_arg(0, 1)]))
        items, msg = read_response(s)
        assert items == [(Status.INVALID, len(value))] and f"more than the {MAX_LAYERS}" in msg
        s.sendall(encode_request(Op.GET_LAYERED, [b"big", b"big"], [layered_arg(0, 1024)] * 2))
        items, _ = read_response(s)
        assert items == [(Status.OK, len(value))] * 2
        got = bytearray()
        while len(got) < 2 * len(value):
            got += s.recv(2 * len(value) - len(got))
    # layer-major: layer l of the first, then of the second
    assert bytes(got) == b"".join(value[l * 1024 : (l + 1) * 1024] * 2 for l in range(MAX_LAYERS))


def test_values_on_the_disk_tier_stream_layer_major_too(make_node, tmp_path):
    node = make_node(dram=1 << 20, disk=str(tmp_path / "disk"), disk_size=64 << 20)
    c = StoreClient(node.address, transport="tcp")
    vals = {bytes([i]) * 8: _value(10 + i, 3) for i in range(12)}  # 1.8 MB: most go to disk
    for k, v in vals.items():
        c.put(k, v)
    from kvstore.store import Tier

    assert node.store.stats()["tiers"][Tier.DISK]["num_entries"] > 0
    keys = list(vals)
    sizes, order, got = _read(c, keys)
    assert sizes == [len(v) for v in vals.values()]
    assert len(order) == 4 * len(keys)
    for (j, part), data in got.items():
        v = vals[keys[j]]
        assert data == (v[:HEAD] if part < 0 else v[HEAD + part * LAYER : HEAD + (part + 1) * LAYER])
    c.close()


def test_a_callback_that_raises_closes_the_stream_and_the_next_read_reconnects(make_node):
    node = make_node()
    c = StoreClient(node.address, transport="tcp")
    c.put(b"a", _value(1, 4))

    def dest(j, part):
        if part == 1:
            raise RuntimeError("landing failed")
        return memoryview(bytearray(HEAD if part < 0 else LAYER))

    with pytest.raises(RuntimeError, match="landing failed"):
        c.batch_get_layered([b"a"], HEAD, LAYER, lambda s: None, dest, lambda j, p: None)
    assert _read(c, [b"a"])[0] == [HEAD + 4 * LAYER]
    assert c.get(b"a") == _value(1, 4)
    c.close()


def test_a_node_killed_mid_stream_is_unavailable_with_the_parts_before_it():
    from tests.helpers import StoreProcess

    big = 1 << 20  # 4 × 8 MiB: more than the sockets' buffers hold
    node = StoreProcess("--dram", "64MiB", "--transport", "tcp")
    try:
        c = StoreClient(node.address, transport="tcp", timeout_s=30)
        for i in range(4):
            c.put(bytes([i]), bytes([i]) * (HEAD + 8 * big))
        arrived = []

        def on_arrival(j, part):
            arrived.append((j, part))
            if (j, part) == (3, 0):
                node.kill9()

        with pytest.raises(UnavailableError):
            c.batch_get_layered([bytes([i]) for i in range(4)], HEAD, big, lambda s: None,
                                lambda j, p: memoryview(bytearray(HEAD if p < 0 else big)), on_arrival)
        assert arrived[:8] == [(j, -1) for j in range(4)] + [(j, 0) for j in range(4)]
        assert len(arrived) < 4 * 9  # it broke off
        c.close()
    finally:
        node.stop()


def test_a_layout_out_of_range_is_refused_before_anything_is_sent():
    with pytest.raises(ValueError):
        layered_arg(HEAD, 0)
    with pytest.raises(ValueError):
        layered_arg(-1, LAYER)
    assert layered_parts([None, None], HEAD, LAYER) == []


# ---- the same read done one-sided (DescriptorSession.get_layered: RDMA READs across hosts; here
# the shm mover, the same protocol over the mapped arena) ---------------------------------------


def _read_one_sided(session, keys, head=HEAD, layer=LAYER):
    sizes, order, bufs = [], [], {}

    def dest(j, part):
        bufs[j, part] = bytearray(head if part < 0 else layer)
        return memoryview(bufs[j, part])

    ok = session.get_layered(keys, head, layer, sizes.extend, dest, lambda j, part: order.append((j, part)))
    return ok, sizes, order, {k: bytes(v) for k, v in bufs.items()}


def _one_sided(node, mover):
    from kvstore.transport.descriptors import Mover

    c = StoreClient(node.address, transport=mover)
    session = c.descriptor_session()
    assert session is not None and session.mover is Mover(mover)
    return c, session


def test_a_one_sided_layered_read_gives_the_data_channels_parts_and_bytes(mover, make_node):
    """The parts, their order and their bytes as GET_LAYERED sends them (values across slots,
    layers straddling slots, misses and other layouts as None); the lease ends with the read."""
    node = make_node()
    c, session = _one_sided(node, mover)
    vals = {b"a": _value(1, 4), b"b": _value(2, 4), b"short": _value(3, 2), b"odd": b"x" * (HEAD + LAYER + 7)}
    for k, v in vals.items():
        c.put(k, v)
    keys = [b"a", b"missing", b"short", b"odd", b"b"]
    ok, sizes, order, got = _read_one_sided(session, keys)
    assert ok
    tcp = StoreClient(node.address, transport="tcp")
    assert (sizes, order, got) == _read(tcp, keys)
    assert sizes == [len(vals[b"a"]), None, len(vals[b"short"]), None, len(vals[b"b"])]
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    tcp.close()
    c.close()


def test_a_one_sided_layered_read_leaves_values_on_the_disk_tier_to_the_node(mover, make_node, tmp_path):
    """One-sided reads reach only the node's DRAM arena: with a value on its disk tier the read
    calls nothing and says so (False), ending its lease; the engine then reads another way."""
    node = make_node(dram=1 << 20, disk=str(tmp_path / "disk"), disk_size=64 << 20)
    c, session = _one_sided(node, mover)
    vals = {bytes([i]) * 8: _value(10 + i, 3) for i in range(12)}
    for k, v in vals.items():
        c.put(k, v)
    called = []
    assert session.get_layered(list(vals), HEAD, LAYER, called.append, lambda j, p: called.append(p),
                               lambda j, p: called.append(p)) is False
    assert called == []
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    c.close()


def test_a_one_sided_layered_read_past_its_lease_stops_and_ends_it(mover, make_node, monkeypatch):
    """A part whose read ended after the lease's safe end is not trusted: nothing arrives from
    it on (UnavailableError: the engine recomputes from that chunk), and the lease is ended."""
    from kvstore.transport import session as session_module

    node = make_node()
    c, session = _one_sided(node, mover)
    c.put(b"a", _value(1, 4))
    c.put(b"b", _value(2, 4))
    real = session_module.safe_end
    monkeypatch.setattr(session_module, "safe_end", lambda g: real(g) - (g.expires_at - g.sent_at) * 10)
    order = []
    with pytest.raises(UnavailableError, match="lease ran out"):
        session.get_layered([b"a", b"b"], HEAD, LAYER, lambda s: None, lambda j, p: bytearray(LAYER),
                            lambda j, p: order.append((j, p)))
    assert order == []
    assert session.num_invalid_reads == 1
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    c.close()


def test_reads_into_buffers_registered_for_good_register_nothing_per_copy(mover, make_node):
    """An engine registers its ring and pools once (``register_buffers``): on RDMA a layered
    read into them registers no memory region per part, a read into any other buffer one per
    copy; the bytes are the same either way (shm registers nothing at all)."""
    node = make_node()
    c, session = _one_sided(node, mover)
    vals = {b"a": _value(1, 3), b"b": _value(2, 3)}
    for k, v in vals.items():
        c.put(k, v)
    m = session._handle.mover
    puts = getattr(m, "num_registrations", 0)  # a put's buffer is registered for that put
    ring = bytearray(2 * 3 * LAYER)
    heads = bytearray(2 * HEAD)
    session.register_buffers([(buffer_address(ring), len(ring)), (buffer_address(heads), len(heads))])
    session.register_buffers([(buffer_address(ring), len(ring))])  # again: nothing new
    order = []

    def dest(j, part):
        if part < 0:
            return memoryview(heads)[j * HEAD : (j + 1) * HEAD]
        return memoryview(ring)[(part * 2 + j) * LAYER : (part * 2 + j + 1) * LAYER]

    assert session.get_layered([b"a", b"b"], HEAD, LAYER, lambda s: None, dest, lambda j, p: order.append((j, p)))
    assert len(order) == 2 + 2 * 3
    for j, k in enumerate([b"a", b"b"]):
        assert bytes(heads[j * HEAD : (j + 1) * HEAD]) == vals[k][:HEAD]
        for part in range(3):
            got = ring[(part * 2 + j) * LAYER : (part * 2 + j + 1) * LAYER]
            assert bytes(got) == vals[k][HEAD + part * LAYER : HEAD + (part + 1) * LAYER]
    if mover == "rdma":
        assert m.registered_buffers == 2 and m.num_registrations == puts
        ok, _, _, got = _read_one_sided(session, [b"a"])  # fresh buffers: one region per part
        assert ok and m.num_registrations == puts + 1 + 3
        with pytest.raises(ValueError, match="overlaps"):  # inside a registered one, at another address
            session.register_buffers([(buffer_address(ring) + 8, 16)])
    else:
        assert not hasattr(m, "register_buffer")
    c.close()


def _recorded_read(session, keys, ahead, fail_at=None, events=None, bufs=None, on_dest=None):
    events, bufs = [] if events is None else events, {} if bufs is None else bufs

    def dest(j, part):
        if on_dest is not None:
            on_dest(j, part)
        events.append(("dest", j, part))
        bufs[j, part] = bytearray(HEAD if part < 0 else LAYER)
        return memoryview(bufs[j, part])

    def arrived(j, part):
        if (j, part) == fail_at:
            raise RuntimeError("the receiver gave up")
        events.append(("arrived", j, part))

    sizes = []
    ok = session.get_layered(keys, HEAD, LAYER, sizes.extend, dest, arrived, ahead=ahead)
    return ok, sizes, events, bufs


def _stored_one_sided(make_node, mover, n, seed):
    """A node holding ``n`` three-layer values, and a one-sided session to it."""
    node = make_node()
    c, session = _one_sided(node, mover)
    vals = {bytes([i]) * 4: _value(seed + i, 3) for i in range(n)}
    for k, v in vals.items():
        c.put(k, v)
    return node, c, session, vals


def _in_flight_at_each_dest(events):
    """Per ``dest`` call: the parts asked for before it that had not arrived yet."""
    asked, arrived, out = [], set(), []
    for kind, j, part in events:
        if kind == "dest":
            out.append(((j, part), [q for q in asked if q not in arrived]))
            asked.append((j, part))
        else:
            arrived.add((j, part))
    return out


def test_a_one_sided_layered_read_keeps_up_to_ahead_parts_of_one_layer_in_flight(mover, make_node):
    """``ahead`` parts are read at once (RDMA: their READs in flight together): a part's buffer
    is asked for while up to ``ahead - 1`` earlier parts are still to arrive, only ever parts
    of its own layer (every head arrives before a layer's buffer is asked for, layer l before
    layer l+1's); parts arrive in order, with their bytes."""
    node, c, session, vals = _stored_one_sided(make_node, mover, 7, seed=20)
    keys = list(vals)
    ok, sizes, events, bufs = _recorded_read(session, keys, ahead=4)
    assert ok
    parts = [(j, p) for j, p, _, _ in layered_parts(sizes, HEAD, LAYER)]
    assert [e[1:] for e in events if e[0] == "arrived"] == parts == [e[1:] for e in events if e[0] == "dest"]
    flights = _in_flight_at_each_dest(events)
    for (j, part), waiting in flights:
        assert len(waiting) <= 3 and all(p == part for _, p in waiting), (j, part, waiting)
    assert max(len(w) for _, w in flights) == 3  # it did read ahead
    for (j, part), buf in bufs.items():
        v = vals[keys[j]]
        assert bytes(buf) == (v[:HEAD] if part < 0 else v[HEAD + part * LAYER : HEAD + (part + 1) * LAYER])
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    c.close()


def test_a_one_sided_layered_read_a_receiver_breaks_off_mid_flight_ends_cleanly(mover, make_node):
    """A receiver that raises in ``arrived`` with parts read ahead of it: the error propagates,
    nothing arrives after it, the reads in flight are over before the call returns, and the
    lease is ended; the session reads again afterwards."""
    node, c, session, vals = _stored_one_sided(make_node, mover, 6, seed=40)
    keys = list(vals)
    events = []
    with pytest.raises(RuntimeError, match="gave up"):
        _recorded_read(session, keys, ahead=4, fail_at=(2, 1), events=events)
    arrivals = [e[1:] for e in events if e[0] == "arrived"]
    assert arrivals == [(j, -1) for j in range(6)] + [(j, 0) for j in range(6)] + [(0, 1), (1, 1)]
    assert ("dest", 5, 1) in events  # parts 3..5 of layer 1 were read ahead of the failure
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    ok, sizes, events, _ = _recorded_read(session, keys, ahead=4)
    assert ok and len([e for e in events if e[0] == "arrived"]) == 6 * 4
    c.close()


# ---- the same, with reads that land asynchronously: an RDMA mover on a simulated HCA whose remote
# memory is the node's mapped arena (no ibverbs device here; tests/transport/simulated_hca.py) ----


@pytest.fixture
def over_rdma(make_node):
    from tests.transport.simulated_hca import reads_over_simulated_rdma

    node, c, session, vals = _stored_one_sided(make_node, "shm", 6, seed=60)
    with reads_over_simulated_rdma(session) as hca:
        yield node, session, vals, hca
    c.close()


def _landed_nothing_later(bufs, hca):
    """After a call returned: nothing more lands in its buffers once the device moves again."""
    before, executed = {k: bytes(v) for k, v in bufs.items()}, hca.executed
    hca.stall = False
    time.sleep(0.05)  # the device's thread runs: a read still queued would land now
    return {k: bytes(v) for k, v in bufs.items()} == before and hca.executed == executed


def test_a_layered_read_over_rdma_reads_ahead_and_every_byte_lands(over_rdma):
    """Reads in flight together on the device (they land while the next are posted): the parts
    arrive in order with their bytes, read ahead as far as ``ahead`` within a layer."""
    node, session, vals, hca = over_rdma
    keys = list(vals)
    ok, sizes, events, bufs = _recorded_read(session, keys, ahead=4)
    assert ok
    assert [e[1:] for e in events if e[0] == "arrived"] == [(j, p) for j, p, _, _ in
                                                            layered_parts(sizes, HEAD, LAYER)]
    assert max(len(w) for _, w in _in_flight_at_each_dest(events)) == 3
    for (j, part), buf in bufs.items():
        v = vals[keys[j]]
        assert bytes(buf) == (v[:HEAD] if part < 0 else v[HEAD + part * LAYER : HEAD + (part + 1) * LAYER])
    assert node.transport.leases.stats()["num_remote_leases"] == 0


@pytest.mark.parametrize("fault", ["receiver", "request", "poll"])
def test_a_layered_read_over_rdma_that_stops_mid_flight_leaves_nothing_landing(over_rdma, fault, monkeypatch):
    """The stream stops while reads posted ahead sit on the device (it stops moving bytes as
    layer 1's fourth part is asked for): the receiver raises for the third, or the third fails
    on the device, or the device's poll fails. The error propagates, the parts that arrived
    are a prefix, nothing lands in a buffer after the call returned even once the device moves
    again (the queue pair holding those reads was destroyed), the lease is ended, and the next
    read works on a new queue pair."""
    from kvstore.errors import DataLossError
    from kvstore.transport import rdma

    monkeypatch.setattr(rdma, "POLL_TIMEOUT_S", 0.3)  # the drain gives up on the stalled reads
    node, session, vals, hca = over_rdma
    session._handle.mover.rdma._queue.timeout_s = 0.3
    keys = list(vals)
    events, bufs = [], {}
    if fault == "request":
        hca.fail_in = 6 + 6 + 2  # the heads, layer 0, two parts of layer 1: the third fails

    def on_dest(j, part):
        if (j, part) == (3, 1):
            while hca.outstanding:  # what was posted before has been moved
                time.sleep(0.001)
            hca.stall = True
            hca.poll_raises = fault == "poll"

    with pytest.raises(RuntimeError if fault == "receiver" else DataLossError):
        _recorded_read(session, keys, ahead=4, fail_at=(2, 1) if fault == "receiver" else None, events=events,
                       bufs=bufs, on_dest=on_dest)
    assert ("dest", 5, 1) in events or fault == "poll", events  # reads were posted past the failing one
    hca.poll_raises = False
    assert _landed_nothing_later(bufs, hca)
    parts = [(j, p) for j, p, _, _ in layered_parts([len(v) for v in vals.values()], HEAD, LAYER)]
    arrived = [e[1:] for e in events if e[0] == "arrived"]
    assert arrived == parts[: len(arrived)] and len(arrived) < len(parts)
    assert node.transport.leases.stats()["num_remote_leases"] == 0
    ok, _, again, _ = _recorded_read(session, keys, ahead=4)
    assert ok and len([e for e in again if e[0] == "arrived"]) == len(parts)
    assert session._handle.mover.rdma.num_reconnects >= 1
