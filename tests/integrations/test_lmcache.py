"""LMCache with Crescent as its remote backend, end to end: the real LMCache (0.5.6), real store nodes.

Each run is a separate process of ``.venv-lmcache/bin/python tests/integrations/lmcache_run.py``
with an LMCache config file naming the ``crescent`` remote storage plugin:
  store      an LMCacheEngine stores the KV of a 53-token prompt (3 full chunks of 16 and a partial one)
  load       a fresh LMCacheEngine (its CPU cache off) looks up and retrieves it from Crescent, byte for
             byte, and finds nothing for a prompt never stored; again after one stored chunk was corrupted,
             and again after the store node stopped
  connector  the connector made by LMCache's CreateConnector: round trips, misses, bad values, outages
The same store and load runs go through a conductor over two store nodes.

LMCache lives in its own venv (``make setup-lmcache``).
"""

from __future__ import annotations

import os

import pytest

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.server import StoreNode
from tests.helpers import ROOT, conductor_and_nodes, require_venv, run_json_script, venv_python

SCRIPT = os.path.join(ROOT, "tests", "integrations", "lmcache_run.py")
PROMPT_TOKENS, CHUNK = 53, 16  # lmcache_run.py's PROMPT and chunk_size
HEADER, DIGEST = 28, 8  # LMCache's remote metadata header (one KV group), the XXH3-64 trailer
FULL_BYTES, PARTIAL_BYTES = 2 * 2 * CHUNK * 16 * 2, 2 * 2 * 5 * 16 * 2  # [2, layers, tokens, hidden] bfloat16
pytestmark = pytest.mark.timeout(900)

CONFIG = """\
chunk_size: {chunk}
local_cpu: false
max_local_cpu_size: 0.05
save_unfull_chunk: true
remote_storage_plugins: ["crescent"]
extra_config:
  remote_storage_plugin.crescent.module_path: kvstore.integrations.lmcache
  remote_storage_plugin.crescent.class_name: CrescentConnectorAdapter
  remote_storage_plugin.crescent.url: "crescent://{address}"
  remote_storage_plugin.crescent.timeout_s: 5
"""


def _run(tmp, name: str, mode: str, address: str) -> dict:
    config, out, log = (os.path.join(tmp, f"{name}.{ext}") for ext in ("yaml", "json", "log"))
    with open(config, "w") as f:
        f.write(CONFIG.format(chunk=CHUNK, address=address))
    # NOTE: LMCache's metrics take PROMETHEUS_MULTIPROC_DIR, or make /tmp/lmcache_prometheus and leave it
    prom = os.path.join(tmp, f"{name}.prometheus")
    env = dict(os.environ, LMCACHE_CONFIG_FILE=config, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
               DO_NOT_TRACK="1", PROMETHEUS_MULTIPROC_DIR=prom)
    return run_json_script(venv_python("lmcache"), SCRIPT, [mode], out, log, env=env, timeout_s=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_venv("lmcache")
    tmp = str(tmp_path_factory.mktemp("lmcache"))
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="64MiB")).start()
    res = {"address": node.address}
    try:
        res["store"] = _run(tmp, "store", "store", node.address)
        keys = [k.encode() for k in res["store"]["keys"]]
        with StoreClient(node.address) as c:
            res["values"] = c.batch_get(keys)
            res["load"] = _run(tmp, "load", "load", node.address)
            bad = bytearray(res["values"][1])
            bad[HEADER + 100] ^= 0x01  # one KV byte of chunk 1
            c.put(keys[1], bad)
            res["corrupt"] = _run(tmp, "corrupt", "load", node.address)
        res["connector"] = _run(tmp, "connector", "connector", node.address)
    finally:
        node.stop(grace=0)
    res["gone"] = _run(tmp, "gone", "load", node.address)
    return res


def test_the_engine_stores_every_chunk_in_crescent(runs):
    store = runs["store"]
    connector = f"InstrumentedRemoteConnector(<CrescentConnector {runs['address']}>)"
    assert store["backends"] == ["LocalCPUBackend", f"RemoteBackend-crescent: {connector}"]
    assert store["lookup"] == PROMPT_TOKENS and len(store["keys"]) == 4
    assert [len(v) for v in runs["values"]] == [HEADER + FULL_BYTES + DIGEST] * 3 + [HEADER + PARTIAL_BYTES + DIGEST]


def test_a_fresh_engine_retrieves_the_kv_from_crescent_byte_for_byte(runs):
    prompt, other = runs["load"]["prompt"], runs["load"]["other"]
    assert prompt == {"lookup": PROMPT_TOKENS, "retrieved": PROMPT_TOKENS, "prefix": True, "equal": True,
                      "rest_untouched": True}
    assert other["lookup"] == 0 and other["retrieved"] == 0 and other["rest_untouched"]


def test_a_corrupt_chunk_is_a_miss_and_ends_the_retrieved_prefix(runs):
    prompt = runs["corrupt"]["prompt"]
    assert prompt["lookup"] == PROMPT_TOKENS  # LMCache's lookup asks only whether the keys exist
    assert prompt["retrieved"] == CHUNK and prompt["prefix"] and prompt["equal"] and prompt["rest_untouched"]
    assert "failed its checksum; read as a miss" in runs["corrupt"]["log"]


def test_without_the_store_the_engine_finds_nothing_and_does_not_fail(runs):
    gone = runs["gone"]
    assert gone["backends"] == ["LocalCPUBackend", "RemoteBackend-crescent: None"]  # LMCache reconnects later
    assert gone["prompt"]["retrieved"] == 0 and gone["prompt"]["rest_untouched"]
    assert gone["other"]["retrieved"] == 0


def test_the_connector_made_by_lmcache(runs):
    c = runs["connector"]
    assert c["type"] == "CrescentConnector" and c["ping"] == 0
    assert c["exists_before"] is False and c["get_missing"] is True
    assert c["exists_after"] == [True, True]
    assert c["full_equal"] and c["partial_equal"] and c["long_key_equal"]  # shape, dtype, format and bytes
    assert c["contains"] == [2, 2]  # keys 1, 2 stored, 9 not: the prefix stops there
    assert c["non_blocking"] == 1  # keys 1, 9, 2: only the leading hit
    assert c["several_twice"] == [[False, True, False, False]] * 2 + [[True] * 4, True]
    assert c["bad_values"] == [True] * 4  # flipped byte, truncated, another key's value, garbage: misses
    assert c["removed"] == [True, False]
    assert "drop remote_url" in c["remote_url"]
    assert c["store_gone"] == [False, None, 0, None, True]  # exists, get, contains, put, ping failed


def test_through_a_conductor_over_two_store_nodes(tmp_path):
    require_venv("lmcache")
    with conductor_and_nodes() as (conductor, nodes):
        store = _run(str(tmp_path), "store", "store", conductor.address)
        assert store["lookup"] == PROMPT_TOKENS
        held = [sum(n.store.exists([k.encode()])[0] for n in nodes) for k in store["keys"]]
        assert held == [1] * 4
        load = _run(str(tmp_path), "load", "load", conductor.address)
        assert load["prompt"] == {"lookup": PROMPT_TOKENS, "retrieved": PROMPT_TOKENS, "prefix": True,
                                  "equal": True, "rest_untouched": True}
