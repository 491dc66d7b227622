"""``ClusterClient``: StoreClient's methods over every store node a conductor knows.

- Reads (``lookup``, ``exists``, ``get``, ``batch_get``, ``batch_get_into``) go
  to the node that holds each key, from the conductor's index (``Locate``),
  cached for ``index_ttl_s``. A key the caller's local node holds is read
  there; otherwise from the holder with the fastest tier. A holder that no
  longer has the key (a stale index) is skipped for the next one, and a key
  no holder has reads as a miss.
- Writes go to the caller's ``local`` node when given, else to the node chosen
  by rendezvous hashing (highest ``xxh3_64(node id ‖ 0 ‖ key)`` among live,
  non-draining store nodes); ``replicas`` > 1 adds the next-ranked nodes. A
  node that cannot be reached is replaced by the next one in the ranking.
- The index is eventually consistent (store nodes batch their events), so a
  client remembers where it put each key for ``index_ttl_s``: its own writes
  are readable at once.
- While the conductor cannot be reached (down, cut off, no leader yet), a
  client with a ``local`` node reads and writes that node directly, asking the
  conductor again after ``index_ttl_s`` (at least 2 s): reuse of what the local node holds
  goes on through a conductor outage. Without ``local`` the outage raises
  UnavailableError, as before.

The conductor itself carries no value bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import xxhash

from kvstore.conductor.client import ConductorClient, MemberInfo
from kvstore.conductor.membership import MemberKind
from kvstore.datachannel import new_buffer
from kvstore.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kvstore.store import Tier

_MAX_CACHED_KEYS = 1 << 18
_LOCAL = "\0local"
"""The holder id of the ``local`` node while the conductor is away (its real id may be unknown)."""
_OUTAGE = (UnavailableError, DeadlineExceededError)


def rendezvous_rank(key: bytes, node_ids: Sequence[str]) -> list[str]:
    """``node_ids`` by decreasing ``xxh3_64(node id ‖ 0 ‖ key)``: the first is the key's home."""
    return sorted(node_ids, key=lambda n: (-xxhash.xxh3_64_intdigest(n.encode() + b"\0" + key), n))


class ClusterClient:
    """A client of a whole Crescent cluster, found through its conductor.

    Args:
        conductor: the conductor's ``host:port``.
        local: ``host:port`` of the caller's own store node (writes go there and
            reads prefer it); None: writes by rendezvous hashing.
        replicas: copies written per key (the local node counts as one).
        index_ttl_s: how long holders from the conductor's index are trusted.
        timeout_s, retry, data_channel: as for ``StoreClient``.
        etcd: etcd endpoints where conductor replicas register (``ConductorClient``).
        **store_options: passed to each node's ``StoreClient`` (e.g. ``transport=``).

    A node's ``StoreClient`` is made on first use and closed once the node has left the member list
    and the client has gone unused for ``prune_after_s``.
    """

    def __init__(self, conductor: str, *, local: str | None = None, replicas: int = 1,
                 index_ttl_s: float = 1.0, timeout_s: float = 60.0, retry=None,
                 data_channel: bool = True, etcd: str | None = None, **store_options) -> None:
        from kvstore.client import Retry

        if replicas < 1:
            raise InvalidArgumentError(f"replicas must be >= 1, got {replicas}")
        self.retry = retry or Retry()
        self.conductor = ConductorClient(conductor, timeout_s=min(timeout_s, 10.0), retry=self.retry, etcd=etcd)
        self.local = local
        self.replicas = replicas
        self.index_ttl_s = index_ttl_s
        self.timeout_s = timeout_s
        self._data_channel = data_channel
        self._store_options = store_options
        self._lock = threading.Lock()
        self._clients: dict[str, object] = {}
        self._used: dict[str, float] = {}  # address → when _client last handed out its client
        self.prune_after_s = 2 * self.retry.attempts * (timeout_s + self.retry.max_backoff_s)
        """How long a client of a node that left the cluster stays unused before it is closed:
        twice the longest a call through it can take (every attempt to its deadline)."""
        self._nodes: list[MemberInfo] = []
        self._nodes_at = -1e9
        self._holders: dict[bytes, tuple[float, dict[str, Tier]]] = {}
        self._conductor_down_until = -1e9
        self.num_conductor_fallbacks = 0
        """Calls served by the local node alone because the conductor could not be reached."""

    def _without_conductor(self) -> bool:
        """True while a recent conductor failure stands and a local node can serve instead."""
        return self.local is not None and time.monotonic() < self._conductor_down_until

    def _conductor_failed(self, exc: Exception) -> None:
        """After a failed conductor call: with a local node, do without the conductor for a while."""
        if self.local is None:
            raise exc
        if not self._without_conductor():
            import logging

            logging.getLogger(__name__).warning("conductor unreachable (%s): reading and writing the local node "
                                                "%s only", exc, self.local)
        self._conductor_down_until = time.monotonic() + max(self.index_ttl_s, 2.0)

    # ---- membership and index ---------------------------------------------------

    def _store_nodes(self) -> list[MemberInfo]:
        """The store nodes, refreshed every ``index_ttl_s``; while the conductor is away, the last list
        (UnavailableError if there was none)."""
        now = time.monotonic()
        if now - self._nodes_at > self.index_ttl_s:
            try:
                members = self.conductor.members()
            except _OUTAGE:
                if not self._nodes:
                    raise
                return self._nodes
            nodes = [m for m in members if m.kind is MemberKind.STORE]
            with self._lock:
                self._nodes, self._nodes_at = nodes, now
                live = {m.address for m in nodes} | {self.local}
                gone = [a for a in self._clients if a not in live and now - self._used[a] > self.prune_after_s]
                stale = [self._clients.pop(a) for a in gone]
                for a in gone:
                    del self._used[a]
            for c in stale:  # (a node that left: its channel, connections and shm mapping go)
                c.close()
        return self._nodes

    def _address(self, node_id: str) -> str | None:
        if node_id == _LOCAL:
            return self.local
        for m in self._store_nodes():
            if m.member_id == node_id:
                return m.address
        return None

    def _local_id(self) -> str | None:
        if self.local is None:
            return None
        for m in self._store_nodes():
            if m.address == self.local:
                return m.member_id
        return None

    def _client(self, address: str):
        from kvstore.client import StoreClient

        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = StoreClient(address, timeout_s=self.timeout_s, retry=self.retry,
                                                         data_channel=self._data_channel, **self._store_options)
            self._used[address] = time.monotonic()
            return c

    def locate(self, keys: Sequence[bytes], *, fresh: bool = False) -> list[dict[str, Tier]]:
        """Holders of each key (node id → tier), from the index cache or the conductor (while the
        conductor is away: the local node, if it holds the key)."""
        keys = [bytes(k) for k in keys]
        if self._without_conductor():
            return self._locate_locally(keys)
        try:
            return self._locate(keys, fresh)
        except _OUTAGE as exc:
            self._conductor_failed(exc)
            return self._locate_locally(keys)

    def _locate_locally(self, keys: list[bytes]) -> list[dict[str, Tier]]:
        self.num_conductor_fallbacks += 1
        try:
            held = self._client(self.local).exists(keys)
        except UnavailableError:
            return [{} for _ in keys]
        return [{_LOCAL: Tier.DRAM} if h else {} for h in held]

    def _locate(self, keys: list[bytes], fresh: bool) -> list[dict[str, Tier]]:
        now = time.monotonic()
        out: list[dict[str, Tier] | None] = [None] * len(keys)
        missing = []
        with self._lock:
            for i, k in enumerate(keys):
                hit = None if fresh else self._holders.get(k)
                if hit is not None and hit[0] > now:
                    out[i] = hit[1]
                else:
                    missing.append(i)
        if missing:
            loc = self.conductor.locate([keys[i] for i in missing])
            with self._lock:
                if len(self._holders) > _MAX_CACHED_KEYS:
                    self._holders.clear()
                for i, holders in zip(missing, loc.holders):
                    mine = self._holders.get(keys[i])
                    if mine is not None and mine[0] > now:  # our own recent writes may not be indexed yet
                        holders = {**mine[1], **holders}
                    if holders:
                        # NOTE: a miss is not cached: a reader waiting for a chunk another engine is still
                        # saving asks again, and must not wait out the TTL once it is indexed
                        self._holders[keys[i]] = (now + self.index_ttl_s, holders)
                    out[i] = holders
        return out  # type: ignore[return-value]

    def _remember(self, key: bytes, node_id: str, present: bool) -> None:
        with self._lock:
            _, holders = self._holders.get(key, (0.0, {}))
            holders = dict(holders)
            if present:
                holders[node_id] = Tier.DRAM
            else:
                holders.pop(node_id, None)
            self._holders[key] = (time.monotonic() + self.index_ttl_s, holders)

    def _read_order(self, holders: dict[str, Tier]) -> list[str]:
        if _LOCAL in holders:
            return [_LOCAL]
        local = self._local_id()
        return sorted(holders, key=lambda n: (n != local, holders[n], n))

    # ---- metadata ------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys held by some node (the cluster-wide hit prefix)."""
        return self.lookup_tiers(keys)[0]

    def lookup_tiers(self, keys: Sequence[bytes]) -> tuple[int, list[Tier]]:
        """The hit prefix's length and, per key of it, the tier it would be read from."""
        tiers = []
        for holders in self.locate(keys):
            if not holders:
                break
            tiers.append(holders[self._read_order(holders)[0]])
        return len(tiers), tiers

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(h) for h in self.locate(keys)]

    # ---- values ------------------------------------------------------------------------

    def put(self, key: bytes, value) -> None:
        """Stores one value on its target node(s); raises ResourceExhaustedError if none had room."""
        if not self.batch_put([(key, value)])[0]:
            raise ResourceExhaustedError(f"no node had room for key {bytes(key).hex()}")

    def batch_put(self, items: Sequence[tuple[bytes, object]]) -> list[bool]:
        """Stores values; per item, whether at least one copy was stored.

        Raises:
            InvalidArgumentError: a bad key or value size.
            UnavailableError: no live store node can be reached.
        """
        if self._without_conductor():
            return self._put_locally(items)
        try:
            nodes = [m for m in self._store_nodes() if m.state != "draining"]
        except _OUTAGE as exc:
            self._conductor_failed(exc)
            return self._put_locally(items)
        if not nodes:
            raise UnavailableError(f"the conductor at {self.conductor.address} knows no live store node")
        ids = [m.member_id for m in nodes]
        addr = {m.member_id: m.address for m in nodes}
        local = self._local_id()
        rankings = []
        for key, _ in items:
            rank = rendezvous_rank(bytes(key), [n for n in ids if n != local])
            rankings.append(([local] if local in addr else []) + rank)
        stored = [0] * len(items)
        cursor = [0] * len(items)
        down: set[str] = set()
        while True:
            groups: dict[str, list[int]] = {}
            for i, rank in enumerate(rankings):
                while stored[i] < self.replicas and cursor[i] < len(rank):
                    node = rank[cursor[i]]
                    cursor[i] += 1
                    if node not in down:
                        groups.setdefault(node, []).append(i)
                        break
            if not groups:
                break
            for node, idx in groups.items():
                try:
                    ok = self._client(addr[node]).batch_put([items[i] for i in idx])
                except UnavailableError:
                    down.add(node)
                    continue
                for i, good in zip(idx, ok):
                    if good:
                        stored[i] += 1
                        self._remember(bytes(items[i][0]), node, True)
            if all(s >= self.replicas or c >= len(r) for s, c, r in zip(stored, cursor, rankings)):
                break
        if down and not any(stored):
            raise UnavailableError(f"no store node could be reached (tried {', '.join(sorted(down))})")
        return [s > 0 for s in stored]

    def _put_locally(self, items: Sequence[tuple[bytes, object]]) -> list[bool]:
        self.num_conductor_fallbacks += 1
        return self._client(self.local).batch_put(items)

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None on a miss (``StoreClient.get`` of a node that holds it)."""
        return self.batch_get_bytes([key])[0]

    def batch_get(self, keys: Sequence[bytes], alloc=new_buffer) -> list:
        """Values (None for misses), one per key, each read from a node that holds it into
        ``alloc(index, size)`` (``StoreClient.batch_get``; ``index`` is the key's here)."""
        return self._read(keys, lambda client, ks, idx: client.batch_get(ks, lambda j, size: alloc(idx[j], size)))

    def batch_get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``batch_get`` as ``bytes``, one allocation per value (``StoreClient.batch_get_bytes``)."""
        return self._read(keys, lambda client, ks, idx: client.batch_get_bytes(ks))

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence) -> list[int | None]:
        """Reads values into caller-owned buffers; per key its size, or None on a miss."""
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._read(keys, lambda client, ks, idx: client.batch_get_into(ks, [buffers[i] for i in idx]))

    def batch_get_layered(self, keys: Sequence[bytes], head: int, layer: int, on_sizes, dest, arrived) -> bool:
        """``StoreClient.batch_get_layered`` from the node every key would be read from first;
        False (nothing called) when that is not one node, or it has no data channel."""
        keys = [bytes(k) for k in keys]
        firsts = {(self._read_order(h) or [None])[0] for h in self.locate(keys)}
        node = firsts.pop() if len(firsts) == 1 else None
        address = self._address(node) if node is not None else None
        if address is None:
            return False
        return self._client(address).batch_get_layered(keys, head, layer, on_sizes, dest, arrived)

    def _read(self, keys, fetch) -> list:
        keys = [bytes(k) for k in keys]
        out: list = [None] * len(keys)
        orders = [self._read_order(h) for h in self.locate(keys)]
        pos = [0] * len(keys)
        while True:
            groups: dict[str, list[int]] = {}
            for i, order in enumerate(orders):
                if out[i] is None and pos[i] < len(order):
                    groups.setdefault(order[pos[i]], []).append(i)
                    pos[i] += 1
            if not groups:
                return out
            for node, idx in groups.items():
                address = self._address(node)
                if address is None:
                    continue
                try:
                    vals = fetch(self._client(address), [keys[i] for i in idx], idx)
                except UnavailableError:
                    continue
                for i, v in zip(idx, vals):
                    out[i] = v
                    if v is None:
                        self._remember(keys[i], node, False)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Removes keys from every node that holds them; returns how many keys were held somewhere."""
        holders = self.locate(keys, fresh=True)
        by_node: dict[str, list[bytes]] = {}
        for k, h in zip(keys, holders):
            for node in h:
                by_node.setdefault(node, []).append(bytes(k))
        for node, ks in by_node.items():
            address = self._address(node)
            if address is not None:
                self._client(address).delete(ks)
            for k in ks:
                self._remember(k, node, False)
        return sum(1 for h in holders if h)

    def clear(self) -> int:
        """Removes every value from every live store node; returns how many they held."""
        n = 0
        for m in self._store_nodes():
            n += self._client(m.address).clear()
        with self._lock:
            self._holders.clear()
        return n

    def pin(self, keys: Sequence[bytes], ttl_s: float = 600.0) -> int:
        """Pins keys on every node that holds them; returns the (key, node) copies pinned."""
        return self.conductor.pin(keys, ttl_s)[0]

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self.pin(keys, 0.0)

    def stats(self) -> dict:
        """The conductor's cluster-wide stats (``ConductorClient.stats``)."""
        return self.conductor.stats()

    def health(self) -> dict:
        nodes = self._store_nodes()
        return {"serving": bool(nodes), "conductor": self.conductor.address,
                "num_store_nodes": len(nodes), "local_node": self._local_id()}

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        self.conductor.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
