"""A simulated HCA: ``rdma._Device``'s interface over this process's memory, for the tests of
what sits above the verbs (no ibverbs device exists here; see test_rdma_queue.py)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import random
import threading
import time
from collections import deque

from kvstore.transport.memcopy import buffer_address
from kvstore.transport import rdma
from kvstore.transport.rdma import DEPTH, QpInfo, RdmaMover

SUCCESS, LOC_PROT_ERR, WR_FLUSH_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR = 0, 4, 5, 10, 12  # ibv_wc_status

_NUMBERS = itertools.count(1 << 20)
"""Keys and queue pair numbers of every simulated device: unique in the process, as on a fabric."""
_REMOTE: dict[int, _MR] = {}
"""rkey → a region some simulated device registered for remote access: what another device's
READ or WRITE naming that rkey reaches (a node's arena, registered by its ``NodeEndpoint``)."""
_LIVE: dict[int, _QP] = {}
"""Queue pairs not destroyed, by number: a request to a region of another device needs the
queue pair it is connected to alive and connected back (else the retries run out)."""


class _MR:
    def __init__(self, hca: SimulatedHca, addr: int, n: int) -> None:
        self.hca, self.addr, self.n = hca, addr, n
        self.lkey = self.rkey = next(_NUMBERS)
        self.closed = False
        hca.mrs[self.lkey] = self

    def close(self) -> None:
        with self.hca.lock:  # not while the device moves bytes through it
            self.closed = True
            _REMOTE.pop(self.rkey, None)
            self.hca.events.append(("dereg", self.lkey))


class _CQ:
    def __init__(self, hca: SimulatedHca) -> None:
        self.hca = hca
        self.done: deque = deque()  # completions not polled yet
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _QP:
    def __init__(self, hca: SimulatedHca, cq: _CQ) -> None:
        self.cq, self.qp_num = cq, next(_NUMBERS)
        self.remote = None
        self.sq: deque = deque()  # posted, not executed yet
        self.error = False
        self.closed = False
        self.hca = hca

    def close(self) -> None:
        with self.hca.lock:
            if self.hca.close_raises:
                raise OSError(5, "ibv_destroy_qp: input/output error")
            self.closed = True
            _LIVE.pop(self.qp_num, None)
            self.sq.clear()  # a destroyed queue pair moves nothing more
            self.hca.events.append(("destroy", self.qp_num))


class SimulatedHca:
    """``rdma._Device``'s interface over this process's memory: the node's arena is ``arena``
    (or ``remote``: an address and size, e.g. a store node's mapped arena).

    Posted requests execute in order per queue pair: at poll time (the default: deterministic,
    a poll finds a random number of them done), or with ``background`` on a thread of their own
    right after posting, as a real HCA moves bytes while the host does other things. A request
    occupies its send queue until its completion is polled. ``fail_in``: the request that many
    executions from now fails (remote access error; the queue pair goes to the error state and
    flushes the rest); ``stall``: nothing executes; ``poll_raises`` / ``close_raises`` /
    ``stop_raises``: the device refuses those calls (a queue pair it would not destroy keeps
    executing).
    """

    def __init__(self, arena_bytes: int = 1 << 20, seed: int = 0, remote: tuple[int, int] | None = None,
                 background: bool = False) -> None:
        if remote is None:
            self.arena = bytearray(arena_bytes)
            self.raddr, self.size = buffer_address(self.arena), arena_bytes
        else:
            self.arena = None
            self.raddr, self.size = remote
        self.rkey = 0x5EED
        self.name, self.port = "sim0", 1
        self.rd_atomic_init = self.rd_atomic_resp = 16
        self.node_rd_atomic = 16  # what the node's end answers at once (connect_fn's reply)
        self.lock = threading.Lock()
        self.mrs: dict[int, _MR] = {}
        self.qps: list[_QP] = []
        self.events: list[tuple] = []
        self.rng = random.Random(seed)
        self.fail_in = None
        self.stall = False
        self.poll_raises = False
        self.close_raises = False
        self.stop_raises = False
        self.max_outstanding = 0
        self.executed = 0
        self.polls = 0
        self.posted = 0
        self.connects = 0
        self.closed = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def connect_fn(self):
        """The mover's ``connect``: the node's answer (its QP, arena address and rkey)."""

        self.replaced: list = []

        def connect(info: QpInfo, replaces):
            self.connects += 1
            self.replaced.append(replaces)
            return QpInfo(b"node", 1, 1000 + self.connects, 1, self.node_rd_atomic), self.raddr, self.rkey

        return connect

    def shutdown(self) -> None:
        self.closed = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the verbs RdmaMover calls ----------------------------------------------------------

    def new_cq(self, depth: int = DEPTH) -> _CQ:
        return _CQ(self)

    def create_qp(self, cq: _CQ | None = None) -> _QP:
        """``cq`` None: the device's shared one (the node's queue pairs, which post nothing)."""
        qp = _QP(self, cq if cq is not None else _CQ(self))
        with self.lock:
            self.qps.append(qp)
            _LIVE[qp.qp_num] = qp
        return qp

    def local_info(self, qp: _QP, psn: int, rd_atomic: int) -> QpInfo:
        return QpInfo(b"client", 1, qp.qp_num, psn, rd_atomic)

    def connect(self, qp: _QP, psn: int, remote: QpInfo, max_rd_atomic: int, max_dest_rd_atomic: int) -> None:
        qp.remote, qp.rd_atomic, qp.dest_rd_atomic = remote, max_rd_atomic, max_dest_rd_atomic

    def register(self, addr: int, nbytes: int, remote: bool) -> _MR:
        with self.lock:
            mr = _MR(self, addr, nbytes)
            if remote:
                _REMOTE[mr.rkey] = mr
            return mr

    def post(self, qp: _QP, wr_id: int, request: tuple) -> None:
        with self.lock:
            assert not qp.closed, "posted on a destroyed queue pair"
            if len(qp.sq) + len(qp.cq.done) >= DEPTH:
                raise OSError(12, "ibv_post_send: the send queue is full")  # what a real one answers
            qp.sq.append((wr_id, *request))
            self.posted += 1
            self.max_outstanding = max(self.max_outstanding, len(qp.sq) + len(qp.cq.done))

    def stop(self, qp: _QP) -> None:
        with self.lock:
            if self.stop_raises:
                raise OSError(5, "ibv_modify_qp: input/output error")
            qp.error = True  # the rest flush: nothing more moves
            self.events.append(("stop", qp.qp_num))

    def poll(self, cq: _CQ, n: int) -> list[tuple[int, int]]:
        self.polls += 1
        with self.lock:
            assert not cq.closed, "polled a destroyed completion queue"
            if self.poll_raises:
                raise OSError(5, "ibv_poll_cq: input/output error")
            if self._thread is None:
                qp = next(q for q in self.qps if q.cq is cq)
                for _ in range(self.rng.randint(0, n)):  # a poll finds some of what is done, maybe none
                    if not self._execute_one(qp):
                        break
            return [cq.done.popleft() for _ in range(min(n, len(cq.done)))]

    def close(self) -> None:
        """Closes the device context: with it every region and queue pair made from it."""
        self.shutdown()
        with self.lock:
            for mr in self.mrs.values():
                mr.closed = True
                _REMOTE.pop(mr.rkey, None)
            for qp in self.qps:
                qp.closed = True
                _LIVE.pop(qp.qp_num, None)
                qp.sq.clear()

    # ---- the device -------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Requests posted on live queue pairs and not executed yet."""
        with self.lock:
            return sum(len(q.sq) for q in self.qps if not q.closed)

    def _run(self) -> None:
        while not self.closed:
            with self.lock:
                moved = sum(self._execute_one(qp) for qp in self.qps if not qp.closed)
            time.sleep(0 if moved else 0.0005)

    def _execute_one(self, qp: _QP) -> bool:
        if self.stall or not qp.sq:
            return False
        wr_id, read, laddr, nbytes, lkey, raddr, rkey = qp.sq.popleft()
        qp.cq.done.append((wr_id, self._execute(qp, read, laddr, nbytes, lkey, raddr, rkey)))
        return True

    def _execute(self, qp: _QP, read, laddr, nbytes, lkey, raddr, rkey) -> int:
        if qp.error:
            return WR_FLUSH_ERR
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in < 0:
                self.fail_in = None
                qp.error = True
                return REM_ACCESS_ERR
        mr = self.mrs.get(lkey)
        if mr is None or mr.closed or not (mr.addr <= laddr and laddr + nbytes <= mr.addr + mr.n):
            qp.error = True
            return LOC_PROT_ERR
        region = None
        if rkey == self.rkey:  # this device's ``arena`` / ``remote``
            base, size = self.raddr, self.size
        else:  # a region another device registered (e.g. a node's arena); a closed one is gone
            region = _REMOTE.get(rkey)
            base, size = (region.addr, region.n) if region is not None else (0, -1)
            peer = _LIVE.get(qp.remote.qp_num)
            if peer is None or peer.remote is None or peer.remote.qp_num != qp.qp_num:
                qp.error = True  # the node's end is gone (closed, or the node stopped)
                return RETRY_EXC_ERR
        # a deregistration (or the context's close) waits for this access, as a device's does
        owner = region.hca.lock if region is not None and region.hca is not self else contextlib.nullcontext()
        with owner:
            if (region is not None and region.closed) or not (base <= raddr and raddr + nbytes <= base + size):
                qp.error = True
                return REM_ACCESS_ERR
            if read:
                ctypes.memmove(laddr, raddr, nbytes)
            else:
                ctypes.memmove(raddr, laddr, nbytes)
        self.executed += 1
        return SUCCESS


class _ReadsOverRdma:
    """A shm session's mover with its reads (and registrations) sent to ``RdmaMover`` instead."""

    def __init__(self, shm, rdma: RdmaMover) -> None:
        self._shm, self.rdma = shm, rdma

    def __getattr__(self, name):
        return getattr(self._shm, name)

    def post_read(self, ops, buffers):
        return self.rdma.post_read(ops, buffers)

    def wait(self, ticket) -> None:
        self.rdma.wait(ticket)

    def read(self, ops, buffers=()) -> None:
        self.rdma.read(ops, buffers)

    def register_buffer(self, addr: int, nbytes: int) -> None:
        self.rdma.register_buffer(addr, nbytes)

    def unregister_buffer(self, addr: int) -> None:
        self.rdma.unregister_buffer(addr)


def simulate_rdma(monkeypatch) -> list[SimulatedHca]:
    """From here on, every ``rdma._Device`` this process makes is a ``SimulatedHca`` (bytes
    moved at poll time): nodes started in-process register their arena on one (``NodeEndpoint``)
    and offer RDMA, clients choose it (``probe`` says yes) and read and write the arena through
    the rkey the node gave. Everything of the RDMA path runs (gRPC, grants, leases, the mover,
    the session) but the verbs. Returns the devices made, in order."""
    made: list[SimulatedHca] = []

    def device():
        made.append(SimulatedHca(remote=(0, 0)))
        return made[-1]

    monkeypatch.setattr(rdma, "_Device", device)
    monkeypatch.setattr(rdma, "probe", lambda: None)
    return made


@contextlib.contextmanager
def reads_over_simulated_rdma(session):
    """Within: ``session`` (a shm descriptor session) reads the node's arena through an RDMA mover
    on a ``SimulatedHca`` (background: bytes land on its own thread) whose remote memory is the
    arena this host maps. Grants, leases and writes stay the session's. Yields the HCA."""
    h = session._handle
    shm = h.mover
    hca = SimulatedHca(remote=(shm.base, shm.arena.size), background=True)
    h.mover = _ReadsOverRdma(shm, RdmaMover(hca.connect_fn(), arena_bytes=shm.arena.size, device=hca))
    try:
        yield hca
    finally:
        h.mover.rdma.close()
        h.mover = shm
