"""The Prometheus rules pass promtool (check and unit tests), every alert is tested firing and not firing,
the scrape config is valid, and the Grafana dashboard parses, with a valid PromQL target in every panel.

promtool comes from Debian's ``prometheus`` package (``make setup`` installs it when it can). Without it
these tests skip, except under CI (``CI=true``), where a missing promtool fails them.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.helpers import ROOT

PROM = os.path.join(ROOT, "deploy", "prometheus")
RULES = os.path.join(PROM, "crescent-rules.yml")
RULE_TESTS = sorted(glob.glob(os.path.join(PROM, "tests", "*.yml")))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "crescent-dashboard.json")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not found (Debian package prometheus; make setup installs it as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"under CI the Prometheus rules must be checked: {reason}")
        pytest.skip(reason)
    return path


def _run(*args: str, cwd: str = PROM) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def load_rules(path: str = RULES) -> list[dict]:
    with open(path) as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]


def load_dashboard(path: str = DASHBOARD) -> dict:
    with open(path) as f:
        return json.load(f)


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel but rows, including those inside collapsed rows."""
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def test_rules_pass_promtool_check(promtool):
    r = _run(promtool, "check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rule_unit_tests_pass(promtool):
    assert RULE_TESTS, "no promtool tests in deploy/prometheus/tests"
    r = _run(promtool, "test", "rules", *RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_labelled_and_tested_firing_and_silent():
    alerts = [r for r in load_rules() if "alert" in r]
    assert alerts
    firing, silent = set(), set()
    for path in RULE_TESTS:
        with open(path) as f:
            for t in yaml.safe_load(f)["tests"]:
                for a in t.get("alert_rule_test", []):
                    (firing if a.get("exp_alerts") else silent).add(a["alertname"])
    for r in alerts:
        name = r["alert"]
        assert r["labels"].get("severity") in ("critical", "warning"), name
        assert r["labels"].get("phase") in ("prefill", "decode", "store", "conductor"), name
        assert r["annotations"].get("summary") and r["annotations"].get("description"), name
        assert name in firing, f"{name}: no promtool test makes it fire"
        assert name in silent, f"{name}: no promtool test where it must stay silent"


def test_recording_rules_named_in_alerts_exist():
    """A recording-rule name misspelt in an expression or an annotation's query would read nothing, silently."""
    rules = load_rules()
    recorded = {r["record"] for r in rules if "record" in r}
    for r in rules:
        texts = [r["expr"], *r.get("annotations", {}).values()]
        for name in re.findall(r"\b(?:role|tier|instance_tier|crescent):[\w:]+", " ".join(texts)):
            assert name in recorded, f"{r.get('alert') or r.get('record')}: {name} is not a recording rule"


def test_slo_alerts_are_split_by_phase():
    """TTFT alerts watch prefill-side engines only, ITL alerts decode-side ones only."""
    alerts = {r["alert"]: r for r in load_rules() if "alert" in r}
    for name, r in alerts.items():
        if r["labels"]["phase"] == "prefill":
            assert 'role=~"prefill|both"' in r["expr"], name
        if r["labels"]["phase"] == "decode":
            assert 'role=~"decode|both"' in r["expr"], name
    for name, metric, phase in (("CrescentTTFTSLOBreach", "ttft", "prefill"), ("CrescentITLSLOBreach", "itl", "decode")):
        assert metric in alerts[name]["expr"] and alerts[name]["labels"]["phase"] == phase, name


def test_scrape_config_is_valid(promtool, tmp_path):
    """Checked as is where promtool knows kubernetes_sd_configs; Debian's build leaves Kubernetes
    service discovery out, so there the pod discovery is swapped for a static target and the rest
    (relabelling, rule files) is checked."""
    r = _run(promtool, "check", "config", os.path.join(PROM, "prometheus.yml"))
    if r.returncode != 0 and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        with open(os.path.join(PROM, "prometheus.yml")) as f:
            text = f.read()
        text, n = re.subn(r"kubernetes_sd_configs:\n(\s+)- role: pod",
                          r'static_configs:\n\1- targets: ["127.0.0.1:9500"]', text)
        assert n == 1
        (tmp_path / "prometheus.yml").write_text(text)
        shutil.copy(RULES, tmp_path)
        r = _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_parses_and_every_panel_has_targets():
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 36
    assert any(i["name"] == "DS_PROMETHEUS" and i["pluginId"] == "prometheus" for i in dash["__inputs"])
    rows = [p["title"] for p in dash["panels"] if p.get("type") == "row"]
    for want in ("Gateway", "Prefill", "Decode", "Store", "Conductor"):
        assert any(t.startswith(want) for t in rows), f"no {want} row in {rows}"
    panels = dashboard_panels(dash)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for p in panels:
        assert p.get("targets"), f"panel {p['title']!r} has no targets"
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"panel {p['title']!r}: empty query"
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]


def test_dashboard_queries_are_valid_promql(promtool, tmp_path):
    """Each target, with Grafana's $__rate_interval filled in, as a recording rule for promtool to parse."""
    rules = [{"record": f"dashboard:panel{p['id']}:{t['refId']}",
              "expr": t["expr"].replace("$__rate_interval", "5m")}
             for p in dashboard_panels(load_dashboard()) for t in p["targets"]]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _run(promtool, "check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
