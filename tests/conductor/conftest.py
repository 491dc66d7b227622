"""Conductor tests: policies, index, replay, the gRPC service, ClusterClient, real processes."""

import pytest

from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.service import Conductor
from kvstore.config import StoreConfig
from kvstore.server import StoreNode

HEARTBEAT_S = 0.1
DEAD_S = 2.0


@pytest.fixture
def conductor():
    c = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=HEARTBEAT_S, dead_timeout=DEAD_S)).start()
    yield c
    c.stop(0)


@pytest.fixture
def make_node(conductor):
    """Starts in-process store nodes registered with the conductor; stops them after the test."""
    nodes = []

    def make(node_id: str, **kw) -> StoreNode:
        kw.setdefault("dram", "8MiB")
        kw.setdefault("slot_size", "4KiB")
        n = StoreNode(StoreConfig(listen="127.0.0.1:0", node_id=node_id, conductor=conductor.address, **kw)).start()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        if not n.stopping:
            n.stop(0)
