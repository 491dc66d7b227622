"""The conductor following vLLM instances' KV events (kvstore/conductor/vllm_events.py): both encodings,
re-keying vLLM blocks into Crescent chunk keys, and a real conductor subscribed over ZeroMQ to
publishers speaking vLLM's protocol (PUB + ROUTER replay), scheduling each prompt to the instance
that holds its prefix. tests/integrations/test_vllm_kv_events.py does the same with real vLLM."""

import json
import random
import threading

import msgpack
import pytest

from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.conductor.vllm_events import (DEFAULT_NAMESPACE, BlockRekeyer, VllmSource, decode_batch,
                                           request_namespace)
from kvstore.keys import chunk_keys
from kvstore.store import Tier
from kvstore.errors import FailedPreconditionError
from tests.conductor.procs import run_cli
from tests.helpers import wait_for

BLOCK, CHUNK = 32, 64


def stored_map(hashes, parent, tokens, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_decode_batch_reads_map_and_array_forms_and_ignores_unknowns():
    tokens = list(range(BLOCK))
    as_map = msgpack.packb({"ts": 1.5, "events": [stored_map([b"h1"], None, tokens, future_field=7),
                                                  {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
                                                  {"type": "SomethingNew", "x": 1},
                                                  {"type": "AllBlocksCleared"}],
                            "data_parallel_rank": 0})
    as_array = msgpack.packb([1.5, [["BlockStored", [b"h1"], None, tokens, BLOCK, None, "GPU", None, None, None,
                                     "full_attention"],  # a newer vLLM's trailing fields
                                    ["BlockRemoved", [b"h1"], "GPU"], ["SomethingNew"], ["AllBlocksCleared"]], 0])
    for payload in (as_map, as_array):
        ts, events = decode_batch(payload)
        assert ts == 1.5 and [e.type for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        f = events[0].fields
        assert (f["block_hashes"], f["parent_block_hash"], f["token_ids"], f["block_size"]) == ([b"h1"], None,
                                                                                           tokens, BLOCK)
    for bad in (b"\xc1", msgpack.packb(3), msgpack.packb({"ts": 1, "events": 5})):
        with pytest.raises(ValueError):
            decode_batch(bad)


def test_rekeyer_turns_block_chains_into_the_chunk_keys_of_their_tokens():
    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(5 * BLOCK)]  # 5 blocks: 2 full chunks and a half
    r = BlockRekeyer(DEFAULT_NAMESPACE, CHUNK)
    keys = chunk_keys(tokens, DEFAULT_NAMESPACE, CHUNK)
    # block 0 alone, then blocks 1-4 in one event (vLLM batches the blocks a step fills)
    assert r.stored(stored_map([0], None, tokens[:BLOCK])) == []
    assert r.stored(stored_map([1, 2, 3, 4], 0, tokens[BLOCK:])) == keys
    # a second prompt sharing block 0-1 (the first chunk) and then diverging
    other = tokens[:2 * BLOCK] + [7] * (2 * BLOCK)
    assert r.stored(stored_map([10, 11], 1, other[2 * BLOCK:])) == [chunk_keys(other, DEFAULT_NAMESPACE, CHUNK)[1]]
    assert r.removed({"block_hashes": [4, 3]}) == [keys[1]]  # the block completing chunk 1 is 3
    assert r.removed({"block_hashes": [99]}) == []
    # not indexed: an unknown parent, extra keys (a cache_salt), another KV-cache group, bad sizes
    assert r.stored(stored_map([20], 12345, tokens[:BLOCK])) == []
    assert r.stored(stored_map([21, 22], None, tokens[:CHUNK], extra_keys=[None, ["salt"]])) == []
    assert r.stored(stored_map([23, 24], None, tokens[:CHUNK], group_idx=1)) == []
    assert r.stored(stored_map([25], None, tokens[:BLOCK - 1])) == []
    assert r.num_skipped == 1 + 2 + 2 + 1
    # ints, bytes and lists all serve as hashes
    assert r.stored(stored_map([[1, 2]], None, tokens[:BLOCK])) == []
    assert r.stored(stored_map([b"x"], [1, 2], tokens[BLOCK:2 * BLOCK])) == keys[:1]


def test_salted_and_lora_requests_are_keyed_under_their_scope_and_other_extra_keys_are_not_indexed():
    """vLLM hashes a request's cache_salt into its first block and its LoRA adapter into every block,
    and publishes both as bare strings in the blocks' extra keys (the adapter first, and named in the
    event): the chain goes under ``request_namespace``, one per salt and adapter, none equal to the
    plain keys. Multimodal and prompt-embedding keys, or keys out of place, leave a block unindexed."""
    rng = random.Random(1)
    tokens = [rng.randrange(50000) for _ in range(4 * BLOCK)]  # two chunks
    r = BlockRekeyer(DEFAULT_NAMESPACE, CHUNK)
    ns = {scope: request_namespace(DEFAULT_NAMESPACE, *scope)
          for scope in [("tenant-a", None), ("tenant-b", None), (None, "ad"), ("tenant-a", "ad"), (None, "ad2")]}
    assert len({DEFAULT_NAMESPACE, *ns.values()}) == 6
    assert request_namespace(DEFAULT_NAMESPACE, "") == request_namespace(DEFAULT_NAMESPACE) == DEFAULT_NAMESPACE
    assert request_namespace(DEFAULT_NAMESPACE, "ab", "c") != request_namespace(DEFAULT_NAMESPACE, "a", "bc")
    lora = dict(lora_name="ad", lora_id=1)
    # the salt on the first block; the next event's blocks (no extra keys) inherit the salted chain
    first = r.stored(stored_map([1, 2], None, tokens[:CHUNK], extra_keys=[["tenant-a"], None]))
    rest = r.stored(stored_map([3, 4], 2, tokens[CHUNK:]))
    assert first + rest == chunk_keys(tokens, ns["tenant-a", None], CHUNK)
    # the same tokens under another salt, with none, under an adapter, under an adapter and a salt
    assert r.stored(stored_map([11, 12, 13, 14], None, tokens, extra_keys=[("tenant-b",), None, None, None])) \
        == chunk_keys(tokens, ns["tenant-b", None], CHUNK)
    assert r.stored(stored_map([21, 22, 23, 24], None, tokens)) == chunk_keys(tokens, DEFAULT_NAMESPACE, CHUNK)
    assert r.stored(stored_map([41, 42], None, tokens[:CHUNK], extra_keys=[["ad"], ["ad"]], **lora)) \
        + r.stored(stored_map([43, 44], 42, tokens[CHUNK:], extra_keys=[["ad"], ["ad"]], **lora)) \
        == chunk_keys(tokens, ns[None, "ad"], CHUNK)
    assert r.stored(stored_map([51, 52], None, tokens[:CHUNK], extra_keys=[["ad", "tenant-a"], ["ad"]], **lora)) \
        == chunk_keys(tokens, ns["tenant-a", "ad"], CHUNK)[:1]
    assert r.num_skipped == 0
    # not indexed: a salt-like key on a block with a parent or past the first; an adapter's name missing
    # from a block or not first; a multimodal key; an empty or non-string key
    skipped = [stored_map([31], 2, tokens[:BLOCK], extra_keys=[["tenant-a"]]),
               stored_map([32, 33], None, tokens[:CHUNK], extra_keys=[None, ["tenant-a"]]),
               stored_map([34, 35], None, tokens[:CHUNK], extra_keys=[["ad"], None], **lora),
               stored_map([36], None, tokens[:BLOCK], extra_keys=[["tenant-a", "ad"]], **lora),
               stored_map([37], None, tokens[:BLOCK], **lora),
               stored_map([38], None, tokens[:BLOCK], extra_keys=[[["mm-hash", 0]]]),
               stored_map([39], None, tokens[:BLOCK], extra_keys=[[""]]),
               stored_map([40], None, tokens[:BLOCK], extra_keys=[[b"digest"]])]
    assert all(r.stored(f) == [] for f in skipped) and r.num_skipped == 1 + 2 + 2 + 1 + 1 + 1 + 1 + 1
    # removing the salted chain's blocks takes its keys away
    assert r.removed({"block_hashes": [4, 3, 2, 1]}) == chunk_keys(tokens, ns["tenant-a", None], CHUNK)[::-1]


def test_vllm_source_flag_parsing():
    s = VllmSource.parse("v1=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558,http://10.0.0.1:8000/")
    assert (s.member_id, s.endpoint, s.replay_endpoint, s.url) == ("v1", "tcp://10.0.0.1:5557",
                                                                   "tcp://10.0.0.1:5558", "http://10.0.0.1:8000")
    assert VllmSource.parse("v2=tcp://h:1").replay_endpoint is None
    for bad in ("tcp://h:1", "=tcp://h:1", "v=", "v=http://h:1", "v=tcp://a:1,tcp://b:2,tcp://c:3", "v=udp://h:1"):
        with pytest.raises(ValueError):
            VllmSource.parse(bad)
    with pytest.raises(ValueError, match="twice"):
        ConductorConfig(vllm_kv_events=["a=tcp://h:1", "a=tcp://h:2"])
    with pytest.raises(ValueError, match="32 hex"):
        ConductorConfig(vllm_namespace="abc")


class FakeVllm:
    """A publisher speaking vLLM's KV-event protocol (PUB, ROUTER replay, map-form msgpack batches):
    what vLLM's ZmqEventPublisher does, driven by the test."""

    def __init__(self):
        import zmq

        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer, self.seq, self._stop = [], 0, threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, events, *, live=True):
        self.publish_payload(msgpack.packb({"ts": 0.0, "events": events, "data_parallel_rank": 0}), live=live)

    def publish_payload(self, payload: bytes, *, live=True):
        with self._lock:
            self.buffer.append((self.seq, payload))
            if live:
                self.pub.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
            self.seq += 1

    def restart(self):
        with self._lock:
            self.buffer, self.seq = [], 0

    def _serve_replay(self):
        while not self._stop.is_set():
            if not self.replay.poll(100):
                continue
            client, _, start = self.replay.recv_multipart()
            with self._lock:
                for seq, payload in self.buffer:
                    if seq >= int.from_bytes(start, "big"):
                        self.replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
                self.replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self):
        self._stop.set()
        self.thread.join()
        self.pub.close(0)
        self.replay.close(0)


def blocks(tokens, first_hash, cache_salt=None, lora=None):
    """One BlockStored per block of ``tokens`` (hashes first_hash, first_hash+1, ...), chained; with
    ``cache_salt`` and ``lora`` (an adapter's name), the extra keys vLLM publishes for such a request."""
    out = []
    for i in range(len(tokens) // BLOCK):
        extra = ([lora] if lora else []) + ([cache_salt] if cache_salt and not i else [])
        out.append(stored_map([first_hash + i], first_hash + i - 1 if i else None, tokens[i * BLOCK:(i + 1) * BLOCK],
                              extra_keys=[extra] if extra else None, lora_name=lora, lora_id=1 if lora else None))
    return out


def wait_idle(cc):
    """Until no instance is busy with what the conductor sent it before (vLLM instances report no load:
    the conductor counts each scheduled prefill's predicted time against its instance)."""
    wait_for(lambda: all(m.predicted_queue_s == 0 for m in cc.members()), what="the instances to be idle")


def schedule_when_idle(cc, keys, num_tokens):
    wait_idle(cc)
    return cc.schedule(keys, num_tokens, vllm=True)


def _random_value(rng: random.Random, depth: int = 0):
    """A random msgpack value: what a publisher of another version, or a broken one, might send in a field."""
    kinds = ["int", "bigint", "neg", "float", "str", "bytes", "none", "bool"] + (["list", "map"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randrange(0, 300)
    if kind == "bigint":
        return rng.choice((1 << 31, 1 << 40, (1 << 64) - 1))
    if kind == "neg":
        return -rng.randrange(1, 1 << 40)
    if kind == "float":
        return rng.choice((0.5, float("nan"), float("inf"), -1e300))
    if kind == "str":
        return rng.choice(("", "x", "BlockStored", "GPU"))
    if kind == "bytes":
        return rng.randbytes(rng.choice((0, 8, 16)))
    if kind in ("none", "bool"):
        return None if kind == "none" else rng.random() < 0.5
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 3, BLOCK)))]
    return {_random_value(rng, 2) if rng.random() < 0.3 else "k": _random_value(rng, depth + 1) for _ in range(2)}


def bad_payload_fields() -> list[tuple[str, object]]:
    """A ``BlockStored``'s fields of a type vLLM never sends."""
    return [("token_ids", 5), ("token_ids", ["x"] * BLOCK), ("token_ids", [1 << 40] * BLOCK),
            ("token_ids", {"a": 1}), ("block_hashes", {"a": 1}), ("block_hashes", [[[1]]]),
            ("block_hashes", [{}]), ("block_hashes", 7), ("block_size", "32"), ("extra_keys", 5)]


def hostile_payloads(seed: int = 7) -> list[bytes]:
    """Batches no vLLM should send: not msgpack, not a batch, and events whose fields have the wrong types or
    ranges (hand-picked, then seeded random ones)."""
    good = stored_map([1], None, list(range(BLOCK)))
    odd = [("token_ids", [-1] * BLOCK), ("block_size", (1 << 64) - 1), ("parent_block_hash", {"x": 1}),
           ("parent_block_hash", [[1]]), ("extra_keys", [[{}]]), ("lora_name", [1]), ("group_idx", [])]
    events = [[{**good, k: v}] for k, v in bad_payload_fields() + odd]
    events += [[{"type": "BlockRemoved", "block_hashes": h}] for h in (7, [{}], [[[1]]], "ab")]
    events += [[["BlockStored", {}, 3]], [["BlockRemoved", 5]], [[]], [None], [["AllBlocksCleared", 1, 2]]]
    rng = random.Random(seed)
    for _ in range(200):
        tag = rng.choice(("BlockStored", "BlockRemoved"))
        e = {**good, "type": tag} if tag == "BlockStored" else {"type": tag, "block_hashes": [1]}
        for k in list(e):
            if k != "type" and rng.random() < 0.4:
                e[k] = _random_value(rng)
        events.append([e])
    out = [b"", b"\xc1", b"not msgpack at all", msgpack.packb(5), msgpack.packb("batch"), msgpack.packb([1]),
           msgpack.packb({"ts": [1], "events": []}), msgpack.packb([[1], [good]]), msgpack.packb([0.0, 5])]
    return out + [msgpack.packb({"ts": 0.0, "events": ev}) for ev in events]


def test_malformed_batches_and_events_are_skipped_and_the_follower_follows_on():
    """A publisher's batches that are not vLLM's (garbage, wrong types and ranges in any field) are counted and
    skipped, event by event: the valid events beside them and the batches after them are still indexed, from
    replay and live. Any one of them used to end the follower for good: the instance then looked cached-cold."""
    rng = random.Random(3)
    a, b = ([rng.randrange(3, 30000) for _ in range(4 * BLOCK)] for _ in range(2))
    v = FakeVllm()
    hostile = hostile_payloads()
    for payload in hostile:
        v.publish_payload(payload, live=False)  # replayed when the conductor connects: all of them, in order
    v.publish(blocks(a, 100) + [{**stored_map([5], None, list(range(BLOCK))), "token_ids": 5}], live=False)
    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", chunk_tokens=CHUNK, heartbeat_interval=0.2,
                                          dead_timeout=30, vllm_kv_events=[f"v={v.endpoint},{v.replay_endpoint}"]))
    conductor.start()
    try:
        ka, kb = chunk_keys(a, DEFAULT_NAMESPACE, CHUNK), chunk_keys(b, DEFAULT_NAMESPACE, CHUNK)
        with ConductorClient(conductor.address) as cc:
            wait_for(lambda: cc.locate(ka).num_prefix == 2, what="the valid blocks after the hostile ones")

            def b_indexed():  # live now: hostile batches again, then b's blocks (resent until the SUB has them)
                if cc.locate(kb).num_prefix < 2:
                    for payload in hostile[::10]:
                        v.publish_payload(payload)
                    v.publish(blocks(b, 500))
                return cc.locate(kb).num_prefix == 2

            wait_for(b_indexed, what="live blocks after live hostile batches")
        assert conductor.vllm["v"].num_bad > 9  # the 9 batches that are none, and events: counted, not taken
    finally:
        conductor.stop()
        v.close()


def test_conductor_schedules_each_prompt_to_the_vllm_instance_holding_its_prefix(capsys):
    rng = random.Random(1)
    a, b = ([rng.randrange(3, 30000) for _ in range(8 * BLOCK)] for _ in range(2))
    v1, v2 = FakeVllm(), FakeVllm()
    v1.publish(blocks(a, 100), live=False)  # before the conductor listens: only replay has it
    conductor = Conductor(ConductorConfig(
        listen="127.0.0.1:0", chunk_tokens=CHUNK, heartbeat_interval=0.2, dead_timeout=30,
        vllm_kv_events=[f"v1={v1.endpoint},{v1.replay_endpoint}", f"v2={v2.endpoint},{v2.replay_endpoint}"])).start()
    try:
        ka, kb = chunk_keys(a, DEFAULT_NAMESPACE, CHUNK), chunk_keys(b, DEFAULT_NAMESPACE, CHUNK)
        with ConductorClient(conductor.address) as cc:
            members = {m.member_id: m for m in cc.members()}
            assert members["v1"].kind.label == "prefill" and members["v1"].namespace == DEFAULT_NAMESPACE
            assert members["v1"].vllm and members["v2"].vllm
            wait_for(lambda: cc.locate(ka).num_prefix == 4, what="v1's replayed blocks indexed")
            assert cc.locate(ka).holders[0] == {"v1": Tier.DEVICE}

            def v2_has_b():  # PUB/SUB drops what is sent before the subscription lands: resend until seen
                if cc.locate(kb).num_prefix < 4:
                    v2.publish(blocks(b, 500))
                return cc.locate(kb).num_prefix == 4

            wait_for(v2_has_b, what="v2's live blocks indexed")
            for keys, tokens, instance in ((ka, a, "v1"), (kb, b, "v2"), (ka[:2], a[:2 * CHUNK], "v1")):
                r = schedule_when_idle(cc, keys, len(tokens) + 10)
                assert (r.prefill, r.num_cached_chunks, r.decode, r.source_node) == (instance, len(keys), None, None)
            # a fresh prompt loads nothing
            assert schedule_when_idle(cc, chunk_keys([5] * CHUNK, DEFAULT_NAMESPACE, CHUNK), CHUNK).num_cached_chunks == 0
            # Crescent's own pool is another: a Crescent gateway is never sent to a vLLM instance
            with pytest.raises(FailedPreconditionError, match="no live prefill engine"):
                cc.schedule(ka, len(a))
            # crescent ctl schedule --vllm computes the keys under the instances' namespace
            wait_idle(cc)
            rc, out, err = run_cli(capsys, "ctl", "schedule", "--vllm", "--conductor", conductor.address,
                                   "--tokens", ",".join(map(str, b)))
            assert rc == 0 and out.startswith("prefill v2 ") and "cached 4 chunks / 256 tokens" in out, (out, err)
            rc, out, _ = run_cli(capsys, "ctl", "nodes", "--conductor", conductor.address)
            assert rc == 0 and "vLLM, 4 chunks cached" in out
            # a salted request's blocks (v1 runs `b` under cache_salt "acme"): `--cache-salt` finds them
            # on v1, the unsalted keys still on v2 alone
            ks = chunk_keys(b, request_namespace(DEFAULT_NAMESPACE, "acme"), CHUNK)

            def v1_has_salted_b():
                if cc.locate(ks).num_prefix < 4:
                    v1.publish(blocks(b, 700, cache_salt="acme"))
                return cc.locate(ks).num_prefix == 4

            wait_for(v1_has_salted_b, what="v1's salted blocks indexed")
            assert cc.locate(kb).holders == [{"v2": Tier.DEVICE}] * 4
            wait_idle(cc)
            rc, out, err = run_cli(capsys, "ctl", "schedule", "--vllm", "--cache-salt", "acme", "--conductor",
                                   conductor.address, "--tokens", ",".join(map(str, b)))
            assert rc == 0 and out.startswith("prefill v1 ") and "cached 4 chunks / 256 tokens" in out, (out, err)
            # and a LoRA request's (v1 runs `b` with adapter "ad", under the same salt): `--lora` too
            kl = chunk_keys(b, request_namespace(DEFAULT_NAMESPACE, "acme", "ad"), CHUNK)

            def v1_has_lora_b():
                if cc.locate(kl).num_prefix < 4:
                    v1.publish(blocks(b, 800, cache_salt="acme", lora="ad"))
                return cc.locate(kl).num_prefix == 4

            wait_for(v1_has_lora_b, what="v1's LoRA blocks indexed")
            wait_idle(cc)
            rc, out, err = run_cli(capsys, "ctl", "schedule", "--vllm", "--cache-salt", "acme", "--lora", "ad",
                                   "--conductor", conductor.address, "--tokens", ",".join(map(str, b)))
            assert rc == 0 and out.startswith("prefill v1 ") and "cached 4 chunks / 256 tokens" in out, (out, err)
            rc, out, err = run_cli(capsys, "ctl", "lookup", "--vllm", "--cache-salt", "acme", "--lora", "ad",
                                   "--conductor", conductor.address, "--tokens", ",".join(map(str, b)), "--json")
            got = json.loads(out)
            assert rc == 0 and got["num_prefix"] == 4 and [k["key"] for k in got["keys"]] == [k.hex() for k in kl]
            assert all(k["holders"] == {"v1": "device"} for k in got["keys"]), got
            rc, _, err = run_cli(capsys, "ctl", "schedule", "--cache-salt", "acme", "--conductor", conductor.address,
                                 "--tokens", "1,2,3")
            assert rc == 2 and "--cache-salt and --lora need --vllm" in err

            # vLLM evicts the block completing chunk 3 of `a`; then clears its cache
            v1.publish([{"type": "BlockRemoved", "block_hashes": [107, 106], "medium": "GPU"}])
            wait_for(lambda: cc.locate(ka).num_prefix == 3, what="the eviction")
            v1.publish([{"type": "AllBlocksCleared"}])
            wait_for(lambda: cc.locate(ka).num_prefix == 0, what="the reset")
            assert cc.schedule(ka, len(a), vllm=True).num_cached_chunks == 0

            # v2 restarts: its sequence starts over, and what it held before is forgotten
            v2.restart()
            v2.publish(blocks(b[:2 * BLOCK], 900))
            wait_for(lambda: cc.locate(kb).num_prefix == 1, what="v2's restart to be noticed")
            # the pin/evict fan-out never treats a vLLM instance as a store node
            assert cc.evict(kb) == (0, 0)
    finally:
        conductor.stop()
        v1.close()
        v2.close()
