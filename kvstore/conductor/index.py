"""The global prefix index: which store nodes hold each chunk, and in which tier.

Fed by the nodes' KV events (stored / moved / removed). Keys are the store's
byte keys in the conductor; the trace simulator uses the trace's integer block
ids, so the index only asks for hashable keys. Not thread-safe: the conductor
guards it (with the member list) by one lock.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable, Sequence

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

    def drop_node(self, node: str) -> int:
        """Forgets every chunk of ``node``; returns how many."""
        slot = self._slot.pop(node, None)
        if slot is None:
            return 0
        keys = self._by_node.pop(node)
        keep = ~(3 << 2 * slot)
        holders = self._holders
        for key in keys:
            bits = holders[key] & keep
            if bits:
                holders[key] = bits
            else:
                del holders[key]
        self._names[slot] = None
        self._free.append(slot)
        self._low &= keep
        self.num_copies -= len(keys)
        return len(keys)

    def holders(self, key: Hashable) -> dict[str, Tier]:
        """The nodes holding ``key`` and their tiers (a new dict; empty when absent)."""
        return self._holders_of(self._holders.get(key, 0))

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
        for k in keys:
            bits = self._holders.get(k)
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

    At most ``max_entries`` keys: past that, cold ones (count < 0.5) go, then the least recently used
    until 3/4 of it are left, so that a prune (a pass over every key) comes at most once per
    ``max_entries / 4`` new keys however the counts decay.
    """

    def __init__(self, half_life_s: float, max_entries: int = 1 << 20) -> None:
        self._rate = math.log(2) / half_life_s
        self._counts: dict[Hashable, tuple[float, float]] = {}  # in order of last use
        self._max_entries = max_entries

    def _decayed(self, key: Hashable, now: float) -> float:
        v = self._counts.get(key)
        if v is None:
            return 0.0
        count, t = v
        return count * math.exp(-self._rate * max(0.0, now - t))

    def touch(self, keys: Iterable[Hashable], now: float) -> None:
        """Counts one use of each key."""
        counts = self._counts
        for k in keys:
            value = self._decayed(k, now) + 1.0
            counts.pop(k, None)  # (to the end: the dict stays in order of last use)
            counts[k] = (value, now)
        if len(counts) > self._max_entries:
            self._prune(now)

    def count(self, key: Hashable, now: float) -> float:
        return self._decayed(key, now)

    def _prune(self, now: float) -> None:
        for k in [k for k in self._counts if self._decayed(k, now) < 0.5]:
            del self._counts[k]
        excess = len(self._counts) - self._max_entries * 3 // 4
        if excess > 0:  # the least recently used first
            for k in list(itertools.islice(self._counts, excess)):
                del self._counts[k]
