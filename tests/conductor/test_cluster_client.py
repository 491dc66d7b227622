"""ClusterClient over in-process store nodes found through an in-process conductor."""

import time

import pytest
import xxhash

from kvstore.client import ClusterClient, Retry, StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.cluster import rendezvous_rank
from kvstore.errors import UnavailableError
from tests.helpers import arena_fds, wait_for

KEYS = [b"key-%03d" % i for i in range(24)]


def score(node: str, key: bytes) -> int:
    """The documented rendezvous score (docs/conductor.md, "ClusterClient"): xxh3_64(node id ‖ 0 ‖ key)."""
    return xxhash.xxh3_64_intdigest(node.encode() + b"\0" + key)


def ranked(key: bytes, nodes) -> list[str]:
    """The key's nodes, best first, computed here from the documented hash (not with rendezvous_rank)."""
    return sorted(nodes, key=lambda n: score(n, key), reverse=True)


@pytest.fixture
def three(make_node, conductor):
    nodes = {n: make_node(n) for n in ("a", "b", "c")}
    with ClusterClient(conductor.address) as c:
        wait_for(lambda: len(c.conductor.members()) == 3, what="3 nodes registered")
    return nodes


def test_rendezvous_ranking_is_the_documented_hash():
    # Pinned by hand from the xxh3_64 scores (hex) of node ‖ 0 ‖ key:
    #   key-000: a 188b6676c0877ef2, b 1f08dbd4f141a48e, c 1821a5ca750b6c56, d 422d0b22cdd56a38 → b a c; d first
    #   key-001: a 1e232a7bf9a2974b, b bb1d5ba55c4e11f7, c ce3de1985bfa576f, d cca50673042a83ba → c b a; c d b a
    #   key-002: a 3e5b44b42081bff1, b 3aae01c58a68f7d2, c 2921fa8041d74d16, d d02f2afb9580b24b → a b c; d first
    assert score("a", b"key-000") == 0x188B6676C0877EF2
    assert rendezvous_rank(b"key-000", ["a", "b", "c"]) == ["b", "a", "c"]
    assert rendezvous_rank(b"key-000", ["a", "b", "c", "d"]) == ["d", "b", "a", "c"]
    assert rendezvous_rank(b"key-001", ["a", "b", "c"]) == ["c", "b", "a"]
    assert rendezvous_rank(b"key-001", ["a", "b", "c", "d"]) == ["c", "d", "b", "a"]
    assert rendezvous_rank(b"key-002", ["c", "b", "a"]) == ["a", "b", "c"]
    for k in KEYS:
        assert rendezvous_rank(k, ["a", "b", "c", "d"]) == ranked(k, ["a", "b", "c", "d"])


def test_rendezvous_moves_only_keys_the_new_node_wins():
    before = {k: rendezvous_rank(k, ["a", "b", "c"])[0] for k in KEYS}
    after = {k: rendezvous_rank(k, ["a", "b", "c", "d"])[0] for k in KEYS}
    # A key moves exactly when d outscores all three old nodes, and then only to d.
    for k in KEYS:
        wins = score("d", k) > max(score(n, k) for n in "abc")
        assert after[k] == ("d" if wins else before[k]), k
    assert len(set(before.values())) == 3
    assert 0 < sum(after[k] == "d" for k in KEYS) < len(KEYS)
    assert rendezvous_rank(b"x", ["b", "a"]) == rendezvous_rank(b"x", ["a", "b"])


def test_puts_go_home_and_reads_find_them(three, conductor):
    with ClusterClient(conductor.address) as c:
        assert c.batch_put([(k, k * 3) for k in KEYS]) == [True] * len(KEYS)
        for k in KEYS:
            home = ranked(k, "abc")[0]
            assert [n for n, node in three.items() if node.store.exists([k])[0]] == [home]
        assert c.batch_get(KEYS) == [bytearray(k * 3) for k in KEYS]  # own writes, before the index has them
        asked = {}  # alloc is told each key's index in this call, whichever node serves it
        got = c.batch_get(KEYS[::-1] + [b"missing"], lambda i, size: asked.setdefault(i, bytearray(size)))
        assert got == [bytearray(k * 3) for k in KEYS[::-1]] + [None]
        assert all(got[i] is asked[i] for i in range(len(KEYS))) and len(asked) == len(KEYS)
        assert c.batch_get_bytes([KEYS[3], b"missing", KEYS[7]]) == [KEYS[3] * 3, None, KEYS[7] * 3]
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
        for k in KEYS[:6]:  # the two best-ranked nodes, exactly
            assert {n for n, node in three.items() if node.store.exists([k])[0]} == set(ranked(k, "abc")[:2]), k
    with ClusterClient(conductor.address, local=three["c"].address, replicas=1) as c:
        c.batch_put([(k, b"w") for k in KEYS[6:12]])
        assert all(three["c"].store.exists(KEYS[6:12]))
        assert not any(three["a"].store.exists(KEYS[6:12]) + three["b"].store.exists(KEYS[6:12]))
    with ClusterClient(conductor.address, local=three["c"].address, replicas=2) as c:
        c.batch_put([(k, b"x") for k in KEYS[12:18]])
        for k in KEYS[12:18]:  # the local node, then the best of the others
            assert {n for n, node in three.items() if node.store.exists([k])[0]} == {"c", ranked(k, "ab")[0]}, k


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
        # Each key is on its first reachable node in the ranking: its home, or the runner-up where a was home.
        expected = [next(n for n in ranked(k, "abc") if n != "a") for k in KEYS]
        assert "a" in [ranked(k, "abc")[0] for k in KEYS]  # some keys really had to move
        assert three["b"].store.exists(KEYS) == [n == "b" for n in expected]
        assert three["c"].store.exists(KEYS) == [n == "c" for n in expected]


def test_draining_nodes_get_no_puts_but_still_serve_reads(three, conductor):
    old = [b"old-%03d" % i for i in range(24)]
    with ClusterClient(conductor.address) as c:
        c.batch_put([(k, k) for k in old])
    assert any(ranked(k, "abc")[0] == "b" for k in old)  # b holds some of them
    with ConductorClient(conductor.address) as cc:
        assert cc.drain("b") == "draining"
        with ClusterClient(conductor.address) as c:
            assert c.batch_put([(k, b"n") for k in KEYS]) == [True] * len(KEYS)
            for k in KEYS:  # b is left out of the ranking; everything else is as before
                assert [n for n, node in three.items() if node.store.exists([k])[0]] == [ranked(k, "ac")[0]], k
            assert "b" in [ranked(k, "abc")[0] for k in KEYS]  # some keys would have gone to b
            # Reads still reach the draining node.
            wait_for(lambda: c.lookup(old) == len(old), what="the old keys indexed")
            assert c.batch_get(old) == [bytearray(k) for k in old]
        # Not even as the caller's local node, nor as an extra replica.
        with ClusterClient(conductor.address, local=three["b"].address, replicas=3) as c:
            more = [b"more-%03d" % i for i in range(8)]
            assert c.batch_put([(k, b"m") for k in more]) == [True] * len(more)
            assert three["b"].store.exists(more) == [False] * len(more)
            assert all(three["a"].store.exists(more)) and all(three["c"].store.exists(more))
        assert cc.drain("b", undo=True) == "alive"
        with ClusterClient(conductor.address) as c:
            back = [b"back-%03d" % i for i in range(24)]
            c.batch_put([(k, b"b") for k in back])
            assert three["b"].store.exists(back) == [ranked(k, "abc")[0] == "b" for k in back]


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


def test_a_conductor_outage_falls_back_to_the_local_node():
    """With the conductor gone, a client with a local node reads and writes that node alone: what it
    holds is still reused; chunks only another node holds read as misses (finding them needs the index)."""
    from kvstore.conductor.config import ConductorConfig
    from kvstore.conductor.service import Conductor
    from kvstore.config import StoreConfig
    from kvstore.server import StoreNode

    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.2)).start()
    nodes = [StoreNode(StoreConfig(listen="127.0.0.1:0", node_id=n, conductor=conductor.address, dram="8MiB",
                                   slot_size="4KiB")).start() for n in ("a", "b")]
    try:
        with ClusterClient(conductor.address, local=nodes[0].address, index_ttl_s=0.01, retry=Retry(attempts=1)) as c:
            wait_for(lambda: len(c.conductor.members()) == 2, what="2 nodes registered")
            assert c.batch_put([(k, k) for k in KEYS[:4]]) == [True] * 4  # to the local node
            nodes[1].store.put(KEYS[4], KEYS[4])  # only b holds this one
            wait_for(lambda: c.lookup(KEYS[:5]) == 5, what="indexed")
            assert c.num_conductor_fallbacks == 0
            conductor.stop(0)
            time.sleep(0.05)  # past index_ttl_s: the client's cached holders are stale
            assert c.lookup(KEYS[:5]) == 4
            assert c.batch_get(KEYS[:5]) == [bytearray(k) for k in KEYS[:4]] + [None]
            assert c.batch_put([(KEYS[5], b"new")]) == [True]
            assert nodes[0].store.get(KEYS[5]) == b"new"
            assert c.exists([KEYS[5], b"nowhere"]) == [True, False]
            assert c.num_conductor_fallbacks > 0
        with ClusterClient(conductor.address, retry=Retry(attempts=1)) as c:  # no local node: the outage shows
            with pytest.raises(UnavailableError):
                c.lookup(KEYS[:1])
    finally:
        for n in nodes:
            n.stop(grace=0)


def test_a_miss_is_not_cached_so_a_chunk_being_saved_is_seen_once_indexed(three, conductor):
    """A decode engine polls for chunks the prefill engine is still saving: a miss must not stick for the
    index TTL (it cost every disaggregated request a second when it did)."""
    with ClusterClient(conductor.address, index_ttl_s=600) as reader, ClusterClient(conductor.address) as writer:
        assert reader.lookup([b"late"]) == 0
        writer.put(b"late", b"v")
        wait_for(lambda: reader.lookup([b"late"]) == 1, timeout_s=60, what="the reader to see the new chunk")
        assert reader.get(b"late") == b"v"


def _deleted_arena_fds() -> list[str]:
    """This process's descriptors of shm arena files a stopped node has removed."""
    return [t for t in arena_fds() if t.endswith("(deleted)")]


def test_the_client_of_a_node_that_left_is_closed_once_no_call_can_still_use_it(make_node, conductor):
    """A node that leaves the cluster for good (stopped; a replacement would come at another address):
    once its client has been unused for ``prune_after_s`` (twice the longest call), the membership
    refresh closes it. Before, it stayed for the ClusterClient's life, and over shm it kept the stopped
    node's arena mapped: the arena's memory (the file removed, the pages not) was never given back."""
    make_node("a")
    b = make_node("b")
    quick = Retry(attempts=1, backoff_s=0.0, max_backoff_s=0.0)
    with ClusterClient(conductor.address, index_ttl_s=0.1, timeout_s=0.5, retry=quick, transport="shm") as c:
        assert c.prune_after_s == 1.0
        wait_for(lambda: len(c.conductor.members()) == 2, what="2 nodes registered")
        assert all(c.batch_put([(k, b"v" * 100)]) == [True] for k in KEYS)  # rendezvous: both nodes
        assert len(c._clients) == 2
        b.stop(0)
        wait_for(lambda: len(c.conductor.members()) == 1, what="b to leave")
        assert _deleted_arena_fds(), "b's arena should still be mapped by its client"
        wait_for(lambda: c.health()["num_store_nodes"] == 1 and len(c._clients) == 1 and not _deleted_arena_fds(),
                 what="b's client closed")
        assert c.batch_get(KEYS[:1]) is not None  # and the cluster serves on
