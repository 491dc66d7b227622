"""The conductor relays the whole cluster's KV events (crescent conductor --kv-events-endpoint): real store
nodes publish their chunks' events in vLLM's format and register their endpoints; the conductor follows
each and republishes its batches unchanged under the node's id, clears a node that leaves or restarts,
and serves replay. A real ZeroMQ subscriber reads it live and through replay."""

import threading
import time

import msgpack
import torch
import zmq

from kvstore.chunk import encode_chunk
from kvstore.client import StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.conductor.vllm_events import decode_batch
from kvstore.config import StoreConfig
from kvstore.keys import ROOT_KEY, Namespace, chunk_keys
from kvstore.kvevents import reachable_endpoint
from kvstore.server import StoreNode
from tests.helpers import wait_for

NS = Namespace(bytes(range(16)))
EP = "tcp://127.0.0.1:*"


def replay(endpoint: str, start: int = 0) -> list[tuple[bytes, int, bytes]]:
    """(topic, sequence, payload) of every batch the replay socket at ``endpoint`` holds from ``start``."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    out = []
    try:
        s.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert s.poll(30_000), "no answer from the replay socket"
            _, topic, seq, payload = s.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq < 0:
                return out
            out.append((topic, seq, payload))
    finally:
        s.close(0)


def events(batches) -> list[tuple[str, str, bytes | None]]:
    """(topic, event type, first block hash) of each event in ``batches``."""
    out = []
    for topic, _, payload in batches:
        for e in decode_batch(payload)[1]:
            out.append((topic.decode(), e.type, (e.fields.get("block_hashes") or [None])[0]))
    return out


def node(conductor, node_id):
    return StoreNode(StoreConfig(listen="127.0.0.1:0", node_id=node_id, conductor=conductor.address, dram="16MiB",
                                 kv_events_endpoint=EP, kv_events_replay_endpoint=EP)).start()


def put_chunk(address: str, tokens: list[int]) -> bytes:
    key = chunk_keys(tokens, NS, len(tokens))[0]
    with StoreClient(address) as c:
        c.put(key, encode_chunk(torch.full((1, 2, 1, len(tokens), 4), 1.0), NS, bytes(ROOT_KEY), tokens))
    return key


def test_reachable_endpoint():
    assert reachable_endpoint("tcp://0.0.0.0:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert reachable_endpoint("tcp://*:5557", "node-1") == "tcp://node-1:5557"
    assert reachable_endpoint("tcp://[::]:5557", "fd00::1") == "tcp://[fd00::1]:5557"
    assert reachable_endpoint("tcp://127.0.0.1:5557", "h") == "tcp://127.0.0.1:5557"
    assert reachable_endpoint("ipc:///tmp/x", "h") == "ipc:///tmp/x" and reachable_endpoint("", "h") == ""


def test_the_conductor_relays_every_nodes_kv_events_and_clears_the_ones_that_leave():
    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.2, kv_events_endpoint=EP,
                                          kv_events_replay_endpoint=EP)).start()
    relay = conductor.kv_events
    nodes = {n: node(conductor, n) for n in ("a", "b")}
    try:
        with ConductorClient(conductor.address) as cc:
            wait_for(lambda: len(cc.members()) == 2, what="2 nodes registered")
        wait_for(lambda: relay.num_followed() == 2, what="the relay to follow both nodes")
        ka, kb = put_chunk(nodes["a"].address, [1, 2, 3, 4]), put_chunk(nodes["b"].address, [5, 6, 7, 8])

        # every node's batch, under its id, byte for byte as the node published it
        want = {("a", "BlockStored", ka), ("b", "BlockStored", kb)}
        wait_for(lambda: want <= set(events(replay(relay.replay_endpoint))), timeout_s=60, what="both chunks relayed")
        relayed = {p for _, _, p in replay(relay.replay_endpoint)}
        for n in nodes.values():
            assert {p for _, _, p in replay(n.kv_events.replay_endpoint)} <= relayed
        seqs = [s for _, s, _ in replay(relay.replay_endpoint)]
        assert seqs == list(range(len(seqs)))  # the relay's own sequence
        stored = [e for e in decode_batch(next(p for t, _, p in replay(relay.replay_endpoint) if t == b"a"))[1]]
        assert stored[0].fields["token_ids"] == [1, 2, 3, 4] and stored[0].fields["medium"] == "CPU"

        # live: a subscriber of the relay's PUB socket sees a new chunk as it is stored
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(relay.endpoint)
        seen, stop = set(), threading.Event()

        def listen():
            while not stop.is_set():
                if sub.poll(100):
                    topic, seq, payload = sub.recv_multipart()
                    seen.update(events([(topic, seq, payload)]))

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        try:
            tokens = iter(range(100, 10_000, 4))

            def live_chunk_seen():  # PUB drops what it sends before the subscription lands: store until one is seen
                first = next(tokens)
                k = put_chunk(nodes["a"].address, list(range(first, first + 4)))
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline:
                    if ("a", "BlockStored", k) in seen:
                        return True
                    time.sleep(0.05)
                return False

            wait_for(live_chunk_seen, timeout_s=60, what="a live relayed batch")
        finally:
            stop.set()
            t.join()
            sub.close(0)

        # a node that leaves is cleared under its topic; one registering again under its id is followed anew
        nodes.pop("b").stop(grace=0)
        wait_for(lambda: ("b", "AllBlocksCleared", None) in events(replay(relay.replay_endpoint)), timeout_s=60,
                 what="b cleared")
        wait_for(lambda: relay.num_followed() == 1, what="b no longer followed")
        nodes["b"] = node(conductor, "b")
        kb2 = put_chunk(nodes["b"].address, [9, 10, 11, 12])
        wait_for(lambda: ("b", "BlockStored", kb2) in events(replay(relay.replay_endpoint)), timeout_s=60,
                 what="the new b relayed")
        # a node's own publisher is untouched by all this
        assert msgpack.unpackb(replay(nodes["a"].kv_events.replay_endpoint)[0][2])[1][0]["type"] == "BlockStored"
    finally:
        for n in nodes.values():
            n.stop(grace=0)
        conductor.stop()
