"""Fixtures of the transport tests: store nodes that offer the one-sided movers."""

import pytest

from kvstore.transport.rdma import probe
from tests.helpers import store_nodes


@pytest.fixture
def make_node(tmp_path):
    """In-process nodes on 127.0.0.1:0 offering every mover (``--transport auto``); stopped after the test."""
    yield from store_nodes(tmp_path, with_disk=False, transport="auto")


@pytest.fixture(params=["shm", "rdma"])
def mover(request):
    """The one-sided mover under test; rdma is skipped, with the reason, where it cannot run."""
    if request.param == "rdma":
        reason = probe()
        if reason is not None:
            pytest.skip(f"rdma: {reason}")
    return request.param
