"""Fixtures of the transport tests: store nodes that offer the one-sided movers."""

import pytest

from kvstore.config import StoreConfig
from kvstore.server import StoreNode
from kvstore.transport.rdma import probe

MiB = 1 << 20


@pytest.fixture
def make_node(tmp_path):
    """In-process nodes on 127.0.0.1:0 offering every mover (``--transport auto``); stopped after the test."""
    nodes = []

    def make(**kw):
        kw.setdefault("dram", 16 * MiB)
        kw.setdefault("transport", "auto")
        if kw.pop("with_disk", False):
            kw.setdefault("disk", str(tmp_path / f"disk{len(nodes)}"))
            kw.setdefault("disk_size", 64 * MiB)
        node = StoreNode(StoreConfig(listen="127.0.0.1:0", **kw)).start()
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        n.stop(grace=0)


@pytest.fixture(params=["shm", "rdma"])
def mover(request):
    """The one-sided mover under test; rdma is skipped, with the reason, where it cannot run."""
    if request.param == "rdma":
        reason = probe()
        if reason is not None:
            pytest.skip(f"rdma: {reason}")
    return request.param
