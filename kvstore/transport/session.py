"""Client side of the descriptor protocol: choose a mover for a node, get and put through it.

``select`` asks the node (``Transports``) what it offers and picks: shm on the
same host, rdma when both ends have a device, else none (the client then uses
its streamed path, the TCP data channel or gRPC). ``DescriptorSession`` runs
the protocol: ask for a grant, move the bytes with the mover, release or
commit.

Read guarantee (see kvstore/transport/leases.py for the node's half): a key
is reported as a hit only when the node confirmed the release of its lease,
which proves the slots held the value, whole, while they were copied. A lease
that expired first makes every key of that batch a miss, and the bytes left
in those buffers are unspecified.

Write safety: a client copies into reserved slots only before its deadline
(``expires_in_s`` counted from when it sent the request, so earlier than the
node's), checked before each piece of a large batch; the node keeps an expired
reservation's slots out of use for one more TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.errors import CrescentError, FailedPreconditionError, InvalidArgumentError, UnavailableError
from kvstore.transport.descriptors import ArenaRef, Grant, Mover, SlotDescriptor, ops_for, value_extents
from kvstore.transport.gpu import CudaStaging, is_cuda
from kvstore.transport.identity import HostIdentity, host_identity, one_sided_candidates
from kvstore.transport.memcopy import local_buffer, plan, slice_extents
from proto.crescent.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

WRITE_PIECE_BYTES = 64 << 20
"""A put batch is copied in pieces of this size, with a deadline check before each."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The one-sided session for a node, or None and why none."""

    session: DescriptorSession | None
    notes: str = ""


def select(stub, call: Callable, timeout_s: float, requested: str) -> Selection:
    """Picks the best one-sided mover the node and this process can both use.

    Args:
        stub: the node's ``KVStoreStub``.
        call: runs a stub call, mapping gRPC errors to CrescentError (with retries).
        timeout_s: deadline of each call.
        requested: ``auto``, ``shm``, ``rdma``, ``tcp`` or ``grpc``.
    """
    if requested in ("tcp", "grpc"):
        one_sided_candidates(requested, set(), False, None, None)  # validates the name
        return Selection(None, f"{requested} requested")
    try:
        r = call(lambda: stub.Transports(pb.TransportsRequest(), timeout=timeout_s))
    except CrescentError as exc:
        return Selection(None, f"the node does not serve descriptors ({exc})")
    offered = set()
    for m in r.offered:
        try:
            offered.add(Mover.from_pb(m))
        except ValueError:
            pass  # a newer node's mover
    same = host_identity().same_host(HostIdentity(r.host.hostname, r.host.boot_id))
    node_rdma = None if r.rdma.available else (r.rdma.reason or "unavailable")
    local_rdma = None
    if requested in ("auto", "rdma") and Mover.RDMA in offered and node_rdma is None:
        from kvstore.transport.rdma import probe

        local_rdma = probe()
    choice = one_sided_candidates(requested, offered, same, local_rdma, node_rdma)
    notes = list(choice.notes)
    arena = ArenaRef.from_pb(r.arena)
    for mover in choice.candidates:
        try:
            m = _open_mover(mover, arena, stub, call, timeout_s)
        except (CrescentError, OSError) as exc:
            notes.append(f"{mover.value}: {exc}")
            continue
        return Selection(DescriptorSession(stub, call, timeout_s, m, arena, requested), "; ".join(notes))
    return Selection(None, "; ".join(notes))


def _open_mover(mover: Mover, arena: ArenaRef, stub, call, timeout_s: float):
    if mover is Mover.SHM:
        from kvstore.transport.shm import ShmMover

        return ShmMover(arena)
    from kvstore.transport.rdma import QpInfo, RdmaMover, RdmaUnavailableError

    def connect(info: QpInfo):
        r = call(lambda: stub.ConnectRdma(pb.RdmaConnectRequest(gid=info.gid, lid=info.lid, qp_num=info.qp_num,
                                                               psn=info.psn), timeout=timeout_s))
        return QpInfo(r.gid, r.lid, r.qp_num, r.psn), r.addr, r.rkey

    try:
        return RdmaMover(connect)
    except CrescentError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyverbs errors: fall back, saying why
        raise RdmaUnavailableError(f"queue pair setup failed: {exc}") from exc


def value_nbytes(part) -> int:
    if hasattr(part, "data_ptr"):  # a CPU or CUDA tensor
        return part.numel() * part.element_size()
    return memoryview(part).nbytes


@dataclass(eq=False)
class _Handle:
    """A mover and the arena it reaches; closed once retired (the node's arena changed) and idle."""

    mover: object
    arena: ArenaRef
    users: int = 0
    retired: bool = False


class DescriptorSession:
    """One client's one-sided path to one node. Thread-safe.

    ``get_into`` and ``put`` run the whole protocol for a batch. The step-wise
    methods (``acquire``/``read``/``release``, ``reserve``/``write``/``commit``/
    ``abort``) expose each step, for tests and for callers that overlap copies
    with other work.
    """

    def __init__(self, stub, call: Callable, timeout_s: float, mover, arena: ArenaRef, requested: str) -> None:
        self._stub, self._call, self.timeout_s = stub, call, timeout_s
        self._handle = _Handle(mover, arena)
        self._requested = requested
        self._lock = threading.Lock()
        self._staging: CudaStaging | None = None
        self.num_invalid_reads = 0
        """Batches whose lease had expired at release: their keys were reported as misses."""

    @property
    def mover(self) -> Mover:
        return self._handle.mover.mover

    @property
    def arena(self) -> ArenaRef:
        return self._handle.arena

    # ---- one batch, whole protocol ------------------------------------------------

    def get_into(self, keys: Sequence[bytes], dst_for: Callable[[int, int], object]
                 ) -> tuple[list[int | None], list[int]]:
        """Reads values into caller buffers.

        Args:
            keys: keys to read.
            dst_for: ``dst_for(index, size)`` returns the destination of key ``index``
                (a writable host buffer, a CPU or CUDA tensor), at least ``size`` bytes.

        Returns:
            Per key, the value's size (None: a miss), and the indices of keys
            held outside the DRAM arena (read those another way).

        Raises:
            InvalidArgumentError: a value is larger than its buffer (nothing is reported read).
        """
        request = lambda: self._stub.AcquireRead(  # noqa: E731
            pb.AcquireReadRequest(keys=keys, mover=self.mover.pb), timeout=self.timeout_s)
        with self._granted(request, read=True) as (h, r, sent):
            sizes: list[int | None] = [None] * len(keys)
            elsewhere = [d.index for d in r.items if d.status == pb.ITEM_ELSEWHERE]
            if not r.lease_id:
                return sizes, elsewhere
            expires_at = sent + r.expires_in_s
            sb = h.arena.slot_bytes
            ok, ops, bufs, keep, cuda = [], [], [], [], []
            copied = False
            try:
                for d in r.items:
                    if d.status != pb.ITEM_OK:
                        continue
                    i, size = d.index, d.size
                    dst = dst_for(i, size)
                    if is_cuda(dst):
                        cap = dst.numel() * dst.element_size()
                        cuda.append((dst, size, value_extents(d.slots, size, sb)))
                    else:
                        addr, cap, ka = local_buffer(dst)
                        ops_for(addr, d.slots, size, sb, ops)
                        bufs.append((addr, cap))
                        keep.append(ka)
                    if size > cap:
                        raise InvalidArgumentError(
                            f"value of key {bytes(keys[i]).hex()} ({size} bytes) exceeds its buffer of {cap}")
                    ok.append((i, size))
                if time.monotonic() < expires_at:  # else the release fails anyway
                    h.mover.read(ops, bufs)
                    for dst, size, ext in cuda:
                        self.staging().to_device(dst, size, _filler(h.mover, ext, read=True))
                    copied = True
            finally:
                valid = self._end_read(r.lease_id)
        if copied and valid:
            for i, size in ok:
                sizes[i] = size
        return sizes, elsewhere

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence]) -> tuple[list[bool], list[int]]:
        """Stores values (each a list of parts: host buffers, CPU or CUDA tensors).

        Returns:
            Per key, whether it was stored, and the indices to store another
            way (the arena had no room now, or the reservation expired).
        """
        sizes = [sum(value_nbytes(p) for p in parts) for parts in values]
        headers = [pb.ValueHeader(key=k, size=s) for k, s in zip(keys, sizes)]
        request = lambda: self._stub.ReserveWrite(  # noqa: E731
            pb.ReserveWriteRequest(values=headers, mover=self.mover.pb), timeout=self.timeout_s)
        with self._granted(request, read=False) as (h, r, sent):
            stored = [False] * len(keys)
            other = [d.index for d in r.items if d.status == pb.ITEM_EXHAUSTED]
            if not r.lease_id:
                return stored, other
            expires_at = sent + r.expires_in_s
            sb = h.arena.slot_bytes
            ok = [d.index for d in r.items if d.status == pb.ITEM_OK]
            committed = False
            try:
                ops, bufs, keep, cuda = [], [], [], []
                for d in r.items:
                    if d.status != pb.ITEM_OK:
                        continue
                    parts = values[d.index]
                    if len(parts) == 1 and not is_cuda(parts[0]):  # the common case: one host buffer
                        addr, n, ka = local_buffer(parts[0])
                        ops_for(addr, d.slots, n, sb, ops)
                        bufs.append((addr, n))
                        keep.append(ka)
                        continue
                    ext, pos = value_extents(d.slots, d.size, sb), 0
                    for part in parts:
                        n = value_nbytes(part)
                        if is_cuda(part):
                            cuda.append((part, n, slice_extents(ext, pos, n)))
                        elif n:
                            addr, _, ka = local_buffer(part)
                            ops += plan([(addr, n)], slice_extents(ext, pos, n))
                            bufs.append((addr, n))
                            keep.append(ka)
                        pos += n
                for piece in _pieces(ops, WRITE_PIECE_BYTES):
                    _check_deadline(expires_at)
                    h.mover.write(piece, bufs)
                for part, n, ext in cuda:
                    _check_deadline(expires_at)
                    self.staging().from_device(part, n, _filler(h.mover, ext, read=False))
                self.commit(r.lease_id)
                committed = True
                for i in ok:
                    stored[i] = True
            except FailedPreconditionError as exc:  # expired: the caller stores these another way
                log.info("write reservation not committed (%s); storing %d values another way", exc, len(ok))
                other += ok
            finally:
                if not committed:
                    self._end_write(r.lease_id)
        return stored, sorted(other)

    # ---- step by step ---------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes]) -> Grant:
        """A read lease on ``keys``: their descriptors, under one lease id (0: nothing leased)."""
        request = lambda: self._stub.AcquireRead(  # noqa: E731
            pb.AcquireReadRequest(keys=keys, mover=self.mover.pb), timeout=self.timeout_s)
        with self._granted(request, read=True) as (_, r, sent):
            return Grant.from_pb(r, sent)

    def read(self, desc: SlotDescriptor, dst) -> None:
        """Copies one granted value into a host buffer (no validity check: ``release`` decides)."""
        addr, cap, ka = local_buffer(dst)
        if desc.size > cap:
            raise InvalidArgumentError(f"value of {desc.size} bytes exceeds its buffer of {cap}")
        with self._use() as h:
            ops: list = []
            ops_for(addr, desc.slots, desc.size, h.arena.slot_bytes, ops)
            h.mover.read(ops, [(addr, cap)])
        del ka

    def release(self, lease_id: int) -> None:
        """Ends a read lease. Raises FailedPreconditionError when it had expired."""
        self._call(lambda: self._stub.ReleaseRead(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Grant:
        """A write reservation for ``(key, size)`` items (0: nothing reserved)."""
        headers = [pb.ValueHeader(key=k, size=s) for k, s in items]
        request = lambda: self._stub.ReserveWrite(  # noqa: E731
            pb.ReserveWriteRequest(values=headers, mover=self.mover.pb), timeout=self.timeout_s)
        with self._granted(request, read=False) as (_, r, sent):
            return Grant.from_pb(r, sent)

    def write(self, desc: SlotDescriptor, src) -> None:
        """Copies one value's bytes into its reserved slots (no deadline check)."""
        addr, n, ka = local_buffer(src)
        if n != desc.size:
            raise InvalidArgumentError(f"{n} bytes for a reservation of {desc.size}")
        with self._use() as h:
            ops: list = []
            ops_for(addr, desc.slots, n, h.arena.slot_bytes, ops)
            h.mover.write(ops, [(addr, n)])
        del ka

    def commit(self, lease_id: int) -> None:
        """Makes a reservation's values visible. Raises FailedPreconditionError when it expired."""
        self._call(lambda: self._stub.CommitWrite(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))

    def abort(self, lease_id: int) -> int:
        r = self._call(lambda: self._stub.AbortWrite(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))
        return r.num_aborted

    # ---- plumbing ---------------------------------------------------------------

    def staging(self) -> CudaStaging:
        with self._lock:
            if self._staging is None:
                self._staging = CudaStaging()
            return self._staging

    def close(self) -> None:
        """Closes the mover once no copy uses it any more."""
        self._retire(self._handle)

    @contextmanager
    def _use(self):
        """The current mover, kept open while the caller copies with it."""
        with self._lock:
            h = self._handle
            h.users += 1
        try:
            yield h
        finally:
            with self._lock:
                h.users -= 1
                idle = h.retired and h.users == 0
            if idle:
                h.mover.close()

    @contextmanager
    def _granted(self, request: Callable, read: bool):
        """Sends a grant request with the current mover in use; yields (handle, response, send time).

        A grant naming another arena (the node restarted) is ended, the new
        arena mapped, and the request sent once more.
        """
        for attempt in range(2):
            with self._use() as h:
                sent = time.monotonic()
                r = self._call(request)
                if not r.lease_id or r.arena == h.arena.name:
                    yield h, r, sent
                    return
                if read:
                    self._end_read(r.lease_id)
                else:
                    self._end_write(r.lease_id)
            if attempt == 0:
                self._reopen(h)
        raise UnavailableError("the node's arena keeps changing (restarting node?)")

    def _reopen(self, stale: _Handle) -> None:
        sel = select(self._stub, self._call, self.timeout_s, self._requested)
        if sel.session is None or sel.session.mover is not self.mover:
            raise UnavailableError(f"the node's arena changed and {self.mover.value} no longer works: {sel.notes}")
        with self._lock:
            if self._handle is not stale:  # another thread re-mapped first
                sel.session.close()
                return
            self._handle = _Handle(sel.session._handle.mover, sel.session.arena)
        self._retire(stale)

    def _retire(self, h: _Handle) -> None:
        with self._lock:
            h.retired = True
            idle = h.users == 0
        if idle:
            h.mover.close()

    def _end_read(self, lease_id: int) -> bool:
        """Releases a read lease; False when it had expired (its keys are misses)."""
        try:
            self.release(lease_id)
            return True
        except FailedPreconditionError as exc:
            self.num_invalid_reads += 1
            log.info("read lease invalid at release (%s): its keys read as misses", exc)
            return False

    def _end_write(self, lease_id: int) -> None:
        try:
            self.abort(lease_id)
        except CrescentError as exc:  # the reservation expires by itself
            log.info("abort of write reservation %#x failed: %s", lease_id, exc)


def _filler(mover, ext, read: bool):
    def fill(addr: int, off: int, n: int) -> None:
        ops = plan([(addr, n)], slice_extents(ext, off, n))
        (mover.read if read else mover.write)(ops, [(addr, n)])

    return fill


def _check_deadline(expires_at: float) -> None:
    if time.monotonic() >= expires_at:
        raise FailedPreconditionError("write reservation expired before its bytes were copied")


def _pieces(ops, limit: int):
    piece, size = [], 0
    for op in ops:
        piece.append(op)
        size += op[2]
        if size >= limit:
            yield piece
            piece, size = [], 0
    if piece:
        yield piece
