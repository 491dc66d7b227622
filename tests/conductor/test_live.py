"""The cluster as real processes: a conductor, 2 store nodes, 2 prefill engines (test-owned agents),
driven through `crescent ctl` as an operator would."""

import json
import socket

import pytest

from kvstore.client import StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.keys import ModelFingerprint, chunk_keys, make_namespace
from tests.conductor.procs import ConductorProcess, EngineProcess, ctl, run_cli
from tests.helpers import StoreProcess, wait_for

CHUNK = 64  # long enough that loading a chunk beats recomputing it in the cost model
NS = make_namespace(ModelFingerprint("live-test", "float16", 2, 2, 8, CHUNK))
P1 = list(range(1000, 1000 + 4 * CHUNK + 2))  # 4 full chunks + 2 tokens
P2 = list(range(5000, 5000 + 4 * CHUNK + 2))


@pytest.fixture
def cluster():
    procs = []
    try:
        cond = ConductorProcess("--heartbeat-interval", "0.3", "--dead-timeout", "3")
        procs.append(cond)
        stores = {}
        for name in ("store-a", "store-b"):
            stores[name] = StoreProcess("--node-id", name, "--dram", "16MiB", "--conductor", cond.address)
            procs.append(stores[name])
        for name, node in (("engine-a", "store-a"), ("engine-b", "store-b")):
            procs.append(EngineProcess(cond.address, name, "--store-node", node, "--namespace", NS.hex(),
                                       "--chunk-tokens", str(CHUNK)))
        yield cond, stores
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture
def cli(capsys):
    def run(*args, conductor=None, json_out=False):
        args = list(args) + (["--conductor", conductor] if conductor else []) + (["--json"] if json_out else [])
        rc, out, err = run_cli(capsys, "ctl", *args)
        if json_out:
            assert rc == 0, err
            return json.loads(out)
        return rc, out, err

    return run


def test_live_cluster(cluster, cli):
    cond, stores = cluster
    cc = ConductorClient(cond.address)
    wait_for(lambda: {m.member_id for m in cc.members()} == {"store-a", "store-b", "engine-a", "engine-b"},
             what="4 members")
    m = {x["member_id"]: x for x in ctl("nodes", conductor=cond.address, json_out=True)}  # the real entry point
    assert m["engine-b"]["kind"] == "prefill" and m["engine-b"]["store_node"] == "store-b"
    assert m["store-a"]["kind"] == "store" and m["store-a"]["state"] == "alive"
    rc, _, err = cli("nodes", conductor=stores["store-a"].address)  # a store is not a conductor: said so
    assert rc == 1 and "UNIMPLEMENTED" in err and "right kind of server" in err and err.count("\n") == 1

    # Prefix P1 is cached on store-b, P2 on store-a.
    keys1, keys2 = chunk_keys(P1, NS, CHUNK), chunk_keys(P2, NS, CHUNK)
    for keys, node in ((keys1, "store-b"), (keys2, "store-a")):
        with StoreClient(stores[node].address) as s:
            s.batch_put([(k, b"kv" * 100) for k in keys])
    wait_for(lambda: cc.locate(keys1).num_prefix == 4 and cc.locate(keys2).num_prefix == 4,
             what="prefixes indexed")
    lk = cli("lookup", "--tokens", ",".join(map(str, P1)), conductor=cond.address, json_out=True)
    assert lk["num_prefix"] == 4
    assert lk["nodes"] == [{"node_id": "store-b", "address": stores["store-b"].address, "num_prefix": 4}]

    # Requests sharing a prefix go where the prefix is.
    def schedule(tokens):
        # NOTE: Schedule counts the prefills it just placed as queued work until they would be done;
        # wait that out so that each decision here is about the cache alone.
        wait_for(lambda: all(m.predicted_queue_s == 0 for m in cc.members() if m.engine), what="idle engines")
        return cli("schedule", "--tokens", ",".join(map(str, tokens)), conductor=cond.address, json_out=True)

    for tokens, engine, node in ((P1, "engine-b", "store-b"), (P2, "engine-a", "store-a"),
                                 (P1 + [1, 2, 3, 4, 5], "engine-b", "store-b")):
        r = schedule(tokens)
        assert (r["accepted"], r["prefill"], r["source_node"], r["num_cached_chunks"]) == (True, engine, node, 4)
    wait_for(lambda: all(m.predicted_queue_s == 0 for m in cc.members() if m.engine), what="idle engines")
    rc, out, _ = cli("schedule", "--tokens", ",".join(map(str, P1)), conductor=cond.address)
    assert rc == 0 and "prefill engine-b" in out and "source store-b" in out

    # --text (UTF-8 bytes as tokens with the default tokenizer), pin/unpin/evict, stats.
    words = "the quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 2 chunks
    keys = chunk_keys(list(words.encode()), NS, CHUNK)
    with StoreClient(stores["store-a"].address) as s:
        s.batch_put([(k, b"x") for k in keys])
    wait_for(lambda: cc.locate(keys).num_prefix == len(keys), what="text prefix indexed")
    assert cli("lookup", "--text", words, conductor=cond.address, json_out=True)["num_prefix"] == len(keys)
    pin = cli("pin", "--text", words, "--ttl", "30", conductor=cond.address, json_out=True)
    assert (pin["num_copies"], pin["num_nodes"]) == (len(keys), 1)
    assert cli("unpin", "--text", words, conductor=cond.address, json_out=True)["num_copies"] == len(keys)
    ev = cli("evict", "--text", words, conductor=cond.address, json_out=True)
    assert (ev["num_copies"], ev["num_nodes"]) == (len(keys), 1)
    assert cli("lookup", "--text", words, conductor=cond.address, json_out=True)["num_prefix"] == 0
    st = cli("stats", conductor=cond.address, json_out=True)
    assert st["num_members"] == 4 and st["num_chunks"] == 8 and st["schedule"]["num_scheduled"] >= 4
    assert {n["member_id"] for n in st["nodes"]} == {"store-a", "store-b", "engine-a", "engine-b"}
    rc, out, _ = cli("stats", conductor=cond.address)
    assert rc == 0 and "hit rate" in out and "engine-a" in out
    rc, out, _ = cli("nodes", conductor=cond.address)
    assert rc == 0 and "store-b" in out and "prefill" in out

    # A drained engine gets no new work; its prefix is pulled by the other one.
    assert cli("drain", "engine-b", conductor=cond.address, json_out=True)["state"] == "draining"
    r = schedule(P1)
    assert (r["prefill"], r["source_node"], r["num_cached_chunks"]) == ("engine-a", "store-b", 4)
    assert cli("drain", "engine-b", "--undo", conductor=cond.address, json_out=True)["state"] == "alive"

    # A killed node leaves the member list within the timeout, and its chunks leave lookups.
    stores["store-b"].kill9()
    wait_for(lambda: "store-b" not in {m.member_id for m in cc.members()}, timeout_s=60,
             what="store-b declared dead")
    assert "store-b" not in {x["member_id"] for x in cli("nodes", conductor=cond.address, json_out=True)}
    assert cc.locate(keys1).num_prefix == 0 and cc.locate(keys2).num_prefix == 4
    r = schedule(P1)
    assert r["num_cached_chunks"] == 0 and r["source_node"] is None
    cc.close()

    # Bad admin input: one line, precise.
    for args, rc, msg in [(("drain", "nobody"), 1, "NOT_FOUND: no live member 'nobody'"),
                          (("lookup", "--keys", "zz"), 2, "--keys takes hex keys"),
                          (("lookup", "--tokens", "1,x"), 2, "--tokens takes integers"),
                          (("lookup", "--tokens", "1,2,3,4", "--namespace", "abc"), 2, "--namespace must be 32"),
                          (("pin", "--keys", "00" * 16, "--ttl", "-5"), 2, "--ttl must be"),
                          (("schedule", "--keys", "00" * 16, "--num-tokens", "1"), 1, "INVALID_ARGUMENT")]:
        code, _, err = cli(*args, conductor=cond.address)
        assert code == rc, (args, err)
        assert err.startswith("crescent ctl: error: ") and msg in err, (args, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_unreachable_conductor_is_one_line(cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    address = f"127.0.0.1:{port}"
    r = ctl("nodes", conductor=address)  # once through the real entry point
    assert r.returncode == 1 and r.stdout == ""
    errors = [r.stderr]
    for cmd in (["stats", "--json"], ["lookup", "--keys", "00" * 16], ["drain", "x"]):
        code, out, err = cli(*cmd, conductor=address)
        assert code == 1 and out == ""
        errors.append(err)
    for err in errors:
        assert err.startswith(f"crescent ctl: error: cannot reach the conductor at {address}"), err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_flags_exit_2(capsys):
    rc, _, err = run_cli(capsys, "store", "--conductor", "nohost")
    assert rc == 2 and "--conductor must be host:port" in err
    rc, _, err = run_cli(capsys, "conductor", "--dead-timeout", "0.5", "--heartbeat-interval", "1")
    assert rc == 2 and "--dead-timeout (0.5) must exceed" in err
    rc, _, err = run_cli(capsys, "conductor", "--policy", "fastest")
    assert rc == 2 and "invalid choice: 'fastest'" in err
    # numbers and addresses checked before anything is sent (they crashed, dialled :443 or wrapped)
    for args, want in ((("ctl", "schedule", "--keys", "aabb", "--num-tokens=-5"), "--num-tokens: must be in"),
                       (("ctl", "schedule", "--keys", "aabb", "--chunk-tokens", str(1 << 40)), "--chunk-tokens: must"),
                       (("ctl", "nodes", "--timeout", "nan"), "--timeout: must be in"),
                       (("ctl", "nodes", "--conductor", "127.0.0.1"), "--conductor must be host:port"),
                       (("ctl", "nodes", "--conductor", ",,"), "--conductor must be host:port"),
                       (("ctl", "nodes", "--etcd", "bad"), "--etcd"),
                       # ("²".isdigit() holds, and int() refuses it)
                       (("ctl", "nodes", "--conductor", "127.0.0.1:\u00b2"), "--conductor must be host:port"),
                       (("ctl", "nodes", "--etcd", "127.0.0.1:\u00b2"), "etcd endpoints must be"),
                       (("store", "--listen", "127.0.0.1:\u00b2"), "--listen must be host:port"),
                       (("--log-level", "bogus", "ctl", "nodes"), "invalid choice: 'BOGUS'"),
                       (("conductor", "--metrics-port", "70000"), "--metrics-port must be a port"),
                       (("engine", "both", "--listen", "127.0.0.1:99999"), "--listen: must be host:port"),
                       (("engine", "both", "--page-size", "0"), "page_size (0)"),
                       (("engine", "both", "--store", "localhost"), "--store must be host:port"),
                       (("engine", "both", "--fetch-timeout-s", "-1"), "--fetch-timeout-s: must be in [0, 86400]"),
                       (("engine", "both", "--fetch-timeout-s", "nan"), "--fetch-timeout-s: must be in [0, 86400]"),
                       (("gateway", "--listen", "127.0.0.1:99999"), "--listen: must be host:port"),
                       (("up", "--gateway-port", "-1"), "--gateway-port: a port is in"),
                       (("up", "--dram", "12XB"), "--dram: not a size")):
        rc, _, err = run_cli(capsys, *args)
        assert rc == 2 and want in err and "Traceback" not in err, (args, err)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, _, err = run_cli(capsys, "conductor", "--listen", f"127.0.0.1:{s.getsockname()[1]}")
    assert rc == 2 and "cannot listen" in err


def test_conductor_stops_on_sigterm():
    c = ConductorProcess()
    assert c.stop() == 0
