"""Disk tier: value bytes in one data file, read and written with large direct I/O; LMDB holds the index.

Layout of the tier's folder:

- ``values.dat``: the value bytes, in 4 KiB blocks. A value occupies one extent
  of whole blocks (a few when free space is fragmented). The file is as large
  as the tier (sparse until written).
- LMDB (``data.mdb``): one small record per value, ``key → size ‖ xxh3_64 ‖
  write time ‖ extents``. It is the index: free space is what no record
  covers, rebuilt at start from the records alone.

A batch of writes puts its values into free extents, then commits their records
in one LMDB transaction: a value exists once its record is committed, whole or
not at all. A value that is replaced or deleted keeps its extents until the
store frees them (after its last read lease), so a read never sees its blocks
reused. A value whose bytes fail their checksum reads as DATA_LOSS, never as
wrong bytes.

Reads and writes use ``O_DIRECT`` where the file system takes it (the DRAM tier
is the cache; the page cache would hold the same bytes twice), one ``preadv`` /
``pwritev`` per extent through a page-aligned buffer; ``read_many`` keeps several
reads in flight on threads (they release the GIL). Why not the values inside
LMDB: py-lmdb touches every 4 KiB page of a value it returns (its ``preload``),
so under LMDB's ``MADV_RANDOM`` map each read became one synchronous 4 KiB I/O
per page (0.04 GB/s where ``fio`` reads 1 GB/s); docs/architecture.md has the
measurements.

Durability: ``kill -9`` loses nothing committed (data is written before its
record commits; both are in the kernel once the calls return). Power loss:
with ``sync=True`` the data file is fdatasync'ed before each index commit, and
the commit is fsync'ed.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import lmdb
import xxhash

from kvstore.errors import CrescentError, DataLossError, ResourceExhaustedError

log = logging.getLogger(__name__)

BLOCK = 4096
"""Allocation unit and direct-I/O alignment (offset, length and buffer address)."""
DATA_FILE = "values.dat"
LOCK_FILE = "LOCK"
"""Held (``flock``) by the one process that has the tier open."""
_IOV_MAX = 512  # buffers per pwritev (Linux takes 1024)
RUN = 8 << 20
"""Largest single read or write: adjacent values of a batch move in runs up to this size."""
_REC = struct.Struct("<QQdI")  # size, xxh3_64, unix time of the write, number of extents
_EXT = struct.Struct("<QQ")  # offset, length (whole blocks)
_REC1 = struct.Struct("<QQdIQQ")  # a record of one extent: _REC then _EXT, packed at once


class DiskTierError(RuntimeError):
    """The disk tier cannot start (unreadable, corrupt or locked files)."""


class DiskFullError(ResourceExhaustedError):
    """The disk tier cannot take a write: no free blocks, or the file system is full (ENOSPC)."""


class DiskWriteError(CrescentError):
    """The disk tier failed a write for another reason than room (an I/O error)."""

    grpc_code = grpc.StatusCode.INTERNAL


def disk_cost(size: int) -> int:
    """Bytes a value of ``size`` takes on disk: whole blocks, at least one."""
    return max(1, -(-size // BLOCK)) * BLOCK


@dataclass(frozen=True, slots=True)
class Loc:
    """Where a value's bytes are, and what they must hash to."""

    extents: tuple[tuple[int, int], ...]
    size: int
    digest: int
    written_at: float

    def encode(self) -> bytes:
        if len(self.extents) == 1:
            return _REC1.pack(self.size, self.digest, self.written_at, 1, *self.extents[0])
        return _REC.pack(self.size, self.digest, self.written_at, len(self.extents)) + b"".join(
            _EXT.pack(o, n) for o, n in self.extents)

    @staticmethod
    def decode(buf) -> Loc:
        """Raises ValueError on a malformed record."""
        if len(buf) < _REC.size:
            raise ValueError("short record")
        size, digest, ts, n = _REC.unpack_from(buf, 0)
        if len(buf) != _REC.size + n * _EXT.size:
            raise ValueError("record length does not match its extents")
        ext = tuple(_EXT.unpack_from(buf, _REC.size + i * _EXT.size) for i in range(n))
        if sum(ln for _, ln in ext) != (-(-size // BLOCK) * BLOCK if size else 0) or any(
                o % BLOCK or ln % BLOCK or ln <= 0 for o, ln in ext):
            raise ValueError("extents do not match the size")
        return Loc(ext, size, digest, ts)


class _Buffers:
    """Reusable page-aligned read buffers in two sizes. Fresh anonymous memory is slow to fault
    in (every page on first touch; on the development VM 8 MiB took 3.4 ms, a third of reading
    it), so buffers go back here when the last value read into one is released."""

    SIZES = (1 << 20, RUN)

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._idle: dict[int, list[mmap.mmap]] = {n: [] for n in self.SIZES}
        self._lock = threading.Lock()

    def get(self, n: int) -> tuple[mmap.mmap, int]:
        for size in self.SIZES:
            if n <= size:
                with self._lock:
                    if self._idle[size]:
                        return self._idle[size].pop(), size
                return mmap.mmap(-1, size), size
        return mmap.mmap(-1, n), 0

    def put(self, buf: mmap.mmap, size: int) -> None:
        if size:
            with self._lock:
                if len(self._idle[size]) < self.keep:
                    self._idle[size].append(buf)


class Hold:
    """What values read into a pooled buffer keep alive: ``release`` once per value; the
    buffer is reused after the last (its views must not be used after their own release)."""

    __slots__ = ("_pool", "_buf", "_size", "_count")

    def __init__(self, pool: _Buffers, buf: mmap.mmap, size: int, count: int) -> None:
        self._pool, self._buf, self._size, self._count = pool, buf, size, count

    def release(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._pool.put(self._buf, self._size)
            self._buf = None


class FreeSpace:
    """Free extents of the data file: sorted, coalesced; first fit, else several pieces."""

    def __init__(self, total: int, used: Sequence[tuple[int, int]] = ()) -> None:
        self.starts: list[int] = []
        self.lens: list[int] = []
        pos = 0
        for off, ln in sorted(used):
            if off < pos or off + ln > total:
                raise ValueError(f"extent {off}+{ln} overlaps another or ends past the file ({total} bytes)")
            if off > pos:
                self.starts.append(pos)
                self.lens.append(off - pos)
            pos = off + ln
        if pos < total:
            self.starts.append(pos)
            self.lens.append(total - pos)
        self.free_bytes = sum(self.lens)

    def alloc(self, nbytes: int) -> tuple[tuple[int, int], ...] | None:
        """Extents totalling ``nbytes`` (a multiple of BLOCK): one where one fits, else the
        lowest pieces; None when not enough is free."""
        if nbytes == 0:
            return ()
        if nbytes > self.free_bytes:
            return None
        off = self.alloc_extent(nbytes)
        if off is not None:
            return ((off, nbytes),)
        out, need = [], nbytes
        while need:
            take = min(self.lens[0], need)
            out.append((self.starts[0], take))
            self._cut(0, take)
            need -= take
        return tuple(out)

    def alloc_extent(self, nbytes: int) -> int | None:
        """The offset of one free extent of ``nbytes`` (first fit), or None where none is that long."""
        for i, ln in enumerate(self.lens):
            if ln >= nbytes:
                off = self.starts[i]
                self._cut(i, nbytes)
                return off
        return None

    def _cut(self, i: int, n: int) -> None:
        self.free_bytes -= n
        if self.lens[i] == n:
            del self.starts[i], self.lens[i]
        else:
            self.starts[i] += n
            self.lens[i] -= n

    def free(self, extents: Sequence[tuple[int, int]]) -> None:
        for off, ln in extents:
            i = bisect.bisect_left(self.starts, off)
            assert i == len(self.starts) or off + ln <= self.starts[i], "freeing a free extent"
            assert i == 0 or self.starts[i - 1] + self.lens[i - 1] <= off, "freeing a free extent"
            self.free_bytes += ln
            if i > 0 and self.starts[i - 1] + self.lens[i - 1] == off:  # merge with the one before
                i -= 1
                self.lens[i] += ln
            else:
                self.starts.insert(i, off)
                self.lens.insert(i, ln)
            if i + 1 < len(self.starts) and self.starts[i] + self.lens[i] == self.starts[i + 1]:
                self.lens[i] += self.lens[i + 1]
                del self.starts[i + 1], self.lens[i + 1]


INDEX_BYTES_PER_BLOCK = 512
"""The index's map per data block. A one-block value's record takes 130-300 bytes of B-tree pages
(measured: random keys, with the pages LMDB's copy-on-write has freed)."""


def index_map_bytes(capacity_bytes: int) -> int:
    """LMDB's map size for a tier of ``capacity_bytes``: room for a record per block, every value
    one block long. It is address space only; the index file grows as records land. (It was 1/256 of
    the tier, which filled at a few hundred thousand records, so a 16 GiB tier of values under ~32 KiB
    said it was full with most of its blocks free.)"""
    return max(64 << 20, capacity_bytes // BLOCK * INDEX_BYTES_PER_BLOCK)


def _lock_folder(path: str) -> int:
    """Takes the folder's ``LOCK`` file (an exclusive ``flock``, dropped by the kernel when the
    process ends) and writes this pid in it; returns its descriptor, held while the tier is open.

    LMDB lets several processes open one environment, and ``values.dat`` has no owner of its own:
    two nodes given one folder (a copied unit file, a debugging run beside the service, two pods
    on one host mounting one ReadWriteOnce volume) would each allocate blocks from their own free
    list and write over each other's values, silently.

    Raises:
        DiskTierError: another process holds the folder, or its lock file cannot be made.
    """
    lock = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DiskTierError(f"--disk: cannot make the lock file {lock}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DiskTierError(f"--disk {path} is in use by another store node"
                            f"{f' (pid {holder} on its host)' if holder.isdigit() else ''}: "
                            "give each node a folder of its own") from None
    except OSError as exc:
        os.close(fd)
        raise DiskTierError(f"--disk: cannot lock {lock}: {exc.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class DiskTier:
    """The disk tier of one node. Thread-safe."""

    def __init__(self, path: str, capacity_bytes: int, sync: bool = False,
                 read_threads: int = 8, direct: bool = True, preallocate: bool = True) -> None:
        """
        Args:
            path: the tier's folder.
            capacity_bytes: size of the data file (rounded down to blocks).
            sync: fdatasync the data and fsync each index commit (power-loss safe).
            read_threads: reads ``read_many`` keeps in flight.
            direct: O_DIRECT reads and writes where the file system takes them.
            preallocate: reserve the data file's blocks at start (``fallocate``) where the file
                system has room for them; else the file stays sparse.

        Raises:
            DiskTierError: the folder cannot be used (corrupt, locked, or an older format).
        """
        if os.path.exists(path) and not os.path.isdir(path):
            raise DiskTierError(f"--disk must be a folder (the disk tier's files go in it), but {path} is a file")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"--disk: cannot make the folder {path}: {exc.strerror}") from None
        self._folder_fd = _lock_folder(path)
        try:
            self._open(path, capacity_bytes, sync, read_threads, direct, preallocate)
        except BaseException:
            os.close(self._folder_fd)
            raise

    def _open(self, path: str, capacity_bytes: int, sync: bool, read_threads: int, direct: bool,
              preallocate: bool) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes // BLOCK * BLOCK
        self.sync = sync
        try:
            self.env = lmdb.open(path, map_size=index_map_bytes(capacity_bytes), subdir=True, max_dbs=2,
                                 sync=sync, metasync=sync, readahead=False, lock=True)
            try:
                self.env.open_db(b"values", create=False)
            except lmdb.NotFoundError:
                pass
            else:
                self.env.close()
                raise DiskTierError(f"{path} holds the older disk-tier format (values inside LMDB); "
                                    "it is a cache: delete the folder or point --disk elsewhere")
            self.db = self.env.open_db(b"extents")
        except lmdb.Error as exc:
            raise DiskTierError(f"cannot open the disk tier at {path}: {exc}") from exc
        self._lock = threading.Lock()
        try:
            used = [ext for _, loc in self.scan() for ext in loc.extents]
            self.space = FreeSpace(self.capacity_bytes, used)
        except (DiskTierError, ValueError) as exc:
            self.env.close()
            raise DiskTierError(f"the disk tier at {path} cannot start: {exc} "
                                "(a larger --disk-size than now, or a corrupt index)") from exc
        data = os.path.join(path, DATA_FILE)
        try:
            fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size < self.capacity_bytes:
                os.ftruncate(fd, self.capacity_bytes)  # sparse: blocks are taken as values land
        except OSError as exc:
            self.env.close()
            raise DiskTierError(f"cannot open the disk tier's data file {data}: {exc}") from exc
        self._fd = fd
        self.preallocated = preallocate and self._preallocate()
        self._dfd = self._open_direct(data) if direct else -1
        self._wlock = threading.Lock()
        self._stage = mmap.mmap(-1, RUN) if self._dfd >= 0 else None  # aligned, for direct writes
        self.direct = self._dfd >= 0
        self.read_threads = max(1, read_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = _Buffers(keep=2 * self.read_threads + 4)

    def _preallocate(self) -> bool:
        """Reserves the data file's blocks (``fallocate``, no zeroing: they read as zeros until
        written). Direct writes into reserved blocks need no block allocation, so two of them go
        to the device at once (on ext4 a direct write that allocates holds the file's lock alone);
        and a file system too small for the tier shows at start. Skipped, with a warning, where the
        file system lacks the room (it keeps ``_INDEX_ROOM`` for the index) or the call, and on
        tmpfs, whose blocks are memory."""
        st = os.fstat(self._fd)
        missing = self.capacity_bytes - st.st_blocks * 512
        if missing <= 0:
            return True
        if _fs_type(self.path) == _TMPFS_MAGIC:  # memory: reserved, the whole tier would be held now
            return False
        free = self._fs_free()
        if free is not None and free < missing + _INDEX_ROOM:
            log.warning("disk tier %s: the file system has %d bytes free, too few to reserve the tier's "
                        "%d bytes; the data file stays sparse, and writes past the room fail as the disk full",
                        self.path, free, self.capacity_bytes)
            return False
        err = _fallocate(self._fd, self.capacity_bytes)
        if err:
            log.warning("disk tier %s: cannot reserve the data file's blocks (%s); it stays sparse",
                        self.path, os.strerror(err))
        return not err

    def _open_direct(self, data: str) -> int:
        """An O_DIRECT descriptor of the data file, or -1 where the file system refuses direct I/O."""
        if not hasattr(os, "O_DIRECT"):
            return -1
        try:
            fd = os.open(data, os.O_RDWR | os.O_DIRECT)
        except OSError:
            return -1
        try:
            os.preadv(fd, [mmap.mmap(-1, BLOCK)], 0)
        except OSError:
            os.close(fd)
            return -1
        return fd

    # ---- index ------------------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, Loc]]:
        """Yields ``(key, loc)`` of every stored value (reads the index only).

        Raises:
            DiskTierError: a record is malformed.
        """
        try:
            with self.env.begin(db=self.db) as txn:
                for key, rec in txn.cursor():
                    try:
                        yield key, Loc.decode(rec)
                    except ValueError as exc:
                        raise DiskTierError(f"corrupt index record under key {key.hex()}: {exc}") from exc
        except lmdb.Error as exc:
            raise DiskTierError(f"the disk tier's index is corrupt: {exc}") from exc

    def lookup(self, key: bytes) -> Loc | None:
        """The committed location of ``key``'s value, or None."""
        with self.env.begin(db=self.db) as txn:
            rec = txn.get(key)
        return None if rec is None else Loc.decode(rec)

    # ---- writes -----------------------------------------------------------------

    def alloc_many(self, sizes: Sequence[int]) -> list[tuple[tuple[int, int], ...]]:
        """Free blocks for values of ``sizes``, taken in order, for ``put_many(..., extents=)``: one
        extent for the whole batch where one is free (the values one after another), else each
        value's first fit.

        Raises:
            DiskFullError: not enough free blocks (nothing is taken).
        """
        costs = [disk_cost(size) if size else 0 for size in sizes]
        out: list[tuple[tuple[int, int], ...]] = []
        with self._lock:
            pos = self.space.alloc_extent(sum(costs)) if len(costs) > 1 else None
            if pos is not None:  # the whole batch in one extent: one search, and one sequential write
                for cost in costs:
                    out.append(((pos, cost),) if cost else ())
                    pos += cost
                return out
            for cost in costs:
                ext = self.space.alloc(cost)
                if ext is None:
                    for x in out:
                        self.space.free(x)
                    raise DiskFullError(f"the disk tier is full ({self.space.free_bytes} bytes free)")
                out.append(ext)
        return out

    def put_many(self, items: list[tuple], only_new: bool = False,
                 extents: Sequence[tuple[tuple[int, int], ...]] | None = None) -> list[Loc]:
        """Writes each ``(key, value parts)`` or ``(key, parts, size)`` into free blocks, then
        commits their records in one transaction. With a size, the parts may run past it to the
        end of its last block (e.g. DRAM slots): page-aligned such parts go to the device as
        they are, with no copy through the staging buffer. A key already on disk now maps to
        the new value; its old blocks stay taken until ``delete_many`` frees them. With
        ``only_new``, a key that already has a record keeps it: that item is not stored and its
        place in the result is None. ``extents`` (from ``alloc_many``, one per item) are the
        blocks to write into; the call owns them: it frees those it does not use.

        Raises:
            DiskFullError: not enough free blocks, or the file system is full (nothing is written).
            DiskWriteError: another write error (nothing is written).
        """
        now = time.time()
        values = []
        for key, parts, *size in items:
            if isinstance(parts, (bytes, bytearray, memoryview)):
                parts = [parts]
            parts = [memoryview(p).cast("B") for p in parts]
            size = size[0] if size else sum(p.nbytes for p in parts)
            if len(parts) == 1:  # NOTE: xxh3 of a 64 KiB value keeps the GIL; one call, no hasher object
                digest = xxhash.xxh3_64_intdigest(parts[0][:size])
            else:
                h = xxhash.xxh3_64()
                for p in _slice(parts, 0, size):
                    h.update(p)
                digest = h.intdigest()
            values.append((key, parts, size, digest))
        if extents is None:
            extents = self.alloc_many([size for _, _, size, _ in values])
        locs = [Loc(tuple(ext), size, digest, now) for (_, _, size, digest), ext in zip(values, extents)]
        try:
            self._write(values, locs)
            if self.sync:
                os.fdatasync(self._fd)
            with self.env.begin(db=self.db, write=True) as txn:
                # NOTE: py-lmdb lets go of the GIL in every call; one putmulti is one call for the batch
                recs = [(key, loc.encode()) for (key, *_), loc in zip(values, locs)]
                _, added = txn.cursor().putmulti(recs, overwrite=not only_new)
                # a key that kept an older record (only_new) maps to another record than ours
                stored = [True] * len(recs) if added == len(recs) else [txn.get(k) == r for k, r in recs]
        except (OSError, lmdb.Error) as exc:
            with self._lock:
                for loc in locs:
                    self.space.free(loc.extents)
            raise self._write_error(exc) from exc
        if not all(stored):
            with self._lock:
                for loc, ok in zip(locs, stored):
                    if not ok:
                        self.space.free(loc.extents)
            locs = [loc if ok else None for loc, ok in zip(locs, stored)]
        return locs

    def _write(self, values: list, locs: list[Loc]) -> None:
        """Writes a batch's values into their extents: adjacent extents (a batch allocates first
        fit, so its values mostly sit one after the other) go down in sequential runs of up to
        RUN bytes, through one aligned staging buffer when writing direct."""
        segs = []  # (file offset, source views, bytes on disk): pieces of at most RUN bytes
        for (_, parts, _, _), loc in zip(values, locs):
            if len(loc.extents) == 1 and len(parts) == 1 and parts[0].nbytes == loc.extents[0][1] <= RUN:
                segs.append((loc.extents[0][0], parts, parts[0].nbytes))  # e.g. a DRAM slot: as it is
                continue
            pos = 0
            for off, n in loc.extents:
                for k in range(0, n, RUN):
                    m = min(RUN, n - k)
                    segs.append((off + k, _slice(parts, pos + k, m), m))
                pos += n
        segs.sort(key=lambda seg: seg[0])
        if self._stage is None:  # buffered: the value bytes as they are
            for off, views, _ in segs:
                _pwrite(self._fd, views, off)
            return
        as_is = [sum(v.nbytes for v in views) == n and all(_aligned(v) for v in views) for _, views, n in segs]
        if all(as_is):
            self._write_direct(segs)  # e.g. DRAM slots: no staging buffer, so no lock (demoters write at once)
            return
        with self._wlock:
            stage = memoryview(self._stage)
            # a run: contiguous on disk, either staged bytes or aligned views written as they are
            start, length, views_run, staged = -1, 0, [], False
            for (off, views, n), direct in zip(segs, as_is):
                if length and (start + length != off or length + n > RUN or staged == direct
                               or len(views_run) + len(views) > _IOV_MAX):
                    _pwrite(self._dfd, [stage[:length]] if staged else views_run, start)
                    length, views_run = 0, []
                if not length:
                    start, staged = off, not direct
                if direct:
                    views_run += views
                else:
                    pos = length
                    for v in views:
                        stage[pos : pos + v.nbytes] = v
                        pos += v.nbytes
                    # NOTE: a last block's tail past the value is not zeroed: reads stop at its size
                length += n
            if length:
                _pwrite(self._dfd, [stage[:length]] if staged else views_run, start)

    def _write_direct(self, segs: list) -> None:
        """``_write`` of pieces that are all aligned views: adjacent ones in runs of up to RUN bytes."""
        start, length, run = -1, 0, []
        for off, views, n in segs:
            if length and (start + length != off or length + n > RUN or len(run) + len(views) > _IOV_MAX):
                _pwrite(self._dfd, run, start)
                length, run = 0, []
            if not length:
                start = off
            run += views
            length += n
        if length:
            _pwrite(self._dfd, run, start)

    def _write_error(self, exc: BaseException) -> CrescentError:
        code = getattr(exc, "errno", None)
        if isinstance(exc, lmdb.MapFullError):
            return DiskFullError("the disk tier's index is full")
        free = self._fs_free()
        # NOTE: LMDB reports a short write (what a full file system gives) as EIO
        if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc) or (
                free is not None and free < (1 << 20)):
            return DiskFullError(f"the disk tier's file system is full ({free} bytes free): {exc}")
        return DiskWriteError(f"the disk tier failed a write: {exc}")

    def _fs_free(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def delete_many(self, items: list[tuple[bytes, Loc]]) -> None:
        """Frees values: deletes each key's record where it still maps to that ``loc`` (not to a
        newer value), then returns the blocks.

        Raises:
            DiskWriteError: the index could not commit; nothing is freed.
        """
        if not items:
            return
        try:
            with self.env.begin(db=self.db, write=True) as txn:
                for key, loc in items:
                    if txn.get(key) == loc.encode():
                        txn.delete(key)
        except lmdb.Error as exc:
            raise DiskWriteError(f"the disk tier failed a delete: {exc}") from exc
        with self._lock:
            for _, loc in items:
                self.space.free(loc.extents)

    # ---- reads ------------------------------------------------------------------

    def read(self, loc: Loc) -> memoryview:
        """The value at ``loc``, verified against its checksum.

        Raises:
            DataLossError: the bytes do not match (or could not be read).
        """
        if len(loc.extents) == 1:
            data = self._pread(*loc.extents[0])[: loc.size]
        else:
            data = memoryview(b"".join(self._pread(off, n) for off, n in loc.extents))[: loc.size]
        if xxhash.xxh3_64_intdigest(data) != loc.digest:
            raise DataLossError("a disk value failed its checksum")
        return data

    def read_many(self, locs: list[Loc], holds: list | None = None) -> list[memoryview | DataLossError]:
        """Reads values, per value its bytes or the error. Values stored one after the other
        (a batch written together) are read in runs of up to RUN bytes, one read each; runs
        and other values go in parallel, ``read_threads`` at a time.

        Args:
            holds: when given, runs are read into reused buffers and this list gets, per value,
                the ``Hold`` to release when its bytes are no longer used (or None).
        """
        out: list = [None] * len(locs)
        held: list = [None] * len(locs)
        runs: list[list] = []  # [file offset, length, [(index, offset in the run)]]
        for off, i in sorted((loc.extents[0][0], i) for i, loc in enumerate(locs) if len(loc.extents) == 1):
            n = locs[i].extents[0][1]
            run = runs[-1] if runs else None
            if run is not None and run[0] + run[1] == off and run[1] + n <= RUN:
                run[1] += n
                run[2].append((i, off - run[0]))
            else:
                runs.append([off, n, [(i, 0)]])
        jobs = [(r, None) for r in runs] + [(None, i) for i, loc in enumerate(locs) if len(loc.extents) != 1]

        def job(item):
            run, i = item
            if i is not None:
                out[i] = self._read_or_error(locs[i])
                return
            if holds is not None:
                buf, size = self._buffers.get(run[1])
                hold = Hold(self._buffers, buf, size, len(run[2]))
                view = memoryview(buf)[: run[1]]
            else:
                hold, view = None, memoryview(mmap.mmap(-1, run[1]))
            try:
                self._pread_into(view, run[0])
            except DataLossError as exc:
                for j, _ in run[2]:
                    out[j], held[j] = exc, hold
                return
            for j, rel in run[2]:
                data = view[rel : rel + locs[j].size]
                ok = xxhash.xxh3_64_intdigest(data) == locs[j].digest
                out[j] = data if ok else DataLossError("a disk value failed its checksum")
                held[j] = hold

        if len(jobs) <= 1 or self.read_threads == 1:
            for item in jobs:
                job(item)
        else:
            list(self._executor().map(job, jobs))
        if holds is not None:
            holds.extend(held)
        return out

    def _pread(self, off: int, n: int) -> memoryview:
        """``n`` bytes (whole blocks) at ``off`` into a fresh page-aligned buffer."""
        view = memoryview(mmap.mmap(-1, n))
        self._pread_into(view, off)
        return view

    def _pread_into(self, view: memoryview, off: int) -> None:
        """Fills ``view`` (page-aligned, whole blocks) from the file at ``off``.

        Raises:
            DataLossError: the read failed or came back short.
        """
        try:
            got = os.preadv(self._dfd if self._dfd >= 0 else self._fd, [view], off)
        except OSError as exc:
            raise DataLossError(f"the disk tier failed a read: {exc}") from exc
        if got < view.nbytes:
            raise DataLossError(f"short read from the disk tier ({got} of {view.nbytes} bytes at {off})")

    def get(self, key: bytes) -> memoryview | None:
        """``key``'s committed value, or None (a convenience for tools and tests).

        Raises:
            DataLossError: the value is corrupt.
        """
        loc = self.lookup(key)
        return None if loc is None else self.read(loc)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1
        self.env.close()
        if self._folder_fd >= 0:
            os.close(self._folder_fd)  # last: the folder is free once every file is closed
            self._folder_fd = -1

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="disk-read")
            return self._pool

    def _read_or_error(self, loc: Loc) -> memoryview | DataLossError:
        try:
            return self.read(loc)
        except DataLossError as exc:
            return exc


_INDEX_ROOM = 64 << 20
"""Room a preallocating tier leaves free on its file system for the LMDB index to grow."""


_TMPFS_MAGIC = 0x01021994
_LIBC = ctypes.CDLL(None, use_errno=True)


def _fs_type(path: str) -> int | None:
    """The file system type (``statfs``'s ``f_type``, its first field on Linux) of ``path``, or None."""
    buf = ctypes.create_string_buffer(512)  # larger than struct statfs
    if getattr(_LIBC, "statfs", None) is None or _LIBC.statfs(os.fsencode(path), buf) != 0:
        return None
    return struct.unpack_from("l", buf)[0]


def _fallocate(fd: int, length: int) -> int:
    """``fallocate(fd, 0, 0, length)``: 0, or the errno. The system call itself, not glibc's
    ``posix_fallocate``, which where the file system lacks it writes every block instead."""
    fn = getattr(_LIBC, "fallocate", None)
    if fn is None:
        return errno.EOPNOTSUPP
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return 0 if fn(fd, 0, 0, length) == 0 else ctypes.get_errno()


def _aligned(v: memoryview) -> bool:
    """Whether a view can go to an O_DIRECT write as it is (address and length in whole blocks)."""
    return (v.nbytes > 0 and v.nbytes % BLOCK == 0 and not v.readonly
            and ctypes.addressof(ctypes.c_char.from_buffer(v)) % BLOCK == 0)


def _pwrite(fd: int, views: list[memoryview], off: int) -> None:
    """Writes all of ``views`` at ``off`` (again after a short write)."""
    n = sum(v.nbytes for v in views)
    done = 0
    while done < n:
        wrote = os.pwritev(fd, _slice(views, done, n - done), off + done)
        if wrote <= 0:
            raise OSError(errno.ENOSPC, "no progress writing the disk tier")
        done += wrote


def _slice(views: list[memoryview], start: int, n: int) -> list[memoryview]:
    """The byte range ``[start, start + n)`` of the concatenation of ``views``, as views."""
    out = []
    for v in views:
        if n <= 0:
            break
        if start >= v.nbytes:
            start -= v.nbytes
            continue
        take = min(v.nbytes - start, n)
        out.append(v[start : start + take])
        n -= take
        start = 0
    return out
