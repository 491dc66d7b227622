"""A store node's KV events in vLLM's wire format, decoded by the real vLLM's own classes (its
``KVEventBatch`` msgspec decoder, in .venv-vllm): chunks stored, deleted and cleared reach a ZeroMQ
subscriber as BlockStored / BlockRemoved with the chunk key as the block hash, the parent key and the
token ids from the chunk header; plain values are not published; the replay socket returns every
buffered batch, then the end marker; live batches follow on the PUB socket."""

import json
import subprocess
import sys
import textwrap

import torch

from kvstore.chunk import encode_chunk
from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
from kvstore.server import StoreNode
from tests.helpers import ROOT, require_venv, wait_for

SUBSCRIBER = """
import json, sys, zmq, msgspec
from vllm.distributed.kv_events import KVEventBatch
endpoint, replay = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
dec = msgspec.msgpack.Decoder(type=KVEventBatch)

def show(batch):
    return [dict(type=type(e).__name__, hashes=[h.hex() for h in getattr(e, "block_hashes", [])],
                 parent=e.parent_block_hash.hex() if getattr(e, "parent_block_hash", None) else None,
                 tokens=list(getattr(e, "token_ids", [])), block_size=getattr(e, "block_size", None),
                 medium=getattr(e, "medium", None)) for e in batch.events]

sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.RCVTIMEO, 300000)
sub.connect(endpoint)
req = ctx.socket(zmq.DEALER)
req.setsockopt(zmq.RCVTIMEO, 300000)
req.connect(replay)
req.send_multipart((b"", (0).to_bytes(8, "big")))
replayed, seqs = [], []
while True:
    _, topic, seq, payload = req.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) == -1:
        break
    seqs.append(int.from_bytes(seq, "big"))
    replayed += show(dec.decode(payload))
print(json.dumps(dict(replayed=replayed, seqs=seqs)), flush=True)
topic, seq, payload = sub.recv_multipart()  # the test keeps storing chunks until one arrives here
print(json.dumps(dict(live=show(dec.decode(payload)), seq=int.from_bytes(seq, "big"))), flush=True)
"""


def _chunk(ns, tokens, parent, value):
    return encode_chunk(torch.full((1, 2, 1, 4, 4), float(value)), ns, parent, tokens)


def test_kv_events_in_vllms_format_decode_with_vllm(tmp_path):
    python = require_venv("vllm")
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB", kv_events_endpoint="tcp://127.0.0.1:*",
                                 kv_events_replay_endpoint="tcp://127.0.0.1:*")).start()
    ns = make_namespace(ModelFingerprint("m", "float32", 1, 1, 4, 4), None)
    tokens = list(range(100, 108))
    k0, k1 = (bytes(k) for k in chunk_keys(tokens, ns, 4))
    sub = None
    try:
        with StoreClient(node.address) as c:
            c.put(k0, _chunk(ns, tokens[:4], bytes(ROOT_KEY), 0))
            c.put(k1, _chunk(ns, tokens[4:], k0, 1))
            c.put(b"not-a-chunk", b"y" * 100)  # plain values are not published, nor is their removal
            assert c.delete([k1]) == 1
            assert c.clear() == 2
            wait_for(lambda: node.kv_events.num_published == 4, timeout_s=120, what="4 events published")

            script = tmp_path / "sub.py"
            script.write_text(textwrap.dedent(SUBSCRIBER))
            sub = subprocess.Popen([python, str(script), node.kv_events.endpoint, node.kv_events.replay_endpoint],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = sub.stdout.readline()
            assert line, sub.stderr.read()[-3000:]
            res = json.loads(line)
            stored = dict(type="BlockStored", medium="CPU", block_size=4)
            removed = dict(type="BlockRemoved", medium="CPU", parent=None, tokens=[], block_size=None)
            assert res["replayed"] == [
                {**stored, "hashes": [k0.hex()], "parent": None, "tokens": tokens[:4]},
                {**stored, "hashes": [k1.hex()], "parent": k0.hex(), "tokens": tokens[4:]},
                {**removed, "hashes": [k1.hex()]},
                {**removed, "hashes": [k0.hex()]},
            ]
            assert res["seqs"] == sorted(res["seqs"]) and res["seqs"][0] == 0

            # Live: a new subscriber may miss what is sent before its subscription settles (ZeroMQ's
            # slow joiner), so store fresh chunks until the subscriber has one.
            i = 0
            while sub.poll() is None and i < 600:
                more = list(range(200 + 4 * i, 204 + 4 * i))
                (key,) = chunk_keys(more, ns, 4)
                c.put(bytes(key), _chunk(ns, more, bytes(ROOT_KEY), i))
                i += 1
                try:
                    sub.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        out, err = sub.communicate(timeout=120)
        assert sub.returncode == 0, err[-3000:]
        live = json.loads(out.strip().splitlines()[-1])
        assert live["seq"] > max(res["seqs"]) and live["live"][0]["type"] == "BlockStored"
        assert live["live"][0]["block_size"] == 4 and live["live"][0]["parent"] is None
    finally:
        if sub is not None and sub.poll() is None:
            sub.kill()
            sub.wait()
        node.stop(grace=0)


def test_a_bad_kv_events_endpoint_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0",
                        "--kv-events-endpoint", "5557"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "ZeroMQ endpoint" in r.stderr, r.stderr


def test_a_chunk_demoted_to_disk_is_removed_from_cpu_and_stored_in_storage(tmp_path):
    """Read with plain ZeroMQ and msgpack (no vLLM needed): a move between tiers is BlockRemoved from the
    old medium and BlockStored in the new, with the same parent and tokens (from the header cache: the
    value on disk is not read back)."""
    import msgpack
    import zmq

    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="256KiB", slot_size="4KiB", disk=str(tmp_path / "disk"),
                                 disk_size="16MiB", kv_events_endpoint="tcp://127.0.0.1:*",
                                 kv_events_replay_endpoint="tcp://127.0.0.1:*")).start()
    ns = make_namespace(ModelFingerprint("m", "float32", 1, 1, 4, 64), None)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 60000)
    req.setsockopt(zmq.LINGER, 0)
    try:
        with StoreClient(node.address) as c:
            for i in range(120):  # one 4 KiB slot each, 480 KiB in all: the first ones leave DRAM for disk
                toks = list(range(1000 * i, 1000 * i + 64))
                (key,) = chunk_keys(toks, ns, 64)
                c.put(bytes(key), encode_chunk(torch.full((1, 2, 1, 64, 4), float(i)), ns, bytes(ROOT_KEY), toks))
        req.connect(node.kv_events.replay_endpoint)

        def events():
            req.send_multipart((b"", (0).to_bytes(8, "big")))
            out = []
            while True:
                _, _, seq, payload = req.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return out
                ts, evs, rank = msgpack.unpackb(payload)
                out += evs

        def moved():
            evs = events()
            to_disk = [e for e in evs if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
            return (evs, to_disk) if to_disk else None

        evs, to_disk = wait_for(moved, timeout_s=120, what="a chunk demoted to disk")
        e = to_disk[0]
        key = e["block_hashes"][0]
        first = next(x for x in evs if x["type"] == "BlockStored" and x["block_hashes"] == [key])
        assert first["medium"] == "CPU" and first["token_ids"] == e["token_ids"] and len(e["token_ids"]) == 64
        assert {"type": "BlockRemoved", "block_hashes": [key], "medium": "CPU"} in evs
        assert evs.index({"type": "BlockRemoved", "block_hashes": [key], "medium": "CPU"}) < evs.index(e)
    finally:
        req.close(0)
        node.stop(grace=0)
