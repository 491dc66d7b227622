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


class GlobalIndex:
    """key → {node id: tier}, and node id → its keys (so a dead node leaves in one step)."""

    def __init__(self) -> None:
        self._holders: dict[Hashable, dict[str, Tier]] = {}
        self._by_node: dict[str, set[Hashable]] = {}
        self.num_copies = 0

    def stored(self, node: str, key: Hashable, tier: Tier) -> None:
        """``key`` is on ``node`` in ``tier`` (a new chunk, a replacement or a move)."""
        holders = self._holders.get(key)
        if holders is None:
            holders = self._holders[key] = {}
        if node not in holders:
            self._by_node.setdefault(node, set()).add(key)
            self.num_copies += 1
        holders[node] = tier

    def removed(self, node: str, key: Hashable) -> bool:
        """``key`` left ``node``; returns whether the index had it there."""
        holders = self._holders.get(key)
        if holders is None or node not in holders:
            return False
        del holders[node]
        if not holders:
            del self._holders[key]
        self._by_node[node].discard(key)
        self.num_copies -= 1
        return True

    def drop_node(self, node: str) -> int:
        """Forgets every chunk of ``node``; returns how many."""
        keys = self._by_node.pop(node, set())
        for key in keys:
            holders = self._holders[key]
            del holders[node]
            if not holders:
                del self._holders[key]
        self.num_copies -= len(keys)
        return len(keys)

    def holders(self, key: Hashable) -> dict[str, Tier]:
        """The nodes holding ``key`` and their tiers (a copy; empty when absent)."""
        return dict(self._holders.get(key, ()))

    def has(self, node: str, key: Hashable) -> bool:
        h = self._holders.get(key)
        return h is not None and node in h

    def num_chunks(self, node: str | None = None) -> int:
        """Distinct keys in the index, or the number of keys on ``node``."""
        if node is None:
            return len(self._holders)
        return len(self._by_node.get(node, ()))

    def match(self, keys: Sequence[Hashable]) -> PrefixMatch:
        """The leading keys held by at least one node, with their holders."""
        out = []
        for k in keys:
            h = self._holders.get(k)
            if not h:
                break
            out.append(h)
        return PrefixMatch(out)

    def node_prefixes(self, keys: Sequence[Hashable]) -> dict[str, int]:
        """For each node holding ``keys[0]``: how many leading keys it holds by itself."""
        if not keys:
            return {}
        alive = {n: 0 for n in self._holders.get(keys[0], ())}
        out: dict[str, int] = {}
        for i, k in enumerate(keys):
            h = self._holders.get(k, {})
            for n in list(alive):
                if n not in h:
                    out[n] = i
                    del alive[n]
            if not alive:
                break
        for n in alive:
            out[n] = len(keys)
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
