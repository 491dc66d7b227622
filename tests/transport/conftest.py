"""Fixtures of the transport tests: store nodes that offer the one-sided movers, and the
knobs that let a test decide when time passes (no race against a short TTL or a timer)."""

import math
import threading
import time

import pytest

from kvstore.transport import session as session_module
from kvstore.transport.rdma import probe
from tests.helpers import store_nodes
from tests.transport.simulated_hca import simulate_rdma


@pytest.fixture
def make_node(tmp_path):
    """In-process nodes on 127.0.0.1:0 offering every mover (``--transport auto``); stopped after the test."""
    yield from store_nodes(tmp_path, with_disk=False, transport="auto")


@pytest.fixture(params=["shm", "rdma"])
def mover(request, monkeypatch):
    """The one-sided mover under test. rdma runs on this host's ibverbs device where it has one,
    else on simulated HCAs (``simulate_rdma``: every verbs call simulated, everything above
    them real), so nodes must be started after this fixture (list it before them)."""
    if request.param == "rdma" and probe() is not None:
        simulate_rdma(monkeypatch)
    return request.param


class ManualClock:
    """A monotonic clock that moves only when ``advance`` is called.

    It starts at ``time.monotonic()``, so deadlines a lease table set before it was
    given this clock stay where they were. Install it as ``node.transport.leases.clock``:
    the node's grants then expire, and its quarantine ends, exactly when the test says.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = time.monotonic()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        with self._lock:
            self._now += seconds


@pytest.fixture
def node_clock():
    """``node_clock(node)`` gives the node's lease table a ManualClock and returns it."""

    def install(node) -> ManualClock:
        clock = ManualClock()
        node.transport.leases.clock = clock
        return clock

    return install


@pytest.fixture
def reports_only_at_close(monkeypatch):
    """Sessions tell the node of their local reads only when closed, never on the periodic
    timer (``REPORT_EVERY_S``), so a test can assert what the node has not been told yet."""
    monkeypatch.setattr(session_module, "REPORT_EVERY_S", math.inf)
