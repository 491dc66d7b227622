"""Every metric the Prometheus rules and the Grafana dashboard name exists on a live `crescent up` cluster.

`crescent up` gives every part a /metrics endpoint (listed under "metrics" in up.json); after a few
completions this scrapes them all (gateway, conductor, store, prefill and decode engines) and fails on
any ``crescent_*`` name that a rule expression or dashboard query uses and no part exposes. A rule on a
misspelt or removed metric never fires, so this is the test that keeps alerts honest.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.deploy.test_prometheus import dashboard_panels, load_dashboard, load_rules
from tests.helpers import wait_for
from tests.serving.conftest import Cluster

PARTS = ("gateway", "conductor", "store", "prefill", "decode")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = re.compile(r"(?<![\w:])crescent_[a-z0-9_]+(?![\w:])")


def promql_names(expr: str, recorded: set[str]) -> set[str]:
    """The raw metric names an expression reads (recording-rule outputs and label values left out)."""
    expr = _STRING.sub('""', expr)
    for r in sorted(recorded, key=len, reverse=True):
        expr = expr.replace(r, " ")
    return set(_NAME.findall(expr))


def referenced_names() -> dict[str, set[str]]:
    """metric name -> where it is used (rule or dashboard panel)."""
    rules = load_rules()
    recorded = {r["record"] for r in rules if "record" in r}
    out: dict[str, set[str]] = {}
    for r in rules:
        for n in promql_names(r["expr"], recorded):
            out.setdefault(n, set()).add(f"rule {r.get('record') or r.get('alert')}")
    for p in dashboard_panels(load_dashboard()):
        for t in p["targets"]:
            for n in promql_names(t["expr"], recorded):
                out.setdefault(n, set()).add(f"panel {p['title']!r}")
    return out


def exposed_names(text: str) -> set[str]:
    """Names in a text exposition: sample names, and the names a family declares (HELP/TYPE), so that a
    labelled counter nothing has incremented yet, or a gauge with no value yet, still counts."""
    names = set()
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            parts = line.split()
            names.add(parts[2])
            if parts[1] == "TYPE" and parts[3] == "histogram":
                names.update(parts[2] + s for s in ("_bucket", "_sum", "_count"))
            if parts[1] == "TYPE" and parts[3] == "counter" and not parts[2].endswith("_total"):
                names.add(parts[2] + "_total")
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][\w:]*", line).group(0))
    return names


def sample(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def _scrape(url: str) -> str:
    def get():
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.read().decode()
        except OSError:
            return None

    return wait_for(get, timeout_s=120, interval_s=0.5, what=f"a scrape of {url}")


def _complete(base_url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "random:tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("metrics-cluster")))
    try:
        urls = c.state.get("metrics", {})
        assert set(PARTS) <= set(urls), f"up.json lists /metrics for {sorted(urls)}, not all of {PARTS}"
        assert all(f"{u}   ({name})" in c.output() for name, u in urls.items()), c.output()
        prompt = [3 + (i * 7) % 240 for i in range(200)]  # 3 chunks of 64 tokens and a tail
        for _ in range(2):  # the second one reuses the first one's chunks
            assert _complete(c.base_url, prompt)["usage"]["completion_tokens"] == 4
        yield {name: _scrape(urls[name]) for name in PARTS}
    finally:
        assert c.stop() == 0, c.output()


def test_every_metric_in_rules_and_dashboard_is_exposed(scrapes):
    exposed = set().union(*(exposed_names(t) for t in scrapes.values()))
    used = referenced_names()
    assert len(used) > 20
    missing = {n: sorted(where) for n, where in used.items() if n not in exposed}
    assert not missing, "metrics named in deploy/prometheus or deploy/grafana that no part exposes:\n" + "\n".join(
        f"  {n}  (used by {', '.join(w)})" for n, w in sorted(missing.items()))


def test_each_part_exposes_its_own_family(scrapes):
    for part, prefix in (("gateway", "crescent_gateway_"), ("conductor", "crescent_conductor_"),
                         ("store", "crescent_store_"), ("prefill", "crescent_engine_"),
                         ("decode", "crescent_engine_")):
        assert any(n.startswith(prefix) for n in exposed_names(scrapes[part])), part


def test_engine_step_prefill_and_kv_metrics_have_samples(scrapes):
    pre, dec = scrapes["prefill"], scrapes["decode"]
    assert sample(pre, "crescent_engine_prefill_seconds_count", role="prefill") >= 2  # one per request at least
    assert sample(pre, "crescent_engine_step_seconds_count", role="prefill") >= 2
    assert sample(dec, "crescent_engine_step_seconds_count", role="decode") >= 2
    assert 0.0 <= sample(dec, "crescent_engine_kv_usage_ratio", role="decode") <= 1.0
    assert sample(dec, "crescent_engine_store_chunks_total", role="decode", direction="loaded") is not None
    assert sample(scrapes["gateway"], "crescent_gateway_ttft_seconds_count") == 2
    assert sample(scrapes["conductor"], "crescent_conductor_is_leader") == 1
