"""Client side of the descriptor protocol: choose a mover for a node, get and put through it.

``select`` asks the node (``Transports``) what it offers and picks: shm on the
same host, rdma when both ends have a device, else none (the client then uses
its streamed path, the TCP data channel or gRPC). ``DescriptorSession`` runs
the protocol: ask for a grant, move the bytes with the mover, release or
commit. The grant calls travel over the node's data channel when it has one
(``ChannelControl``: a binary request on a kept-open TCP connection, tens of
microseconds) and as ``KVStore`` RPCs otherwise (``GrpcControl``: about a
millisecond each in Python); a broken channel is re-resolved once (the node
may have restarted on a new data port).

Read guarantee (see kvstore/transport/leases.py for the node's half): a key
is reported as a hit only when its copy ended before the client's deadline for
the lease (the TTL counted from when the request was *sent*, less a 1% margin
for clock-rate drift between hosts), which comes before the node's: the node
never frees leased slots before that, so the copy read the value whole. The
release therefore needs no answer on the critical path; on the data channel it
is sent and its answer checked just before the next request's. A lease that
ran out first makes every key of that batch a miss, and the bytes left in
those buffers are unspecified.

Local reads: values whose descriptors the session remembers (from earlier
grants) are read with no call to the node at all, checked against the node's
slot generation table, which the shm mover maps with the arena: equal before
and after the copy, the copy is the value (``DescriptorSession._read_local``).

Write safety: a client copies into reserved slots only before its deadline
(``expires_in_s`` counted from when it sent the request, so earlier than the
node's), checked before each piece of a large batch; the node keeps an expired
reservation's slots out of use for one more TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvstore.datachannel import CLOSE_WAIT_S, Op, Status, _Connections
from kvstore.errors import (CrescentError, DataLossError, FailedPreconditionError, InvalidArgumentError,
                            UnavailableError)
from kvstore.store import Tier, check_key
from kvstore.transport.descriptors import (SHM_PROOF_HEADER, ArenaRef, DeviceArenaRef, Grant, ItemStatus, Mover,
                                           SlotDescriptor, ops_for, value_extents)
from kvstore.transport.gpu import CudaStaging, is_cuda
from kvstore.transport.identity import HostIdentity, host_identity, one_sided_candidates
from kvstore.transport.memcopy import local_buffer, plan, slice_extents
from proto.crescent.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

WRITE_PIECE_BYTES = 64 << 20
"""A put batch is copied in pieces of this size, with a deadline check before each."""
DESCRIPTOR_CACHE_KEYS = 1 << 14
"""Keys whose last descriptors a session keeps (the values it may read locally, ``_read_local``)."""
LAYERED_AHEAD = 8
"""Parts of a layered read (``get_layered``) in flight at once: a chunk-layer is ~1 MiB for an
8B model's 256-token chunk, so ~8 MiB on the wire while Python hands the earlier ones on."""
DISCONNECT_TIMEOUT_S = 2.0
"""Deadline of the one DisconnectRdma call a closing RDMA mover makes (not retried)."""
REPORT_EVERY_S = 1.0
"""How often (at most) a session tells the node how many values it read locally."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The one-sided session for a node, or None and why none."""

    session: DescriptorSession | None
    notes: str = ""


def select(stub, call: Callable, timeout_s: float, requested: str,
           channel: Callable[[], _Connections | None] | None = None) -> Selection:
    """Picks the best one-sided mover the node and this process can both use.

    Args:
        stub: the node's ``KVStoreStub``.
        call: runs a stub call, mapping gRPC errors to CrescentError (with retries).
        timeout_s: deadline of each call.
        requested: ``auto``, ``shm``, ``rdma``, ``tcp`` or ``grpc``.
        channel: opens connections to the node's data channel (None when it has
            none); the grant calls then travel there instead of over gRPC.
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
        try:
            conns = channel() if channel is not None else None  # (a Health call: the node may be gone again)
        except BaseException:
            m.close()
            raise
        proof = getattr(m, "proof", b"")  # shm: this client read the arena's secret (the node checks it)
        if conns is not None:
            conns.proof = proof  # sent on each connection before its first grant
        control = ChannelControl(conns) if conns is not None else GrpcControl(stub, call, timeout_s, proof)
        session = DescriptorSession(stub, call, timeout_s, m, arena, requested, control, channel)
        h = session._handle
        if mover is Mover.SHM:  # the device tier beside it, for GPU clients (open_device)
            h.device_ref = DeviceArenaRef.from_pb(r.device_arena) if Mover.CUDA_IPC in offered else None
            h.device_reason = r.device_arena.reason or "the node does not offer cuda_ipc"
        return Selection(session, "; ".join(notes))
    return Selection(None, "; ".join(notes))


class GrpcControl:
    """The grant calls as ``KVStore`` RPCs."""

    lane = "grpc"

    def __init__(self, stub, call: Callable, timeout_s: float, proof: bytes = b"") -> None:
        self._stub, self._call, self.timeout_s = stub, call, timeout_s
        self._meta = [(SHM_PROOF_HEADER, proof.hex())] if proof else None

    def acquire(self, keys: Sequence[bytes], mover: Mover) -> Grant:
        sent = time.monotonic()
        r = self._call(lambda: self._stub.AcquireRead(pb.AcquireReadRequest(keys=keys, mover=mover.pb),
                                                      timeout=self.timeout_s, metadata=self._meta))
        return Grant.from_pb(r, sent)

    def reserve(self, items: Sequence[tuple[bytes, int]], mover: Mover) -> Grant:
        headers = [pb.ValueHeader(key=k, size=n) for k, n in items]
        sent = time.monotonic()
        r = self._call(lambda: self._stub.ReserveWrite(pb.ReserveWriteRequest(values=headers, mover=mover.pb),
                                                       timeout=self.timeout_s, metadata=self._meta))
        return Grant.from_pb(r, sent)

    def release(self, lease_id: int) -> None:
        self._call(lambda: self._stub.ReleaseRead(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))

    release_later = None  # a unary RPC is answered before the next: releases wait
    report_later = None  # no RPC for it: local reads stay out of the node's counters

    def settle(self) -> None:
        pass  # nothing is sent without waiting

    def commit(self, lease_id: int) -> None:
        self._call(lambda: self._stub.CommitWrite(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))

    def abort(self, lease_id: int) -> int:
        r = self._call(lambda: self._stub.AbortWrite(pb.LeaseRequest(lease_id=lease_id), timeout=self.timeout_s))
        return r.num_aborted

    def close(self, deadline: float | None = None) -> None:
        pass


_ITEM_STATUS = {Status.OK: ItemStatus.OK, Status.NOT_FOUND: ItemStatus.NOT_FOUND,
                Status.ELSEWHERE: ItemStatus.ELSEWHERE, Status.EXHAUSTED: ItemStatus.EXHAUSTED}


class ChannelControl:
    """The grant calls on the node's data channel (one connection per thread)."""

    lane = "tcp"

    def __init__(self, conns: _Connections) -> None:
        self._conns = conns

    def acquire(self, keys: Sequence[bytes], mover: Mover) -> Grant:
        sent = time.monotonic()
        return self._grant(sent, self._run(lambda c: c.grant(Op.ACQUIRE, keys, [0] * len(keys), mover.pb)),
                           mover.tier)

    def reserve(self, items: Sequence[tuple[bytes, int]], mover: Mover) -> Grant:
        keys, sizes = [k for k, _ in items], [n for _, n in items]
        sent = time.monotonic()
        return self._grant(sent, self._run(lambda c: c.grant(Op.RESERVE, keys, sizes, mover.pb)))

    def release(self, lease_id: int) -> None:
        self._end(Op.RELEASE, lease_id)

    def release_later(self, lease_ids: Sequence[int], on_answer: Callable | None) -> None:
        """Sends one release of every lease without waiting; ``on_answer(items, message)``
        gets the node's answer once read."""
        self._run(lambda c: c.end_later(Op.RELEASE, lease_ids, on_answer))

    def report_later(self, values: int, nbytes: int, batches: int) -> None:
        """Tells the node about local reads (it counts them as hits), without waiting."""
        self._run(lambda c: c.end_later(Op.REPORT, [values, nbytes, batches], None))

    def settle(self) -> None:
        """Waits for the node's answers to this thread's releases and reports sent without waiting."""
        conn = self._conns.current()
        if conn is not None:
            conn.settle()

    def commit(self, lease_id: int) -> None:
        self._end(Op.COMMIT, lease_id)

    def abort(self, lease_id: int) -> int:
        return self._end(Op.ABORT, lease_id)

    def close(self, deadline: float | None = None) -> None:
        self._conns.close(deadline)

    def _run(self, fn):
        try:
            return fn(self._conns.get())
        except DataLossError:  # the connection closed itself; get() opens a new one
            return fn(self._conns.get())

    def _end(self, op: Op, lease_id: int) -> int:
        status, size, msg = self._run(lambda c: c.end(op, lease_id))
        _raise_for(status, msg)
        return size

    @staticmethod
    def _grant(sent: float, reply, tier: Tier = Tier.DRAM) -> Grant:
        items, msg, g = reply
        if g is None:
            if items:
                _raise_for(items[0][0], msg)
            return Grant(0, sent, "", (), msg, sent)
        lease_id, ttl_s, arena, slots, gens = g
        out = []
        for i, ((status, size), ss, gs) in enumerate(zip(items, slots, gens)):
            st = _ITEM_STATUS.get(status)
            if st is None:
                raise DataLossError(f"data channel: unexpected item status {status.name} in a grant")
            out.append(SlotDescriptor(i, st, size, tier if st is ItemStatus.OK else None, tuple(ss), tuple(gs)))
        return Grant(lease_id, sent + ttl_s, arena, tuple(out), msg, sent)


def _raise_for(status: Status, msg: str) -> None:
    if status is Status.OK:
        return
    if status is Status.INVALID:
        raise InvalidArgumentError(msg)
    if status is Status.FAILED_PRECONDITION:
        raise FailedPreconditionError(msg)
    raise DataLossError(f"data channel: unexpected status {status.name}: {msg}")


def _open_mover(mover: Mover, arena: ArenaRef, stub, call, timeout_s: float):
    if mover is Mover.SHM:
        from kvstore.transport.shm import ShmMover

        return ShmMover(arena)
    from kvstore.transport.rdma import QpInfo, RdmaMover, RdmaUnavailableError

    def connect(info: QpInfo, replaces: tuple[int, int] | None):
        node_end, client_end = replaces or (0, 0)
        r = call(lambda: stub.ConnectRdma(pb.RdmaConnectRequest(
            gid=info.gid, lid=info.lid, qp_num=info.qp_num, psn=info.psn, rd_atomic=info.rd_atomic,
            replaces_qp_num=node_end, replaces_client_qp_num=client_end), timeout=timeout_s))
        return QpInfo(r.gid, r.lid, r.qp_num, r.psn, r.rd_atomic), r.addr, r.rkey

    def disconnect(gid: bytes, ends: tuple[int, int]):
        # NOTE: once, with a short deadline: a node that is gone needs no telling
        stub.DisconnectRdma(pb.RdmaDisconnectRequest(gid=gid, qp_num=ends[0], client_qp_num=ends[1]),
                            timeout=min(timeout_s, DISCONNECT_TIMEOUT_S))

    try:
        return RdmaMover(connect, arena_bytes=arena.size, disconnect=disconnect)
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
    """A mover, the arena it reaches and the grant calls' lane; closed once retired
    (the node's arena or data channel changed) and idle."""

    mover: object
    arena: ArenaRef
    control: GrpcControl | ChannelControl
    users: int = 0
    retired: bool = False
    known: OrderedDict = field(default_factory=OrderedDict)
    """key → (size, slots, generations) of its last grant in this arena (the descriptor cache)."""
    device_ref: DeviceArenaRef | None = None
    """The node's device tier as this host maps it (cuda_ipc, beside shm), if it offers one."""
    device_reason: str = "no device tier offered"
    device: object = None
    """The device tier mapped here (``CudaIpcMover``), once ``open_device`` did."""

    def view_of(self, arena: str):
        """The mover that maps the arena a grant names (the DRAM arena's, or the device tier's
        once mapped), or None: another arena (the node restarted)."""
        if self.device is not None and arena == self.device.name:
            return self.device
        return self.mover if arena == self.arena.name else None

    def close(self, deadline: float | None = None) -> None:
        self.mover.close()
        if self.device is not None:
            self.device.close()
        self.control.close(deadline)


class DescriptorSession:
    """One client's one-sided path to one node. Thread-safe.

    ``get_into`` and ``put`` run the whole protocol for a batch. The step-wise
    methods (``acquire``/``read``/``release``, ``reserve``/``write``/``commit``/
    ``abort``) expose each step, for tests and for callers that overlap copies
    with other work.
    """

    def __init__(self, stub, call: Callable, timeout_s: float, mover, arena: ArenaRef, requested: str,
                 control: GrpcControl | ChannelControl | None = None,
                 channel: Callable[[], _Connections | None] | None = None) -> None:
        self._stub, self._call, self.timeout_s = stub, call, timeout_s
        self._handle = _Handle(mover, arena, control or GrpcControl(stub, call, timeout_s))
        self._requested = requested
        self._channel = channel
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as the current mover's last user leaves
        self._staging: CudaStaging | None = None
        self.num_invalid_reads = 0
        """Batches whose lease ran out before their copy ended: their keys were reported as misses."""
        self.num_late_release_failures = 0
        """Releases sent after a copy that ended in time and then refused by the node (clock trouble)."""
        self.local_reads = True
        """Read remembered values with no call to the node (``_read_local``); False: always a grant."""
        self.num_local_reads = 0
        """Values read with no call to the node: remembered descriptors the generation table confirmed."""
        self.num_local_misses = 0
        """Values copied from remembered descriptors that the second check refused (read again via a grant)."""
        self._cuda_registered = False
        self._cuda_device = None
        self._buffers: dict[int, int] = {}
        """Host buffers registered for good (``register_buffers``): addr → bytes."""
        self._put_streams: dict = {}
        self._device_wanted = False
        self._unreported = [0, 0, 0]  # local reads the node has not been told of: values, bytes, batches
        self._reported_at = time.monotonic()
        self._closed = False

    @property
    def mover(self) -> Mover:
        return self._handle.mover.mover

    @property
    def arena(self) -> ArenaRef:
        return self._handle.arena

    @property
    def control_lane(self) -> str:
        """Where the grant calls travel: ``tcp`` (the node's data channel) or ``grpc``."""
        return self._handle.control.lane

    # ---- one batch, whole protocol ------------------------------------------------

    def get_into(self, keys: Sequence[bytes], dst_for: Callable[[int, int], object]
                 ) -> tuple[list[int | None], list[int]]:
        """Reads values into caller buffers.

        Values whose descriptors this session remembers are read with no call to
        the node when the node's generation table confirms them (``_read_local``);
        the rest through a grant.

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
        with self._use() as h:
            local = (self._read_local(h, keys, dst_for)
                     if self.local_reads and h.known and h.mover.mover is Mover.SHM else {})
        if not local:
            return self._get_granted(keys, dst_for)
        sizes: list[int | None] = [None] * len(keys)
        for i, size in local.items():
            sizes[i] = size
        rest = [i for i in range(len(keys)) if i not in local]
        if not rest:
            return sizes, []
        got, elsewhere = self._get_granted([keys[i] for i in rest], lambda j, size: dst_for(rest[j], size))
        for j, size in enumerate(got):
            sizes[rest[j]] = size
        return sizes, [rest[j] for j in elsewhere]

    def _read_local(self, h: _Handle, keys: Sequence[bytes], dst_for: Callable) -> dict[int, int]:
        """Reads the values whose descriptors this session remembers, checking them against
        the node's generation table instead of asking for a grant (a seqlock); returns
        ``{index: size}`` of the values read.

        A slot's generation grows when it is freed and when its value leaves the
        index while leased (kvstore/arena.py), and both happen to all of a value's
        slots at once; so its first slot's generation stands for the value's. Equal
        to the one in the grant that cached the descriptors, it means the key still
        maps to that value, in those slots; equal again after the copy, it means no
        slot was freed (hence none rewritten) while it ran: the copy is the value,
        read as of the first check. The checks and the copy are loads in program
        order, which x86-64 keeps in order; the node bumps a generation before the
        slot can be rewritten. Each value read marks its first slot touched, which
        the node's eviction counts as a use. A value that fails either check is read through
        a grant instead; so is every value once the arena file is unlinked (the
        node stopped, or a restarted one reaped it: ``ShmMover.current``). CUDA
        destinations always go through a grant.
        """
        table, touched = h.mover.generations, h.mover.touched
        if table is None or not h.mover.current():
            return {}  # an old node, or its arena is gone (the grant path finds the new one)
        with self._lock:
            known = [(i, h.known.get(bytes(k))) for i, k in enumerate(keys)]
        sb = h.arena.slot_bytes
        ops, bufs, keep, cand = [], [], [], []
        for i, e in known:
            if e is None:
                continue
            size, slots, gens = e
            if table[slots[0]] != gens[0]:
                continue  # freed or replaced since: ask the node
            dst = dst_for(i, size)
            if is_cuda(dst):
                continue
            addr, cap, ka = local_buffer(dst)
            if size > cap:
                continue  # the granted path says why
            ops_for(addr, slots, size, sb, ops)
            bufs.append((addr, cap))
            keep.append(ka)
            cand.append((i, size, slots, gens))
        if not cand:
            return {}
        h.mover.read(ops, bufs)
        out = {}
        for i, size, slots, gens in cand:
            if table[slots[0]] == gens[0]:
                out[i] = size
                touched[slots[0]] = 1
        self.num_local_reads += len(out)
        self.num_local_misses += len(cand) - len(out)
        if out:
            with self._lock:
                u = self._unreported
                u[0] += len(out)
                u[1] += sum(out.values())
                u[2] += 1
            if time.monotonic() - self._reported_at >= REPORT_EVERY_S:
                self._report(h)
        return out

    def _report(self, h: _Handle) -> None:
        """Sends the local reads not yet reported (the node's hit counters and metrics)."""
        with self._lock:
            values, nbytes, batches = self._unreported
            self._unreported = [0, 0, 0]
            self._reported_at = time.monotonic()
        if values and h.control.report_later is not None:
            try:
                h.control.report_later(values, nbytes, batches)
            except CrescentError as exc:  # statistics only: never fails a read
                log.debug("could not report local reads: %s", exc)

    def _get_granted(self, keys: Sequence[bytes], dst_for: Callable[[int, int], object]
                     ) -> tuple[list[int | None], list[int]]:
        """``get_into`` through a read lease: acquire, copy, release."""
        with self._granted(lambda h: h.control.acquire(keys, self.mover), read=True) as (h, g):
            sizes: list[int | None] = [None] * len(keys)
            elsewhere = [d.index for d in g.items if d.status is ItemStatus.ELSEWHERE]
            self._remember(h, keys, g.items)
            if not g.lease_id:
                return sizes, elsewhere
            sb = h.arena.slot_bytes
            ok, ops, bufs, keep, cuda = [], [], [], [], []
            copied = late = failed = False
            try:
                for d in g.items:
                    if d.status is not ItemStatus.OK:
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
                if time.monotonic() < g.expires_at:  # else the lease is over: nothing to copy
                    try:
                        h.mover.read(ops, bufs)
                        for dst, size, ext in cuda:
                            self.staging().to_device(dst, size, _filler(h.mover, ext, read=True))
                    except DataLossError as exc:  # the mover failed (rdma: its queue pair broke)
                        log.warning("%s read of %d values failed (%s): reading them another way",
                                    self.mover.value, len(ok), exc)
                        failed = True
                    else:
                        copied = time.monotonic() < safe_end(g)
                late = not copied and not failed
            finally:
                if copied and h.control.release_later is not None:
                    h.control.release_later([g.lease_id], self._late_answer)
                    valid = True
                else:
                    valid = self._end_read(h, g.lease_id) and copied
                    if late:
                        self.num_invalid_reads += 1
        if valid:
            for i, size in ok:
                sizes[i] = size
        elif failed:  # the values are intact on the node: the caller streams them
            elsewhere = sorted(elsewhere + [i for i, _ in ok])
        return sizes, elsewhere

    def _remember(self, h: _Handle, keys: Sequence[bytes], items) -> None:
        """Caches the descriptors of a grant's OK items (and forgets its other keys)."""
        with self._lock:
            known = h.known
            for d in items:
                key = bytes(keys[d.index])
                if d.status is ItemStatus.OK:
                    known[key] = (d.size, d.slots, d.generations)
                    known.move_to_end(key)
                else:
                    known.pop(key, None)
            while len(known) > DESCRIPTOR_CACHE_KEYS:
                known.popitem(last=False)

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence]) -> tuple[list[bool], list[int]]:
        """Stores values (each a list of parts: host buffers, CPU or CUDA tensors).

        Returns:
            Per key, whether it was stored, and the indices to store another
            way (the arena had no room now, or the reservation expired).
        """
        items = [(k, sum(value_nbytes(p) for p in parts)) for k, parts in zip(keys, values)]
        with self._granted(lambda h: h.control.reserve(items, self.mover), read=False) as (h, g):
            stored = [False] * len(keys)
            other = [d.index for d in g.items if d.status is ItemStatus.EXHAUSTED]
            if not g.lease_id:
                return stored, other
            sb = h.arena.slot_bytes
            ok = [d.index for d in g.items if d.status is ItemStatus.OK]
            committed = False
            try:
                ops, bufs, keep, cuda = [], [], [], []
                for d in g.items:
                    if d.status is not ItemStatus.OK:
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
                    _check_deadline(g.expires_at)
                    h.mover.write(piece, bufs)
                if cuda and getattr(h.mover, "cuda_registered", False):
                    _check_deadline(g.expires_at)
                    _device_to_arena(h.mover, cuda, self._put_stream(cuda[0][0].device))  # no host copy
                else:
                    for part, n, ext in cuda:
                        _check_deadline(g.expires_at)
                        self.staging().from_device(part, n, _filler(h.mover, ext, read=False))
                h.control.commit(g.lease_id)
                committed = True
                for i in ok:
                    stored[i] = True
                self._remember(h, keys, [d for d in g.items if d.status is ItemStatus.OK])
            except (FailedPreconditionError, DataLossError) as exc:  # expired, or the mover failed (rdma)
                log.info("write reservation not committed (%s); storing %d values another way", exc, len(ok))
                other += ok
            finally:
                if not committed:
                    self._end_write(h, g.lease_id)
        return stored, sorted(other)

    def get_layered(self, keys: Sequence[bytes], head: int, layer: int,
                    on_sizes: Callable[[list[int | None]], None], dest: Callable[[int, int], object],
                    arrived: Callable[[int, int], None], ahead: int = LAYERED_AHEAD) -> bool:
        """``StoreClient.batch_get_layered`` done with this session's one-sided mover (RDMA READs
        across hosts, copies from the mapped arena on one): one read lease on ``keys``; then each
        value's head into ``dest(value, -1)``, layer 0 of every value into ``dest(value, 0)``,
        layer 1, … (the order of ``datachannel.layered_parts``), each part read straight into
        its buffer and ``arrived(value, part)`` called once it is in and the lease still held it.

        Up to ``ahead`` parts of one layer (or of the heads) are read at once: over RDMA their
        READs are in flight together, so the wire does not wait on Python between parts.
        ``dest`` is asked for a part's buffer once at most ``ahead - 1`` parts before it are
        still to arrive, all of its own layer: the heads all arrived before any layer's buffer
        is asked for (a header may change where the layers go), and layer ``l`` before layer
        ``l + 1``'s (a receiver's ring may reuse them). ``arrived`` comes in order.

        ``on_sizes`` gets each value's size first (None: a miss, or not ``head`` + whole layers).
        Returns False, having called nothing, when a value is held outside the DRAM arena (on
        the node's disk or device tier, which one-sided reads cannot reach: read another way).
        Raises UnavailableError when the lease ran out before a part's read ended (nothing
        arrives after it), or when the node had ended it by the time it was released (every
        part arrived, but may be stale: the caller's check decides); a callback's exception
        propagates. The lease ends on every path, and no read lands in a buffer after this
        returns.
        """
        from kvstore.datachannel import layered_parts

        with self._granted(lambda h: h.control.acquire(keys, self.mover), read=True) as (h, g):
            pending: deque = deque()  # (value, part, ticket, buffer keep-alive), in posting order
            try:
                if any(d.status is ItemStatus.ELSEWHERE for d in g.items):
                    return False
                sizes: list[int | None] = [None] * len(keys)
                extents: dict[int, list] = {}
                sb = h.arena.slot_bytes
                for d in g.items:
                    if d.status is ItemStatus.OK and d.size >= head and (d.size - head) % layer == 0:
                        sizes[d.index] = d.size
                        extents[d.index] = value_extents(d.slots, d.size, sb)
                on_sizes(sizes)
                end = safe_end(g)

                def arrive_first() -> None:
                    j, part, ticket, _ = pending[0]
                    h.mover.wait(ticket)
                    pending.popleft()
                    if time.monotonic() >= end:
                        self.num_invalid_reads += 1
                        raise UnavailableError(f"read lease ran out before part {part} of value {j} was read")
                    arrived(j, part)

                for j, part, off, n in layered_parts(sizes, head, layer):
                    while pending and (len(pending) >= ahead or part != pending[-1][1]):
                        arrive_first()
                    addr, cap, ka = local_buffer(dest(j, part))
                    if n > cap:
                        raise InvalidArgumentError(f"part {part} of value {j} ({n} bytes) exceeds its buffer "
                                                   f"of {cap}")
                    ops, pos = [], 0
                    for aoff, ln in slice_extents(extents[j], off, n):
                        ops.append((addr + pos, aoff, ln))
                        pos += ln
                    pending.append((j, part, h.mover.post_read(ops, [(addr, cap)]), ka))
                while pending:
                    arrive_first()
            finally:
                try:
                    for _, _, ticket, _ in pending:  # reads posted ahead of a failure: over before returning
                        try:
                            h.mover.wait(ticket)
                        except Exception as exc:  # noqa: BLE001 - its queue pair was destroyed: nothing lands
                            log.debug("a read posted ahead failed after the stream stopped: %s", exc)
                finally:
                    released = not g.lease_id or self._end_read(h, g.lease_id)
        if not released:  # the node had ended the lease: its slots may have been rewritten under the reads
            self.num_invalid_reads += 1
            raise UnavailableError("the read lease had expired at release: the parts read may be stale")
        return True

    # ---- step by step ---------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes], mover: Mover | None = None) -> Grant:
        """A read lease on ``keys``: their descriptors, under one lease id (0: nothing leased).

        ``mover`` ``cuda_ipc`` leases device-tier values instead (``open_device`` first): the
        grant names the device arena, and ``in_place`` gives its mapping."""
        mover = mover or self.mover
        _check_keys(keys)
        if mover is Mover.CUDA_IPC and not self.device_mapped:
            raise FailedPreconditionError("the node's device tier is not mapped here (open_device)")
        with self._granted(lambda h: h.control.acquire(keys, mover), read=True) as (_, g):
            return g

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
        _check_lease(lease_id)
        with self._use() as h:
            h.control.release(lease_id)

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Grant:
        """A write reservation for ``(key, size)`` items (0: nothing reserved)."""
        if isinstance(items, (bytes, str)) or not hasattr(items, "__iter__") \
                or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
            raise InvalidArgumentError("reserve takes a list of (key, size) pairs")
        _check_keys([k for k, _ in items])
        for _, n in items:
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 63:
                raise InvalidArgumentError(f"a size is a byte count, got {n!r}")
        with self._granted(lambda h: h.control.reserve(items, self.mover), read=False) as (_, g):
            return g

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
        _check_lease(lease_id)
        with self._use() as h:
            h.control.commit(lease_id)

    def abort(self, lease_id: int) -> int:
        _check_lease(lease_id)
        with self._use() as h:
            return h.control.abort(lease_id)

    def register_cuda(self, device=None) -> str | None:
        """Page-locks the mapped arena for CUDA DMA (``ShmMover.register_cuda``, for ``device``'s
        copies, default the current GPU; kept across re-maps); None when done, else why not."""
        with self._use() as h:
            if not hasattr(h.mover, "register_cuda"):
                return f"{self.mover.value} maps no arena here"
            why = h.mover.register_cuda(device)
        self._cuda_registered = why is None
        self._cuda_device = device
        return why

    def register_buffers(self, buffers: Sequence[tuple[int, int]]) -> None:
        """Registers host buffers ``(addr, nbytes)`` that the caller keeps alive as long as this
        session (an engine's staging pool, its stream ring) with a mover for which registering
        costs: RDMA memory regions, so that a copy into or out of them registers nothing (per
        copy, ``ibv_reg_mr`` pins and maps the pages again). Kept across re-maps; a range
        already registered is skipped, so calling this before every load is cheap. Nothing
        to do for shm.

        Raises:
            ValueError: a buffer overlaps another one registered at another address.
        """
        with self._lock:
            new = [(a, n) for a, n in buffers if self._buffers.get(a) != n]
            if not new:
                return
        with self._use() as h:
            _register(h.mover, new)
        with self._lock:
            self._buffers.update(new)

    def open_device(self) -> str | None:
        """Maps the node's device tier into this process with CUDA IPC (once; again after the
        node restarts), for ``acquire(keys, Mover.CUDA_IPC)``. None when mapped, else why not
        (no device tier, another GPU, no CUDA here): its values are then read through the node."""
        self._device_wanted = True
        with self._use() as h:
            if h.device is not None:
                return None
            if h.device_ref is None:
                return h.device_reason
            from kvstore.transport.cuda_ipc import CudaIpcMover, CudaIpcUnavailableError

            try:
                device = CudaIpcMover(h.device_ref)
            except Exception as exc:  # noqa: BLE001 - whatever CUDA says, the values are read through the node
                why = str(exc) if isinstance(exc, CudaIpcUnavailableError) else f"{type(exc).__name__}: {exc}"
                h.device_reason = why
                h.device_ref = None  # not tried again for this node
                return why
            with self._lock:
                if h.device is None:
                    h.device, device = device, None
            if device is not None:
                device.close()
        return None

    @property
    def device_mapped(self) -> bool:
        """Whether the node's device tier is mapped here (``open_device``)."""
        return self._handle.device is not None

    @contextmanager
    def in_place(self, g: Grant):
        """The mover that maps ``g``'s arena, kept open in the block (for readers that use the
        leased bytes where they are: ``ShmMover.tensor``, or ``CudaIpcMover.tensor`` for a
        device-tier grant); None when the session maps another arena now (the node restarted)
        or does not use shm."""
        with self._use() as h:
            view = h.view_of(g.arena)
            yield view if view is not None and view.mover in (Mover.SHM, Mover.CUDA_IPC) else None

    # ---- plumbing ---------------------------------------------------------------

    def _put_stream(self, device):
        """The CUDA stream puts copy ``device``'s values into the arena on (made once per device)."""
        with self._lock:
            stream = self._put_streams.get(device)
            if stream is None:
                import torch

                stream = self._put_streams[device] = torch.cuda.Stream(device)
            return stream

    def staging(self) -> CudaStaging:
        with self._lock:
            if self._staging is None:
                self._staging = CudaStaging()
            return self._staging

    def settle(self) -> None:
        """Sends this session's unreported local reads and waits until the node has done this
        thread's releases sent without waiting: its counters and lease table then include every
        read this thread made (``StoreClient.stats`` calls it first)."""
        with self._use() as h:
            self._report(h)
            try:
                h.control.settle()
            except CrescentError as exc:  # the channel broke: those leases end at their deadline
                log.debug("could not settle the data channel: %s", exc)

    def close(self) -> None:
        """Reports the last local reads, and closes the mover once no copy uses it any more (later
        calls raise FailedPreconditionError). Idempotent.

        Within ``CLOSE_WAIT_S`` in all: calls under way on other threads finish (their leases end
        cleanly), and the node answers the releases and reports sent without waiting. Past it, the
        grant channel is closed under the calls, so one that waits on a node that does not answer
        fails at once instead of at its deadline. The mover stays mapped until the last copy with
        it has ended."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        with self._lock:
            if self._closed:
                return
            self._closed = True
            h = self._handle
        self._report(h)
        with self._idle:
            busy = not self._idle.wait_for(lambda: h.users == 0, timeout=CLOSE_WAIT_S)
        if busy:
            h.control.close(deadline)
        self._retire(h, deadline)

    @contextmanager
    def _use(self):
        """The current mover, kept open while the caller copies with it."""
        with self._lock:
            if self._closed:  # its mapping may be gone: a copy now would fault
                raise FailedPreconditionError("the descriptor session is closed")
            h = self._handle
            h.users += 1
        try:
            yield h
        finally:
            with self._lock:
                h.users -= 1
                idle = h.retired and h.users == 0
                if h.users == 0:
                    self._idle.notify_all()
            if idle:
                h.close()

    @contextmanager
    def _granted(self, request: Callable, read: bool):
        """Runs ``request(handle)`` with the current mover in use; yields (handle, Grant).

        A grant naming another arena (the node restarted) is ended, the new
        arena mapped, and the request sent once more; so is one that failed
        because the data channel broke (a restarted node listens elsewhere).
        """
        for attempt in range(2):
            with self._use() as h:
                try:
                    g = request(h)
                except (DataLossError, UnavailableError) as exc:
                    if self._closed:  # close() on another thread ended this call's wait
                        raise FailedPreconditionError("the descriptor session was closed during the call") from exc
                    if attempt or h.control.lane == "grpc":
                        raise
                    g = None
                if g is not None:
                    if not g.lease_id or h.view_of(g.arena) is not None:
                        yield h, g
                        return
                    if read:
                        self._end_read(h, g.lease_id)
                    else:
                        self._end_write(h, g.lease_id)
            if attempt == 0:
                self._reopen(h)
        raise UnavailableError("the node's arena keeps changing (restarting node?)")

    def _reopen(self, stale: _Handle) -> None:
        sel = select(self._stub, self._call, self.timeout_s, self._requested, self._channel)
        if sel.session is None or sel.session.mover is not self.mover:
            if sel.session is not None:
                sel.session.close()
            raise UnavailableError(f"the node's arena changed and {self.mover.value} no longer works: {sel.notes}")
        with self._lock:
            closed, taken = self._closed, self._handle is not stale  # (taken: another thread re-mapped first)
            if not closed and not taken:
                self._handle = sel.session._handle
        if closed or taken:  # (a close() meanwhile retired the handle it found: this one would stay mapped)
            sel.session.close()
            if closed:
                raise FailedPreconditionError("the descriptor session was closed during the call")
            return
        self._retire(stale)
        if self._cuda_registered:  # the new arena is DMA-able too
            self.register_cuda(self._cuda_device)
        if self._buffers:  # and the long-lived buffers registered with the new mover
            with self._use() as h:
                _register(h.mover, list(self._buffers.items()))
        if self._device_wanted:  # and the new node's device tier mapped
            self.open_device()

    def _retire(self, h: _Handle, deadline: float | None = None) -> None:
        with self._lock:
            h.retired = True
            idle = h.users == 0
        if idle:
            h.close(deadline)

    def _end_read(self, h: _Handle, lease_id: int) -> bool:
        """Releases a read lease and waits; False when it had expired."""
        try:
            h.control.release(lease_id)
            return True
        except FailedPreconditionError as exc:
            log.info("read lease invalid at release (%s): its keys read as misses", exc)
            return False

    def _late_answer(self, items: list, msg: str) -> None:
        failed = sum(1 for status, _ in items if status is not Status.OK)
        if failed:
            self.num_late_release_failures += failed
            log.warning("a read lease was refused at release after its copy ended in time (%s); "
                        "are the two hosts' clocks drifting?", msg)

    def _end_write(self, h: _Handle, lease_id: int) -> None:
        try:
            h.control.abort(lease_id)
        except CrescentError as exc:  # the reservation expires by itself
            log.info("abort of write reservation %#x failed: %s", lease_id, exc)


def _register(mover, buffers) -> None:
    reg = getattr(mover, "register_buffer", None)
    if reg is not None:
        for addr, n in buffers:
            reg(addr, n)


def _device_to_arena(mover, parts: list, stream) -> None:
    """Copies CUDA tensor parts ``(tensor, nbytes, arena extents)`` into an arena page-locked
    for CUDA (``ShmMover.register_cuda``): one device-to-host DMA per extent, straight into
    the reserved slots, on a side stream after the caller's work; returns once they landed."""
    import torch

    from kvstore.transport.gpu import _flat_bytes

    stream.wait_stream(torch.cuda.current_stream(parts[0][0].device))
    with torch.cuda.stream(stream):
        for part, _, ext in parts:
            src, pos = _flat_bytes(part), 0
            for off, n in ext:
                mover.tensor(off, n).copy_(src[pos : pos + n], non_blocking=True)
                pos += n
    stream.synchronize()


def _filler(mover, ext, read: bool):
    def fill(addr: int, off: int, n: int) -> None:
        ops = plan([(addr, n)], slice_extents(ext, off, n))
        (mover.read if read else mover.write)(ops, [(addr, n)])

    return fill


def leased_head(view, desc: SlotDescriptor, head_bytes: int) -> tuple[bytearray, list[tuple[int, int]]]:
    """A value leased in place (``in_place``'s ``view``): its first ``head_bytes`` copied out of
    the arena, and the arena runs ``(offset, length)`` of the rest (read where they are, e.g.
    ``view.tensor(*runs[0])`` when they are one run)."""
    ext = value_extents(desc.slots, desc.size, view.slot_bytes)
    head = bytearray(head_bytes)
    addr, _, keep = local_buffer(head)
    view.read(plan([(addr, head_bytes)], slice_extents(ext, 0, head_bytes)))
    del keep
    return head, slice_extents(ext, head_bytes, desc.size - head_bytes)


LEASE_MARGIN = 0.01
"""Share of a lease's TTL that a reader leaves unused (clock-rate drift between hosts)."""


def safe_end(g: Grant) -> float:
    """When this client stops trusting a read lease: a little before its deadline.

    The deadline counts from when the request was sent, the node's from when it
    arrived, so on one host (one monotonic clock) a copy that ended before it ran
    under a live lease; across hosts only the clocks' rate difference matters.
    """
    ttl = g.expires_at - g.sent_at
    return g.expires_at - LEASE_MARGIN * ttl


def _check_keys(keys) -> None:
    if isinstance(keys, (bytes, bytearray, str)) or not hasattr(keys, "__iter__"):
        raise InvalidArgumentError(f"keys must be a list of bytes, got {type(keys).__name__}")
    for k in keys:
        check_key(k)


def _check_lease(lease_id) -> None:
    if not isinstance(lease_id, int) or isinstance(lease_id, bool) or not 0 <= lease_id < 1 << 64:
        raise InvalidArgumentError(f"a lease id is an unsigned 64-bit integer, got {lease_id!r}")


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
