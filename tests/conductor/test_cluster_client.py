"""ClusterClient over in-process store nodes found through an in-process conductor."""

import pytest

from kvstore.client import ClusterClient, Retry, StoreClient
from kvstore.cluster import rendezvous_rank
from kvstore.errors import UnavailableError
from tests.helpers import wait_for

KEYS = [b"key-%03d" % i for i in range(24)]


@pytest.fixture
def three(make_node, conductor):
    nodes = {n: make_node(n) for n in ("a", "b", "c")}
    with ClusterClient(conductor.address) as c:
        wait_for(lambda: len(c.conductor.members()) == 3, what="3 nodes registered")
    return nodes


def test_rendezvous_moves_only_keys_the_new_node_wins():
    before = {k: rendezvous_rank(k, ["a", "b", "c"])[0] for k in KEYS * 1}
    after = {k: rendezvous_rank(k, ["a", "b", "c", "d"])[0] for k in KEYS}
    assert all(after[k] in (before[k], "d") for k in KEYS)
    assert len(set(before.values())) == 3
    assert rendezvous_rank(b"x", ["b", "a"]) == rendezvous_rank(b"x", ["a", "b"])


def test_puts_go_home_and_reads_find_them(three, conductor):
    with ClusterClient(conductor.address) as c:
        assert c.batch_put([(k, k * 3) for k in KEYS]) == [True] * len(KEYS)
        for k in KEYS:
            home = rendezvous_rank(k, ["a", "b", "c"])[0]
            assert [n for n, node in three.items() if node.store.exists([k])[0]] == [home]
        assert c.batch_get(KEYS) == [bytearray(k * 3) for k in KEYS]  # own writes, before the index has them
    with ClusterClient(conductor.address) as fresh:  # a new client reads through the index
        wait_for(lambda: fresh.lookup(KEYS) == len(KEYS), what="indexed")
        assert fresh.get(KEYS[5]) == KEYS[5] * 3
        assert fresh.exists([KEYS[0], b"missing"]) == [True, False]
        bufs = [bytearray(64) for _ in KEYS[:4]]
        assert fresh.batch_get_into(KEYS[:4], bufs) == [len(k) * 3 for k in KEYS[:4]]
        assert bytes(bufs[0][: len(KEYS[0]) * 3]) == KEYS[0] * 3
        n, tiers = fresh.lookup_tiers(KEYS[:3] + [b"missing", KEYS[4]])
        assert n == 3 and [t.name for t in tiers] == ["DRAM"] * 3


def test_replicas_and_local_node(three, conductor):
    with ClusterClient(conductor.address, replicas=2) as c:
        c.batch_put([(k, b"v") for k in KEYS[:6]])
        for k in KEYS[:6]:
            assert sum(node.store.exists([k])[0] for node in three.values()) == 2
    with ClusterClient(conductor.address, local=three["c"].address, replicas=1) as c:
        c.batch_put([(k, b"w") for k in KEYS[6:12]])
        assert all(three["c"].store.exists(KEYS[6:12]))
        assert not any(three["a"].store.exists(KEYS[6:12]) + three["b"].store.exists(KEYS[6:12]))


def test_reads_prefer_the_local_copy(three, conductor):
    for node in three.values():
        node.store.put(b"shared", b"s")
    with ClusterClient(conductor.address, local=three["b"].address) as c:
        wait_for(lambda: len(c.locate([b"shared"], fresh=True)[0]) == 3, what="3 copies indexed")
        hits = {n: node.store.stats()["tiers"] for n, node in three.items()}
        assert c.get(b"shared") == b"s"
        after = {n: node.store.stats()["tiers"] for n, node in three.items()}
        changed = [n for n in three if after[n] != hits[n]]
        assert changed == ["b"]


def test_stale_index_reads_as_a_miss_and_delete_reaches_every_copy(three, conductor):
    with ClusterClient(conductor.address, replicas=3, index_ttl_s=60) as c:
        c.batch_put([(k, b"v") for k in KEYS[:3]])
        for node in three.values():  # behind the client's back
            node.store.delete([KEYS[0]])
        assert c.batch_get(KEYS[:2]) == [None, bytearray(b"v")]
        wait_for(lambda: len(c.locate([KEYS[1]], fresh=True)[0]) == 3, what="indexed")
        assert c.delete(KEYS[1:3] + [b"missing"]) == 2
        assert not any(node.store.exists([KEYS[1]])[0] for node in three.values())
        assert c.get(KEYS[1]) is None


def test_an_unreachable_node_is_skipped_for_the_next(three, conductor):
    with ClusterClient(conductor.address, index_ttl_s=60, retry=Retry(attempts=2, backoff_s=0.01)) as c:
        c.health()  # caches the member list with all three nodes
        three["a"].stop(0)
        assert c.batch_put([(k, b"v") for k in KEYS]) == [True] * len(KEYS)
        assert not any(three["b"].store.exists([k])[0] and three["c"].store.exists([k])[0] for k in KEYS)
        assert sum(three["b"].store.exists(KEYS)) + sum(three["c"].store.exists(KEYS)) == len(KEYS)


def test_no_store_node(conductor):
    with ClusterClient(conductor.address) as c:
        with pytest.raises(UnavailableError, match="knows no live store node"):
            c.put(b"k", b"v")
        assert c.get(b"k") is None
        assert c.health()["num_store_nodes"] == 0


def test_storeclient_parity():
    """The value and metadata methods of StoreClient, with the same parameter names."""
    import inspect

    for name in ("put", "batch_put", "get", "batch_get", "batch_get_into", "lookup", "lookup_tiers", "exists",
                 "delete", "pin", "unpin", "stats", "health", "close"):
        theirs = [p for p in inspect.signature(getattr(StoreClient, name)).parameters if not p.startswith("_")]
        ours = list(inspect.signature(getattr(ClusterClient, name)).parameters)
        assert ours == theirs, name
