"""The RDMA mover's queue discipline, against a simulated HCA.

No ibverbs device exists here (no RDMA NIC, no rdma_rxe module), so the verbs
themselves (``rdma._Device``: posting, polling, registering) cannot run. What
sits above them can: ``SendQueue`` (tickets, a send queue kept full, in-order
completions, a failure or a stall breaking the queue) and ``RdmaMover`` (memory
regions for one copy freed only after it, a broken queue pair destroyed before
its buffers are reused, the next copy reconnecting). ``SimulatedHca`` stands in
for the device with the behaviour RC verbs specify: a send queue of fixed
depth, completions in posting order, a failed request putting the queue pair in
the error state and flushing the rest, copies done (``memmove``) between real
buffers of this process at poll time, after checking the lkey's region is still
registered and covers the range. What stays unverified is the real device's
side: ``_Device``'s pyverbs calls (``tests/transport/test_units.py`` builds its
work requests with the real pyverbs where it is installed) and RoCE/IB timing.
"""

from __future__ import annotations

import ctypes
import random
import threading
from collections import deque

import pytest

from kvstore.errors import DataLossError
from kvstore.transport import rdma
from kvstore.transport.memcopy import buffer_address
from kvstore.transport.rdma import DEPTH, QpInfo, RdmaMover, SendQueue

SUCCESS, LOC_PROT_ERR, WR_FLUSH_ERR, REM_ACCESS_ERR = 0, 4, 5, 10  # ibv_wc_status


class _MR:
    def __init__(self, hca: SimulatedHca, addr: int, n: int) -> None:
        self.hca, self.addr, self.n = hca, addr, n
        self.lkey = next(hca.keys)
        self.closed = False
        hca.mrs[self.lkey] = self

    def close(self) -> None:
        self.closed = True
        self.hca.events.append(("dereg", self.lkey))


class _CQ:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _QP:
    def __init__(self, hca: SimulatedHca, cq: _CQ) -> None:
        self.cq, self.qp_num = cq, next(hca.keys)
        self.sq: deque = deque()
        self.error = False
        self.closed = False
        self.hca = hca

    def close(self) -> None:
        self.closed = True
        self.sq.clear()  # a destroyed queue pair moves nothing more
        self.hca.events.append(("destroy", self.qp_num))


class SimulatedHca:
    """``rdma._Device``'s interface over this process's memory: the node's arena is ``arena``."""

    def __init__(self, arena_bytes: int = 1 << 20, seed: int = 0) -> None:
        self.arena = bytearray(arena_bytes)
        self.raddr, self.rkey = buffer_address(self.arena), 0x5EED
        self.keys = iter(range(100, 1 << 30))
        self.mrs: dict[int, _MR] = {}
        self.qps: list[_QP] = []
        self.events: list[tuple] = []
        self.rng = random.Random(seed)
        self.fail_in = None  # the request that many executions from now fails (remote access error)
        self.stall = False  # polls find nothing
        self.max_outstanding = 0
        self.executed = 0
        self.closed = False

    def connect_fn(self):
        """The mover's ``connect``: the node's answer (its QP, arena address and rkey)."""
        self.connects = 0

        def connect(info: QpInfo):
            self.connects += 1
            return QpInfo(b"node", 1, 7, 1), self.raddr, self.rkey

        return connect

    # ---- the verbs RdmaMover calls ----------------------------------------------------------

    def new_cq(self, depth: int = DEPTH) -> _CQ:
        return _CQ()

    def create_qp(self, cq: _CQ) -> _QP:
        qp = _QP(self, cq)
        self.qps.append(qp)
        return qp

    def local_info(self, qp: _QP, psn: int) -> QpInfo:
        return QpInfo(b"client", 1, qp.qp_num, psn)

    def connect(self, qp: _QP, psn: int, remote: QpInfo) -> None:
        pass

    def register(self, addr: int, nbytes: int, remote: bool) -> _MR:
        return _MR(self, addr, nbytes)

    def post(self, qp: _QP, wr_id: int, request: tuple) -> None:
        assert not qp.closed, "posted on a destroyed queue pair"
        if len(qp.sq) >= DEPTH:
            raise OSError(12, "ibv_post_send: the send queue is full")  # what a real one answers
        qp.sq.append((wr_id, *request))
        self.max_outstanding = max(self.max_outstanding, len(qp.sq))

    def poll(self, cq: _CQ, n: int) -> list[tuple[int, int]]:
        assert not cq.closed, "polled a destroyed completion queue"
        qp = next(q for q in self.qps if q.cq is cq)
        if self.stall:
            return []
        out = []
        for _ in range(self.rng.randint(0, n)):  # a poll finds some of what is done, maybe none
            if not qp.sq:
                break
            wr_id, read, laddr, nbytes, lkey, raddr, rkey = qp.sq.popleft()
            out.append((wr_id, self._execute(qp, read, laddr, nbytes, lkey, raddr, rkey)))
        return out

    def close(self) -> None:
        self.closed = True

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
        if rkey != self.rkey or not (self.raddr <= raddr and raddr + nbytes <= self.raddr + len(self.arena)):
            qp.error = True
            return REM_ACCESS_ERR
        if read:
            ctypes.memmove(laddr, raddr, nbytes)
        else:
            ctypes.memmove(raddr, laddr, nbytes)
        self.executed += 1
        return SUCCESS

    @property
    def outstanding(self) -> int:
        return sum(len(q.sq) for q in self.qps if not q.closed)


@pytest.fixture
def hca():
    h = SimulatedHca()
    h.arena[:] = random.Random(1).randbytes(len(h.arena))
    return h


def _mover(hca: SimulatedHca) -> RdmaMover:
    return RdmaMover(hca.connect_fn(), arena_bytes=len(hca.arena), device=hca)


def _scattered_ops(buf: bytearray, pieces: int, size: int, seed: int = 2) -> list[tuple[int, int, int]]:
    """``pieces`` reads of ``size`` bytes from scattered arena offsets into consecutive ``buf`` bytes."""
    rng, base = random.Random(seed), buffer_address(buf)
    return [(base + i * size, rng.randrange(0, (1 << 20) - size), size) for i in range(pieces)]


def _expected(hca: SimulatedHca, ops, base: int) -> bytes:
    out = bytearray(sum(n for _, _, n in ops))
    for laddr, off, n in ops:
        out[laddr - base : laddr - base + n] = hca.arena[off : off + n]
    return bytes(out)


def _read_new(m: RdmaMover, hca: SimulatedHca, pieces: int, seed: int = 2) -> None:
    """Reads ``pieces`` scattered 64-byte extents into a new buffer and checks its bytes."""
    buf = bytearray(pieces * 64)
    ops = _scattered_ops(buf, pieces, 64, seed)
    m.read(ops, [(buffer_address(buf), len(buf))])
    assert bytes(buf) == _expected(hca, ops, buffer_address(buf))


def test_a_copy_longer_than_the_send_queue_streams_through_it_full(hca):
    """1,000 requests through a send queue of 256: never more in flight than it holds (the
    device would refuse), and it fills (no stop between windows); the bytes are the arena's."""
    m = _mover(hca)
    _read_new(m, hca, 1000)
    assert hca.max_outstanding == DEPTH and hca.outstanding == 0
    assert m.num_registrations == 1 and all(mr.closed for mr in hca.mrs.values())
    src = bytearray(random.Random(3).randbytes(300 * 128))
    wops = [(buffer_address(src) + i * 128, 3000 * i, 128) for i in range(300)]
    m.write(wops, [(buffer_address(src), len(src))])
    for i in range(300):
        assert hca.arena[3000 * i : 3000 * i + 128] == src[i * 128 : (i + 1) * 128]
    m.close()
    assert hca.closed


def test_copies_posted_back_to_back_overlap_and_each_waits_only_for_its_own(hca):
    """``post_read`` returns before its copy is done; a later copy is posted while it is in
    flight, and waiting for the first reaps no further than the first needs."""
    m = _mover(hca)
    small, big = bytearray(5 * 64), bytearray(500 * 64)
    m.register_buffer(buffer_address(small), len(small))
    m.register_buffer(buffer_address(big), len(big))
    a_ops, b_ops = _scattered_ops(small, 5, 64, seed=4), _scattered_ops(big, 500, 64, seed=5)
    a = m.post_read(a_ops, [(buffer_address(small), len(small))])
    b = m.post_read(b_ops, [(buffer_address(big), len(big))])
    assert hca.outstanding > 0  # both posted, neither waited for
    m.wait(a)
    assert bytes(small) == _expected(hca, a_ops, buffer_address(small))
    assert hca.outstanding > 0  # the second copy is still in flight
    m.wait(b)
    assert bytes(big) == _expected(hca, b_ops, buffer_address(big))
    assert m.num_registrations == 0  # both buffers registered for good
    m.close()


@pytest.mark.parametrize("fail_in", [0, 3, 400])
def test_a_failed_request_fails_its_copy_destroys_the_queue_pair_and_the_next_copy_reconnects(hca, fail_in):
    """A request failing on the device (the queue pair goes to the error state and flushes the
    rest) fails that copy with DataLossError (its keys read as misses); the queue pair is
    destroyed before the copy's one-off registrations are (no transfer can touch the buffer
    after the call returns), and the next copy connects a new queue pair and works."""
    m = _mover(hca)
    hca.fail_in = fail_in
    with pytest.raises(DataLossError, match="failed with status 10"):
        _read_new(m, hca, 600)
    first = hca.qps[0]
    assert first.closed and first.cq.closed
    destroyed = hca.events.index(("destroy", first.qp_num))
    assert [e for e in hca.events[:destroyed] if e[0] == "dereg"] == []  # deregistered only after
    assert all(mr.closed for mr in hca.mrs.values())
    _read_new(m, hca, 600)
    assert m.num_reconnects == 1 and hca.connects == 2 and not hca.qps[1].closed
    m.close()


def test_a_ticket_of_a_queue_pair_that_broke_fails_too(hca):
    """Two copies in flight, the first fails: waiting for either raises (the second's requests
    were flushed with the queue pair), and nothing of either lands afterwards."""
    m = _mover(hca)
    b1, b2 = bytearray(50 * 64), bytearray(50 * 64)
    t1 = m.post_read(_scattered_ops(b1, 50, 64), [(buffer_address(b1), len(b1))])
    t2 = m.post_read(_scattered_ops(b2, 50, 64, seed=9), [(buffer_address(b2), len(b2))])
    hca.fail_in = 1
    with pytest.raises(DataLossError):
        m.wait(t1)
    with pytest.raises(DataLossError, match="broke"):
        m.wait(t2)
    executed = hca.executed
    assert hca.outstanding == 0 and executed < 100
    m.close()


def test_a_stalled_queue_pair_fails_in_time_instead_of_hanging(hca, monkeypatch):
    """No completion for ``POLL_TIMEOUT_S`` (a peer that vanished without an error): the copy
    fails, the queue pair is destroyed, and the next copy works on a new one."""
    monkeypatch.setattr(rdma, "POLL_TIMEOUT_S", 0.2)
    m = _mover(hca)
    hca.stall = True
    with pytest.raises(DataLossError, match="did not complete in 0.2 s"):
        _read_new(m, hca, 10)
    assert hca.qps[0].closed
    hca.stall = False
    _read_new(m, hca, 10)
    assert m.num_reconnects == 1
    m.close()


def test_one_off_registrations_live_exactly_as_long_as_their_copy(hca):
    """A buffer nobody registered for good is registered for its copy and deregistered once
    the copy completed, not before (the device checks the region at every transfer)."""
    m = _mover(hca)
    buf = bytearray(300 * 64)
    ops = _scattered_ops(buf, 300, 64)
    t = m.post_read(ops, [(buffer_address(buf), len(buf))])
    (mr,) = hca.mrs.values()
    assert not mr.closed
    m.wait(t)
    assert mr.closed and m.num_registrations == 1
    assert bytes(buf) == _expected(hca, ops, buffer_address(buf))  # no transfer found it closed
    m.close()


def test_bad_descriptors_and_buffers_are_refused_before_anything_is_posted(hca):
    """A range outside the node's arena (a corrupt descriptor) is a DataLossError and a local
    range outside the copy's buffers a ValueError, both before any request: the queue pair
    stays as it was, nothing is left registered."""
    m = _mover(hca)
    buf = bytearray(64)
    with pytest.raises(DataLossError, match="outside the arena"):
        m.read([(buffer_address(buf), len(hca.arena) - 32, 64)], [(buffer_address(buf), 64)])
    with pytest.raises(ValueError, match="none of the copy's buffers"):
        m.read([(buffer_address(buf) + 32, 0, 64)], [(buffer_address(buf), 64)])
    assert hca.outstanding == 0 and all(mr.closed for mr in hca.mrs.values())
    m.read([(buffer_address(buf), 128, 64)], [(buffer_address(buf), 64)])
    assert bytes(buf) == bytes(hca.arena[128:192]) and m.num_reconnects == 0 and len(hca.qps) == 1
    m.close()


def test_threads_sharing_a_mover_each_get_their_own_bytes(hca):
    """Four threads post and wait on one queue pair at once (the step's loads, the saver):
    every copy gets exactly its bytes."""
    m = _mover(hca)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                _read_new(m, hca, 40, seed=t * 100 + i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads) and errors == []
    m.close()


def test_send_queue_tickets_complete_in_posting_order():
    """``SendQueue`` alone: tickets count requests; a completion reports everything before it
    done too (RC order); a refused post breaks the queue for good."""
    done: deque = deque()
    posted = []
    q = SendQueue(lambda wr_id, req: (posted.append(wr_id), done.append(wr_id)),
                  lambda n: [(done.popleft(), 0)] if done else [], depth=4, timeout_s=30)
    t1 = q.post([("r",)] * 3)
    t2 = q.post([("r",)] * 6)
    assert (t1, t2) == (3, 9) and posted == list(range(1, 10)) and q.outstanding <= 4
    q.wait(t2)
    assert q.completed == 9 and q.outstanding == 0

    def refuse(wr_id, req):
        raise OSError(12, "full")

    bad = SendQueue(refuse, lambda n: [], depth=4, timeout_s=30)
    with pytest.raises(DataLossError, match="posting work request 1 failed"):
        bad.post([("r",)])
    with pytest.raises(DataLossError):
        bad.wait(0 + 1)


def test_work_requests_are_built_with_the_real_pyverbs():
    """The one verbs object built without a device: a signaled READ or WRITE, one gather entry
    (what the simulated device receives as a tuple, the real one as this). Needs Debian's
    python3-pyverbs (``make rdma-setup``, part of ``make test``)."""
    pytest.importorskip("pyverbs.wr", reason="pyverbs is not installed (make rdma-setup)")
    import pyverbs.enums as e

    for read, opcode in ((True, e.IBV_WR_RDMA_READ), (False, e.IBV_WR_RDMA_WRITE)):
        wr = rdma.work_request(41, read, 0x10000, 4096, 7, 0x7F0000001000, 0x5EED)
        assert (wr.wr_id, wr.opcode, wr.num_sge, wr.send_flags) == (41, opcode, 1, e.IBV_SEND_SIGNALED)
