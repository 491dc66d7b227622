"""The ``rdma`` mover: one-sided RDMA READ/WRITE with pyverbs. Thin on purpose.

Only what is RDMA-specific lives here: opening a device, registering memory,
setting up RC queue pairs and posting/polling work requests. The protocol
(leases, descriptors, commit/release, expiry) is the shared code that the shm
tests exercise.

- Node: ``NodeEndpoint`` registers the whole DRAM arena as one memory region
  (remote read and write) and, per client, creates an RC queue pair connected
  to the client's (their addresses are exchanged by ``KVStore.ConnectRdma``).
- Client: ``RdmaMover`` owns one RC queue pair and its completion queue; for each
  copy it posts one work request per extent (READ for gets, WRITE for puts)
  against ``arena address + offset`` with the node's rkey. ``post_read`` returns
  a ticket at once and ``wait(ticket)`` reaps completions until that copy is in
  (``SendQueue``: up to ``DEPTH`` requests in flight, so several copies overlap);
  ``read``/``write`` do both. Buffers their owner keeps alive (an engine's staging
  pool and stream ring) are registered once (``register_buffer``); any other
  buffer is registered for its one copy (``ibv_reg_mr`` pins and maps its pages
  each time: tens of microseconds per MiB, a cost of the order of the transfer)
  and deregistered once that copy completed.
- A failed completion (the queue pair is then in the error state and flushes
  the rest) or ``POLL_TIMEOUT_S`` without progress fails the copies in flight
  with ``DataLossError`` (their keys read as misses) and destroys the queue pair,
  which ends any transfer still under way before the buffers are used again; the
  next copy connects a new one (``num_reconnects``).

The verbs themselves (``_Device``: device, PD, CQs, QPs, MRs, posting and
polling) are the only part that needs a device; the rest is tested here against
a simulated HCA (tests/transport/test_rdma_queue.py).

pyverbs is optional (``pip install .[rdma]``; Debian/Ubuntu ship it as
``python3-pyverbs``) and imported lazily. Without it, or without an ibverbs
device, ``probe()`` says why in one line, ``NodeEndpoint``/``RdmaMover`` raise
``RdmaUnavailableError`` with that line, and clients fall back to another mover.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import CrescentError, DataLossError, FailedPreconditionError
from kvstore.transport.descriptors import Mover
from kvstore.transport.memcopy import buffer_address

log = logging.getLogger(__name__)

GID_INDEX = int(os.environ.get("CRESCENT_RDMA_GID_INDEX", "0"))
"""GID table index used on both ends (RoCE setups may need another; IB uses 0)."""
MAX_QPS = 256
"""Client queue pairs a node keeps; the least recently connected goes first."""
DEPTH = 256
"""Work requests in flight on a client queue pair (its send queue's size)."""
POLL_TIMEOUT_S = 30.0
"""A queue pair with requests outstanding and no completion for this long is broken."""
RECONNECT_BACKOFF_S = 1.0
"""After a failed reconnect, copies fail at once (misses) this long before the next try; the
wait doubles with every failure in a row, up to ``RECONNECT_BACKOFF_MAX_S``."""
RECONNECT_BACKOFF_MAX_S = 30.0
_POLL_BATCH = 32


class RdmaUnavailableError(FailedPreconditionError):
    """pyverbs or an ibverbs device is missing (the message says which)."""


class Regions:
    """Memory regions registered for good, by address: buffers whose owner keeps them alive
    (and tells when they go), so that a copy into or out of them registers nothing.

    Regions do not overlap; ``covering`` finds the one that holds a whole range in O(log n).
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[int, int, object]] = []  # (addr, nbytes, mr), by addr

    def __len__(self) -> int:
        return len(self._regions)

    def has(self, addr: int, nbytes: int) -> bool:
        """Whether exactly this range is registered."""
        i = bisect.bisect_left(self._starts, addr)
        return i < len(self._starts) and self._regions[i][:2] == (addr, nbytes)

    def add(self, addr: int, nbytes: int, mr) -> None:
        """Raises ValueError when the range is empty or overlaps a registered one."""
        if nbytes <= 0:
            raise ValueError(f"an empty buffer at {addr:#x} cannot be registered")
        i = bisect.bisect_left(self._starts, addr)
        prev_end = self._regions[i - 1][0] + self._regions[i - 1][1] if i else addr
        if prev_end > addr or (i < len(self._starts) and self._starts[i] < addr + nbytes):
            raise ValueError(f"buffer {addr:#x}+{nbytes} overlaps one already registered")
        self._starts.insert(i, addr)
        self._regions.insert(i, (addr, nbytes, mr))

    def pop(self, addr: int):
        """The region that starts at ``addr``, removed (its MR is the caller's to close), or None."""
        i = bisect.bisect_left(self._starts, addr)
        if i == len(self._starts) or self._starts[i] != addr:
            return None
        del self._starts[i]
        return self._regions.pop(i)[2]

    def covering(self, addr: int, nbytes: int):
        """The MR of the region that holds all of ``[addr, addr + nbytes)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        a, n, mr = self._regions[i]
        return mr if addr + nbytes <= a + n else None


def probe() -> str | None:
    """None when pyverbs and at least one ibverbs device are present here, else why not."""
    try:
        import pyverbs.device as d
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        return ("pyverbs is not installed (`pip install .[rdma]`, or Debian's python3-pyverbs "
                "made visible to this environment; see docs/api.md)")
    try:
        devices = d.get_device_list()
    except PyverbsError as exc:
        return f"no ibverbs device ({exc})"
    if not devices:
        return "no ibverbs device"
    return None


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What one end of an RC connection tells the other."""

    gid: bytes
    lid: int
    qp_num: int
    psn: int
    rd_atomic: int = 0
    """RDMA READs this end's device has in flight at once on a queue pair: as initiator (the
    client's) or as responder (the node's); 0: unknown."""


class SendQueue:
    """The send queue of one RC queue pair, by sequence number: ``post`` a copy's work requests
    and get its ticket (the number of its last request); reap completions until ``completed``
    reaches it.

    Every request is signaled, and an RC queue pair completes its send queue in posting order,
    so the completions counted so far tell which tickets are done. At most ``depth`` requests
    are outstanding (posting more reaps completions first): the queue stays full while a long
    copy streams, and copies posted back to back overlap.

    A failed completion breaks the queue (``broken`` says why; the requests before it did
    complete), and so do a post the device refuses, a poll that fails, and ``timeout_s`` of
    polling with requests outstanding and none completing: those raise DataLossError. The
    owner must then destroy the queue pair (ending every transfer still in flight) before the
    buffers of the copies not completed are used again. Not thread-safe (``RdmaMover`` locks).

    Args:
        post_one: ``post_one(wr_id, request)`` posts one work request.
        poll: ``poll(n)`` returns up to ``n`` completions, ``(wr_id, status)``, 0 meaning success.
    """

    def __init__(self, post_one: Callable[[int, tuple], None], poll: Callable[[int], list[tuple[int, int]]],
                 depth: int = DEPTH, timeout_s: float = POLL_TIMEOUT_S) -> None:
        self._post_one, self._poll = post_one, poll
        self.depth, self.timeout_s = depth, timeout_s
        self.posted = 0
        self.completed = 0
        self.broken: str | None = None
        """Why the queue broke, or None."""
        self._stalled_since: float | None = None

    @property
    def outstanding(self) -> int:
        return self.posted - self.completed

    def post(self, requests: Sequence[tuple]) -> int:
        """Posts ``requests`` in order, reaping for room; returns the ticket of the last."""
        i = 0
        while i < len(requests):
            i = self.post_some(requests, i)
            if i < len(requests):
                self.wait(self.posted + 1 - self.depth)  # room for one more
        return self.posted

    def post_some(self, requests: Sequence[tuple], start: int = 0) -> int:
        """Posts ``requests[start:]`` in order while the send queue has room; returns the index of
        the first not posted."""
        self._check()
        i = start
        while i < len(requests) and self.posted - self.completed < self.depth:
            try:
                self._post_one(self.posted + 1, requests[i])
            except Exception as exc:  # noqa: BLE001 - a full queue, a QP in the error state
                self._break(f"posting work request {self.posted + 1} failed: {exc}")
            self.posted += 1
            i += 1
        return i

    def wait(self, ticket: int) -> None:
        """Reaps until every request up to ``ticket`` completed; DataLossError if one of them
        will not."""
        empty = 0
        while self.completed < ticket:
            self._check()
            if self.reap():
                empty = 0
            else:
                empty += 1
                pause(empty)

    def reap(self) -> bool:
        """Polls once; True when requests completed (the queue may have broken after them)."""
        if self.broken is not None or self.posted == self.completed:
            return False
        try:
            done = self._poll(min(self.posted - self.completed, _POLL_BATCH))
        except Exception as exc:  # noqa: BLE001 - the completions it took are lost: nothing is certain
            self._break(f"polling the completion queue failed: {exc}")
        for wr_id, status in done:
            if status != 0:  # the rest are flushed: the queue pair is in the error state
                self.broken = f"RDMA work request {wr_id} failed with status {status}"
                break
            self.completed = max(self.completed, wr_id)  # in order: everything before it is done too
        if done:
            self._stalled_since = None
            return True
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        elif now - self._stalled_since > self.timeout_s:
            self._break(f"RDMA: {self.posted - self.completed} work requests did not complete in {self.timeout_s:g} s")
        return False

    def _check(self) -> None:
        if self.broken is not None:
            raise DataLossError(self.broken)

    def _break(self, why: str) -> None:
        self.broken = why
        raise DataLossError(why)


def pause(empty_polls: int) -> None:
    """Between empty polls: give the GIL to the other Python threads (the step), and after a
    thousand, the core too (a long transfer, a stalled peer)."""
    time.sleep(0 if empty_polls < 1000 else 50e-6)


def work_request(wr_id: int, read: bool, laddr: int, n: int, lkey: int, raddr: int, rkey: int):
    """One signaled RDMA READ (remote → local) or WRITE (local → remote) of ``n`` bytes (pyverbs)."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ if read else e.IBV_WR_RDMA_WRITE, num_sge=1,
                sg=[SGE(laddr, n, lkey)], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    return wr


class _Device:
    """A device context and protection domain on the first active port, with a completion queue
    for the node's queue pairs (which post nothing) and the verbs the movers use."""

    def __init__(self, cq_depth: int = 2 * DEPTH) -> None:
        reason = probe()
        if reason is not None:
            raise RdmaUnavailableError(reason)
        import pyverbs.device as d
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.pd import PD

        self.e = e
        dev = d.get_device_list()[0]
        self.name = dev.name.decode()
        self.ctx = d.Context(name=self.name)
        self.port = 0
        for port in range(1, self.ctx.query_device().phys_port_cnt + 1):
            if self.ctx.query_port(port).state == e.IBV_PORT_ACTIVE:
                self.port = port
                break
        if not self.port:
            self.ctx.close()
            raise RdmaUnavailableError(f"ibverbs device {self.name} has no active port")
        self.port_attr = self.ctx.query_port(self.port)
        self.gid = self.ctx.query_gid(self.port, GID_INDEX)
        dev = self.ctx.query_device()
        self.rd_atomic_init = max(1, min(16, dev.max_qp_init_rd_atom))
        """RDMA READs a queue pair here may issue at once."""
        self.rd_atomic_resp = max(1, min(16, dev.max_qp_rd_atom))
        """RDMA READs a queue pair here may answer at once."""
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cq_depth, None, None, 0)

    def register(self, addr: int, nbytes: int, remote: bool):
        from pyverbs.mr import MR

        e = self.e
        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return MR(self.pd, max(1, nbytes), access, address=addr)

    def new_cq(self, depth: int = DEPTH):
        from pyverbs.cq import CQ

        return CQ(self.ctx, depth, None, None, 0)

    def create_qp(self, cq=None):
        """An RC queue pair in INIT, allowing remote read and write, completing into ``cq``
        (the device's shared one by default)."""
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self.e
        cq = cq or self.cq
        cap = QPCap(max_send_wr=DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return QP(self.pd, init, attr)

    def post(self, qp, wr_id: int, request: tuple) -> None:
        """Posts ``work_request(wr_id, *request)`` on ``qp``."""
        qp.post_send(work_request(wr_id, *request))

    def stop(self, qp) -> None:
        """Moves ``qp`` to the error state: the device flushes its requests, moving nothing more."""
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = self.e.IBV_QPS_ERR
        qp.modify(attr, self.e.IBV_QP_STATE)

    def poll(self, cq, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` completions of ``cq``: ``(wr_id, status)``, status 0 (IBV_WC_SUCCESS) if it worked."""
        got, wcs = cq.poll(n)
        return [(wc.wr_id, wc.status) for wc in wcs[:got]]

    def local_info(self, qp, psn: int, rd_atomic: int) -> QpInfo:
        return QpInfo(self.gid.gid.encode(), self.port_attr.lid, qp.qp_num, psn, rd_atomic)

    def connect(self, qp, local_psn: int, remote: QpInfo, max_rd_atomic: int, max_dest_rd_atomic: int) -> None:
        """Moves ``qp`` to RTS, connected to ``remote``, issuing up to ``max_rd_atomic`` READs at
        once and answering up to ``max_dest_rd_atomic``."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port)
        attr.path_mtu = self.port_attr.active_mtu
        attr.max_dest_rd_atomic = max_dest_rd_atomic
        attr.max_rd_atomic = max_rd_atomic
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(remote.gid.decode()), sgid_index=GID_INDEX)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=remote.lid)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = local_psn
        qp.to_rts(attr)

    def close(self) -> None:
        self.ctx.close()  # closes the PD, CQ, MRs and QPs made from it


class NodeEndpoint:
    """The node's arena as a memory region, and one RC queue pair per connected client."""

    def __init__(self, arena, device=None) -> None:
        self._dev = device if device is not None else _Device()
        self.device, self.port = self._dev.name, self._dev.port
        self.addr = buffer_address(arena.buf)
        self.mr = self._dev.register(self.addr, arena.capacity_bytes, remote=True)
        self.rkey = self.mr.rkey
        self._qps: OrderedDict[int, tuple[object, bytes, int]] = OrderedDict()
        """This end's queue pair number → (queue pair, the client's GID and queue pair number), oldest first."""
        self._lock = threading.Lock()

    def connect(self, gid: bytes, lid: int, qp_num: int, psn: int, rd_atomic: int = 0,
                replaces: tuple[int, int] = (0, 0)) -> QpInfo:
        """A new queue pair connected to the client's; returns this end's address, with the READs
        it answers at once (the client issues no more: more would fail the queue pair).

        ``replaces``: the two ends (this one's number, the client's) of the client's previous
        queue pair, which broke: closed now rather than when 256 newer ones push it out. Only a
        queue pair connected to that client end at that GID is (processes on one host share the
        GID, and a device reuses numbers).

        Raises:
            FailedPreconditionError: the device refused (bad peer address, no resources).
        """
        with self._lock:
            self._release(gid, *replaces)
            try:
                qp = self._dev.create_qp()
                my_psn = random.getrandbits(24)
                resp = self._dev.rd_atomic_resp
                self._dev.connect(qp, my_psn, QpInfo(gid, lid, qp_num, psn, rd_atomic), max_rd_atomic=1,
                                  max_dest_rd_atomic=resp)
            except Exception as exc:  # noqa: BLE001 - pyverbs errors become one status
                raise FailedPreconditionError(f"RDMA connect failed: {exc}") from exc
            self._qps[qp.qp_num] = (qp, gid, qp_num)
            while len(self._qps) > MAX_QPS:
                _, (gone, _, _) = self._qps.popitem(last=False)
                _close_quietly(gone)
            return self._dev.local_info(qp, my_psn, resp)

    def disconnect(self, gid: bytes, qp_num: int, client_qp_num: int) -> bool:
        """Closes the queue pair a client closed (this end's number, the client's, its GID):
        whether one matched. Only both ends and the GID together name it, as for ``replaces``."""
        with self._lock:
            return self._release(gid, qp_num, client_qp_num)

    def _release(self, gid: bytes, mine: int, theirs: int) -> bool:
        old = self._qps.get(mine) if mine else None
        if old is None or old[1:] != (gid, theirs):
            return False
        del self._qps[mine]
        _close_quietly(old[0])
        return True

    @property
    def num_qps(self) -> int:
        return len(self._qps)

    def close(self) -> None:
        with self._lock:
            self._qps.clear()
            self._dev.close()


class RdmaMover:
    """Client end: one RC queue pair to one node, posting READ/WRITE against its arena.

    Thread-safe: threads post and wait side by side, each holding the mover's lock for one
    batch of posts or one poll at a time (the send queue completes in order whatever thread
    posted, and each waiter returns once the completions counted reach its ticket).

    Args:
        connect: ``connect(info, replaces)`` sends this end's ``QpInfo`` to the node
            (``KVStore.ConnectRdma``) and returns the node's ``(QpInfo, arena address,
            rkey)``; called again for a new queue pair after one broke, with the broken
            one's two ends (``replaces``: ``(node's qp_num, ours)``; None the first time).
        arena_bytes: the arena's size: a descriptor outside it is refused before
            anything is posted (DataLossError), as the shm mover does.
        device: the verbs (``_Device``, closed with the mover); made here by default.
        disconnect: ``disconnect(gid, ends)`` asks the node to close its end of the last
            queue pair (``KVStore.DisconnectRdma``) once ``close`` destroyed this one; best
            effort (a node that does not answer keeps it until newer ones push it out).
    """

    mover = Mover.RDMA

    def __init__(self, connect: Callable[[QpInfo, tuple[int, int] | None], tuple[QpInfo, int, int]],
                 arena_bytes: int | None = None, device=None,
                 disconnect: Callable[[bytes, tuple[int, int]], None] | None = None) -> None:
        self._dev = device if device is not None else _Device()
        self._connect = connect
        self._disconnect = disconnect
        self.arena_bytes = arena_bytes
        self._lock = threading.Lock()  # held for one batch of posts, one poll, or a state change
        self._regions = Regions()
        self._once: deque[list] = deque()
        """[ticket, MRs] registered for one copy on the current queue pair, deregistered once the
        ticket completed (None while the copy is still being posted) or the queue pair is destroyed."""
        self.num_registrations = 0
        """Memory regions registered for a single copy (buffers not registered for good)."""
        self.num_reconnects = 0
        """Queue pairs connected after one broke."""
        self._qp = self._cq = self._queue = None
        self._ends: tuple[int, int] | None = None  # (node's qp_num, ours) of the last queue pair connected
        self._gid = b""  # this end's GID, as the node knows it
        self.rd_atomic = 0
        """RDMA READs in flight at once on the queue pair: the fewer of what the two ends can."""
        self.raddr = self.rkey = None
        self._closed = False
        self._stale: str | None = None  # the node's arena moved: this mover is done
        self._connecting = False
        self._retry_at = 0.0
        self._backoff = RECONNECT_BACKOFF_S
        try:
            self._install(*self._dial())
        except BaseException:
            self._dev.close()
            self._say_closed(self._ends)  # the node connected its end before ours failed
            raise

    def _dial(self):
        """A new queue pair connected to the node (a ConnectRdma call; not under the lock)."""
        cq = self._dev.new_cq(DEPTH)  # room for every completion of a full send queue (DEPTH)
        qp = None
        try:
            qp = self._dev.create_qp(cq)
            psn = random.getrandbits(24)
            mine = self._dev.rd_atomic_init
            info = self._dev.local_info(qp, psn, mine)
            remote, raddr, rkey = self._connect(info, self._ends)
            with self._lock:  # the node has this end now: named by the next reconnect, or by close
                self._gid, self._ends = info.gid, (remote.qp_num, qp.qp_num)
            # NOTE: more READs in flight than the node's end answers at once fail the queue pair.
            rd_atomic = min(mine, remote.rd_atomic) if remote.rd_atomic else mine
            self._dev.connect(qp, psn, remote, max_rd_atomic=rd_atomic, max_dest_rd_atomic=1)
        except BaseException:
            _close_quietly(qp, cq)
            raise
        return qp, cq, raddr, rkey, rd_atomic

    def _install(self, qp, cq, raddr: int, rkey: int, rd_atomic: int) -> None:
        """Makes a dialled queue pair the current one (under the lock, or before any thread)."""
        if self.raddr is not None and (raddr, rkey) != (self.raddr, self.rkey):
            # NOTE: the node registers its arena once: another address is another node process,
            # whose slots the descriptors in hand do not describe. The session re-maps (a grant
            # names the new arena); this mover serves no more copies.
            _close_quietly(qp, cq)
            self._stale = "RDMA: the node's arena is not the one this mover reads (restarted?)"
            raise DataLossError(self._stale)
        self._qp, self._cq, self.raddr, self.rkey, self.rd_atomic = qp, cq, raddr, rkey, rd_atomic
        self._queue = SendQueue(lambda wr_id, req: self._dev.post(qp, wr_id, req), lambda n: self._dev.poll(cq, n),
                                DEPTH, POLL_TIMEOUT_S)

    def register_buffer(self, addr: int, nbytes: int) -> None:
        """Registers ``[addr, addr + nbytes)`` until ``unregister_buffer(addr)`` or ``close``:
        copies into or out of it then register nothing. The caller keeps the memory alive
        until then (a registration of freed and reused memory would move bytes to the wrong
        pages). Registering the same range again does nothing.

        Raises:
            ValueError: the range overlaps another registered one, or is empty.
        """
        with self._lock:
            self._check_open()
            if self._regions.has(addr, nbytes):
                return
            mr = self._dev.register(addr, nbytes, remote=False) if nbytes > 0 else None
            try:
                self._regions.add(addr, nbytes, mr)
            except ValueError:
                if mr is not None:
                    mr.close()
                raise

    def unregister_buffer(self, addr: int) -> None:
        """Ends ``register_buffer(addr)``, once the copies posted before have completed (a
        transfer through a deregistered region would fail and break the queue pair)."""
        with self._lock:
            self._check_open()
            queue = self._queue
            last = queue.posted if queue is not None else 0
        if last:
            try:
                self.wait((queue, last))
            except DataLossError:  # their waiters learn of it; the queue pair is gone
                pass
        with self._lock:
            mr = self._regions.pop(addr)
        if mr is not None:
            mr.close()

    @property
    def registered_buffers(self) -> int:
        return len(self._regions)

    def read(self, ops: Sequence[tuple[int, int, int]], buffers: Sequence[tuple[int, int]]) -> None:
        """RDMA READs: ``ops`` are ``(local addr, arena offset, length)``; ``buffers``
        the ``(addr, nbytes)`` of the local memory they land in (registered for this call
        unless ``register_buffer`` covers them)."""
        self.wait(self.post(ops, buffers, read=True))

    def write(self, ops: Sequence[tuple[int, int, int]], buffers: Sequence[tuple[int, int]]) -> None:
        """RDMA WRITEs: ``ops`` are ``(local addr, arena offset, length)``."""
        self.wait(self.post(ops, buffers, read=False))

    def post_read(self, ops: Sequence[tuple[int, int, int]], buffers: Sequence[tuple[int, int]]):
        """Posts ``read``'s work requests and returns once they are all posted: ``wait`` on the
        ticket before using the buffers (later copies may be posted meanwhile: they overlap)."""
        return self.post(ops, buffers, read=True)

    def post(self, ops, buffers, read: bool):
        """Posts one copy (a batch at a time: the send queue holds ``DEPTH``); returns its ticket.

        Raises:
            DataLossError: a descriptor outside the arena (nothing posted), a queue pair that
                broke while posting (destroyed: nothing of the copy lands later), or none now
                (reconnecting, or failed to moments ago).
            ValueError: a local range outside ``buffers`` (nothing posted).
        """
        if not ops:
            return None
        if self.arena_bytes is not None:
            for _, off, n in ops:
                if off < 0 or n < 0 or off + n > self.arena_bytes:
                    raise DataLossError(f"descriptor outside the arena: offset {off} + {n} > {self.arena_bytes}")
        buffers = [(a, n) for a, n in buffers if n]  # nothing to register for empty values
        queue = self._current_queue()
        with self._lock:
            if queue is not self._queue:
                raise DataLossError("RDMA: the queue pair broke before this copy was posted")
            self._release_once(queue)
            # NOTE: a buffer no one registered for good is registered per copy, not cached:
            # a cached registration of freed and reused memory would move bytes to the wrong pages.
            once: list = []
            try:
                reqs = self._requests(ops, buffers, read, once)
            except BaseException:
                _close_quietly(*once)
                raise
            entry = [None, once]
            self._once.append(entry)  # from here _destroy frees them (after ending the transfers)
            self.num_registrations += len(once)
        i, empty = 0, 0
        while True:
            with self._lock:
                if queue is not self._queue:
                    raise DataLossError(f"RDMA: the queue pair broke while this copy was posted: {queue.broken}")
                try:
                    i = queue.post_some(reqs, i)
                    if i == len(reqs):
                        entry[0] = queue.posted
                        return queue, queue.posted
                    progressed = queue.reap()  # room for the rest
                except BaseException:
                    self._destroy()  # some of it may be in flight: end it before the buffers go
                    raise
                if queue.broken is not None:
                    self._destroy()
                    raise DataLossError(queue.broken)
            empty = 0 if progressed else empty + 1
            pause(empty)

    def wait(self, ticket) -> None:
        """Returns once the copy of ``ticket`` (from ``post``) completed.

        Raises:
            DataLossError: it failed, or its queue pair broke before it completed (the queue
                pair is then destroyed: nothing of it lands after this returns).
        """
        if ticket is None:
            return
        queue, seq = ticket
        empty = 0
        while seq > queue.completed:
            if not self._lock.acquire(timeout=0.001):  # another thread posts or polls: it may reap ours
                continue
            try:
                if seq <= queue.completed:
                    break
                if queue is not self._queue:
                    raise DataLossError(f"RDMA: the queue pair of this copy was destroyed before it completed "
                                        f"({queue.broken or 'closed'})")
                try:
                    progressed = queue.reap()
                except DataLossError:
                    self._destroy()
                    raise
                if queue.broken is not None:  # a later request failed; those before it did complete
                    self._destroy()
                    if seq > queue.completed:
                        raise DataLossError(queue.broken)
                self._release_once(queue)
            finally:
                self._lock.release()
            empty = 0 if progressed else empty + 1
            pause(empty)

    def close(self) -> None:
        """Destroys the queue pair and the registrations, then asks the node to close its end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ends, self._ends = self._ends, None
            self._destroy()
            self._dev.close()  # closes the PD and the MRs made from it
        self._say_closed(ends)

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError("the RDMA mover is closed")

    def _current_queue(self) -> SendQueue:
        """The queue pair's send queue, connecting a new queue pair first if the last broke: the
        ConnectRdma call runs outside the lock, and other copies fail at once meanwhile."""
        with self._lock:
            self._check_open()
            if self._stale is not None:
                raise DataLossError(self._stale)
            if self._queue is not None:
                return self._queue
            if self._connecting:
                raise DataLossError("RDMA: the queue pair broke and is being reconnected")
            if time.monotonic() < self._retry_at:
                raise DataLossError("RDMA: the queue pair broke and reconnecting failed moments ago")
            self._connecting = True
        try:
            dialled = self._dial()
        except Exception as exc:
            with self._lock:
                self._connecting = False
                self._retry_at = time.monotonic() + self._backoff  # from the failure: a slow one counts
                self._backoff = min(2 * self._backoff, RECONNECT_BACKOFF_MAX_S)
            self._disconnect_if_closed()
            if isinstance(exc, CrescentError):
                raise
            raise DataLossError(f"RDMA: reconnecting the queue pair failed: {exc}") from exc
        with self._lock:
            self._connecting = False
            if self._closed:
                _close_quietly(*dialled[:2])
            else:
                self._install(*dialled)
                self._backoff = RECONNECT_BACKOFF_S
                self.num_reconnects += 1
                return self._queue
        self._disconnect_if_closed()  # closed while connecting: the node's new end too
        self._check_open()

    def _disconnect_if_closed(self) -> None:
        with self._lock:
            ends = self._ends if self._closed else None
            if ends is not None:
                self._ends = None
        self._say_closed(ends)

    def _say_closed(self, ends: tuple[int, int] | None) -> None:
        """Asks the node to close its end of ``ends`` (not under the lock)."""
        if ends is None or self._disconnect is None:
            return
        try:
            self._disconnect(self._gid, ends)
        except Exception as exc:  # noqa: BLE001 - the node's LRU closes it in the end
            log.info("RDMA: the node did not close its end of queue pair %d: %s", ends[1], exc)

    def _requests(self, ops, buffers, read: bool, once: list) -> list[tuple]:
        """The work requests of a copy, registering the buffers no region covers into ``once``."""
        spans = []
        for a, n in buffers:
            mr = self._regions.covering(a, n)
            if mr is None:
                mr = self._dev.register(a, n, remote=False)
                once.append(mr)
            spans.append((a, a + n, mr.lkey))
        spans.sort()
        starts = [a for a, _, _ in spans]
        reqs = []
        for laddr, off, n in ops:
            i = bisect.bisect_right(starts, laddr) - 1
            if i < 0 or laddr + n > spans[i][1]:
                raise ValueError(f"local range {laddr:#x}+{n} lies in none of the copy's buffers")
            reqs.append((read, laddr, n, spans[i][2], self.raddr + off, self.rkey))
        return reqs

    def _release_once(self, queue: SendQueue) -> None:
        while self._once and self._once[0][0] is not None and self._once[0][0] <= queue.completed:
            _close_quietly(*self._once.popleft()[1])

    def _destroy(self) -> None:
        """Destroys the queue pair (ending every transfer in flight), then frees the copies'
        one-off registrations; the next post connects a new one. Never raises: a device that
        refuses (removed, reset) leaves the objects to the context's close."""
        qp, cq, once = self._qp, self._cq, self._once
        self._qp = self._cq = self._queue = None
        self._once = deque()
        if qp is not None:
            try:
                qp.close()
            except Exception as exc:  # noqa: BLE001
                # NOTE: a queue pair still alive could land its READs in buffers the callers
                # reuse; in the error state it flushes them instead. (Deregistering the one-off
                # regions below fences their buffers whatever the device did.)
                log.warning("RDMA: destroying the queue pair failed (%s): moving it to the error state", exc)
                try:
                    self._dev.stop(qp)
                except Exception as exc2:  # noqa: BLE001
                    log.error("RDMA: the device refused to stop queue pair %d as well (%s): reads posted "
                              "on it may still land in registered buffers", qp.qp_num, exc2)
        _close_quietly(cq)
        for _, mrs in once:
            _close_quietly(*mrs)


def _close_quietly(*objs) -> None:
    """Closes verbs objects in order, logging (not raising) a refusal: cleanup must finish."""
    for obj in objs:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("RDMA: closing %s failed: %s", type(obj).__name__, exc)
