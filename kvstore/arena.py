"""Fixed-size slot arenas: host DRAM in a shared-memory segment, and GPU HBM.

A value occupies ``ceil(size / slot_bytes)`` slots, not necessarily adjacent.
Free slots form an intrusive singly linked list: the link of slot ``i`` is
``next_free[i]`` in a flat int array, so alloc and free allocate no Python
objects per slot and never scan. Each slot carries a generation that grows on
every free, so a descriptor naming (slot, generation) goes stale the moment the
slot is reused. A slot's generation also grows when its value leaves the index
while still leased (``retire``: replaced or deleted under a reader), so equal
generations mean the slot has held the same *live* value throughout.

The host arena keeps its generations, and one "touched" byte per slot, in the
same shared file, after the slots: a same-host client that remembers a value's
(slots, generations) reads it with no call to the node (generations checked
before and after its copy, a seqlock) and marks it touched so that eviction
treats it as recently used (``TieredStore``: a second chance).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import mmap
import os
import secrets
import weakref
from array import array

SHM_DIR = "/dev/shm"
SHM_PREFIX = "crescent-"


def reap_stale_segments() -> list[str]:
    """Unlinks the arena files in /dev/shm that no live store node holds (left by kill -9, an OOM kill).

    Each node holds an exclusive ``flock`` on its arena file for its whole life, and the kernel drops
    it when the process ends, however it ends. So a file whose lock this process can take belongs to
    no one. That rule needs no pid: it holds where the name's pid says nothing, as in a restarted
    container whose new node has the dead one's pid (1, say) while the dead one's arena still fills
    the pod's memory-backed /dev/shm, or beside a node in another pid namespace that shares
    /dev/shm, whose pid this process cannot see. The lock is held while unlinking, so a node
    creating its file at the same moment finds out (``HostArena`` checks its name after locking).
    """
    removed = []
    if not os.path.isdir(SHM_DIR):
        return removed
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(SHM_PREFIX):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, another user's, or no regular file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # BlockingIOError: a live node holds it; FileNotFoundError: another reaper was first
        finally:
            os.close(fd)
    return removed


def table_bytes(num_slots: int) -> int:
    """Bytes of the slot tables after a host arena's slots: u64 generations, then u8 touched."""
    return 9 * num_slots


SECRET_BYTES = 32
"""The arena's secret, after its slot tables: only a process that can open the file (0600, the
node's user) reads it, and it proves so to the node before its first shm grant (``shm_proof``)."""


def shm_proof(secret: bytes) -> bytes:
    """What a client sends to show it read the arena's secret (not the secret itself)."""
    return hmac.new(secret, b"crescent shm grant", hashlib.sha256).digest()[:16]


def slot_tables(buf, offset: int, num_slots: int) -> tuple[memoryview, memoryview]:
    """``(generations, touched)`` views of the slot tables at ``offset`` of a mapped arena file."""
    m = memoryview(buf)
    gens = m[offset : offset + 8 * num_slots].cast("Q")
    touched = m[offset + 8 * num_slots : offset + 9 * num_slots]
    m.release()
    return gens, touched


class SlotAllocator:
    """Slot bookkeeping shared by the host and device arenas."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        assert num_slots > 0 and slot_bytes > 0
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._next_free = array("i", range(1, num_slots + 1))
        self._next_free[num_slots - 1] = -1
        self._free_head = 0
        self.num_free = num_slots
        self.generation = array("Q", bytes(8 * num_slots))

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def alloc(self, num: int) -> list[int] | None:
        """Takes ``num`` free slots, or None (and takes nothing) when fewer are free.

        Returned in ascending order: slots freed one by one (small values) sit on the
        free list in reverse, and sorted they are again one run (one copy, not ``num``).
        """
        if num > self.num_free:
            return None
        out = []
        head, nxt = self._free_head, self._next_free
        for _ in range(num):
            out.append(head)
            head = nxt[head]
        self._free_head = head
        self.num_free -= num
        if num > 1:
            out.sort()
        return out

    def retire(self, slots: list[int]) -> None:
        """Bumps the generation of slots whose value left the index but stays leased
        (it is freed, and bumped again, at the last release)."""
        gen = self.generation
        for s in slots:
            gen[s] += 1

    def free(self, slots: list[int]) -> None:
        """Returns slots; pushed in reverse so that the next ``alloc`` of as many takes them
        back in ascending order (a value's adjacent slots stay one run for the copiers)."""
        head, nxt, gen = self._free_head, self._next_free, self.generation
        for s in reversed(slots):
            gen[s] += 1
            nxt[s] = head
            head = s
        self._free_head = head
        self.num_free += len(slots)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - self.num_free) * self.slot_bytes


def _unlink_own(path: str, owner_pid: int) -> None:
    """Unlinks ``path`` if this is the process that made it: a child forked from the node that
    exits normally runs the parent's exit hooks, and must not take the live node's file away."""
    if os.getpid() == owner_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class HostArena(SlotAllocator):
    """Slots in one file under /dev/shm, mapped shared so same-host clients can map it too.

    The file is named ``crescent-<pid>-<random>``. The node holds a ``flock`` on it while it
    lives; ``reap_stale_segments`` removes the files no one holds at the next node's start.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int, populate: bool = False) -> None:
        """
        Args:
            populate: reserve the file's memory and fault the mapping in now (``fallocate``,
                ``MAP_POPULATE``). A first write into a fresh shared-memory page is a page fault
                that allocates it: on the development VM a first pass over a fresh arena wrote
                0.35-1.4 GB/s where a populated one takes 18 GB/s. Populated, that cost is paid
                once at start, and a /dev/shm too small for the arena is an error now instead of
                a SIGBUS at the put that finds it full.

        Raises:
            ValueError: no slot fits.
            OSError: (``populate``) /dev/shm cannot hold the arena (ENOSPC).
        """
        num_slots = capacity_bytes // slot_bytes
        if num_slots <= 0:
            raise ValueError(f"a DRAM arena of {capacity_bytes} B holds no {slot_bytes} B slot")
        super().__init__(num_slots, slot_bytes)
        self.table_offset = num_slots * slot_bytes
        secret_at = self.table_offset + table_bytes(num_slots)
        file_bytes = secret_at + SECRET_BYTES
        fd = self._create_locked()
        try:
            os.ftruncate(fd, file_bytes)
            if populate:
                try:
                    os.posix_fallocate(fd, 0, file_bytes)
                except OSError as exc:
                    free = os.statvfs(SHM_DIR)
                    raise OSError(exc.errno, f"cannot reserve {file_bytes} bytes for the DRAM arena in {SHM_DIR} "
                                  f"({free.f_bavail * free.f_frsize} bytes free): lower --dram or enlarge "
                                  f"{SHM_DIR}") from exc
            secret = secrets.token_bytes(SECRET_BYTES)
            os.pwrite(fd, secret, secret_at)
            self.shm_proof = shm_proof(secret)
            """What a same-host client that read the file's secret sends before its shm grants."""
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(fd, secret_at, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.unlink(self.path)
            os.close(fd)
            raise
        self._lock_fd = fd
        """Open, with the file's ``flock``, until ``close``: the mark of a live owner."""
        self._unlink = weakref.finalize(self, _unlink_own, self.path, os.getpid())
        """Removes the file once: at ``close``, or when the arena is collected or its process exits
        without closing it (an embedding program that never stopped its node). The reaper would
        take it only at some later node's start; until then it holds its size of the host's RAM."""
        self.buf = memoryview(self._mmap)[: self.table_offset]
        self.generation, self.touched = slot_tables(self._mmap, self.table_offset, num_slots)

    def _create_locked(self) -> int:
        """Creates the arena's file under a fresh name and takes its lock; returns the descriptor."""
        for _ in range(8):
            self.name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self.path = os.path.join(SHM_DIR, self.name)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # NOTE: a starting node's reaper may have locked and unlinked the file between its
                # creation and this lock; once locked, no reaper can, so check the name once.
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except OSError:
                pass
            os.close(fd)
        raise OSError(f"could not create and lock an arena file in {SHM_DIR}")

    def free(self, slots: list[int]) -> None:
        touched = self.touched
        for s in slots:
            touched[s] = 0
        super().free(slots)

    def views(self, slots: list[int], nbytes: int) -> list[memoryview]:
        """Writable views covering the first ``nbytes`` of ``slots``, in order."""
        sb, buf, out = self.slot_bytes, self.buf, []
        for s in slots:
            n = min(sb, nbytes)
            if n <= 0:
                break
            out.append(buf[s * sb : s * sb + n])
            nbytes -= n
        return out

    def close(self) -> None:
        try:
            for v in (self.buf, self.generation, self.touched):
                v.release()
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported (a reader mid-copy at shutdown): the OS frees it at exit
        self._unlink()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class DeviceArena(SlotAllocator):
    """Slots in one CUDA allocation (HBM). Reads and writes copy to or from host memory."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, device: str = "cuda") -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the device tier needs a CUDA GPU; torch sees none (use --device 0)")
        num_slots = capacity_bytes // slot_bytes
        super().__init__(num_slots, slot_bytes)
        self._torch = torch
        self.storage = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=device)

    def write(self, slots: list[int], src: list[memoryview]) -> None:
        """Copies the host bytes of ``src`` (concatenated) into ``slots``."""
        data = b"".join(src) if len(src) != 1 else src[0]
        host = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        sb, off = self.slot_bytes, 0
        for s in slots:
            n = min(sb, host.numel() - off)
            if n <= 0:
                break
            self.storage[s * sb : s * sb + n].copy_(host[off : off + n], non_blocking=False)
            off += n

    def read(self, slots: list[int], nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        host = self._torch.frombuffer(out, dtype=self._torch.uint8) if nbytes else None
        sb, off = self.slot_bytes, 0
        for s in slots:
            n = min(sb, nbytes - off)
            if n <= 0:
                break
            host[off : off + n].copy_(self.storage[s * sb : s * sb + n])
            off += n
        return out

    def ipc_export(self) -> tuple[str, tuple]:
        """``(device UUID, handle)``: the tier's memory as another process on this host maps it
        with CUDA IPC (torch's ``_share_cuda_`` tuple, opened by ``kvstore/transport/cuda_ipc.py``).

        Raises:
            RuntimeError: the driver or torch cannot export it (the message says why).
        """
        dev = self.storage.device
        props = self._torch.cuda.get_device_properties(dev)
        uuid = str(getattr(props, "uuid", ""))
        return uuid, self.storage.untyped_storage()._share_cuda_()

    def close(self) -> None:
        del self.storage
