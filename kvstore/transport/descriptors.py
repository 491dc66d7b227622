"""Types of the descriptor protocol, shared by the node and the client.

A descriptor names where a value lives in the node's DRAM arena: its slots, in
value order, each with the generation it had when granted. Slot ``i`` holds
bytes ``[i * slot_bytes, min(size, (i + 1) * slot_bytes))`` of the value at
arena offset ``slots[i] * slot_bytes``. Descriptors travel under a lease id (a
read lease or a write reservation) that expires by itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from kvstore.store import Tier
from proto.crescent.v1 import kvstore_pb2 as pb


class Mover(enum.Enum):
    """How value bytes move between a client and a node; values are the CLI/Stats names."""

    GRPC = "grpc"
    TCP = "tcp"
    SHM = "shm"
    RDMA = "rdma"
    CUDA_IPC = "cuda_ipc"
    """Reads of the node's device tier, device to device, beside shm (``kvstore/transport/cuda_ipc.py``)."""

    @property
    def pb(self) -> int:
        return _TO_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> Mover:
        try:
            return _FROM_PB[value]
        except KeyError:
            raise ValueError(f"unknown mover {value}") from None

    @property
    def one_sided(self) -> bool:
        """True for the movers that use descriptors (the client moves the bytes)."""
        return self in (Mover.SHM, Mover.RDMA, Mover.CUDA_IPC)

    @property
    def tier(self) -> Tier:
        """The tier whose slots this one-sided mover's grants name: the device tier's for
        cuda_ipc, the DRAM arena's for the others."""
        return Tier.DEVICE if self is Mover.CUDA_IPC else Tier.DRAM


_TO_PB = {Mover.GRPC: pb.MOVER_GRPC, Mover.TCP: pb.MOVER_TCP, Mover.SHM: pb.MOVER_SHM,
          Mover.RDMA: pb.MOVER_RDMA, Mover.CUDA_IPC: pb.MOVER_CUDA_IPC}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


class ItemStatus(enum.IntEnum):
    """Per key of a descriptor request; numbers match ``crescent.v1.ItemStatus``."""

    OK = 1
    NOT_FOUND = 2
    ELSEWHERE = 3  # read: present outside the arena asked of (DRAM, or the device tier for cuda_ipc)
    EXHAUSTED = 4  # write: the arena cannot make room


SHM_PROOF_NEEDED = ("shm grants need proof that this client can open the node's arena file (0600, the node's user): "
                    "its HMAC of the file's secret, sent first (clients of this project do; others use tcp)")
SHM_PROOF_HEADER = "crescent-shm-proof"
"""gRPC metadata carrying the proof (hex) on AcquireRead/ReserveWrite with the shm mover."""


@dataclass(frozen=True, slots=True)
class ArenaRef:
    """How a client reaches a node's DRAM arena."""

    name: str
    """File name under /dev/shm."""
    size: int
    slot_bytes: int
    file_dev: int
    file_ino: int
    rdma_addr: int = 0
    rdma_rkey: int = 0
    table_offset: int = 0
    """Where the slot tables (generations, touched marks) start in the file; 0: none."""

    @classmethod
    def from_pb(cls, a: pb.ArenaInfo) -> ArenaRef:
        return cls(a.name, a.size, a.slot_bytes, a.file_dev, a.file_ino, a.rdma_addr, a.rdma_rkey,
                   a.table_offset)


@dataclass(frozen=True, slots=True)
class DeviceArenaRef:
    """How a same-host GPU client maps a node's device tier (``pb.DeviceArenaInfo``)."""

    name: str
    size: int
    slot_bytes: int
    device_uuid: str
    ipc: tuple
    """torch's ``_share_cuda_`` tuple: (device, handle, storage bytes, storage offset,
    ref counter handle, ref counter offset, event handle, event sync required)."""

    @classmethod
    def from_pb(cls, d: pb.DeviceArenaInfo) -> DeviceArenaRef | None:
        if not d.available:
            return None
        ipc = (d.device_index, d.ipc_handle, d.storage_bytes, d.storage_offset, d.ref_counter_handle,
               d.ref_counter_offset, d.event_handle, d.event_sync_required)
        return cls(d.name, d.size, d.slot_bytes, d.device_uuid, ipc)


class SlotDescriptor(NamedTuple):
    """One key of a grant: its status and, when OK, its arena slots.

    A named tuple: a grant of a large batch builds one per key on both ends.
    """

    index: int
    status: ItemStatus
    size: int
    tier: Tier | None
    slots: tuple[int, ...] = ()
    generations: tuple[int, ...] = ()

    def extents(self, slot_bytes: int) -> list[tuple[int, int]]:
        """``(arena offset, length)`` runs covering the value in order; adjacent slots merge."""
        return value_extents(self.slots, self.size, slot_bytes)


def gather(values, slots) -> tuple[int, ...]:
    """``values[s]`` for each slot, as a tuple (one C call)."""
    if len(slots) == 1:
        return (values[slots[0]],)
    return itemgetter(*slots)(values) if slots else ()


def value_extents(slots, size: int, slot_bytes: int) -> list[tuple[int, int]]:
    """Arena ``(offset, length)`` runs of a value of ``size`` bytes held in ``slots``."""
    out: list[tuple[int, int]] = []
    left = size
    for s in slots:
        n = min(slot_bytes, left)
        if n <= 0:
            break
        off = s * slot_bytes
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
        left -= n
    return out


def ops_for(local_addr: int, slots, size: int, slot_bytes: int, out: list) -> None:
    """Appends ``(local addr, arena offset, length)`` copies between a contiguous local
    buffer at ``local_addr`` and a value of ``size`` bytes in ``slots`` (adjacent slots merge)."""
    n = len(slots)
    if n and size <= n * slot_bytes and size > (n - 1) * slot_bytes and slots[-1] - slots[0] == n - 1 \
            and (n < 3 or tuple(slots) == tuple(range(slots[0], slots[0] + n))):
        out.append((local_addr, slots[0] * slot_bytes, size))  # the usual case: one ascending run
        return
    pos = 0
    run_local = run_off = run_n = 0
    for s in slots:
        n = size - pos
        if n <= 0:
            break
        if n > slot_bytes:
            n = slot_bytes
        off = s * slot_bytes
        if run_n and run_off + run_n == off:
            run_n += n
        else:
            if run_n:
                out.append((run_local, run_off, run_n))
            run_local, run_off, run_n = local_addr + pos, off, n
        pos += n
    if run_n:
        out.append((run_local, run_off, run_n))


@dataclass(frozen=True, slots=True)
class Grant:
    """A read lease or a write reservation as the client holds it."""

    lease_id: int
    """0 when no key was granted (nothing to release or commit)."""
    expires_at: float
    """``time.monotonic()`` by which the node may sweep it (measured from the request's send)."""
    arena: str
    items: tuple[SlotDescriptor, ...]
    message: str = ""
    sent_at: float = 0.0
    """``time.monotonic()`` when the request was sent."""

    @classmethod
    def from_pb(cls, r, sent_at: float) -> Grant:
        items = tuple(
            SlotDescriptor(d.index, ItemStatus(d.status), d.size, Tier(d.tier) if d.tier else None,
                           tuple(d.slots), tuple(d.generations))
            for d in r.items)
        return cls(r.lease_id, sent_at + r.expires_in_s, r.arena, items, getattr(r, "message", ""), sent_at)


def descriptor_pb(index: int, status: ItemStatus, size: int = 0, tier: Tier | None = None,
                  slots=(), generations=()) -> pb.SlotDescriptor:
    return pb.SlotDescriptor(index=index, status=int(status), size=size,
                             tier=int(tier) if tier is not None else 0,
                             slots=slots, generations=generations)
