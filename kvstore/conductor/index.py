"""The global prefix index: which store nodes hold each chunk, and in which tier.

Fed by the nodes' KV events (stored / moved / removed). Keys are the store's
byte keys in the conductor; the trace simulator uses the trace's integer block
ids, so the index only asks for hashable keys. Not thread-safe: the conductor
guards it (with the member list) by one lock.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence

from kvstore.conductor.policy import PrefixMatch
from kvstore.store import Tier


_TIERS = (None, Tier.DEVICE, Tier.DRAM, Tier.DISK)  # a holder's 2-bit code: its Tier (0: not a holder)


class GlobalIndex:
    """key → the nodes holding it and their tiers, and node id → its keys (so a dead node leaves in one step).

    Each node gets a slot while it holds keys; a key's holders are one int, two bits per slot (the
    node's ``Tier``, 0 where it does not hold the key): 136 bytes per (key, node) copy where a dict
    per key took 300 (in-process, keys already made); the whole conductor process, 206 bytes per copy
    where it took 276 (``bench/conductor_scale_bench.py``, docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self._holders: dict[Hashable, int] = {}
        self._by_node: dict[str, set[Hashable]] = {}
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []  # slot → node (None: free)
        self._free: list[int] = []
        self._low = 0  # the low bit of every slot in use
        self._live = 0  # both bits of every slot in use: a key's bits masked by it are its holders
        self._dropped: collections.deque[tuple[int, Iterator[Hashable]]] = collections.deque()
        """Slots of dropped nodes whose keys still carry their bits (``sweep``), each with its keys to clear."""
        self.num_copies = 0

    def _holders_of(self, bits: int) -> dict[str, Tier]:
        out = {}
        names = self._names
        while bits:
            shift = (bits & -bits).bit_length() - 1 & ~1
            out[names[shift >> 1]] = _TIERS[bits >> shift & 3]
            bits &= ~(3 << shift)
        return out

    def stored(self, node: str, key: Hashable, tier: Tier) -> None:
        """``key`` is on ``node`` in ``tier`` (a new chunk, a replacement or a move)."""
        slot = self._slot.get(node)
        if slot is None:
            slot = self._slot[node] = self._free.pop() if self._free else len(self._names)
            if slot == len(self._names):
                self._names.append(node)
            self._names[slot] = node
            self._low |= 1 << 2 * slot
            self._live |= 3 << 2 * slot
            self._by_node[node] = set()
        shift = 2 * slot
        bits = self._holders.get(key, 0)
        if not bits >> shift & 3:
            self._by_node[node].add(key)
            self.num_copies += 1
        self._holders[key] = bits & ~(3 << shift) | int(tier) << shift

    def removed(self, node: str, key: Hashable) -> bool:
        """``key`` left ``node``; returns whether the index had it there."""
        slot = self._slot.get(node)
        bits = self._holders.get(key, 0)
        if slot is None or not bits >> 2 * slot & 3:
            return False
        bits &= ~(3 << 2 * slot)
        if bits:
            self._holders[key] = bits
        else:
            del self._holders[key]
        self._by_node[node].discard(key)
        self.num_copies -= 1
        return True

    def drop_node(self, node: str, lazy: bool = False) -> int:
        """Forgets every chunk of ``node``; returns how many.

        The node leaves every answer at once, in O(1): its slot leaves the live mask. Its keys' bits
        are cleared by ``sweep``, here unless ``lazy`` (the conductor sweeps in batches off its lock:
        a node of 500,000 keys took 0.47 s under it). Until then the slot is not reused, and
        ``num_chunks()`` still counts the keys that only the dropped node held.
        """
        slot = self._slot.pop(node, None)
        if slot is None:
            return 0
        keys = self._by_node.pop(node)
        keep = ~(3 << 2 * slot)
        self._names[slot] = None
        self._low &= keep
        self._live &= keep
        self.num_copies -= len(keys)
        self._dropped.append((slot, iter(keys)))
        if not lazy:
            self.sweep()
        return len(keys)

    def sweep(self, budget: int | None = None) -> bool:
        """Clears dropped nodes' bits from up to ``budget`` keys (None: all) and frees their slots once
        done; returns False once none are left (True: call again)."""
        holders = self._holders
        while self._dropped:
            slot, keys = self._dropped[0]
            keep = ~(3 << 2 * slot)
            n = 0
            for key in keys if budget is None else itertools.islice(keys, budget):
                n += 1
                bits = holders[key] & keep  # (nothing else clears a dropped slot's bits: the key is there)
                if bits:
                    holders[key] = bits
                else:
                    del holders[key]
            if budget is not None:
                budget -= n
                if budget <= 0:
                    return True  # (the slot may be done: the next call frees it)
            self._dropped.popleft()
            self._free.append(slot)
        return False

    def holders(self, key: Hashable) -> dict[str, Tier]:
        """The nodes holding ``key`` and their tiers (a new dict; empty when absent)."""
        return self._holders_of(self._holders.get(key, 0) & self._live)

    def has(self, node: str, key: Hashable) -> bool:
        slot = self._slot.get(node)
        return slot is not None and bool(self._holders.get(key, 0) >> 2 * slot & 3)

    def num_chunks(self, node: str | None = None) -> int:
        """Distinct keys in the index, or the number of keys on ``node``."""
        if node is None:
            return len(self._holders)
        return len(self._by_node.get(node, ()))

    def match(self, keys: Sequence[Hashable]) -> PrefixMatch:
        """The leading keys held by at least one node, with their holders."""
        out = []
        live = self._live
        for k in keys:
            bits = self._holders.get(k, 0) & live
            if not bits:
                break
            out.append(self._holders_of(bits))
        return PrefixMatch(out)

    def node_prefixes(self, keys: Sequence[Hashable]) -> dict[str, int]:
        """For each node holding ``keys[0]``: how many leading keys it holds by itself."""
        if not keys:
            return {}
        low = self._low

        def present(bits: int) -> int:  # the low bit of each slot that holds the key
            return (bits | bits >> 1) & low

        alive = present(self._holders.get(keys[0], 0))
        out: dict[str, int] = {}
        for i, k in enumerate(keys):
            now = alive & present(self._holders.get(k, 0))
            for name in self._holders_of(alive & ~now):
                out[name] = i
            alive = now
            if not alive:
                break
        for name in self._holders_of(alive):
            out[name] = len(keys)
        return out


class HotTracker:
    """Decayed use counts of keys: ``count`` halves every ``half_life_s`` of idle time.

    At most ``max_entries`` keys. Past that, each touch drops as many keys as it added, the least
    recently used (a key in use is touched again, and so never the least recently used). A touch
    costs O(its keys) however full the tracker is: no pass over every key (the previous design
    pruned cold keys in one pass, ~0.7 s for a million under the conductor's lock, once per quarter
    of its size of new keys; keys used within a half-life went least recently used first there too,
    bench/hot_tracker_bench.py). A large tracker is split by key hash into up to ``SHARDS`` parts of
    ``SHARD_MIN`` keys or more, each with its own size and order: a dict's rebuild (growth, or
    compaction after many evictions) then stalls a touch for one part's size, not the whole's (the
    least recently used order is kept per part: nearly the global one, the keys being hashes).

    Each key holds one float, ``ln(count) + rate * t`` at its last touch ``t``, so that its count at
    ``now`` is ``exp(value - rate * now)``; ``now`` is a monotonic clock (an earlier one is read as
    the latest touch's).
    """

    SHARDS = 64
    SHARD_MIN = 4096

    def __init__(self, half_life_s: float, max_entries: int = 1 << 20) -> None:
        self._rate = math.log(2) / half_life_s
        n = 1
        while n < self.SHARDS and max_entries // (2 * n) >= self.SHARD_MIN:
            n *= 2
        # each part in order of last use
        self._shards: list[collections.OrderedDict[Hashable, float]] = [collections.OrderedDict() for _ in range(n)]
        self._mask = n - 1
        self._per_shard = max_entries // n
        self._now = -math.inf  # the latest touch
        self.num_evicted = 0

    def __len__(self) -> int:
        return sum(len(d) for d in self._shards)

    def _decayed(self, value: float | None, now: float) -> float:
        if value is None:
            return 0.0
        return math.exp(value - self._rate * max(now, self._now))

    def touch(self, keys: Iterable[Hashable], now: float) -> None:
        """Counts one use of each key."""
        shards, mask, per = self._shards, self._mask, self._per_shard
        now = self._now = max(now, self._now)
        at = self._rate * now
        grown = []
        for k in keys:
            d = shards[hash(k) & mask]
            v = d.get(k)
            if v is None:
                d[k] = at  # ln(1) + rate * now
                if len(d) > per:
                    grown.append(d)
            else:
                d[k] = math.log(math.exp(v - at) + 1.0) + at
                d.move_to_end(k)
        for d in grown:
            while len(d) > per:
                d.popitem(last=False)
                self.num_evicted += 1

    def count(self, key: Hashable, now: float) -> float:
        return self._decayed(self._shards[hash(key) & self._mask].get(key), now)

