"""Tenant key namespaces and quotas (kvstore/auth.py, kvstore/store.py) on real servers.

A tenant's keys live under its namespace, derived by the node from its token: another tenant that
knows the keys reads misses on every path (gRPC, the TCP data channel, shm grants) and in the
conductor's index; tokens that name one namespace share it; admin tokens see the stored keys as
they are. A namespace's quota bounds its bytes: writing past it evicts the tenant's own oldest
values, other tenants keep theirs, and what cannot fit is RESOURCE_EXHAUSTED."""

import json
import os
import urllib.request

import pytest

from kvstore import auth
from kvstore.client import ClusterClient, Retry, StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.server import StoreNode
from kvstore.store import TieredStore
from tests.helpers import MiB, conductor_and_nodes, restored_env, wait_for

ADMIN, ACME, GLOBEX = "ops-0123456789abcdef", "acme-0123456789abcdef", "globex-0123456789abcd"
TEAM1, TEAM2 = "team1-0123456789abcdef", "team2-0123456789abcdef"
KiB = 1 << 10


@pytest.fixture(autouse=True)
def no_auth_leaks():
    with restored_env(auth.FILE_ENV, auth.TOKEN_ENV):
        yield


def write_auth(tmp_path, **quotas):
    entries = [{"token": ADMIN, "tenant": "ops", "scopes": ["admin"]},
               {"token": ACME, "tenant": "acme", "scopes": ["tenant"]},
               {"token": GLOBEX, "tenant": "globex", "scopes": ["tenant"]},
               {"token": TEAM1, "tenant": "team1", "scopes": ["tenant"], "namespace": "pool"},
               {"token": TEAM2, "tenant": "team2", "scopes": ["tenant"], "namespace": "pool"}]
    for e in entries:
        if e["tenant"] in quotas:
            e["quota"] = quotas[e["tenant"]]
    p = tmp_path / "auth.json"
    p.write_text(json.dumps({"tokens": entries}))
    return str(p)


def client(address, token, transport):
    os.environ[auth.TOKEN_ENV] = token
    return StoreClient(address, timeout_s=30, transport=transport, retry=Retry(attempts=3))


def test_namespace_and_quota_entries_are_checked(tmp_path):
    bad = [({"namespace": ""}, "namespace must be"), ({"quota": {"ram": "1GiB"}}, "quota must be"),
           ({"quota": {"dram": "lots"}}, "not a size")]
    for i, (extra, why) in enumerate(bad):
        p = tmp_path / f"{i}.json"
        p.write_text(json.dumps({"tokens": [{"token": ACME, "tenant": "acme", "scopes": ["tenant"], **extra}]}))
        with pytest.raises(ValueError, match=why):
            auth.load(str(p))
    p = tmp_path / "admin.json"
    p.write_text(json.dumps({"tokens": [{"token": ADMIN, "tenant": "ops", "scopes": ["admin"],
                                         "quota": {"dram": "1MiB"}}]}))
    with pytest.raises(ValueError, match="admin token has no namespace"):
        auth.load(str(p))
    p = tmp_path / "clash.json"
    p.write_text(json.dumps({"tokens": [
        {"token": TEAM1, "tenant": "t1", "scopes": ["tenant"], "namespace": "pool", "quota": {"dram": "1MiB"}},
        {"token": TEAM2, "tenant": "t2", "scopes": ["tenant"], "namespace": "pool", "quota": {"dram": "2MiB"}}]}))
    with pytest.raises(ValueError, match="different quotas"):
        auth.load(str(p))


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_a_tenant_cannot_read_overwrite_or_probe_another_tenants_chunks(tmp_path, transport):
    auth.configure(write_auth(tmp_path), None)
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    os.environ.pop(auth.FILE_ENV)
    keys = [bytes([i]) * 32 for i in range(4)]
    try:
        with client(node.address, ACME, transport) as acme:
            assert all(acme.batch_put([(k, b"acme:" + k) for k in keys]))
            assert acme.batch_get(keys) == [b"acme:" + k for k in keys]
        with client(node.address, GLOBEX, transport) as globex:
            assert globex.transport == transport
            assert globex.batch_get(keys) == [None] * 4  # knowing the keys is not enough
            assert globex.exists(keys) == [False] * 4 and globex.lookup(keys) == 0
            buf = bytearray(64)
            assert globex.batch_get_into(keys[:1], [buf]) == [None]
            assert all(globex.batch_put([(k, b"globex:" + k) for k in keys]))  # its own, beside acme's
            assert globex.batch_get(keys) == [b"globex:" + k for k in keys]
        with client(node.address, ACME, transport) as acme:
            assert acme.batch_get(keys) == [b"acme:" + k for k in keys]  # untouched
        with client(node.address, TEAM1, transport) as t1:
            assert all(t1.batch_put([(keys[0], b"pool")]))
        with client(node.address, TEAM2, transport) as t2:  # the same namespace: shared
            assert t2.get(keys[0]) == b"pool" and t2.get(keys[1]) is None
        with client(node.address, ADMIN, transport) as admin:  # the stored keys, as they are
            assert admin.get(keys[0]) is None
            assert admin.get(auth.namespace_prefix("acme") + keys[0]) == b"acme:" + keys[0]
            assert admin.get(auth.namespace_prefix("pool") + keys[0]) == b"pool"
            assert admin.stats()["tiers"]["dram"]["num_entries"] == 9
    finally:
        node.stop(grace=0)


def test_the_conductor_locates_a_tenants_chunks_only_for_its_namespace(tmp_path):
    auth.configure(write_auth(tmp_path), ADMIN)  # the cluster's own processes hold the admin token
    with conductor_and_nodes() as (conductor, nodes):
        os.environ.pop(auth.FILE_ENV)
        keys = [bytes([i]) * 16 for i in range(4)]
        os.environ[auth.TOKEN_ENV] = ACME
        with ClusterClient(conductor.address, timeout_s=30) as c:
            assert all(c.batch_put([(k, k) for k in keys]))
            with ConductorClient(conductor.address) as cc:
                wait_for(lambda: cc.locate(keys).num_prefix == 4, what="acme's chunks indexed")
            assert c.batch_get(keys) == keys
        os.environ[auth.TOKEN_ENV] = GLOBEX
        with ConductorClient(conductor.address) as cc:
            assert cc.locate(keys).num_prefix == 0
        with ClusterClient(conductor.address, timeout_s=30) as c:
            assert c.batch_get(keys) == [None] * 4
        os.environ[auth.TOKEN_ENV] = ADMIN
        with ConductorClient(conductor.address) as cc:
            assert cc.locate([auth.namespace_prefix("acme") + k for k in keys]).num_prefix == 4


def test_a_quota_bounds_a_namespace_and_evicts_its_own_values_first(tmp_path):
    auth.configure(write_auth(tmp_path, acme={"dram": "1MiB", "disk": "2MiB"}, globex={"dram": "4MiB"}), None)
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB", disk=str(tmp_path / "disk"),
                                 disk_size="64MiB", metrics_port=0)).start()
    os.environ.pop(auth.FILE_ENV)
    value = lambda tag, i: bytes([i % 251]) * (64 * KiB - len(tag)) + tag  # noqa: E731
    try:
        with client(node.address, GLOBEX, "tcp") as globex:
            assert all(globex.batch_put([(b"g%d" % i, value(b"g", i)) for i in range(32)]))  # 2 MiB
        with client(node.address, ACME, "tcp") as acme:
            for i in range(96):  # 6 MiB: three times what its quota holds
                acme.put(b"a%d" % i, value(b"a", i))
            got = acme.batch_get([b"a%d" % i for i in range(96)])
            kept = [i for i, v in enumerate(got) if v is not None]
            assert all(got[i] == value(b"a", i) for i in kept)
            assert 40 <= len(kept) <= 48 and kept == list(range(96 - len(kept), 96))  # its newest, ~3 MiB
            with pytest.raises(ResourceExhaustedError, match="quota"):
                acme.put(b"huge", bytes(3 * MiB))  # more than both bounds
        usage = {ns: (mem, disk) for ns, mem, disk, *_ in node.store.tenant_usage()}
        assert usage["acme"][0] <= MiB and usage["acme"][1] <= 2 * MiB
        with client(node.address, GLOBEX, "tcp") as globex:
            assert globex.batch_get([b"g%d" % i for i in range(32)]) == [value(b"g", i) for i in range(32)]
        text = urllib.request.urlopen(f"http://127.0.0.1:{node._metrics_server.server_port}/metrics",
                                      timeout=30).read().decode()
        assert 'crescent_store_tenant_quota_bytes{namespace="acme",tier="dram"} 1.048576e+06' in text
        assert "crescent_store_quota_refused_total 1.0" in text
        assert "crescent_store_quota_evictions_total" in text
        with client(node.address, ACME, "tcp") as acme:
            acme.put(b"after", b"still serving")
            assert acme.get(b"after") == b"still serving"
    finally:
        node.stop(grace=0)


def test_a_namespace_whose_own_values_are_all_leased_is_refused_and_others_are_not():
    acme = auth.namespace_prefix("acme")
    store = TieredStore(StoreConfig(dram="4MiB"), quotas={acme: auth.Quota("acme", dram_bytes=256 * KiB)})
    try:
        for i in range(4):
            store.put(acme + b"%d" % i, bytes(64 * KiB))
        leases = store.acquire_many([acme + b"%d" % i for i in range(4)])
        with pytest.raises(ResourceExhaustedError, match="namespace 'acme' is at its quota"):
            store.put(acme + b"x", bytes(64 * KiB))
        store.put(b"other-tenant", bytes(1 * MiB))  # unbounded: not affected
        store.release_many(leases)
        store.put(acme + b"x", bytes(64 * KiB))  # now its oldest makes room
        assert store.get(acme + b"0") is None and store.get(acme + b"x") is not None
        assert store.stats()["quota_refused"] == 1 and store.stats()["quota_evictions"] == 1
    finally:
        store.close()
