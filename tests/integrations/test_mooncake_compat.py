"""kvstore.compat.mooncake against a real store node (and a conductor over two), with Mooncake's return
conventions: status 0 / negative ErrorCode values, b"" on a miss, 1/0 existence, byte counts."""

import ctypes

import numpy as np
import pytest

from kvstore.compat.mooncake import (BUFFER_OVERFLOW, INVALID_PARAMS, OBJECT_NOT_FOUND, RPC_FAIL, MooncakeDistributedStore,
                                     ReplicateConfig)
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.config import StoreConfig
from kvstore.server import StoreNode
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def node():
    n = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="32MiB")).start()
    yield n
    n.stop(grace=0)


@pytest.fixture
def store(node):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "http://unused:8080/metadata", 512 << 20, 128 << 20, "tcp", "", node.address) == 0
    yield s
    assert s.close() == 0


def test_put_get_batch_exist_remove(store):
    assert store.put("hello_key", b"Hello, Mooncake Store!") == 0
    assert store.get("hello_key") == b"Hello, Mooncake Store!"
    assert store.get("missing") == b""
    assert store.put_batch(["k1", "k2", "k3"], [b"v1", b"v2", b"v3"]) == 0
    assert store.get_batch(["k1", "nope", "k3"]) == [b"v1", b"", b"v3"]
    assert store.put_parts("greeting", b"Hello, ", b"World!") == 0
    assert store.get("greeting") == b"Hello, World!"
    assert store.is_exist("k2") == 1 and store.is_exist("nope") == 0
    assert store.batch_is_exist(["k1", "nope", "k2"]) == [1, 0, 1]
    assert store.get_size("greeting") == 13 and store.get_size("nope") == OBJECT_NOT_FOUND
    assert store.put("big", bytes(3 * (1 << 20) + 5)) == 0
    sizes = [store.get_size(k) for k in ("big", "big", "greeting", "nope")]
    assert sizes == [3 * (1 << 20) + 5] * 2 + [13, OBJECT_NOT_FOUND]
    assert store.remove("big") == 0
    buf = store.get_buffer("greeting")
    assert buf.size() == 13 and bytes(buf) == b"Hello, World!" and buf.ptr() != 0
    assert np.array(buf, copy=False).tobytes() == b"Hello, World!"  # the buffer protocol, no copy
    assert store.get_buffer("nope") is None
    handles = store.batch_get_buffer(["k1", "nope", "greeting"])
    assert handles[1] is None and [bytes(h) for h in handles[::2]] == [b"v1", b"Hello, World!"]
    assert all(type(h).__name__ == "BufferHandle" and h.size() == len(h) for h in handles[::2])
    got = store.get_batch(["greeting", "k3", "k1"])
    assert all(type(v) is bytes for v in got) and store.get_batch(["k3"]) == [b"v3"] and got[0] == b"Hello, World!"
    assert store.put("k1", b"replaced") == 0 and store.get("k1") == b"replaced"
    assert store.remove("k1") == 0 and store.remove("k1") == OBJECT_NOT_FOUND
    assert store.batch_remove(["k2", "nope", "k3"]) == [0, OBJECT_NOT_FOUND, 0]
    assert store.batch_is_exist(["k2", "k3"]) == [0, 0]
    assert store.put_batch(["a"], [b"1", b"2"]) == INVALID_PARAMS
    assert store.put("", b"x") == INVALID_PARAMS  # Crescent keys are 1..1024 bytes
    assert store.get_hostname() == "localhost"
    assert store.put_batch(["x1", "x2"], [b"1", b"2"]) == 0
    assert store.remove_all() >= 3  # x1, x2, greeting (and what other tests left)
    assert store.batch_is_exist(["x1", "x2", "greeting"]) == [0, 0, 0] and store.remove_all() == 0


def test_zero_copy_needs_registered_buffers(store):
    data = np.random.default_rng(0).standard_normal((100, 100)).astype(np.float32)
    src, size = data.ctypes.data, data.nbytes
    assert store.put_from("tensor", src, size) == INVALID_PARAMS  # not registered
    assert store.register_buffer(src, size) == 0
    assert store.put_from("tensor", src, size) == 0
    out = np.empty_like(data)
    dst = out.ctypes.data
    assert store.get_into("tensor", dst, out.nbytes) == INVALID_PARAMS
    assert store.register_buffer(dst, out.nbytes) == 0
    assert store.get_into("tensor", dst, out.nbytes) == size
    assert np.array_equal(out, data)
    assert store.register_buffer(dst + 8, 16) == INVALID_PARAMS  # overlaps a registration

    # Batches: per key a count or a code; a value larger than its buffer is BUFFER_OVERFLOW.
    small = (ctypes.c_ubyte * 64)()
    sp = ctypes.addressof(small)
    assert store.register_buffer(sp, 64) == 0
    ctypes.memmove(sp, b"x" * 64, 64)
    assert store.batch_put_from(["s1", "s2"], [sp, sp + 32], [32, 32]) == [0, 0]
    assert store.batch_get_into(["s1", "tensor", "gone", "s2"], [sp, sp, sp, sp + 32], [32, 64, 32, 32]) == \
        [32, BUFFER_OVERFLOW, OBJECT_NOT_FOUND, 32]
    assert store.batch_get_into(["s1"], [sp], [32, 1]) == [INVALID_PARAMS]
    # an empty buffer reads an empty value (0) or misses; bad keys and buffers are INVALID_PARAMS
    # (all three read BUFFER_OVERFLOW before), a non-string key is a TypeError as in Mooncake's
    # binding (it was stored under bytes(5): five NUL bytes)
    assert store.put("empty", b"") == 0
    assert store.batch_get_into(["empty", "gone"], [sp, sp], [0, 0]) == [0, OBJECT_NOT_FOUND]
    assert store.batch_get_into(["", "k" * 2000, "s1"], [sp, sp, sp], [32, 32, 32]) == \
        [INVALID_PARAMS, INVALID_PARAMS, 32]
    with pytest.raises(TypeError, match="a key is a str"):
        store.put(5, b"x")
    assert store.register_buffer(sp, None) == INVALID_PARAMS and store.register_buffer("0x10", 8) == INVALID_PARAMS
    cfg = ReplicateConfig()
    cfg.replica_num = "2"
    assert store.put("r", b"x", cfg) == INVALID_PARAMS
    for p in (src, dst, sp):
        assert store.unregister_buffer(p) == 0
    assert store.unregister_buffer(sp) == INVALID_PARAMS


def test_setup_errors_and_a_dead_master():
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", 0, 0, "tcp", "", "") == INVALID_PARAMS
    assert s.setup("localhost", "", 0, 0, "tcp", "", "127.0.0.1:1") == RPC_FAIL
    assert s.setup("localhost", "", 0, 0, "tcp", "", "127.0.0.1:99999") == INVALID_PARAMS
    assert s.get("k") == b"" and s.put("k", b"v") < 0 and s.is_exist("k") == -1


def test_a_conductor_as_master_spreads_keys_and_honours_replica_num():
    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.2)).start()
    nodes = [StoreNode(StoreConfig(listen="127.0.0.1:0", node_id=n, conductor=conductor.address, dram="8MiB",
                                   slot_size="4KiB")).start() for n in ("a", "b")]
    s = MooncakeDistributedStore()
    try:
        assert s.setup("localhost", "", 0, 0, "tcp", "", conductor.address) == 0
        wait_for(lambda: len(s._client.conductor.members()) == 2, what="2 nodes registered")
        keys = [f"key-{i}" for i in range(16)]
        assert s.put_batch(keys, [k.encode() for k in keys]) == 0
        held = [sum(n.store.exists([k.encode()])[0] for n in nodes) for k in keys]
        assert held == [1] * 16 and all(any(n.store.exists([k.encode()])[0] for k in keys) for n in nodes)
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        assert s.put("both", b"twice", cfg) == 0
        assert all(n.store.exists([b"both"])[0] for n in nodes)
        wait_for(lambda: s.batch_is_exist(keys + ["both"]) == [1] * 17, what="indexed")
        assert s.get_batch(keys) == [k.encode() for k in keys]
        assert s.remove_all() == 18  # 16 keys, and "both" on each of the two nodes
        assert not any(n.store.exists([k.encode()])[0] for n in nodes for k in keys + ["both"])
    finally:
        s.close()
        for n in nodes:
            n.stop(grace=0)
        conductor.stop(0)
