"""Bearer tokens with scopes (kvstore/auth.py) on real servers: a store node, a conductor with its
store node and an engine, and real `crescent` processes with `ctl`. Missing and unknown tokens are
UNAUTHENTICATED, a tenant token on an admin operation is PERMISSION_DENIED, health probes need none,
and the servers keep serving the right tokens through all of it."""

import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import auth
from kvstore.client import ClusterClient, Retry, StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.config import StoreConfig
from kvstore.errors import PermissionDeniedError, UnauthenticatedError
from kvstore.server import StoreNode
from tests.helpers import ROOT, Proc, StoreProcess, conductor_and_nodes, restored_env, wait_for

ADMIN, TENANT = "ops-0123456789abcdef", "acme-0123456789abcdef"
ONCE = Retry(attempts=1)


@pytest.fixture(autouse=True)
def no_auth_leaks():
    with restored_env(auth.FILE_ENV, auth.TOKEN_ENV):
        yield


@pytest.fixture
def auth_file(tmp_path):
    p = tmp_path / "auth.json"
    p.write_text(json.dumps({"tokens": [{"token": ADMIN, "tenant": "ops", "scopes": ["admin", "tenant"]},
                                        {"token": TENANT, "tenant": "acme", "scopes": ["tenant"]}]}))
    return str(p)


def as_token(token: str | None) -> None:
    if token:
        os.environ[auth.TOKEN_ENV] = token
    else:
        os.environ.pop(auth.TOKEN_ENV, None)


def test_the_auth_file_is_checked_at_start(tmp_path):
    cases = [("nope", "not JSON"), ({"tokens": []}, "needs"),
             ({"tokens": [{"token": "short", "tenant": "a", "scopes": ["tenant"]}]}, "at least 8"),
             ({"tokens": [{"token": TENANT, "tenant": "", "scopes": ["tenant"]}]}, "tenant must be"),
             ({"tokens": [{"token": TENANT, "tenant": "a", "scopes": ["root"]}]}, "scopes must list"),
             ({"tokens": [{"token": TENANT, "tenant": "a", "scopes": ["tenant"]}] * 2}, "repeats"),
             ({"tokens": [{"token": "tok en-123", "tenant": "a", "scopes": ["tenant"]}]}, "printable ASCII")]
    for i, (doc, why) in enumerate(cases):
        p = tmp_path / f"{i}.json"
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        with pytest.raises(ValueError, match=why):
            auth.load(str(p))
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "--auth-file", str(tmp_path / "missing.json"), "store"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "--token", "a\nb-token", "ctl", "nodes"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)  # it was "INTERNAL: Invalid metadata"
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--token must be printable" in r.stderr


def test_a_store_node_takes_only_known_tokens_and_admin_operations_need_the_admin_scope(auth_file):
    auth.configure(auth_file, None)
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    os.environ.pop(auth.FILE_ENV)  # (this process's own clients are not servers)
    try:
        for token, err in ((None, UnauthenticatedError), ("wrong-token-0000", UnauthenticatedError)):
            as_token(token)
            with StoreClient(node.address, timeout_s=10, retry=ONCE) as c:
                with pytest.raises(err):
                    c.put(b"k", b"v")
                with pytest.raises(err):
                    c.get(b"k")
        as_token(TENANT)
        with StoreClient(node.address, timeout_s=30) as c:
            c.put(b"k", b"tenant data")
            assert c.get(b"k") == b"tenant data" and c.exists([b"k"]) == [True] and c.lookup([b"k"]) == 1
            for admin_op in (lambda: c.delete([b"k"]), lambda: c.clear(), lambda: c.pin([b"k"], 60)):
                with pytest.raises(PermissionDeniedError, match="admin scope"):
                    admin_op()
            assert c.get(b"k") == b"tenant data"  # nothing was removed
        as_token(ADMIN)  # admin tokens see the stored keys: the tenant's are under its namespace
        with StoreClient(node.address, timeout_s=30) as c:
            assert c.delete([b"k"]) == 0
            assert c.delete([auth.namespace_prefix("acme") + b"k"]) == 1
        as_token(None)  # probes carry no token
        with grpc.insecure_channel(node.address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        node.stop(grace=0)


def test_a_cluster_whose_members_hold_admin_tokens_serves_tenants(auth_file):
    auth.configure(auth_file, ADMIN)  # the cluster's processes: servers with the file, clients with admin
    with conductor_and_nodes() as (conductor, nodes):
        os.environ.pop(auth.FILE_ENV)
        as_token(TENANT)
        keys = [bytes([i]) * 16 for i in range(4)]
        with ClusterClient(conductor.address, timeout_s=30) as c:
            assert all(c.batch_put([(k, k) for k in keys]))
            with ConductorClient(conductor.address) as cc:
                wait_for(lambda: cc.locate(keys).num_prefix == 4, what="the chunks indexed")
                assert {m.member_id for m in cc.members()} == {"a", "b"}
                with pytest.raises(PermissionDeniedError):
                    cc.drain("a")
                with pytest.raises(PermissionDeniedError):
                    cc.evict(keys)
            assert c.batch_get(keys) == keys
        as_token(None)
        with pytest.raises(UnauthenticatedError):
            with ConductorClient(conductor.address, timeout_s=10, retry=ONCE) as cc:
                cc.members()
        as_token(ADMIN)
        with ConductorClient(conductor.address) as cc:
            assert cc.drain("a") == "draining"


def test_real_processes_and_ctl_with_tokens(auth_file):
    top = ["--auth-file", auth_file, "--token", ADMIN]
    conductor = Proc([sys.executable, "-m", "kvstore.cli", *top, "conductor", "--listen", "127.0.0.1:0",
                      "--heartbeat-interval", "0.2"], "listening on")
    address = conductor.line.split("listening on ")[1].split()[0].rstrip(",")
    store = StoreProcess("--node-id", "n1", "--conductor", address, "--dram", "16MiB", top=top)
    try:
        def ctl(*args, token=None):
            t = ["--token", token] if token else []
            return subprocess.run([sys.executable, "-m", "kvstore.cli", *t, "ctl", *args, "--conductor", address,
                                   "--timeout", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)

        wait_for(lambda: "n1" in ctl("nodes", token=TENANT).stdout, timeout_s=60, what="n1 registered")
        for args, token, want in ((("nodes",), None, "UNAUTHENTICATED"), (("drain", "n1"), TENANT, "PERMISSION_DENIED")):
            r = ctl(*args, token=token)
            assert r.returncode == 1 and r.stderr.count("\n") == 1 and want in r.stderr, r.stderr
        r = ctl("drain", "n1", token=ADMIN)
        assert r.returncode == 0, r.stderr
    finally:
        store.stop()
        conductor.stop()
