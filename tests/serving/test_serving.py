"""The serving path with real processes on loopback, through the official `openai` client."""

import http.client
import json
import os
import signal
import ssl
import urllib.parse

import grpc
import pytest

from engine import LLM
from proto.crescent.v1 import engine_pb2 as epb
from proto.crescent.v1 import engine_pb2_grpc as epb_grpc
from tests.helpers import restored_env, wait_for
from tests.serving.conftest import Cluster

openai = pytest.importorskip("openai")  # the official client drives the gateway

MODEL = "random:tiny"


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=300, max_retries=0)


def engine_stats(address: str) -> epb.EngineStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return epb_grpc.EngineStub(ch).Stats(epb.EngineStatsRequest(), timeout=30)


def _ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def storeless():
    with LLM(MODEL, dtype="float32", chunk_tokens=64) as llm:
        yield llm


def test_completions_and_chat_streaming_and_not(cluster):
    c = client(cluster)
    r = c.completions.create(model=MODEL, prompt="Hello, Crescent", max_tokens=7, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens == len("Hello, Crescent") + 1
    assert r.choices[0].finish_reason == "length"
    streamed = c.completions.create(model=MODEL, prompt="Hello, Crescent", max_tokens=7, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_prefix_reuse_across_tenants_gives_the_storeless_tokens(cluster, storeless):
    c = client(cluster)
    prefix = _ids(1, 300)
    a = prefix + _ids(2, 40)
    b = prefix + _ids(3, 25)
    ra = c.completions.create(model=MODEL, prompt=a, max_tokens=10, temperature=0, user="tenant-a",
                              extra_body={"ignore_eos": True})
    rb = c.completions.create(model=MODEL, prompt=b, max_tokens=10, temperature=0, user="tenant-b",
                              extra_body={"ignore_eos": True})
    assert rb.usage.prompt_tokens_details.cached_tokens >= 256
    ref = storeless.generate([a, b], max_tokens=10, ignore_eos=True)
    tok = storeless.tokenizer
    assert ra.choices[0].text == tok.decode(ref[0].token_ids)
    assert rb.choices[0].text == tok.decode(ref[1].token_ids)
    # the decode engine loaded a's 5 chunks from the store, and of b's only the one its
    # own pages (shared with a) did not hold
    assert engine_stats(cluster.state["decode_engine"]).chunks_loaded >= 6
    # a salted tenant shares nothing
    rs = c.completions.create(model=MODEL, prompt=b, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True, "cache_salt": "secret-tenant"})
    assert rs.usage.prompt_tokens_details.cached_tokens == 0


def _post(cluster, path, body: bytes, content_type="application/json"):
    u = urllib.parse.urlparse(cluster.state["gateway"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": content_type})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "gpt-17", "prompt": "x"}).encode(), "model"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 2, 10**9]}).encode(), None),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 9}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
])
def test_bad_requests_get_400_with_openai_errors(cluster, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, data = _post(cluster, path, body)
    assert status == 400
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["message"]
    if param:
        assert data["error"]["param"] == param


def test_openai_client_sees_bad_request_errors(cluster):
    c = client(cluster)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        c.completions.create(model="nope", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=-3)


def test_client_disconnect_mid_stream_frees_the_pages(cluster):
    decode = cluster.state["decode_engine"]
    u = urllib.parse.urlparse(cluster.state["gateway"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": _ids(9, 200), "max_tokens": 5000, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # the first event is flowing
    wait_for(lambda: engine_stats(decode).num_running == 1, what="the request to run on the decode engine")
    conn.sock.close()  # the client goes away
    conn.close()
    st = wait_for(lambda: (s := engine_stats(decode)).num_running == 0 and s.num_free_pages == s.num_pages and s,
                  timeout_s=120, what="the decode engine to free the sequence's pages")
    assert st.num_waiting == 0


def test_killing_the_store_mid_run_still_completes_requests(tmp_path, storeless):
    cl = Cluster(str(tmp_path))
    try:
        c = client(cl)
        prompt = _ids(5, 200)
        before = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        os.kill(cl.state["pids"]["store"], signal.SIGKILL)
        wait_for(lambda: "the store exited" in cl.output(), what="crescent up to notice")
        fresh = _ids(6, 230)
        after = c.completions.create(model=MODEL, prompt=fresh, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        ref = storeless.generate([prompt, fresh], max_tokens=8, ignore_eos=True)
        assert before.choices[0].text == storeless.tokenizer.decode(ref[0].token_ids)
        assert after.choices[0].text == storeless.tokenizer.decode(ref[1].token_ids)
        assert after.usage.completion_tokens == 8
    finally:
        assert cl.stop() == 0, cl.output()


def test_up_restart_brings_a_killed_engine_back_on_its_grpc_and_metrics_ports(tmp_path, storeless):
    import urllib.request

    cl = Cluster(str(tmp_path), "--restart")
    try:
        # every part bound its own /metrics port (port 0) and up.json names the ones they got
        for name, url in cl.state["metrics"].items():
            assert urllib.request.urlopen(url, timeout=30).status == 200, name
        decode, metrics_url = cl.state["decode_engine"], cl.state["metrics"]["decode"]
        os.kill(cl.state["pids"]["decode"], signal.SIGKILL)

        def restarted():
            with open(os.path.join(cl.data, "up.json")) as f:
                state = json.load(f)
            return state.get("restarts", {}).get("decode") == 1 and state

        state = wait_for(restarted, timeout_s=120, what="crescent up to restart the decode engine")
        assert state["pids"]["decode"] != cl.state["pids"]["decode"]
        assert state["decode_engine"] == decode and state["metrics"]["decode"] == metrics_url

        def answers(call):
            try:
                return call()
            except (grpc.RpcError, OSError):  # not listening yet
                return None

        wait_for(lambda: answers(lambda: engine_stats(decode).num_pages > 0), timeout_s=300, interval_s=0.5,
                 what="the decode engine back on its port")
        text = wait_for(lambda: answers(lambda: urllib.request.urlopen(metrics_url, timeout=30).read().decode()),
                        timeout_s=60, interval_s=0.5, what="the restarted engine's /metrics on its old port")
        assert "crescent_engine" in text
        prompt = _ids(7, 150)
        out = client(cl).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
        ref = storeless.generate([prompt], max_tokens=6, ignore_eos=True)
        assert out.choices[0].text == storeless.tokenizer.decode(ref[0].token_ids)
    finally:
        assert cl.stop() == 0, cl.output()


def test_second_up_on_the_same_data_is_a_clear_error(cluster):
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "up", "--data", cluster.data], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "another `crescent up`" in r.stderr and "Traceback" not in r.stderr
    gw_port = urllib.parse.urlparse(cluster.state["gateway"]).port
    other = os.path.join(cluster.data, "other")
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "up", "--data", other, "--gateway-port", str(gw_port)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "in use" in r.stderr and "Traceback" not in r.stderr


def test_a_port_whose_last_connections_linger_in_time_wait_is_free_for_up():
    """Stop a cluster and start it again at once: the gateway's port still has connections in TIME_WAIT
    (the server closed them). The parts bind with SO_REUSEADDR and can listen there; up's own check
    bound without it and said the port was in use, for a minute."""
    import socket

    from engine.serve.up import _port_free

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server ends the connection first: its end waits in TIME_WAIT
    client.close()
    listener.close()
    with socket.socket() as s:  # what the check did: the port reads as taken
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
    assert _port_free("127.0.0.1", port)
    with socket.create_server(("127.0.0.1", port)):  # (create_server sets SO_REUSEADDR, as the parts do)
        assert not _port_free("127.0.0.1", port)  # a listener there: taken


def test_up_on_a_host_it_cannot_listen_on_says_so_not_that_ports_are_in_use(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "up", "--host", "nohost.invalid", "--no-netns",
                        "--data", str(tmp_path / "data")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--host nohost.invalid: cannot listen there" in r.stderr and "in use" not in r.stderr


@pytest.mark.parametrize("flags, says", [
    (["--slo-ttft", "-1"], "--slo-ttft must be a positive number of seconds"),
    (["--slo-tbt", "nan"], "--slo-tbt must be a positive number of seconds"),
    (["--chunk-tokens", "0"], "--chunk-tokens must be a positive number of tokens"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least --chunk-size"),
])
def test_up_checks_its_numbers_before_it_starts_anything(tmp_path, flags, says):
    """Before, a bad SLO or chunk size surfaced as a part's exit (status 1, two lines), and
    --max-num-batched-tokens 0 was taken for the default: the cluster started."""
    import sys

    from tests.helpers import run_in_own_session

    # (its own session: a cluster it started by mistake ends with it, on the timeout)
    rc, out = run_in_own_session([sys.executable, "-m", "kvstore.cli", "up", "--data", str(tmp_path / "data"),
                                  "--no-netns", "--gateway-port", "0", "--store-port", "0", "--prefill-port", "0",
                                  "--decode-port", "0", "--conductor-port", "0", *flags], timeout_s=120)
    assert rc == 2 and says in out and out.count("\n") == 1, out


def _scrape(cluster) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(cluster.state["gateway"] + "/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics(cluster):
    # NOTE: a fresh histogram prints zero buckets and a labelled counter its HELP line before
    # any request: only values that requests produce prove that requests are counted
    before = _scrape(cluster)
    done = ("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "200")))
    c = client(cluster)
    completion_tokens = 0
    for i in range(3):
        r = c.completions.create(model=MODEL, prompt=_ids(200 + i, 30), max_tokens=3 + i, temperature=0,
                                 extra_body={"ignore_eos": True})
        completion_tokens += r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    completion_tokens += chunks[-1].usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    # (a request is counted as its handler ends, just after the client has read its answer)
    chat = ("crescent_gateway_requests_total", (("endpoint", "chat"), ("status", "200")))
    after = wait_for(lambda: (lambda m: m if m.get(chat, 0.0) - before.get(chat, 0.0) >= 1 and
                              m.get(done, 0.0) - before.get(done, 0.0) >= 3 else None)(_scrape(cluster)),
                     what="the requests to be counted")

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("crescent_gateway_requests_total", endpoint="completions", status="200") == 3
    assert delta("crescent_gateway_requests_total", endpoint="chat", status="200") == 1
    assert delta("crescent_gateway_requests_total", endpoint="completions", status="400") == 1
    assert delta("crescent_gateway_ttft_seconds_count") == 4
    assert delta("crescent_gateway_ttft_seconds_bucket", le="+Inf") == 4
    assert delta("crescent_gateway_tokens_total", kind="completion") == completion_tokens == 3 + 4 + 5 + 4
    assert delta("crescent_gateway_tokens_total", kind="prompt") >= 3 * 30
    assert after[("crescent_gateway_requests_total", (("endpoint", "completions"), ("status", "200")))] >= 3


def _ctl(cluster, *args):
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "ctl", *args, "--conductor", cluster.state["conductor"],
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_engines_and_store_join_the_conductor_and_feed_its_cost_model(cluster):
    kinds = sorted(m["kind"] for m in _ctl(cluster, "nodes"))
    assert kinds == ["decode", "prefill", "store"]
    c = client(cluster)
    for i in range(10):  # the conductor refits its prefill model every few measured prefills
        c.completions.create(model=MODEL, prompt=_ids(100 + i, 40 + 30 * i), max_tokens=2, temperature=0)
    # NOTE: whether the conductor's refit accepts the samples depends on timing noise; that
    # they arrive does not
    stats = wait_for(lambda: (s := _ctl(cluster, "stats")) and s["cost_model"]["num_samples_received"] >= 10 and s,
                     what="measured prefills to reach the conductor")
    assert stats["schedule"]["num_scheduled"] >= 1


def test_conductor_down_gateway_falls_back_and_slo_rejections_are_429(tmp_path, storeless):
    cl = Cluster(str(tmp_path), "--slo-ttft", "0.000001")
    try:
        c = client(cl)
        with pytest.raises(openai.RateLimitError, match="rejected by the scheduler"):
            c.completions.create(model=MODEL, prompt=_ids(12, 100), max_tokens=3, temperature=0)
        os.kill(cl.state["pids"]["conductor"], signal.SIGKILL)
        wait_for(lambda: "the conductor exited" in cl.output(), what="crescent up to notice")
        prompt = _ids(13, 120)
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
        ref = storeless.generate([prompt], max_tokens=6, ignore_eos=True)[0]
        assert r.choices[0].text == storeless.tokenizer.decode(ref.token_ids)
    finally:
        assert cl.stop() == 0, cl.output()


def test_conductor_replicas_fail_over_while_serving(tmp_path, storeless):
    """`crescent up --conductors 2` (a local etcd elects the leader): kill -9 of the leader mid-run, every
    request is still answered with the exact tokens, and the survivor leads with every member back."""
    from kvstore.conductor.client import ConductorClient

    cl = Cluster(str(tmp_path), "--conductors", "2")
    try:
        assert cl.state["etcd"] and "," in cl.state["conductor"]
        c = client(cl)
        prompts = [_ids(20 + i, 150) for i in range(4)]
        ref = storeless.generate(prompts, max_tokens=6, ignore_eos=True)

        def ask(i):
            r = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.choices[0].text == storeless.tokenizer.decode(ref[i].token_ids)

        ask(0)
        with ConductorClient(cl.state["conductor"], timeout_s=30) as cc:
            cc.members()
            leader = cc.address
        name = "conductor" if leader == cl.state["conductor"].split(",")[0] else "conductor-2"
        os.kill(cl.state["pids"][name], signal.SIGKILL)
        wait_for(lambda: f"the {name} exited" in cl.output(), what="crescent up to notice")
        ask(1)  # during or after the failover: answered either way (the gateway falls back while no one leads)
        survivor = [a for a in cl.state["conductor"].split(",") if a != leader][0]

        def back():
            try:
                with ConductorClient(survivor, timeout_s=5) as cc2:
                    return {m.kind.label for m in cc2.members()} == {"store", "prefill", "decode"}
            except Exception:  # noqa: BLE001 - not leading yet
                return False
        wait_for(back, timeout_s=120, what="the survivor to lead with every member re-registered")
        ask(2)
        ask(3)
    finally:
        assert cl.stop() == 0, cl.output()


def test_up_nodes_on_loopback_serves_across_store_nodes(tmp_path, storeless):
    """`crescent up --nodes 2 --no-netns`: two store nodes (and a prefill and a decode engine, one per
    "host") on distinct loopback ports; the decode engine loads the chunks the prefill engine saved on
    the other node, and the tokens are exact."""
    cl = Cluster(str(tmp_path), "--nodes", "2", "--no-netns")
    try:
        st = cl.state
        assert len(st["stores"]) == 2 and len(set(st["stores"])) == 2 and st["hosts"] is None
        c = client(cl)
        prompts = [_ids(40, 200), _ids(41, 200)]
        ref = storeless.generate(prompts, max_tokens=5, ignore_eos=True)
        for p, want in zip(prompts, ref):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.choices[0].text == storeless.tokenizer.decode(want.token_ids)
        import re
        import urllib.request

        text = urllib.request.urlopen(st["metrics"]["decode"], timeout=60).read().decode()
        loaded = re.search(r'crescent_engine_store_chunks_total\{direction="loaded",role="decode"\} (\S+)', text)
        assert loaded and float(loaded.group(1)) > 0
    finally:
        assert cl.stop() == 0, cl.output()


def test_up_with_tls_runs_every_grpc_hop_on_mtls_and_serves_the_storeless_tokens(tmp_path, storeless):
    from kvstore import tls
    from kvstore.client import Retry, StoreClient
    from kvstore.errors import CrescentError

    with restored_env(*tls.ENV.values()):  # the test takes the tools' certificate below
        c = Cluster(str(tmp_path), "--tls", "--conductors", "2")  # their etcd on mTLS too
        try:
            ids = _ids(41, 150)
            d = c.state["tls"]
            assert c.state["etcd"].startswith("https://") and "," in c.state["conductor"]
            assert c.base_url.startswith("https://")  # the gateway too, with the development CA
            https = openai.OpenAI(base_url=c.base_url, api_key="unused", timeout=300, max_retries=0,
                                  http_client=openai.DefaultHttpxClient(
                                      verify=ssl.create_default_context(cafile=f"{d}/ca.pem")))
            r = https.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
            want = storeless.generate(ids, max_tokens=12, ignore_eos=True)[0].text
            assert r.choices[0].text == want
            with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA
                client(c).models.list()
            with pytest.raises(openai.APIConnectionError):  # plain HTTP to the HTTPS port
                openai.OpenAI(base_url=c.base_url.replace("https://", "http://"), api_key="unused", timeout=60,
                              max_retries=0).models.list()
            assert https.models.list().data  # the gateway is still serving
            assert d and "mTLS" in c.output()
            for address in (c.state["store"], c.state["prefill_engine"], c.state["decode_engine"]):
                with grpc.insecure_channel(address) as ch:  # plaintext to each TLS port
                    with pytest.raises(grpc.RpcError) as err:
                        epb_grpc.EngineStub(ch).Health(epb.EngineHealthRequest(), timeout=10)
                    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            with pytest.raises(CrescentError):
                with StoreClient(c.state["store"], timeout_s=10, retry=Retry(attempts=1)) as s:
                    s.health()
            tls.configure(f"{d}/client.pem", f"{d}/client-key.pem", f"{d}/ca.pem")  # the tools' certificate
            with StoreClient(c.state["store"], timeout_s=30) as s:
                st = s.stats()  # the engines' saves came over mTLS
                assert s.health()["serving"] and sum(t["num_entries"] for t in st["tiers"].values()) > 0
        finally:
            assert c.stop() == 0, c.output()


def test_up_with_auth_needs_tokens_on_every_grpc_server_and_still_serves(tmp_path, storeless):
    from kvstore import auth
    from kvstore.client import Retry, StoreClient
    from kvstore.errors import PermissionDeniedError, UnauthenticatedError

    with restored_env(auth.TOKEN_ENV):  # the test acts as several clients below
        c = Cluster(str(tmp_path), "--auth")
        try:
            ids = _ids(43, 150)
            r = client(c).completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert r.choices[0].text == storeless.generate(ids, max_tokens=12, ignore_eos=True)[0].text
            tokens = c.state["auth"]
            assert tokens and os.stat(tokens["file"]).st_mode & 0o777 == 0o600
            os.environ.pop(auth.TOKEN_ENV, None)
            with pytest.raises(UnauthenticatedError):
                with StoreClient(c.state["store"], timeout_s=10, retry=Retry(attempts=1)) as s:
                    s.health()
            with grpc.insecure_channel(c.state["decode_engine"]) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    epb_grpc.EngineStub(ch).Health(epb.EngineHealthRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            os.environ[auth.TOKEN_ENV] = tokens["tenant"]
            with StoreClient(c.state["store"], timeout_s=30) as s:
                assert s.health()["serving"]
                with pytest.raises(PermissionDeniedError):
                    s.clear()
        finally:
            assert c.stop() == 0, c.output()



def test_up_with_async_scheduling_streams_the_storeless_tokens(tmp_path, storeless):
    """`crescent up --async-scheduling`: concurrent streamed requests sharing a prefix (the decode
    engine loads it from the store) give the storeless engine's tokens, and the decode engine's
    steps went first (its `crescent_engine_overlapped_steps_total`)."""
    import re
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    cl = Cluster(str(tmp_path), "--async-scheduling")
    try:
        c = client(cl)
        prefix = _ids(50, 150)
        prompts = [prefix + _ids(51 + i, 10 + 7 * i) for i in range(4)]
        ref = storeless.generate(prompts, max_tokens=16, ignore_eos=True)

        def stream(prompt):
            chunks = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            return "".join(ch.choices[0].text for ch in chunks if ch.choices)

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(stream, prompts))
        assert got == [storeless.tokenizer.decode(r.token_ids) for r in ref]
        text = urllib.request.urlopen(cl.state["metrics"]["decode"], timeout=60).read().decode()
        overlapped = re.search(r'crescent_engine_overlapped_steps_total\{role="decode"\} (\S+)', text)
        assert overlapped and float(overlapped.group(1)) > 0
    finally:
        assert cl.stop() == 0, cl.output()
