"""The conductor's HTTP endpoint: /api/console against a real conductor and store node fed over gRPC,
/ui and its files, /metrics, and clear errors for other paths."""

import json
import time
import urllib.error
import urllib.request

import pytest

from kvstore.client import StoreClient
from kvstore.conductor.agent import MemberAgent
from kvstore.conductor.client import ConductorClient
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.console import ConsoleLog, DECISION_AGE_S
from kvstore.conductor.service import Conductor
from kvstore.conductor.membership import MemberKind
from kvstore.config import StoreConfig
from kvstore.errors import FailedPreconditionError
from kvstore.keys import chunk_keys
from kvstore.server import StoreNode
from tests.helpers import wait_for

CT = 256
"""Tokens per chunk: prompts long enough that loading their prefix beats recomputing it."""


@pytest.fixture
def cluster():
    c = Conductor(ConductorConfig(listen="127.0.0.1:0", metrics_port=0, heartbeat_interval=0.2, dead_timeout=30,
                                  chunk_tokens=CT)).start()
    n = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="32MiB", conductor=c.address, node_id="store-0")).start()
    yield c, n
    n.stop(grace=0)
    c.stop()


def get(conductor, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{conductor.metrics_port}{path}", timeout=30) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def api(conductor) -> dict:
    code, ctype, body = get(conductor, "/api/console")
    assert code == 200 and ctype == "application/json"
    return json.loads(body)


def test_console_shows_members_decisions_hot_prefixes_pins_and_series(cluster):
    conductor, node = cluster
    wait_for(lambda: any(m["id"] == "store-0" and m.get("tiers") for m in api(conductor)["members"]),
             what="the store node's first heartbeat")
    ns = b"n" * 16
    shared = list(range(2 * CT))  # two chunks every prompt starts with
    prompts = [shared + [i] * CT for i in range(3)]
    keys = [chunk_keys(p, ns, CT) for p in prompts]
    with StoreClient(node.address) as sc:
        sc.batch_put([(k, b"x" * 1000) for k in keys[0]])
    wait_for(lambda: api(conductor)["conductor"]["num_chunks"] == 3, what="the node's events to reach the index")
    engine_id = "prefill-0"
    with ConductorClient(conductor.address) as cc:
        with pytest.raises(FailedPreconditionError):
            cc.schedule(keys[0], 3 * CT)  # no prefill engine yet: an error, not a decision
        agent = MemberAgent(conductor.address, engine_id, MemberKind.PREFILL, store_node="store-0").start()
        try:
            assert agent.registered.wait(60)
            for k in keys:
                cc.schedule(k, 3 * CT)
            n, nodes = cc.pin(keys[0][:2], 600)
            assert (n, nodes) == (2, 1)
            s = api(conductor)
        finally:
            agent.stop()
    assert {m["id"]: m["kind"] for m in s["members"]} == {"store-0": "store", engine_id: "prefill"}
    store = next(m for m in s["members"] if m["id"] == "store-0")
    assert store["chunks"] == 3 and [t["tier"] for t in store["tiers"]][0] == "dram"
    assert s["counters"]["scheduled"] == 3 and s["counters"]["scheduled_chunks"] == 9
    assert s["counters"]["cached_chunks"] == 3 + 2 + 2  # the first prompt whole, the shared two after
    assert [d["cached_chunks"] for d in s["decisions"]] == [2, 2, 3]  # newest first
    assert all(d["prefill"] == engine_id and d["source"] == "store-0" and not d["rejected"] for d in s["decisions"])
    hot = s["hot_prefixes"]
    assert [h["key"] for h in hot[:2]] == [keys[0][0][:8].hex(), keys[0][1][:8].hex()]  # used by every prompt
    assert hot[0]["tokens"] == CT and hot[1]["tokens"] == 2 * CT and hot[0]["uses"] > hot[2]["uses"]
    assert hot[0]["holders"] == {"store-0": "dram"}
    assert sorted(p["key"] for p in s["pins"]) == sorted(k[:8].hex() for k in keys[0][:2])
    assert all(590 < p["expires_in_s"] <= 600 and p["nodes"] == 1 for p in s["pins"])
    # the series: a sample a second of cumulative counters (the page turns them into rates)
    # (the requests count when scheduled; the stored bytes come with the store's next heartbeat)
    def sampled() -> bool:
        last = api(conductor)["series"][-1]
        return last["scheduled"] == 3 and last["bytes_in"] >= 3000

    wait_for(sampled, what="a sample after the requests and the store's next heartbeat")
    series = api(conductor)["series"]
    assert series[-1]["cached_chunks"] == 7 and series[-1]["bytes_in"] == 3000
    assert all(a["t"] < b["t"] for a, b in zip(series, series[1:]))
    with ConductorClient(conductor.address) as cc:
        cc.pin(keys[0][:2], 0)  # unpinned: gone from the page
    assert api(conductor)["pins"] == []


def test_console_log_forgets_old_decisions_and_expired_pins(monkeypatch):
    log = ConsoleLog()
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    log.scheduled([b"a"], 4, {"tokens": 4})
    log.pinned([b"a", b"b"], 10, 1)
    now[0] += 11
    log.pinned([b"c"], 10, 1)  # expired pins leave on the next change
    assert set(log.pins) == {b"c"}
    assert log.decisions[0]["t"] == 1000.0 and DECISION_AGE_S >= 60


def test_ui_files_metrics_and_unknown_paths(cluster):
    conductor, _ = cluster
    code, ctype, body = get(conductor, "/ui")
    assert code == 200 and ctype.startswith("text/html") and b'src="/ui/console.js"' in body
    for path in ("/ui/console.js", "/ui/console.css"):
        code, _, body = get(conductor, path)
        assert code == 200 and body
    assert b"http://" not in get(conductor, "/ui/console.js")[2]  # no CDN: the page loads nothing else
    code, ctype, body = get(conductor, "/metrics")
    assert code == 200 and ctype.startswith("text/plain") and b"crescent_conductor_members" in body
    code, _, body = get(conductor, "/nope")
    assert code == 404 and b"/ui" in body
    code, _, _ = get(conductor, "/")  # redirected to the console
    assert code == 200
