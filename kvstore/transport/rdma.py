"""The ``rdma`` mover: one-sided RDMA READ/WRITE with pyverbs. Thin on purpose.

Only what is RDMA-specific lives here: opening a device, registering memory,
setting up RC queue pairs and posting/polling work requests. The protocol
(leases, descriptors, commit/release, expiry) is the shared code that the shm
tests exercise.

- Node: ``NodeEndpoint`` registers the whole DRAM arena as one memory region
  (remote read and write) and, per client, creates an RC queue pair connected
  to the client's (their addresses are exchanged by ``KVStore.ConnectRdma``).
- Client: ``RdmaMover`` owns one RC queue pair; for each copy it posts one work
  request per extent (READ for gets, WRITE for puts) against ``arena address +
  offset`` with the node's rkey, and polls the completion queue until every
  request has completed. Buffers their owner keeps alive (an engine's staging
  pool and stream ring) are registered once (``register_buffer``); any other
  buffer is registered for the one copy (``ibv_reg_mr`` pins and maps its pages
  each time: tens of microseconds per MiB, a cost of the order of the transfer).

pyverbs is optional (``pip install .[rdma]``; Debian/Ubuntu ship it as
``python3-pyverbs``) and imported lazily. Without it, or without an ibverbs
device, ``probe()`` says why in one line, ``NodeEndpoint``/``RdmaMover`` raise
``RdmaUnavailableError`` with that line, and clients fall back to another mover.
"""

from __future__ import annotations

import bisect
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import DataLossError, FailedPreconditionError
from kvstore.transport.descriptors import Mover
from kvstore.transport.memcopy import buffer_address

GID_INDEX = int(os.environ.get("CRESCENT_RDMA_GID_INDEX", "0"))
"""GID table index used on both ends (RoCE setups may need another; IB uses 0)."""
MAX_QPS = 256
"""Client queue pairs a node keeps; the least recently connected goes first."""
_WINDOW = 128  # work requests in flight per poll round
_POLL_TIMEOUT_S = 30.0


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


class _Device:
    """A device context, protection domain and completion queue on the first active port."""

    def __init__(self, cq_depth: int = 4 * _WINDOW) -> None:
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
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cq_depth, None, None, 0)

    def register(self, addr: int, nbytes: int, remote: bool):
        from pyverbs.mr import MR

        e = self.e
        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return MR(self.pd, max(1, nbytes), access, address=addr)

    def create_qp(self):
        """An RC queue pair in INIT, allowing remote read and write."""
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self.e
        cap = QPCap(max_send_wr=2 * _WINDOW, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return QP(self.pd, init, attr)

    def local_info(self, qp, psn: int) -> QpInfo:
        return QpInfo(self.gid.gid.encode(), self.port_attr.lid, qp.qp_num, psn)

    def connect(self, qp, local_psn: int, remote: QpInfo) -> None:
        """Moves ``qp`` to RTS, connected to ``remote``."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port)
        attr.path_mtu = self.port_attr.active_mtu
        dev = self.ctx.query_device()
        attr.max_dest_rd_atomic = max(1, min(16, dev.max_qp_rd_atom))  # READs we answer at once
        attr.max_rd_atomic = max(1, min(16, dev.max_qp_init_rd_atom))  # READs we issue at once
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

    def __init__(self, arena) -> None:
        self._dev = _Device()
        self.device, self.port = self._dev.name, self._dev.port
        self.addr = buffer_address(arena.buf)
        self.mr = self._dev.register(self.addr, arena.capacity_bytes, remote=True)
        self.rkey = self.mr.rkey
        self._qps: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()

    def connect(self, gid: bytes, lid: int, qp_num: int, psn: int) -> QpInfo:
        """A new queue pair connected to the client's; returns this end's address.

        Raises:
            FailedPreconditionError: the device refused (bad peer address, no resources).
        """
        with self._lock:
            try:
                qp = self._dev.create_qp()
                my_psn = random.getrandbits(24)
                self._dev.connect(qp, my_psn, QpInfo(gid, lid, qp_num, psn))
            except Exception as exc:  # noqa: BLE001 - pyverbs errors become one status
                raise FailedPreconditionError(f"RDMA connect failed: {exc}") from exc
            self._qps[qp.qp_num] = qp
            while len(self._qps) > MAX_QPS:
                _, old = self._qps.popitem(last=False)
                old.close()
            return self._dev.local_info(qp, my_psn)

    def close(self) -> None:
        with self._lock:
            self._qps.clear()
            self._dev.close()


class RdmaMover:
    """Client end: one RC queue pair to one node, posting READ/WRITE against its arena.

    Args:
        connect: sends this end's ``QpInfo`` to the node (``KVStore.ConnectRdma``)
            and returns the node's ``(QpInfo, arena address, rkey)``.
    """

    mover = Mover.RDMA

    def __init__(self, connect: Callable[[QpInfo], tuple[QpInfo, int, int]]) -> None:
        self._dev = _Device()
        self._qp = self._dev.create_qp()
        psn = random.getrandbits(24)
        remote, self.raddr, self.rkey = connect(self._dev.local_info(self._qp, psn))
        self._dev.connect(self._qp, psn, remote)
        self._lock = threading.Lock()  # one poster at a time on the queue pair
        self._regions = Regions()
        self.num_registrations = 0
        """Memory regions registered for a single copy (buffers not registered for good)."""

    def register_buffer(self, addr: int, nbytes: int) -> None:
        """Registers ``[addr, addr + nbytes)`` until ``unregister_buffer(addr)`` or ``close``:
        copies into or out of it then register nothing. The caller keeps the memory alive
        until then (a registration of freed and reused memory would move bytes to the wrong
        pages). Registering the same range again does nothing.

        Raises:
            ValueError: the range overlaps another registered one, or is empty.
        """
        with self._lock:
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
        self._post(ops, buffers, read=True)

    def write(self, ops: Sequence[tuple[int, int, int]], buffers: Sequence[tuple[int, int]]) -> None:
        """RDMA WRITEs: ``ops`` are ``(local addr, arena offset, length)``."""
        self._post(ops, buffers, read=False)

    def close(self) -> None:
        self._dev.close()

    def _post(self, ops, buffers, read: bool) -> None:
        from pyverbs.wr import SGE, SendWR

        if not ops:
            return
        e = self._dev.e
        opcode = e.IBV_WR_RDMA_READ if read else e.IBV_WR_RDMA_WRITE
        buffers = [(a, n) for a, n in buffers if n]  # nothing to register for empty values
        with self._lock:
            # NOTE: a buffer no one registered for good is registered per call, not cached:
            # a cached registration of freed and reused memory would move bytes to the wrong pages.
            mrs, once = [], []
            for a, n in buffers:
                mr = self._regions.covering(a, n)
                if mr is None:
                    mr = self._dev.register(a, n, remote=False)
                    once.append(mr)
                mrs.append((a, n, mr))
            self.num_registrations += len(once)
            try:
                for start in range(0, len(ops), _WINDOW):
                    window = ops[start : start + _WINDOW]
                    for i, (laddr, off, n) in enumerate(window):
                        lkey = next(mr.lkey for a, size, mr in mrs if a <= laddr and laddr + n <= a + size)
                        wr = SendWR(wr_id=start + i, opcode=opcode, num_sge=1, sg=[SGE(laddr, n, lkey)],
                                    send_flags=e.IBV_SEND_SIGNALED)
                        wr.set_wr_rdma(self.rkey, self.raddr + off)
                        self._qp.post_send(wr)
                    self._poll(len(window))
            finally:
                for mr in once:
                    mr.close()

    def _poll(self, num: int) -> None:
        e = self._dev.e
        deadline = time.monotonic() + _POLL_TIMEOUT_S
        while num:
            got, wcs = self._dev.cq.poll(num)
            for wc in wcs[:got]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise DataLossError(f"RDMA work request {wc.wr_id} failed with status {wc.status}")
            num -= got
            if num and time.monotonic() > deadline:
                raise DataLossError(f"RDMA: {num} work requests did not complete in {_POLL_TIMEOUT_S:.0f} s")
