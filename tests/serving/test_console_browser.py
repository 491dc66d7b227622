"""The conductor's web console in a real headless browser (Debian's chromium and chromedriver, through
selenium) against a live `crescent up`: the page shows the cluster's members and its real numbers, and
updates as requests flow, with no reload. A screenshot is kept in build/test-artifacts/console.png.

Without chromium these tests skip (`make setup-tools` installs it as root), except under CI, where
that fails them."""

import os
import random
import shutil
import subprocess
import sys

import pytest

from kvstore.conductor.client import ConductorClient
from tests.helpers import ROOT, wait_for

openai = pytest.importorskip("openai")
MODEL = "random:tiny"
ARTIFACTS = os.environ.get("CRESCENT_TEST_ARTIFACTS", os.path.join(ROOT, "build", "test-artifacts"))


def _browser_or_skip():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    reason = None
    if not (chromium and driver):
        reason = "chromium and chromedriver not found (Debian packages chromium, chromium-driver; make setup-tools)"
    else:
        try:
            import selenium  # noqa: F401
        except ImportError:
            reason = "selenium is not installed (make setup)"
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"under CI the web console must be tested in a browser: {reason}")
    if reason:
        pytest.skip(reason)
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1700", "--disable-extensions"):
        opts.add_argument(arg)
    # NOTE: chromium leaves its singleton socket's folder (org.chromium.Chromium.*) in TMPDIR when
    # chromedriver ends it: in pytest's temporary folder, not one more in /tmp per run.
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium"))}
    d = webdriver.Chrome(service=Service(driver_path, env=env), options=opts)
    d.set_page_load_timeout(120)
    d.set_script_timeout(60)
    yield d
    d.quit()


def _page(d, script: str):
    return d.execute_script(script)


def _num(d, sel: str) -> int:
    text = _page(d, f"return document.querySelector('{sel}').textContent")
    return int(text) if text.isdigit() else -1


def test_console_shows_the_live_cluster_and_updates_as_requests_flow(cluster, browser):
    conductor = cluster.state["conductor"]
    ui = cluster.state["metrics"]["conductor"].removesuffix("/metrics") + "/ui"
    browser.get(ui)
    assert browser.title == "Crescent conductor"
    polls = "return Number(document.querySelector('#updated').dataset.ok)"
    wait_for(lambda: _page(browser, polls) >= 1, what="the page's first update")

    with ConductorClient(conductor) as cc:
        members = {m.member_id: m for m in cc.members()}
        shown = _page(browser, "return [...document.querySelectorAll('#members tbody tr')]"
                               ".map(tr => [tr.dataset.id, tr.dataset.kind])")
        assert sorted(shown) == sorted([m.member_id, m.kind.label] for m in members.values())
        assert {m.kind.label for m in members.values()} == {"store", "prefill", "decode"}
        tiers = _page(browser, "return [...document.querySelectorAll('#members tr[data-kind=store] .tier')]"
                               ".map(t => t.dataset.tier)")
        assert "dram" in tiers and "disk" in tiers
        before = _page(browser, "return window.crescentConsole.snapshot.counters")

        # Four requests sharing a 192-token prefix (3 chunks of 64): the first stores it, the
        # others load it, so the conductor schedules them with cached chunks.
        rng = random.Random(5)
        prefix = [rng.randrange(3, 250) for _ in range(192)]
        client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=300, max_retries=0)
        client.completions.create(model=MODEL, prompt=prefix + [7, 8, 9], max_tokens=2, temperature=0)
        wait_for(lambda: cc.stats()["num_chunks"] >= 3, what="the prefix to reach the conductor's index")
        for i in range(3):
            client.completions.create(model=MODEL, prompt=prefix + [10 + i] * 5, max_tokens=2, temperature=0)

        # The page catches up by itself (no reload), and shows what the conductor says.
        def caught_up():
            c = _page(browser, "return window.crescentConsole.snapshot.counters")
            return c["scheduled"] >= before["scheduled"] + 4 and c["cached_chunks"] > before["cached_chunks"]

        wait_for(caught_up, what="the page to show the new requests")
        stats = cc.stats()["schedule"]
        wait_for(lambda: _num(browser, "#stat-scheduled") == stats["num_scheduled"], what="the page's next update")
        shown_cached = int(_page(browser, "return document.querySelector('#stat-hit-rate').dataset.cached"))
        assert shown_cached == stats["num_cached_chunks"]
        assert _page(browser, "return document.querySelector('#stat-hit-rate').textContent").endswith("%")

        # The decisions table lists them, newest first, with the prefill engine that got each.
        rows = _page(browser, "return [...document.querySelectorAll('#decisions tbody tr')]"
                              ".map(tr => [...tr.cells].map(td => td.textContent))")
        assert len(rows) >= 4
        prefills = {m for m, x in members.items() if x.kind.label == "prefill"}
        assert all(r[3] in prefills for r in rows[:4])
        assert int(rows[0][2].split(" / ")[0]) == 3  # the newest loaded the whole stored prefix

        # The hottest prefixes: the shared chunks, held by the store node.
        hot = _page(browser, "return [...document.querySelectorAll('#hot tbody tr')]"
                             ".map(tr => [...tr.cells].map(td => td.textContent))")
        assert [r[1] for r in hot[:3]] == ["64", "128", "192"] and "store-0" in hot[0][3]

        # A pin through the admin CLI shows up in the pins table.
        r = subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", "pin", "--tokens", ",".join(map(str, prefix)),
                            "--ttl", "600", "--conductor", conductor], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _page(browser, "return document.querySelectorAll('#pins tbody tr code').length") == 3,
                 what="the pins on the page")

        # The charts' series: reuse and bytes moved per second, from the conductor's samples. Reuse
        # is counted when the conductor schedules; bytes come with the store's next heartbeat (1 s),
        # so either may reach the page first: wait for each.
        wait_for(lambda: _page(browser, "return window.crescentConsole.rates.some(r => r.reuse > 0)"),
                 what="a per-second sample with reused chunks")
        wait_for(lambda: _page(browser, "return window.crescentConsole.rates.some(r => r.bytesIn > 0)"),
                 what="a per-second sample with bytes stored")
        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = os.path.join(ARTIFACTS, "console.png")
        assert browser.save_screenshot(shot) and os.path.getsize(shot) > 10_000


def test_console_says_when_the_conductor_is_unreachable(browser, tmp_path):
    """A page whose conductor went away says so (and keeps retrying) instead of showing stale numbers."""
    import http.server
    import threading

    ui = os.path.join(ROOT, "kvstore", "conductor", "ui")

    class Files(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=ui, **kw)

        def translate_path(self, path):  # /ui/x → ui/x; /api/console → 404
            return super().translate_path(path.removeprefix("/ui"))

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{srv.server_port}/ui/index.html")
        wait_for(lambda: "unreachable" in _page(browser, "return document.querySelector('#updated').textContent"),
                 what="the page to report the failed poll")
        assert _page(browser, "return document.querySelector('#updated').className") == "error"
    finally:
        srv.shutdown()
        srv.server_close()
