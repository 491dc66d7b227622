"""The ``shm`` mover: a same-host client maps the node's DRAM arena and copies slots itself.

The arena is one file under /dev/shm (kvstore/arena.py). The client opens it
read-write, checks that it is the node's very file (device and inode from
``KVStore.Transports``; a container with its own /dev/shm sees another file or
none) and maps it shared. Copies are plain memmoves between the caller's
buffers and the mapping, several threads for large batches.

The client trusts the descriptors' bounds only after checking them against the
arena's size: a bad descriptor fails the call, it never touches memory outside
the mapping.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

from kvstore.arena import SECRET_BYTES, SHM_DIR, shm_proof, slot_tables, table_bytes
from kvstore.errors import DataLossError, FailedPreconditionError
from kvstore.transport.descriptors import ArenaRef, Mover
from kvstore.transport.memcopy import DEFAULT_THREADS, CopyEngine, Op, buffer_address


class ShmUnavailableError(FailedPreconditionError):
    """The node's arena file cannot be mapped here (the message says why)."""


class ShmMover:
    """Copies between local memory and a node's mapped arena.

    Args:
        arena: the node's arena (from ``Transports``).
        threads: copy threads for large batches (the caller's thread included).

    Raises:
        ShmUnavailableError: the file is missing, not readable and writable by
            this user, not the node's file, or smaller than announced.
    """

    mover = Mover.SHM

    def __init__(self, arena: ArenaRef, threads: int = DEFAULT_THREADS) -> None:
        if "/" in arena.name or not arena.name:
            raise ShmUnavailableError(f"bad arena name {arena.name!r}")
        path = os.path.join(SHM_DIR, arena.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmUnavailableError(f"cannot open the node's arena {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (arena.file_dev, arena.file_ino):
                raise ShmUnavailableError(f"{path} is not the node's arena file (another /dev/shm?)")
            num_slots = arena.size // arena.slot_bytes
            length = arena.table_offset + table_bytes(num_slots) if arena.table_offset else arena.size
            if arena.table_offset and arena.table_offset < arena.size:
                raise ShmUnavailableError(f"slot tables at {arena.table_offset} overlap the slots")
            if st.st_size < length:
                raise ShmUnavailableError(f"{path} holds {st.st_size} bytes, not {length}")
            self._mmap = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept: ``current`` asks it whether the node still links the file
        self.arena = arena
        self.base = buffer_address(self._mmap)
        self.generations = self.touched = None
        """The node's slot tables (``kvstore/arena.py``), when it shares them: read-mostly views."""
        self.proof = b""
        """Shows the node this client read its arena's secret (sent with every shm grant call)."""
        if arena.table_offset:
            self.generations, self.touched = slot_tables(self._mmap, arena.table_offset, num_slots)
            secret = os.pread(fd, SECRET_BYTES, length)
            if len(secret) == SECRET_BYTES:
                self.proof = shm_proof(secret)
        self._engine = CopyEngine(threads)
        self._tensor = None  # the whole arena as a CPU tensor, made on first use (tensor())
        self._registered = False
        self._cuda_device = None

    @property
    def slot_bytes(self) -> int:
        return self.arena.slot_bytes

    def current(self) -> bool:
        """Whether the node still serves this arena: a node that stops unlinks its file,
        and so does the next node to start after one that died (``reap_stale_segments``)."""
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:
            return False

    def read(self, ops: Sequence[Op], buffers=()) -> None:
        """Copies arena bytes to local memory: ``ops`` are ``(local addr, arena offset, length)``."""
        self._check(ops)
        base = self.base
        self._engine.run([(local, base + off, n) for local, off, n in ops])

    def write(self, ops: Sequence[Op], buffers=()) -> None:
        """Copies local bytes into the arena: ``ops`` are ``(local addr, arena offset, length)``."""
        self._check(ops)
        base = self.base
        self._engine.run([(base + off, local, n) for local, off, n in ops])

    def post_read(self, ops: Sequence[Op], buffers=()) -> None:
        """``read``, done by the time it returns (the RDMA mover's returns at once): its ticket."""
        self.read(ops, buffers)

    def wait(self, ticket) -> None:
        """Nothing to wait for: ``post_read`` copied already."""

    def tensor(self, offset: int, n: int):
        """Arena bytes ``[offset, offset + n)`` as a CPU uint8 tensor viewing the mapping (no
        copy): valid while a lease holds them and this mover is open."""
        if offset < 0 or n < 0 or offset + n > self.arena.size:
            raise DataLossError(f"descriptor outside the arena: offset {offset} + {n} > {self.arena.size}")
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.arena.size)
        return self._tensor[offset : offset + n]

    @property
    def cuda_registered(self) -> bool:
        """Whether the mapping is page-locked for CUDA (device copies to and from it are DMA)."""
        return self._registered

    def register_cuda(self, device=None) -> str | None:
        """Page-locks the mapping for CUDA (``cudaHostRegister``; the pages stay the node's),
        so that a device copy from arena bytes is a DMA straight from them. ``device``: the GPU
        whose copies use it (default the current one; its context makes the call). None when done
        (or done before), else why not (copies then stage through the driver)."""
        if self._registered:
            return None
        try:
            from kernels.host import register_host_memory
        except ImportError as exc:  # no torch: nothing to register for
            return f"torch unavailable: {exc}"
        why = register_host_memory(self.base, self.arena.size, device)
        self._registered = why is None
        self._cuda_device = device
        return why

    def close(self) -> None:
        if self._fd < 0:  # closed already
            return
        self._engine.close()
        os.close(self._fd)
        self._fd = -1
        for v in (self.generations, self.touched):
            if v is not None:
                v.release()
        if self._registered:
            from kernels.host import unregister_host_memory

            unregister_host_memory(self.base, self._cuda_device)
            self._registered = False
        self._tensor = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor viewing it is still alive: the mapping goes with it
            pass

    def _check(self, ops: Sequence[Op]) -> None:
        size = self.arena.size
        for _, off, n in ops:
            if off < 0 or n < 0 or off + n > size:
                raise DataLossError(f"descriptor outside the arena: offset {off} + {n} > {size}")
