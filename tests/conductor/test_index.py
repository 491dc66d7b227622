"""GlobalIndex and HotTracker, exactly."""

import pytest

from kvstore.conductor.index import GlobalIndex, HotTracker
from kvstore.store import Tier

D, K = Tier.DRAM, Tier.DISK


def test_stored_moved_removed_and_counts():
    ix = GlobalIndex()
    ix.stored("a", b"k1", D)
    ix.stored("b", b"k1", D)
    ix.stored("a", b"k1", K)  # moved: still one copy on a
    ix.stored("a", b"k2", D)
    assert ix.holders(b"k1") == {"a": K, "b": D}
    assert (ix.num_chunks(), ix.num_copies, ix.num_chunks("a"), ix.num_chunks("b")) == (2, 3, 2, 1)
    assert ix.removed("b", b"k1")
    assert not ix.removed("b", b"k1")
    assert not ix.removed("zz", b"k9")
    assert ix.holders(b"k1") == {"a": K}
    assert ix.num_copies == 2


def test_drop_node_removes_only_its_copies():
    ix = GlobalIndex()
    for k in (b"1", b"2", b"3"):
        ix.stored("a", k, D)
    ix.stored("b", b"2", D)
    assert ix.drop_node("a") == 3
    assert ix.holders(b"1") == {} and ix.holders(b"2") == {"b": D}
    assert (ix.num_chunks(), ix.num_copies) == (1, 1)
    assert ix.drop_node("a") == 0


def test_match_and_node_prefixes():
    ix = GlobalIndex()
    keys = [b"k0", b"k1", b"k2", b"k3"]
    for k in keys[:3]:
        ix.stored("a", k, D)
    ix.stored("b", b"k0", D)
    ix.stored("b", b"k2", D)
    ix.stored("c", b"k1", D)
    m = ix.match(keys)
    assert m.num_global == 3
    assert m.local_prefix("a") == 3 and m.local_prefix("b") == 1 and m.local_prefix("c") == 0
    assert ix.node_prefixes(keys) == {"a": 3, "b": 1}
    assert ix.node_prefixes([]) == {}
    assert ix.match([b"nope", b"k0"]).num_global == 0


@pytest.mark.parametrize("lazy", [False, True])
def test_the_packed_index_answers_as_a_dict_of_dicts_under_random_events(lazy):
    """Holders packed two bits per node slot, slots freed by dropped nodes and reused: every answer equals
    that of the plain model (key → {node: tier}) after each of 20,000 random events over 70 nodes.
    ``lazy``: dropped nodes' bits are swept a few keys at a time between events, as the conductor does
    off its lock; every answer but the count of distinct keys is exact before the sweep ends."""
    import random

    rng = random.Random(5)
    ix, model = GlobalIndex(), {}
    nodes = [f"n{i}" for i in range(70)]
    keys = [bytes([i]) * 4 for i in range(60)]
    for step in range(20_000):
        r, node, key = rng.random(), rng.choice(nodes), rng.choice(keys)
        if r < 0.55:
            tier = rng.choice(list(Tier))
            ix.stored(node, key, tier)
            model.setdefault(key, {})[node] = tier
        elif r < 0.95:
            had = node in model.get(key, {})
            assert ix.removed(node, key) == had
            if had:
                del model[key][node]
                if not model[key]:
                    del model[key]
        else:
            gone = [k for k, h in model.items() if node in h]
            assert ix.drop_node(node, lazy=lazy) == len(gone)
            for k in gone:
                del model[k][node]
                if not model[k]:
                    del model[k]
        if lazy and rng.random() < 0.1:
            ix.sweep(rng.randrange(0, 8))
        if step % 97 == 0 or step > 19_900:
            for k in keys:
                assert ix.holders(k) == model.get(k, {})
                assert all(ix.has(n, k) == (n in model.get(k, {})) for n in nodes)
            assert ix.num_copies == sum(map(len, model.values()))
            assert ix.num_chunks() >= len(model)
            if not lazy or not ix.sweep(0):
                assert ix.num_chunks() == len(model)
            assert all(ix.num_chunks(n) == sum(n in h for h in model.values()) for n in nodes)
            prompt = rng.sample(keys, 6)
            lead = next((i for i, k in enumerate(prompt) if k not in model), len(prompt))
            assert ix.match(prompt).num_global == lead
            want = {}
            for n in model.get(prompt[0], {}):
                want[n] = next((i for i, k in enumerate(prompt) if n not in model.get(k, {})), len(prompt))
            assert ix.node_prefixes(prompt) == want
    assert not ix.sweep() and ix.num_chunks() == len(model)
    assert len(ix._free) + len(ix._slot) == len(ix._names)  # every swept slot free again


def test_a_lazily_dropped_node_is_swept_in_batches_and_its_slot_reused():
    ix = GlobalIndex()
    for i in range(10):
        ix.stored("a", b"%d" % i, D)
    ix.stored("b", b"3", K)
    assert ix.drop_node("a", lazy=True) == 10
    assert ix.holders(b"3") == {"b": K} and ix.holders(b"4") == {} and ix.match([b"0"]).num_global == 0
    assert ix.num_copies == 1 and ix.num_chunks() == 10  # (the keys only "a" held are counted until swept)
    ix.stored("c", b"0", D)  # a node that comes while the sweep goes on gets a slot of its own
    assert ix.holders(b"0") == {"c": D}
    assert [ix.sweep(4), ix.sweep(4), ix.sweep(4)] == [True, True, False]
    assert ix.num_chunks() == 2 and ix.holders(b"3") == {"b": K} and ix.holders(b"0") == {"c": D}
    ix.stored("d", b"9", D)
    assert ix._names == ["d", "b", "c"]  # the dropped node's slot, free again


def test_hot_tracker_decays_by_half_life():
    h = HotTracker(half_life_s=10.0)
    h.touch([b"x", b"y"], now=0.0)
    h.touch([b"x"], now=0.0)
    assert h.count(b"x", 0.0) == pytest.approx(2.0)
    assert h.count(b"x", 10.0) == pytest.approx(1.0)
    assert h.count(b"y", 20.0) == pytest.approx(0.25)
    assert h.count(b"z", 5.0) == 0.0
    h.touch([b"x"], now=10.0)
    assert h.count(b"x", 10.0) == pytest.approx(2.0)


def test_hot_tracker_drops_the_least_recently_used():
    h = HotTracker(half_life_s=1.0, max_entries=4)
    h.touch([1] * 5 + [2, 3, 4], now=0.0)
    h.touch([5, 1], now=3.0)  # 1 is in use again: 2 goes, the least recently used
    assert list(h._shards[0]) == [3, 4, 5, 1] and h.num_evicted == 1
    assert h.count(1, 3.0) == pytest.approx(5 / 8 + 1)
    assert h.count(2, 3.0) == 0.0 and h.count(3, 3.0) == pytest.approx(1 / 8)
    h.touch([6, 7, 3], now=3.0)  # 3 again, then 4 and 5 go
    assert list(h._shards[0]) == [1, 6, 7, 3] and h.num_evicted == 3
    assert h.count(3, 3.0) == pytest.approx(1 / 8 + 1)


def test_a_large_hot_tracker_is_split_by_key_hash_and_holds_its_size():
    size = 32 * HotTracker.SHARD_MIN
    h = HotTracker(half_life_s=60.0, max_entries=size)
    assert len(h._shards) == 32 and h._per_shard == size // 32  # parts of SHARD_MIN keys or more
    assert len(HotTracker(60.0, max_entries=1 << 20)._shards) == HotTracker.SHARDS
    keys = [i.to_bytes(16, "big") for i in range(size + size // 2)]
    for i in range(0, len(keys), 100):
        h.touch(keys[i:i + 100] + [b"prefix"], now=i / 1e4)
    assert size - len(h._shards) <= len(h) <= size and h.num_evicted == len(keys) + 1 - len(h)
    assert h.count(b"prefix", len(keys) / 1e4) > 100  # in use all along: kept, with its decayed sum
    assert h.count(keys[-1], len(keys) / 1e4) > 0.99 and h.count(keys[0], len(keys) / 1e4) == 0.0


def test_hot_tracker_stays_at_its_size_under_a_stream_of_fresh_keys():
    """A steady stream of fresh prompts: the tracker stays at its size, each touch dropping what it added
    (no pass over every key: the previous design's prune), and the key in use every step keeps its
    exact decayed count."""
    size = 1000
    h = HotTracker(half_life_s=1.0, max_entries=size)
    now = 0.0
    for i in range(20 * size):
        now += 1.01 / size  # one new key per step: keys go cold about as fast as new ones come
        h.touch([("fresh", i), "hot"], now)
        assert len(h) <= size
    assert h.num_evicted == 20 * size + 1 - size
    # touched every 1.01 ms: the decayed sum of 20,000 ones, 2^(-1.01e-3 k) for k = 0..19,999
    assert h.count("hot", now) == pytest.approx(sum(2 ** (-1.01e-3 * k) for k in range(20 * size)))
    assert h.count(("fresh", 20 * size - 1), now) == pytest.approx(1.0)
    assert h.count(("fresh", 0), now) == 0.0


def test_hot_tracker_reads_an_earlier_clock_as_its_latest_touch():
    h = HotTracker(half_life_s=1.0)
    h.touch(["x"], now=5.0)
    assert h.count("x", 4.0) == pytest.approx(1.0)  # not 2: a count never grows by going back in time
    h.touch(["x"], now=4.0)
    assert h.count("x", 5.0) == pytest.approx(2.0)
