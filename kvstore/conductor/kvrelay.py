"""The whole cluster's KV events on one endpoint: ``crescent conductor --kv-events-endpoint``.

Store nodes started with ``--kv-events-endpoint`` publish their own chunks' events in vLLM's wire format
(kvstore/kvevents.py) and name that endpoint when they register. A conductor given an endpoint of its
own follows every such node (``EventFollower``: live batches, replay from the start and after gaps)
and republishes each batch unchanged on its PUB socket with its own sequence numbers, under the
node's member id as the topic, so one subscription sees the cluster and still knows which node holds
what (vLLM's own instances publish under their configured topic the same way). When a node dies,
leaves, re-registers (a restart) or its publisher restarts, the relay publishes ``AllBlocksCleared``
under its topic: what the node held before is not known any more. The replay socket serves the
relay's last batches, as a node's does.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.kvevents import EventFollower, EventPublisher

log = logging.getLogger(__name__)


def all_blocks_cleared() -> bytes:
    import msgpack

    return msgpack.packb([time.time(), [{"type": "AllBlocksCleared"}], 0], use_bin_type=True)


class _NodeFollower(EventFollower):
    def __init__(self, relay: ClusterKvEvents, node_id: str, endpoint: str, replay_endpoint: str | None) -> None:
        super().__init__(node_id, endpoint, replay_endpoint)
        self.relay = relay
        self.topic = node_id.encode()

    def on_batch(self, seq: int, payload: bytes) -> None:
        self.relay.publisher.submit(self.topic, payload)
        self.relay.num_relayed += 1

    def on_restart(self) -> None:
        self.relay.publisher.submit(self.topic, all_blocks_cleared())


class ClusterKvEvents:
    """Relays the KV events of every store node that publishes them (see the module docstring).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        self.publisher = EventPublisher(endpoint, replay_endpoint, name="cluster-kv-events")
        self._followers: dict[str, tuple[tuple, _NodeFollower]] = {}
        self._lock = threading.Lock()
        self.num_relayed = 0
        """Node batches republished so far."""

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def start(self) -> ClusterKvEvents:
        self.publisher.start()
        return self

    def stop(self) -> None:
        with self._lock:
            followers, self._followers = self._followers, {}
        for _, f in followers.values():
            f.stop()
        self.publisher.stop()

    def follow(self, nodes: dict[str, tuple]) -> None:
        """Follows exactly ``nodes``: member id → (incarnation, endpoint, replay endpoint) of each live
        store node that publishes. A node no longer listed, or listed with another incarnation or
        endpoint, is cleared under its topic (and followed again when listed)."""
        with self._lock:
            gone = [(n, f) for n, (ident, f) in self._followers.items() if nodes.get(n) != ident]
            for n, _ in gone:
                del self._followers[n]
            new = {n: ident for n, ident in nodes.items() if n not in self._followers}
            for n, ident in new.items():
                _, endpoint, replay = ident
                self._followers[n] = (ident, _NodeFollower(self, n, endpoint, replay or None))
            started = [self._followers[n][1] for n in new]
        for n, f in gone:
            f.stop()
            self.publisher.submit(f.topic, all_blocks_cleared())
            log.info("cluster KV events: %s left; its blocks cleared", n)
        for f in started:
            f.start()
            log.info("cluster KV events: relaying %s from %s", f.name, f.endpoint)

    def num_followed(self) -> int:
        with self._lock:
            return len(self._followers)
