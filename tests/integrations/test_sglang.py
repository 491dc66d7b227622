"""SGLang's HiCache L3 on Crescent, driven as SGLang's HiCacheController drives it: the real sglang (0.5.23)
package's storage interface, backend factory and page hashes, a real store node, a real conductor.

Two processes of ``.venv-sglang/bin/python tests/integrations/sglang_run.py``:
  write   builds the backend through SGLang's ``StorageBackendFactory`` ("dynamic"), stores pages on the
          zero-copy path (``batch_set_v1``) and the copying one (``batch_set``), queries prefixes, reads
          back, damages pages, and checks who shares pages (TP shards, dtypes, MLA)
  read    a second instance reads the first one's pages byte for byte; a cluster round trip through a
          conductor over two store nodes; a store that cannot be reached
SGLang lives in its own venv (``make setup-sglang``).
"""

from __future__ import annotations

import os

import pytest

from kvstore.config import StoreConfig
from kvstore.server import StoreNode
from kvstore.store import Tier
from tests.helpers import ROOT, conductor_and_nodes, require_venv, run_json_script

SCRIPT = os.path.join(ROOT, "tests", "integrations", "sglang_run.py")
pytestmark = pytest.mark.timeout(900)


def _run(python: str, tmp: str, phase: str, *args: str) -> dict:
    out, log = os.path.join(tmp, f"{phase}.json"), os.path.join(tmp, f"{phase}.log")
    return run_json_script(python, SCRIPT, [phase, *args], out, log)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    python = require_venv("sglang")
    tmp = str(tmp_path_factory.mktemp("sglang"))
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="64MiB")).start()
    try:
        with conductor_and_nodes() as (conductor, nodes):
            res = {"write": _run(python, tmp, "write", node.address),
                   "read": _run(python, tmp, "read", node.address, conductor.address)}
            res["held"] = [n.store.stats()["tiers"][Tier.DRAM]["num_entries"] for n in nodes]
            return res
    finally:
        node.stop(grace=0)


def test_sglang_builds_the_backend_and_its_zero_copy_path_round_trips(runs):
    w = runs["write"]
    assert w["backend"] == "CrescentHiCacheStorage"
    assert w["set_v1"] == [True] * 6 and w["get_v1"] == [True] * 6 and w["get_v1_exact"]
    # pages held whole are not sent again: the rewrite adds no object
    assert w["set_v1_again"] == [True] * 6 and w["objects_added_by_rewrite"] == 0
    assert w["get_v1_with_miss"] == [True, False, True]
    assert w["stats_pages"] == {"backup": 6, "prefetch": 8}


def test_prefix_queries_count_leading_pages(runs):
    w = runs["write"]
    assert w["exists_prefix"] == 6  # 8 keys, 6 stored
    assert w["exists_with_gap"] == 2  # keys 0, 1, (7 missing), 3: the prefix stops at the gap
    assert w["exists_one"] == [True, False]


def test_a_damaged_page_reads_as_a_miss(runs):
    # page 1's V part has a flipped byte, page 2's K part lost two bytes
    assert runs["write"]["get_v1_damaged"] == [True, False, False]


def test_the_copying_path(runs):
    w = runs["write"]
    assert w["generic_exists_before"] == 0  # its objects are not the zero-copy path's
    assert w["generic_set"] and w["generic_exists"] == 4
    assert w["generic_get_count"] == 4 and w["generic_get_exact"]  # stops at the first miss, as SGLang does
    assert w["generic_get_one"] and w["generic_get_miss"] and w["generic_set_one"] == [True, True]


def test_only_instances_with_the_same_page_layout_share_pages(runs):
    w = runs["write"]
    assert w["exists_other_tp_shard"] == 0 and w["exists_float16"] == 0  # MHA: heads differ per TP rank
    assert w["mla_set_rank0"] and w["mla_exists_rank1"] == 2  # MLA: every rank holds the same KV


def test_bad_options_stop_sglang_with_a_message_and_the_address_may_come_from_the_environment(runs):
    w = runs["write"]
    assert w["refused_unknown_option"].startswith("unknown Crescent option(s) ['crescent_stor']")
    assert w["refused_no_address"].startswith("no Crescent address")
    assert w["exists_via_env"] == 6


def test_a_second_instance_reads_the_first_ones_pages(runs):
    r = runs["read"]
    assert r["exists_prefix"] == 6 and r["get_v1"] == [True] * 6 and r["get_v1_exact"]
    assert r["exists_after_clear"] == 0


def test_pages_spread_over_a_conductors_store_nodes(runs):
    r = runs["read"]
    assert r["cluster_set_v1"] == [True] * 8 and r["cluster_exists"] == 8
    assert r["cluster_get_v1"] == [True] * 8 and r["cluster_get_v1_exact"]
    assert sum(runs["held"]) == 8 * 3  # K, V and checksums of each page
    assert all(runs["held"]), "both nodes hold pages"


def test_an_unreachable_store_is_misses_and_refused_writes(runs):
    assert runs["read"]["unreachable"] == {"exists": 0, "get_v1": [False] * 4, "set_v1": [False] * 4,
                                           "generic_set": False, "generic_get": 0, "get": None, "exists_one": False}
