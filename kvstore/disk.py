"""Disk tier: values in one LMDB environment, read with large direct I/O.

Each batch of writes is one LMDB write transaction, so a batch appears whole or
not at all and a committed value survives kill -9 (and power loss with
``sync=True``). Each stored value is prefixed by a 24-byte record header
(xxh3_64 of the value, its size, and the time it was written), so a value that
rots on disk reads as DATA_LOSS, never as wrong bytes, and the index rebuilt at
start knows every size and the write order without reading the values.

Reads do not fault a value in through LMDB's map page by page (4 KiB at a time:
the map is opened without readahead so that B-tree look-ups stay one page). A
value larger than a page is an LMDB overflow run, contiguous in ``data.mdb``:
the read transaction finds it (a zero-copy buffer into the map, whose address
less the map's base is its offset in the file) and one ``preadv`` of the
page-aligned range around it brings it in, with ``O_DIRECT`` where the file
system allows (the DRAM tier is the cache; the page cache would hold the same
bytes twice). The read happens while the transaction is open, so LMDB cannot
reuse those pages under it, and the kernel writes back any dirty page of the
range before a direct read, so the bytes are the committed ones. ``read_many``
keeps several such reads in flight on threads (``preadv`` releases the GIL).
See docs/architecture.md ("Disk tier") for the measurements behind this.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import xxhash

import grpc

from kvstore.errors import CrescentError, DataLossError, ResourceExhaustedError

log = logging.getLogger(__name__)

_REC = struct.Struct("<QQd")  # xxh3_64, size, unix time of the write
PAGE = 4096
ALIGN = 4096
"""Alignment of direct reads (offset, length and buffer); a multiple of any logical block size."""


class DiskTierError(RuntimeError):
    """The disk tier cannot start (unreadable, corrupt or locked LMDB file)."""


class DiskFullError(ResourceExhaustedError):
    """The disk tier cannot take a write: its map is full, or the file system is (ENOSPC)."""


class DiskWriteError(CrescentError):
    """The disk tier failed a write for another reason than room (an I/O error)."""

    grpc_code = grpc.StatusCode.INTERNAL


def disk_cost(size: int) -> int:
    """Bytes a value of ``size`` is charged on disk: its record rounded up to LMDB pages."""
    return -(-(size + _REC.size + 64) // PAGE) * PAGE


def _map_base(path: str) -> int | None:
    """Address where this process maps ``path`` from offset 0 (LMDB's map), from /proc/self/maps."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real and int(parts[2], 16) == 0:
                    return int(parts[0].split("-")[0], 16)
    except OSError:
        pass
    return None


class DiskTier:
    """LMDB-backed tier. Thread-safe: LMDB serialises writers, readers never block."""

    def __init__(self, path: str, capacity_bytes: int, sync: bool = False,
                 read_threads: int = 8, direct: bool = True, offset_reads: bool = True) -> None:
        """
        Args:
            path: folder of the LMDB environment.
            capacity_bytes: the map size (values are admitted up to 85% of it).
            sync: fsync each commit (power-loss safe).
            read_threads: reads ``read_many`` keeps in flight.
            direct: read with O_DIRECT where the file system allows.
            offset_reads: read values at their file offsets (False: through the map, page
                fault by page fault, as before; kept for benchmarks and as the fallback).
        """
        os.makedirs(path, exist_ok=True)
        # NOTE: LMDB needs room for its B-tree and free pages beyond the values'
        # own pages: the tier admits values up to 85% of the map size.
        self.capacity_bytes = int(capacity_bytes * 0.85)
        self.map_size = capacity_bytes
        try:
            self.env = lmdb.open(path, map_size=capacity_bytes, subdir=True, max_dbs=1,
                                 sync=sync, metasync=sync, readahead=False, lock=True)
            self.db = self.env.open_db(b"values")
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot open the disk tier at {path}: {exc}") from exc
        self.read_threads = max(1, read_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._fd, self.direct = -1, False
        self._base = _map_base(os.path.join(path, "data.mdb")) if offset_reads else None
        if self._base is not None:
            self._open_reader(os.path.join(path, "data.mdb"), direct)
        if self._fd < 0 and offset_reads:
            log.warning("disk tier %s: reading values through the LMDB map (no file offsets)", path)

    def _open_reader(self, path: str, direct: bool) -> None:
        """Opens the file for offset reads: O_DIRECT where the file system takes it, else buffered."""
        for flags in ((os.O_RDONLY | os.O_DIRECT,) if direct and hasattr(os, "O_DIRECT") else ()) + (os.O_RDONLY,):
            try:
                fd = os.open(path, flags)
            except OSError:
                continue
            try:
                buf = mmap.mmap(-1, ALIGN)
                os.preadv(fd, [buf], 0)  # tmpfs and some others refuse direct reads here (EINVAL)
            except OSError:
                os.close(fd)
                continue
            self._fd, self.direct = fd, bool(flags & getattr(os, "O_DIRECT", 0))
            return

    def scan(self) -> Iterator[tuple[bytes, int, float]]:
        """Yields ``(key, size, written_at)`` of every stored value (reads headers only).

        Raises:
            DiskTierError: the file is corrupt.
        """
        try:
            with self.env.begin(db=self.db, buffers=True) as txn:
                for key, val in txn.cursor():
                    if len(val) < _REC.size:
                        raise DiskTierError(f"corrupt record under key {bytes(key).hex()}")
                    _, size, ts = _REC.unpack_from(val, 0)
                    if size != len(val) - _REC.size:
                        raise DiskTierError(f"truncated record under key {bytes(key).hex()}")
                    yield bytes(key), size, ts
        except lmdb.Error as exc:
            raise DiskTierError(f"the disk tier is corrupt: {exc}") from exc

    def put_many(self, items: list[tuple[bytes, list[memoryview] | bytes]]) -> None:
        """Writes every ``(key, value parts)`` in one transaction.

        Raises:
            DiskFullError: the LMDB map or the file system is full (nothing of the batch is written).
            DiskWriteError: another write error (nothing of the batch is written).
        """
        now = time.time()
        nbytes = 0
        try:
            with self.env.begin(db=self.db, write=True) as txn:
                for key, parts in items:
                    if isinstance(parts, (bytes, bytearray, memoryview)):
                        parts = [parts]
                    h = xxhash.xxh3_64()
                    size = 0
                    for p in parts:
                        h.update(p)
                        size += len(p)
                    nbytes += disk_cost(size)
                    txn.put(key, b"".join([_REC.pack(h.intdigest(), size, now), *parts]))
        except lmdb.MapFullError as exc:
            raise DiskFullError("the disk tier is full (its map size)") from exc
        except lmdb.Error as exc:
            # NOTE: LMDB reports a short write (what a full file system gives) as EIO:
            # the file system's free space tells the two apart.
            free = self._free_bytes()
            if _errno(exc) in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < nbytes + (1 << 20)):
                raise DiskFullError(f"the disk tier's file system is full ({free} bytes free): {exc}") from exc
            raise DiskWriteError(f"the disk tier failed a write: {exc}") from exc

    def get(self, key: bytes) -> memoryview | None:
        """The value, verified against its checksum; None if absent.

        Raises:
            DataLossError: the stored record is corrupt.
        """
        return self._read(key)

    def read_many(self, keys: list[bytes]) -> list[memoryview | None | DataLossError]:
        """Reads values with several large reads in flight: per key its bytes, None (absent)
        or the DataLossError of a corrupt record."""
        if len(keys) <= 1 or self.read_threads == 1:
            return [self._read_or_error(k) for k in keys]
        return list(self._executor().map(self._read_or_error, keys))

    def delete_many(self, keys: list[bytes]) -> None:
        """Deletes records in one transaction.

        Raises:
            DiskWriteError: LMDB could not commit (e.g. a full file system); nothing is deleted.
        """
        if not keys:
            return
        try:
            with self.env.begin(db=self.db, write=True) as txn:
                for k in keys:
                    txn.delete(k)
        except lmdb.Error as exc:
            raise DiskWriteError(f"the disk tier failed a delete: {exc}") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.env.close()

    # ---- internals ----------------------------------------------------------

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.env.path())
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="disk-read")
            return self._pool

    def _read_or_error(self, key: bytes) -> memoryview | None | DataLossError:
        try:
            return self._read(key)
        except DataLossError as exc:
            return exc

    def _read(self, key: bytes) -> memoryview | None:
        with self.env.begin(db=self.db, buffers=True) as txn:
            val = txn.get(key)
            if val is None:
                return None
            n = len(val)
            if n < _REC.size:
                raise DataLossError(f"corrupt disk record for key {key.hex()}")
            off = self._offset(val)
            rec = self._pread(off, n) if off is not None else memoryview(bytes(val))
        digest, size, _ = _REC.unpack_from(rec, 0)
        data = rec[_REC.size:]
        if size != len(data) or xxhash.xxh3_64_intdigest(data) != digest:
            raise DataLossError(f"disk record for key {key.hex()} failed its checksum")
        return data

    def _offset(self, val: memoryview) -> int | None:
        """The file offset of a value LMDB handed out as a buffer into its map, when
        offset reads are on and the value spans more than a page (smaller values are
        copied from the map: they sit inside B-tree pages, one fault at most)."""
        if self._fd < 0 or len(val) < PAGE:
            return None
        off = np.frombuffer(val, np.uint8).ctypes.data - self._base
        return off if 0 <= off and off + len(val) <= self.map_size else None

    def _pread(self, off: int, n: int) -> memoryview:
        """``n`` bytes at ``off`` of the file in one aligned read, into a fresh page-aligned buffer."""
        start = off - off % ALIGN
        end = -(-(off + n) // ALIGN) * ALIGN
        buf = mmap.mmap(-1, end - start)
        got = os.preadv(self._fd, [buf], start)
        if got < off + n - start:
            raise DataLossError(f"short read from the disk tier ({got} of {end - start} bytes)")
        return memoryview(buf)[off - start : off - start + n]


def _errno(exc: lmdb.Error) -> int | None:
    """The errno behind a py-lmdb error, from its message (py-lmdb keeps LMDB's text only)."""
    text = str(exc)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        if os.strerror(code) in text:
            return code
    return None
