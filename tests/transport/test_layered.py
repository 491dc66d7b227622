"""GET_LAYERED on the data channel: a KV chunk's head, then layer 0 of every chunk, layer 1, …
from one request: the parts in that order and with their bytes, misses and values of another
layout as None with no bytes, values spanning slots and on the disk tier, and a stream a
callback breaks off or a node that goes away mid-stream."""

import random

import pytest

from kvstore.client import StoreClient
from kvstore.datachannel import layered_arg, layered_parts
from kvstore.errors import UnavailableError

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
