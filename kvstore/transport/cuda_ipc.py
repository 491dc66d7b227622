"""The ``cuda_ipc`` mover: a same-host GPU client maps the node's device (HBM) tier.

The node's device tier is one CUDA allocation. The node exports it with CUDA
IPC (``DeviceArena.ipc_export``; the handle travels in ``KVStore.Transports``)
and a client on the same host opens it once, as torch's own tensor sharing
does (``UntypedStorage._new_shared_cuda``), on its index of the same GPU (found
by UUID). A granted value is then a slice of that mapping: the engine copies
it device to device into its pages, with no host copy at all (Mooncake's
intra-node NVLink transport, on one GPU).

Only reads: the device tier takes puts through the node. The grant calls are
the descriptor protocol's (``AcquireRead`` with mover ``cuda_ipc`` names
device-arena slots), and the same read guarantee holds: the lease is released
after the copies that read it have completed.

The mapping lives as long as the node's allocation: a restarted node exports a
new one, and the session maps it anew with its new shm arena.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import DataLossError, FailedPreconditionError
from kvstore.transport.descriptors import DeviceArenaRef, Mover
from kvstore.transport.memcopy import Op


class CudaIpcUnavailableError(FailedPreconditionError):
    """The node's device tier cannot be mapped here (the message says why)."""


def _device_index(torch, ref: DeviceArenaRef) -> int:
    """This process's index of the node's GPU."""
    if not ref.device_uuid:
        return ref.ipc[0]  # a torch that cannot tell UUIDs: the node's index (same visible devices)
    for i in range(torch.cuda.device_count()):
        if str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) == ref.device_uuid:
            return i
    raise CudaIpcUnavailableError(f"the node's GPU {ref.device_uuid} is not visible to this process")


class CudaIpcMover:
    """The node's device tier mapped into this process.

    Args:
        ref: the node's device arena (``Transports``).

    Raises:
        CudaIpcUnavailableError: no CUDA here, the node's GPU is not visible, or the driver
            refuses the handle (another host's, or the node's own process).
    """

    mover = Mover.CUDA_IPC

    def __init__(self, ref: DeviceArenaRef) -> None:
        try:
            import torch
        except ImportError:
            raise CudaIpcUnavailableError("torch is not installed here") from None
        if not torch.cuda.is_available():
            raise CudaIpcUnavailableError("torch sees no CUDA device here")
        self._torch = torch
        self.ref = ref
        self.device = torch.device("cuda", _device_index(torch, ref))
        dev, handle, nbytes, offset, rc_handle, rc_offset, ev_handle, ev_sync = ref.ipc
        if nbytes < ref.size:
            raise CudaIpcUnavailableError(f"the exported allocation holds {nbytes} bytes, not {ref.size}")
        try:
            with torch.cuda.device(self.device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    self.device.index, bytes(handle), nbytes, offset, bytes(rc_handle), rc_offset, bytes(ev_handle),
                    bool(ev_sync))
        except Exception as exc:  # noqa: BLE001 - the driver's refusal, said in one line
            raise CudaIpcUnavailableError(f"cannot open the node's CUDA IPC handle: {exc}") from None
        self._storage = storage
        self._arena = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (ref.size,), (1,))
        self._stream = torch.cuda.Stream(self.device)
        """Header reads go here: on the compute stream they would wait for the queued kernels."""

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def slot_bytes(self) -> int:
        return self.ref.slot_bytes

    def tensor(self, offset: int, n: int):
        """Bytes ``[offset, offset + n)`` of the device tier as a CUDA uint8 tensor (no copy): valid
        while a lease holds them and this mover is open."""
        if offset < 0 or n < 0 or offset + n > self.ref.size:
            raise DataLossError(f"descriptor outside the device arena: offset {offset} + {n} > {self.ref.size}")
        return self._arena[offset : offset + n]

    def read(self, ops: Sequence[Op], buffers=()) -> None:
        """Copies device-tier bytes to host memory: ``ops`` are ``(host addr, arena offset, length)``
        (small reads: chunk headers)."""
        import ctypes

        torch = self._torch
        with torch.cuda.stream(self._stream):
            for addr, off, n in ops:
                src = self.tensor(off, n)
                if n:
                    dst = torch.frombuffer((ctypes.c_char * n).from_address(addr), dtype=torch.uint8)
                    dst.copy_(src)  # to pageable memory: synchronous, the bytes are there on return

    def write(self, ops: Sequence[Op], buffers=()) -> None:
        raise FailedPreconditionError("cuda_ipc reads the device tier; writes go through the node")

    def current(self) -> bool:
        return True  # the shm mover beside it tells when the node restarted

    def close(self) -> None:
        self._arena = None
        self._storage = None  # torch closes the IPC mapping with the last reference


__all__ = ["CudaIpcMover", "CudaIpcUnavailableError"]
