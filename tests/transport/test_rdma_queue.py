"""The RDMA mover's queue discipline, against a simulated HCA.

No ibverbs device exists here (no RDMA NIC, no rdma_rxe module), so the verbs
themselves (``rdma._Device``: posting, polling, registering) cannot run. What
sits above them can: ``SendQueue`` (tickets, a send queue kept full, in-order
completions, a failure or a stall breaking the queue) and ``RdmaMover`` (memory
regions for one copy freed only after it, a broken queue pair destroyed before
its buffers are reused, the next copy reconnecting, threads waiting side by
side). ``SimulatedHca`` (simulated_hca.py) stands in for the device with the
behaviour RC verbs specify: a send queue of fixed depth, completions in posting
order, a failed request putting the queue pair in the error state and flushing
the rest, copies done (``memmove``) between real buffers of this process, at
poll time or on the device's own thread right after posting, after checking the
lkey's region is still registered and covers the range. What stays unverified
is the real device's side: ``_Device``'s pyverbs calls (the last test builds
its work requests with the real pyverbs) and RoCE/IB timing.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque

import grpc
import pytest

from kvstore.client import StoreClient
from kvstore.errors import DataLossError, FailedPreconditionError
from kvstore.transport import rdma
from kvstore.transport.descriptors import Mover
from kvstore.transport.memcopy import buffer_address
from kvstore.transport.rdma import DEPTH, RdmaMover, SendQueue
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.transport.simulated_hca import SimulatedHca, simulate_rdma

@pytest.fixture
def hca():
    h = SimulatedHca()
    h.arena[:] = random.Random(1).randbytes(len(h.arena))
    yield h
    h.shutdown()


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


@pytest.fixture
def live_hca():
    """A simulated HCA that moves bytes on its own thread, right after posting."""
    h = SimulatedHca(background=True)
    h.arena[:] = random.Random(1).randbytes(len(h.arena))
    yield h
    h.shutdown()


def test_a_copy_behind_a_failed_one_fails_and_one_before_it_does_not(live_hca):
    """Three copies in flight; a request of the second fails on the device. The first had
    completed: its wait returns (its bytes are in), before and after the queue pair broke. The
    second and third fail (the third's requests were flushed), and the queue pair is gone."""
    hca = live_hca
    m = _mover(hca)
    bufs = [bytearray(50 * 64) for _ in range(3)]
    ops = [_scattered_ops(b, 50, 64, seed=i) for i, b in enumerate(bufs)]
    hca.stall = True
    tickets = [m.post_read(o, [(buffer_address(b), len(b))]) for o, b in zip(ops, bufs)]
    hca.fail_in = 60  # the 11th request of the second copy
    hca.stall = False
    m.wait(tickets[0])
    assert bytes(bufs[0]) == _expected(hca, ops[0], buffer_address(bufs[0]))
    with pytest.raises(DataLossError, match="failed with status 10"):
        m.wait(tickets[1])
    with pytest.raises(DataLossError, match="destroyed before it completed"):
        m.wait(tickets[2])
    m.wait(tickets[0])  # still done
    assert hca.qps[0].closed and hca.connects == 1
    m.close()


def test_a_stalled_queue_pair_fails_in_time_and_nothing_of_it_lands_later(live_hca, monkeypatch):
    """No completion for ``POLL_TIMEOUT_S`` (a peer that vanished without an error): the copy
    fails and its queue pair is destroyed, so when the peer comes back nothing of that copy
    lands in the buffer (the caller reuses it); the next copy works on a new queue pair."""
    hca = live_hca
    monkeypatch.setattr(rdma, "POLL_TIMEOUT_S", 0.2)
    m = _mover(hca)
    buf = bytearray(10 * 64)
    hca.stall = True
    with pytest.raises(DataLossError, match="did not complete in 0.2 s"):
        m.read(_scattered_ops(buf, 10, 64), [(buffer_address(buf), len(buf))])
    assert hca.qps[0].closed
    hca.stall = False
    time.sleep(0.05)  # the device's thread runs: a queue pair left alive would land the reads now
    assert bytes(buf) == bytes(len(buf)) and hca.executed == 0
    _read_new(m, hca, 10)
    assert m.num_reconnects == 1
    m.close()


def test_a_queue_pair_the_device_will_not_destroy_is_stopped_before_its_buffers_are_reused(live_hca, monkeypatch,
                                                                                           caplog):
    """A destroy the device refuses leaves the queue pair executing: it is moved to the error
    state, so its reads flush instead of landing later in a buffer registered for good (which no
    deregistration fences); a device refusing that too is logged as the hazard it is."""
    hca = live_hca
    monkeypatch.setattr(rdma, "POLL_TIMEOUT_S", 0.2)
    m = _mover(hca)
    buf = bytearray(10 * 64)
    m.register_buffer(buffer_address(buf), len(buf))
    hca.stall, hca.close_raises = True, True
    with pytest.raises(DataLossError, match="did not complete"):
        m.read(_scattered_ops(buf, 10, 64), [(buffer_address(buf), len(buf))])
    assert not hca.qps[0].closed and ("stop", hca.qps[0].qp_num) in hca.events
    hca.stall = hca.close_raises = False
    time.sleep(0.05)  # the device's thread runs: a queue pair left executing would land the reads now
    assert bytes(buf) == bytes(len(buf)) and hca.executed == 0
    _read_new(m, hca, 10)  # on a new queue pair
    hca.stall = hca.close_raises = hca.stop_raises = True
    with pytest.raises(DataLossError, match="did not complete"):
        m.read(_scattered_ops(buf, 10, 64), [(buffer_address(buf), len(buf))])
    assert "may still land in registered buffers" in caplog.text
    hca.stall = hca.close_raises = hca.stop_raises = False
    m.close()


def test_a_done_copy_is_not_held_up_by_another_thread_posting_or_waiting(live_hca):
    """Threads share the mover's lock a batch at a time: a copy that completed returns while
    another thread waits on a copy the device is not moving, or posts more requests than the
    send queue holds (a big put), each of them polling or posting under the lock meanwhile."""
    hca = live_hca
    m = _mover(hca)
    for big_job in ("wait", "post"):
        small = bytearray(4 * 64)
        a = m.post_read(_scattered_ops(small, 4, 64), [(buffer_address(small), len(small))])
        while hca.outstanding:  # the small copy executed, not yet reaped
            time.sleep(0.001)
        hca.stall = True
        big = bytearray(1000 * 64)
        ops = _scattered_ops(big, 1000, 64, seed=3)
        if big_job == "wait":
            b = m.post_read(ops[:200], [(buffer_address(big), len(big))])
            other = threading.Thread(target=m.wait, args=(b,))
        else:
            other = threading.Thread(target=m.read, args=(ops, [(buffer_address(big), len(big))]))
        polls = hca.polls
        other.start()
        while hca.polls < polls + 3:  # the other thread is in its loop, polling under the lock
            time.sleep(0.001)
        m.wait(a)
        assert other.is_alive(), big_job  # still waiting for the device
        hca.stall = False
        other.join(timeout=60)
        assert not other.is_alive()
    m.close()


def test_a_small_copy_is_posted_between_the_batches_of_a_big_one(hca):
    """A copy of more requests than the send queue holds (a 64 MiB put is ~1,000) is posted a
    batch at a time, the lock let go in between: another thread's copy gets on the queue pair
    before the big one's last request, not after it."""
    m = _mover(hca)
    big = bytearray(1000 * 64)
    x = threading.Thread(target=m.read, args=(_scattered_ops(big, 1000, 64), [(buffer_address(big), len(big))]))
    x.start()
    while hca.posted < 300:  # the big copy is on its way
        time.sleep(0.001)
    small = bytearray(64)
    ops = _scattered_ops(small, 1, 64, seed=5)
    t = m.post_read(ops, [(buffer_address(small), len(small))])
    x.join(timeout=60)
    assert not x.is_alive() and t[1] < 1001  # not after the big copy's 1,000 requests
    m.wait(t)
    assert bytes(small) == _expected(hca, ops, buffer_address(small))
    m.close()


def test_a_copy_completed_before_another_thread_broke_the_queue_pair_stays_good(hca):
    """Thread A waits on a copy; under the lock meanwhile, another reaps A's completions and a
    failure after them, and destroys the queue pair: A's copy completed, so A returns."""
    m = _mover(hca)
    buf = bytearray(8 * 64)
    a = m.post_read(_scattered_ops(buf, 8, 64), [(buffer_address(buf), len(buf))])
    other = bytearray(8 * 64)
    m.post_read(_scattered_ops(other, 8, 64, seed=7), [(buffer_address(other), len(other))])
    hca.fail_in = 8  # the other copy's first request
    errors = []
    with m._lock:
        waiter = threading.Thread(target=lambda: _catch(errors, m.wait, a))
        waiter.start()
        queue = m._queue
        while queue.broken is None:
            queue.reap()
        assert queue.completed >= a[1]
        m._destroy()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and errors == []
    m.close()


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)
def test_a_device_that_fails_to_poll_or_close_leaves_a_working_mover(hca):
    """A poll the device refuses breaks the queue pair like a failed request (the copy fails,
    nothing of it lands later); a destroy it refuses is logged, not raised, and the mover
    connects a new queue pair for the next copy all the same."""
    m = _mover(hca)
    hca.poll_raises = True
    with pytest.raises(DataLossError, match="polling the completion queue failed"):
        _read_new(m, hca, 20)
    assert hca.qps[0].closed and all(mr.closed for mr in hca.mrs.values())
    hca.poll_raises = False
    _read_new(m, hca, 20)
    hca.fail_in, hca.close_raises = 0, True
    with pytest.raises(DataLossError, match="failed with status"):
        _read_new(m, hca, 20)
    hca.close_raises = False
    _read_new(m, hca, 20)
    assert m.num_reconnects == 2
    m.close()


def test_a_node_that_cannot_be_reconnected_is_not_asked_again_on_every_copy(hca, monkeypatch):
    """After a failed reconnect (even a slow one: the back-off counts from the failure), copies
    fail at once (misses) instead of each making a connect call, for ``RECONNECT_BACKOFF_S``,
    doubling while the failures go on; a connect that succeeds resets it."""
    monkeypatch.setattr(rdma, "RECONNECT_BACKOFF_S", 0.05)
    m = _mover(hca)
    m._backoff = rdma.RECONNECT_BACKOFF_S
    hca.fail_in = 0
    with pytest.raises(DataLossError):
        _read_new(m, hca, 5)
    good = hca.connect_fn()

    def slow_refusal(info, replaces):
        time.sleep(0.1)  # longer than the back-off
        raise OSError(111, "connection refused")

    m._connect = slow_refusal
    with pytest.raises(DataLossError, match="reconnecting the queue pair failed"):
        _read_new(m, hca, 5)
    with pytest.raises(DataLossError, match="moments ago"):
        _read_new(m, hca, 5)
    assert m._backoff == 0.1  # doubled
    m._connect = good
    while True:  # the back-off ends
        try:
            _read_new(m, hca, 5)
            break
        except DataLossError as exc:
            assert "moments ago" in str(exc)
            time.sleep(0.01)
    assert m.num_reconnects == 1 and m._backoff == 0.05
    m.close()
    with pytest.raises(FailedPreconditionError, match="closed"):
        _read_new(m, hca, 5)
    with pytest.raises(FailedPreconditionError, match="closed"):
        m.register_buffer(0x1000, 64)


def test_a_node_with_another_arena_retires_the_mover(hca):
    """A reconnect answered with another arena address (a new node process, whose slots the
    descriptors in hand do not describe) is refused, and so is every later copy, at once: the
    session re-maps through its grants, which name the new arena."""
    m = _mover(hca)
    hca.fail_in = 0
    with pytest.raises(DataLossError):
        _read_new(m, hca, 5)
    hca.raddr += 4096
    for _ in range(2):
        with pytest.raises(DataLossError, match="not the one this mover reads"):
            _read_new(m, hca, 5)
    assert hca.connects == 2
    m.close()
def test_unregistering_a_buffer_waits_for_the_copies_posted_through_it(hca):
    """A registration ended while a copy through it is in flight would fail that copy on the
    device and break the queue pair: ``unregister_buffer`` lets the posted copies finish first
    (the device moves nothing until polled here, so without the wait every request would fail)."""
    m = _mover(hca)
    buf = bytearray(200 * 64)
    m.register_buffer(buffer_address(buf), len(buf))
    ops = _scattered_ops(buf, 200, 64)
    t = m.post_read(ops, [(buffer_address(buf), len(buf))])
    m.unregister_buffer(buffer_address(buf))
    m.wait(t)
    assert bytes(buf) == _expected(hca, ops, buffer_address(buf)) and m.num_reconnects == 0
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


@pytest.mark.parametrize("node_depth", [4, 0])
def test_a_reconnect_names_the_broken_queue_pair_and_reads_no_deeper_than_the_node_answers(hca, node_depth):
    """The client issues no more READs at once than the node's end answers (more would fail the
    queue pair on the device; a node that does not say, 0, leaves the client's own limit), and a
    reconnect names both ends of the broken queue pair."""
    hca.node_rd_atomic = node_depth
    m = _mover(hca)
    want = node_depth or hca.rd_atomic_init
    assert m.rd_atomic == want and hca.qps[0].rd_atomic == want
    hca.fail_in = 0
    with pytest.raises(DataLossError):
        _read_new(m, hca, 5)
    _read_new(m, hca, 5)
    assert hca.replaced == [None, (1001, hca.qps[0].qp_num)]
    m.close()
class _Arena:
    def __init__(self, n: int) -> None:
        self.buf, self.capacity_bytes = bytearray(n), n


def test_the_node_closes_a_clients_broken_queue_pair_when_it_reconnects():
    """``NodeEndpoint``: one queue pair per connection, answering as many READs at once as its
    device does; a reconnect's ``replaces`` closes the client's old one, but only when both of
    its ends and the GID match (processes on one host share a GID: another one naming it
    closes nothing), and at most ``MAX_QPS`` are kept."""
    hca = SimulatedHca()
    node = rdma.NodeEndpoint(_Arena(1 << 16), device=hca)
    a = node.connect(b"host-1", 1, 11, 5, rd_atomic=16)
    assert a.rd_atomic == hca.rd_atomic_resp and hca.qps[-1].dest_rd_atomic == hca.rd_atomic_resp
    b = node.connect(b"host-1", 1, 12, 5, replaces=(a.qp_num, 12))  # same host, another process
    node.connect(b"host-2", 1, 11, 5, replaces=(a.qp_num, 11))  # another host, same client number
    assert node.num_qps == 3 and not hca.qps[0].closed
    node.connect(b"host-1", 1, 13, 5, replaces=(a.qp_num, 11))
    assert node.num_qps == 3 and hca.qps[0].closed and not hca.qps[1].closed
    for i in range(rdma.MAX_QPS):
        node.connect(b"host-3", 1, 100 + i, 5)
    assert node.num_qps == rdma.MAX_QPS and hca.qps[1].closed and b.qp_num == hca.qps[1].qp_num
    node.close()


def test_a_closed_mover_asks_the_node_to_close_its_end_once_and_a_refusal_does_not_fail_it(hca):
    """``close`` destroys this end, then names both ends of the last queue pair to the node
    (DisconnectRdma), once; a node that does not answer leaves the close done."""
    told = []
    m = RdmaMover(hca.connect_fn(), arena_bytes=len(hca.arena), device=hca,
                  disconnect=lambda gid, ends: told.append((gid, ends)))
    hca.fail_in = 0
    with pytest.raises(DataLossError):
        _read_new(m, hca, 5)
    _read_new(m, hca, 5)  # reconnected: the node's end of the broken one was named by ConnectRdma
    m.close()
    m.close()
    assert told == [(b"client", (1002, hca.qps[1].qp_num))] and hca.qps[1].closed

    def refuse(gid, ends):
        raise OSError("the node is gone")

    hca2 = SimulatedHca()
    m2 = RdmaMover(hca2.connect_fn(), arena_bytes=len(hca2.arena), device=hca2, disconnect=refuse)
    m2.close()
    assert hca2.qps[0].closed
    with pytest.raises(FailedPreconditionError):
        _read_new(m2, hca2, 1)


def test_a_mover_closed_while_it_reconnects_tells_the_node_of_the_new_end(hca):
    """The ConnectRdma of a reconnect runs outside the lock; a close meanwhile must not leave the
    queue pair the node just connected to this closed mover (it would stay until pushed out)."""
    told, entered, go = [], threading.Event(), threading.Event()
    connect = hca.connect_fn()

    def slow_connect(info, replaces):
        if replaces is not None:
            entered.set()
            go.wait(30)
        return connect(info, replaces)

    m = RdmaMover(slow_connect, arena_bytes=len(hca.arena), device=hca,
                  disconnect=lambda gid, ends: told.append(ends))
    hca.fail_in = 0
    with pytest.raises(DataLossError):
        _read_new(m, hca, 5)
    failed = []
    t = threading.Thread(target=lambda: failed.append(pytest.raises(Exception, _read_new, m, hca, 5)))
    t.start()
    assert entered.wait(30)
    m.close()  # the old ends were replaced by the dial in flight: nothing to tell yet, or the old ones
    go.set()
    t.join(30)
    assert failed and told[-1] == (1002, hca.qps[1].qp_num) and hca.qps[1].closed


def test_the_node_closes_the_queue_pair_a_client_names_when_it_closes():
    """``NodeEndpoint.disconnect``: both ends and the GID must match one connected queue pair."""
    hca = SimulatedHca()
    node = rdma.NodeEndpoint(_Arena(1 << 16), device=hca)
    a = node.connect(b"host-1", 1, 11, 5)
    b = node.connect(b"host-1", 1, 12, 5)
    assert not node.disconnect(b"host-2", a.qp_num, 11) and not node.disconnect(b"host-1", a.qp_num, 12)
    assert not node.disconnect(b"host-1", 0, 0) and node.num_qps == 2
    assert node.disconnect(b"host-1", a.qp_num, 11) and node.num_qps == 1 and hca.qps[0].closed
    assert not node.disconnect(b"host-1", a.qp_num, 11) and not hca.qps[1].closed
    node.close()
    assert not node.disconnect(b"host-1", b.qp_num, 12)


def test_a_client_reading_over_rdma_leaves_the_node_no_queue_pair_once_closed(make_node, monkeypatch):
    """A client of a real node over gRPC, reading over (simulated) RDMA: its values arrive; a copy
    on a queue pair that breaks is done over the stream instead (before, batch_get raised
    DataLossError), the next over a new queue pair, the broken one closed on the node when the
    client reconnects; the last one when the client closes (before DisconnectRdma, a closed
    client's stayed until 256 newer ones pushed it out)."""
    devices = simulate_rdma(monkeypatch)
    node = make_node()
    (node_hca,) = devices
    rng = random.Random(3)
    values = {f"k{i}".encode(): rng.randbytes(1000 + 97 * i) for i in range(24)}
    keys = list(values)
    with StoreClient(node.address, transport="rdma") as c:
        assert c.batch_put(list(values.items())) == [True] * len(keys)
        assert c.transport == "rdma" and c.batch_get(keys) == list(values.values())
        client_hca = devices[1]
        assert node.transport.rdma.num_qps == 1 and client_hca.executed > 0
        assert "crescent_store_rdma_queue_pairs 1.0" in _metrics(node)
        with grpc.insecure_channel(node.address) as ch:
            r = pb_grpc.KVStoreStub(ch).Transports(pb.TransportsRequest(), timeout=30)
        assert r.rdma.available and r.rdma.num_queue_pairs == 1 and pb.MOVER_RDMA in r.offered
        client_hca.fail_in = 3  # the queue pair breaks mid-read: the values come over the stream
        assert c.batch_get(keys) == list(values.values()) and client_hca.qps[0].closed
        executed = client_hca.executed
        assert c.batch_get(keys) == list(values.values()) and client_hca.executed > executed  # rdma again
        assert node.transport.rdma.num_qps == 1 and node_hca.qps[0].closed  # the broken one named
        client_hca.fail_in = 2  # a put whose writes fail is stored another way
        assert c.batch_put([(k, v[::-1]) for k, v in values.items()]) == [True] * len(keys)
        assert c.batch_get(keys) == [v[::-1] for v in values.values()]
    assert node.transport.rdma.num_qps == 0 and all(q.closed for q in node_hca.qps)
    assert all(q.closed for q in client_hca.qps) and "crescent_store_rdma_queue_pairs 0.0" in _metrics(node)


def _metrics(node) -> str:
    from prometheus_client import generate_latest

    return generate_latest(node.metrics.registry).decode()


def test_an_rdma_client_follows_its_node_through_a_restart(make_node, monkeypatch):
    """The node stops (its queue pairs and arena registration end with its device) and a new one
    starts at the same address: the client's reads fail over to the stream or fail cleanly
    while it is down, then it reads and writes the new node over RDMA again (a new queue
    pair, to the new arena), and its old mover's end is gone from both."""
    from kvstore.client import Retry
    from kvstore.errors import UnavailableError

    devices = simulate_rdma(monkeypatch)
    node = make_node()
    values = {f"k{i}".encode(): bytes([i]) * (70_000 + i) for i in range(4)}
    keys = list(values)
    c = StoreClient(node.address, transport="rdma", retry=Retry(attempts=3, backoff_s=0.02, max_backoff_s=0.1),
                    timeout_s=30)
    try:
        c.batch_put(list(values.items()))
        assert c.transport == "rdma" and c.batch_get(keys) == list(values.values())
        old_mover = c.descriptor_session()._handle.mover
        port = node.address.rpartition(":")[2]
        node.stop(0)
        assert all(q.closed for q in devices[0].qps)  # the node's ends went with it
        with pytest.raises(UnavailableError):
            c.batch_get(keys)
        node = make_node(listen=f"127.0.0.1:{port}")
        got = None
        for _ in range(50):  # the client's next calls find the new node
            try:
                got = c.batch_get(keys)
                break
            except UnavailableError:
                time.sleep(0.1)
        assert got == [None] * len(keys)  # DRAM is volatile: the new node is empty, and says so
        c.batch_put(list(values.items()))
        assert c.batch_get(keys) == list(values.values()) and c.transport == "rdma"
        mover = c.descriptor_session()._handle.mover
        assert mover is not old_mover and mover.raddr == node.transport.rdma.addr
        assert node.transport.rdma.num_qps == 1
    finally:
        c.close()
    assert node.transport.rdma.num_qps == 0
