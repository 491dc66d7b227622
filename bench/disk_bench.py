"""Disk tier against the disk itself: cold batch reads and demotion writes vs fio, same run.

For each value size (1 MiB and 64 KiB), in rounds (``--reps``) so that the
disk's drift hits every row alike, all in one folder on one file system:

1. Ceilings: fio (Debian's ``/usr/bin/fio``) on a file beside the store:
   sequential O_DIRECT reads (psync, 1 MiB blocks and blocks of the value
   size) and sequential O_DIRECT 1 MiB writes with ``--end_fsync=1``. Without
   fio, a Python O_DIRECT sequential ``preadv``/``pwritev`` loop stands in
   (labelled as such).
2. Writes: a TieredStore with a small DRAM tier (``--dram-mib``) and a disk
   tier takes every value (``put``), so nearly all are demoted (by the
   store's demoter threads; once more with each put writing its own); timed up
   to the demoters' last run and an fdatasync of the tier's files (comparable
   to fio's end_fsync): ``disk_bytes_written`` / wall time. The same bytes written with
   ``DiskTier.put_many`` in ~8 MiB batches (the disk write path alone), and
   with the old disk tier's writes (below). Each twice: right after a cache
   drop and again at once (on this VM, writes into just-freed memory are
   slower; fio's are not), the target judged on the second.
3. Cold batch reads, the page cache dropped before each (``sync; echo 3 >
   /proc/sys/vm/drop_caches``, as root): every disk-resident value through
   ``TieredStore.acquire_many`` in batches of ``--batch`` keys (released after
   each batch; some values' bytes checked); then ``DiskTier.read_many`` over
   the same folder with 8 and with 1 read in flight.
4. The old path, the disk tier before issue 19, reproduced here with the same
   py-lmdb calls and flags (it is gone from kvstore/): values inside LMDB as
   header + value records, one write transaction per batch; a read copies the
   value out of LMDB's MADV_RANDOM map, which py-lmdb faults in a 4 KiB page
   at a time. Read per key (what the old store did) and 8 at a time. It, and
   one read in flight, read the first ``--old-mib`` MiB only (they are slow).

Reported: medians over the rounds, GB/s (10^9 bytes of values per second) and
the ratio to the same run's fio figure (pooled over every round and both value
sizes). Targets: cold reads of 1 MiB values >= 0.8x fio's sequential 1 MiB
O_DIRECT reads, 64 KiB values >= 0.5x (same denominator), demotion writes
>= 0.7x fio's sequential writes.

    python bench/disk_bench.py [--quick] [--write-docs] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import OUT, publish, table  # noqa: E402

MiB = 1 << 20
FIO = shutil.which("fio")


def log(msg: str) -> None:
    print(f"[disk] {msg}", flush=True)


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ---- ceilings -----------------------------------------------------------------


def fio(path: str, rw: str, bs: int, size: int) -> float:
    """GB/s of one fio job (psync, O_DIRECT, one thread) from its JSON output."""
    cmd = [FIO, "--name=ceiling", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
           "--direct=1", "--ioengine=psync", "--iodepth=1", "--numjobs=1", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = res.stdout[res.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0]["read" if rw == "read" else "write"]
    return job["bw_bytes"] / 1e9


def py_seq_read(path: str, bs: int) -> float:
    """Fallback ceiling: one thread, O_DIRECT, sequential preadv of ``bs`` blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, bs)
        size, off = os.fstat(fd).st_size, 0
        t0 = time.perf_counter()
        while off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
        return gbps(off, time.perf_counter() - t0)
    finally:
        os.close(fd)


def py_seq_write(path: str, bs: int, size: int) -> float:
    """Fallback ceiling: one thread, O_DIRECT, sequential pwritev of ``bs`` blocks, then fsync."""
    buf = mmap.mmap(-1, bs)
    buf.write(os.urandom(bs))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, bs):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        return gbps(size, time.perf_counter() - t0)
    finally:
        os.close(fd)


def ceilings(folder: str, size: int, value_bytes: int, cold: bool) -> dict[str, float]:
    path = os.path.join(folder, "fio.dat")
    if os.path.exists(path):
        os.unlink(path)
    out = {}
    if FIO:
        out["write"] = fio(path, "write", MiB, size)
        for bs in sorted({MiB, value_bytes}, reverse=True):
            cold and drop_caches()
            out[f"read_{bs}"] = fio(path, "read", bs, size)
    else:
        out["write"] = py_seq_write(path, MiB, size)
        for bs in sorted({MiB, value_bytes}, reverse=True):
            cold and drop_caches()
            out[f"read_{bs}"] = py_seq_read(path, bs)
    os.unlink(path)
    return out


# ---- the disk tier ------------------------------------------------------------


class Values:
    """One shared random buffer; value ``i`` is it with ``i`` in its first 8 bytes."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(os.urandom(size))
        self.arr = np.frombuffer(self.buf, np.uint8)

    def set(self, i: int) -> bytearray:
        self.buf[:8] = i.to_bytes(8, "little")
        return self.buf

    def check(self, i: int, view) -> None:
        got = np.frombuffer(view, np.uint8)
        if got.size != self.arr.size or int.from_bytes(bytes(got[:8]), "little") != i \
                or not np.array_equal(got[8:], self.arr[8:]):
            raise AssertionError(f"value {i} read back wrong")


def key(i: int) -> bytes:
    return b"disk-bench-%08d" % i


def sync_tier(folder: str, env) -> None:
    """What fio's end_fsync is to its file: fdatasync of the tier's data file (values.dat, where
    there is one) and of its LMDB file."""
    data = os.path.join(folder, "values.dat")
    if os.path.exists(data):
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    env.sync(True)


def batches(n: int, value_bytes: int, values: Values):
    """The values as (key, bytes) lists of ~8 MiB, built before the clock starts."""
    per = max(1, (8 * MiB) // value_bytes)
    for s in range(0, n, per):
        yield [(key(i), bytes(values.set(i))) for i in range(s, min(n, s + per))]


def store_writes(folder: str, n: int, values: Values, dram: int, disk_size: int, background: bool = True):
    """Every value ``put`` into a TieredStore whose DRAM holds ``dram`` bytes; timed through the end
    of the demoter's last run and a sync of the disk tier. ``background=False``: each put writes the
    demotions it needs itself. Returns (store, GB/s of disk bytes written, fraction of the time
    after the last put, stats)."""
    from kvstore.config import StoreConfig
    from kvstore.store import TieredStore

    store = TieredStore(StoreConfig(dram=dram, slot_size=64 << 10, disk=folder, disk_size=disk_size,
                                    disk_read_threads=8, background_demotion=background))
    t0 = time.perf_counter()
    for i in range(n):
        store.put(key(i), values.set(i))
    t1 = time.perf_counter()
    store.settle()
    sync_tier(folder, store.disk.env)
    dt = time.perf_counter() - t0
    st = store.stats()
    return store, gbps(st["disk_bytes_written"], dt), (dt - (t1 - t0)) / dt, st


def put_many_writes(folder: str, n: int, values: Values, disk_size: int) -> tuple[float, float]:
    """The same values straight into a DiskTier, ~8 MiB per ``put_many``, then the sync.
    Returns (GB/s, fraction of the time in the sync)."""
    from kvstore.disk import DiskTier

    disk = DiskTier(folder, disk_size)
    try:
        dt = 0.0
        for items in batches(n, len(values.buf), values):
            t0 = time.perf_counter()
            disk.put_many(items)
            dt += time.perf_counter() - t0
        t0 = time.perf_counter()
        sync_tier(folder, disk.env)
        ds = time.perf_counter() - t0
        return gbps(n * len(values.buf), dt + ds), ds / (dt + ds)
    finally:
        disk.close()


# ---- the old disk tier (before this issue), reproduced: values inside LMDB, read through its map ----

_OLD_REC = struct.Struct("<QQd")  # xxh3_64, size, time: the old record header


def old_open(folder: str, disk_size: int):
    import lmdb

    # NOTE: the old DiskTier's flags: readahead=False is LMDB's MADV_RANDOM map
    env = lmdb.open(folder, map_size=disk_size, subdir=True, max_dbs=1, sync=False, metasync=False,
                    readahead=False, lock=True)
    return env, env.open_db(b"values")


def old_writes(folder: str, n: int, values: Values, disk_size: int) -> tuple[float, float]:
    """The old DiskTier.put_many: each batch one LMDB write transaction of header ‖ value records."""
    env, db = old_open(folder, disk_size)
    try:
        dt = 0.0
        for items in batches(n, len(values.buf), values):
            t0 = time.perf_counter()
            now = time.time()
            with env.begin(db=db, write=True) as txn:
                for k, v in items:
                    txn.put(k, b"".join([_OLD_REC.pack(xxhash.xxh3_64_intdigest(v), len(v), now), v]))
            dt += time.perf_counter() - t0
        t0 = time.perf_counter()
        env.sync(True)
        ds = time.perf_counter() - t0
        return gbps(n * len(values.buf), dt + ds), ds / (dt + ds)
    finally:
        env.close()


def old_reads(folder: str, disk_size: int, idx: list[int], values: Values, batch: int, threads: int,
              cold: bool) -> float:
    """The old DiskTier.get (a read transaction, the value copied out of the map, checksummed),
    per key (``threads`` 1, what the old store did) or ``threads`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    env, db = old_open(folder, disk_size)

    def get(k: bytes) -> bytes:
        with env.begin(db=db, buffers=True) as txn:
            val = txn.get(k)
            digest, size, _ = _OLD_REC.unpack_from(val, 0)
            data = bytes(val[_OLD_REC.size:])
        if size != len(data) or xxhash.xxh3_64_intdigest(data) != digest:
            raise AssertionError("old record failed its checksum")
        return data

    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        cold and drop_caches()
        nbytes = 0
        t0 = time.perf_counter()
        for s in range(0, len(idx), batch):
            part = idx[s : s + batch]
            keys = [key(i) for i in part]
            got = list(pool.map(get, keys)) if pool else [get(k) for k in keys]
            for j, (i, v) in enumerate(zip(part, got)):
                nbytes += len(v)
                if j == 0 and (s // batch) % 4 == 0:
                    values.check(i, v)
        return gbps(nbytes, time.perf_counter() - t0)
    finally:
        if pool:
            pool.shutdown()
        env.close()


# ---- reads ------------------------------------------------------------------------


def store_reads(store, idx: list[int], values: Values, batch: int) -> float:
    nbytes = 0
    t0 = time.perf_counter()
    for s in range(0, len(idx), batch):
        part = idx[s : s + batch]
        leases = store.acquire_many([key(i) for i in part])
        for j, (i, lease) in enumerate(zip(part, leases)):
            if lease is None:
                raise AssertionError(f"value {i} missing")
            nbytes += lease.size
            if j == 0 and (s // batch) % 4 == 0:
                values.check(i, lease.views[0])
        store.release_many([x for x in leases if x is not None])
    return gbps(nbytes, time.perf_counter() - t0)


def tier_reads(disk, idx: list[int], values: Values, batch: int) -> float:
    """``DiskTier.read_many`` in batches. Where it takes locations (the store keeps them in its
    index), they are looked up before the clock starts; where it takes keys, the keys."""
    by_loc = hasattr(disk, "lookup")
    args = [disk.lookup(key(i)) for i in idx] if by_loc else [key(i) for i in idx]
    nbytes = 0
    t0 = time.perf_counter()
    for s in range(0, len(idx), batch):
        part = idx[s : s + batch]
        holds: list = []  # reused buffers, as the store reads them (the old tier takes no holds)
        got = disk.read_many(args[s : s + batch], holds) if by_loc else disk.read_many(args[s : s + batch])
        for j, (i, v) in enumerate(zip(part, got)):
            if not isinstance(v, memoryview):
                raise AssertionError(f"value {i}: {v!r}")
            nbytes += len(v)
            if j == 0 and (s // batch) % 4 == 0:
                values.check(i, v)
        del got
        for h in holds:
            if h is not None:
                h.release()
    return gbps(nbytes, time.perf_counter() - t0)


def one_round(folder: str, value_bytes: int, n: int, args, cold: bool, rep: int) -> dict:
    from kvstore.disk import DiskTier
    from kvstore.store import Tier

    label = f"{value_bytes // 1024} KiB" if value_bytes < MiB else f"{value_bytes // MiB} MiB"
    tag = f"{label}, round {rep + 1}/{args.reps}"
    total = n * value_bytes
    disk_size = 2 * total + 256 * MiB
    r: dict = {}
    values = Values(value_bytes)

    c = ceilings(folder, total, value_bytes, cold)
    r["fio_write"], r["fio_read_1m"], r["fio_read_bs"] = c["write"], c[f"read_{MiB}"], c[f"read_{value_bytes}"]
    log(f"{tag}: ceiling seq write {r['fio_write']:.2f}, seq read 1 MiB {r['fio_read_1m']:.2f}, "
        f"seq read {label} blocks {r['fio_read_bs']:.2f} GB/s")

    # NOTE: each write phase twice: right after a cache drop (on this VM freed memory goes back to the
    # hypervisor and a write's fresh buffers must fault it in again) and again at once (memory warm).
    pm, st_dir, old_dir = (os.path.join(folder, d) for d in ("put_many", "store", "old"))
    for p in ("cold", "warm"):
        for name, fn, d in (("put_many", put_many_writes, pm), ("old", old_writes, old_dir)):
            p == "cold" and cold and drop_caches()
            r[f"{name}_write_{p}"], r[f"{name}_sync_frac_{p}"] = fn(d, n, values, disk_size)
            if not (name == "old" and p == "warm"):  # the last old one is kept for the old reads
                shutil.rmtree(d)
            log(f"{tag}: {'DiskTier.put_many' if name == 'put_many' else 'old path (LMDB values) puts'} "
                f"+ sync ({p} memory) {r[f'{name}_write_{p}']:.2f} GB/s "
                f"({r[f'{name}_sync_frac_{p}']:.0%} of it in the sync)")
        p == "cold" and cold and drop_caches()
        store, r[f"demotion_write_{p}"], r[f"demotion_sync_frac_{p}"], st = store_writes(
            st_dir, n, values, args.dram_mib * MiB, disk_size)
        log(f"{tag}: TieredStore demotions ({p} memory; {st['demotions']} values, "
            f"{st['disk_bytes_written'] / MiB:.0f} MiB written) + sync {r[f'demotion_write_{p}']:.2f} GB/s "
            f"({r[f'demotion_sync_frac_{p}']:.0%} of it in the sync)")
        if p == "cold":
            store.close()
            shutil.rmtree(st_dir)
        else:  # the same puts, each writing the demotions it needs itself (the store before the demoter)
            sync_dir = os.path.join(folder, "store-sync")
            s2, r["demotion_sync_write_warm"], _, st2 = store_writes(
                sync_dir, n, values, args.dram_mib * MiB, disk_size, background=False)
            s2.close()
            shutil.rmtree(sync_dir)
            log(f"{tag}: TieredStore, each put its own demotions ({st2['demotions']} values) + sync "
                f"{r['demotion_sync_write_warm']:.2f} GB/s")
    idx = [i for i in range(n) if store.tier_of(key(i)) is Tier.DISK]
    r["demoted_values"], r["demotions"] = len(idx), st["demotions"]

    cold and drop_caches()
    r["store_read"] = store_reads(store, idx, values, args.batch)
    r["store_read_promotions"] = store.stats()["promotions"]
    r["store_read_written"] = store.stats()["disk_bytes_written"] - st["disk_bytes_written"]
    store.close()
    log(f"{tag}: TieredStore.acquire_many, {len(idx)} disk values in batches of {args.batch}: "
        f"{r['store_read']:.2f} GB/s")

    old = idx[: max(1, min(len(idx), args.old_mib * MiB // value_bytes))]
    r["old_values"] = len(old)
    for threads in (8, 1):
        disk = DiskTier(st_dir, disk_size, read_threads=threads)
        r["direct"] = disk.direct
        part = idx if threads > 1 else old  # one in flight: the slow rows' share
        try:
            cold and drop_caches()
            r[f"new_read_t{threads}"] = tier_reads(disk, part, values, args.batch)
        finally:
            disk.close()
        log(f"{tag}: DiskTier.read_many{' (O_DIRECT)' if r['direct'] else ''}, {threads} in flight, "
            f"{len(part) * value_bytes / MiB:.0f} MiB: {r[f'new_read_t{threads}']:.3f} GB/s")
    shutil.rmtree(st_dir)

    for name, threads in (("old_read_t8", 8), ("old_get", 1)):
        r[name] = old_reads(old_dir, disk_size, old, values, args.batch, threads, cold)
        log(f"{tag}: old path (LMDB values through the map), {'per-key get' if threads == 1 else '8 threads'}, "
            f"first {len(old) * value_bytes / MiB:.0f} MiB: {r[name]:.3f} GB/s")
    shutil.rmtree(old_dir)
    return r


ROWS = [  # (key, phase, ceiling key)
    ("fio_read_bs", "ceiling: {c} seq read, {v} blocks", "fio_read_1m"),
    ("store_read", "cold read: TieredStore.acquire_many (8 in flight)", "fio_read_1m"),
    ("new_read_t8", "cold read: DiskTier.read_many (8 in flight)", "fio_read_1m"),
    ("new_read_t1", "cold read: DiskTier.read_many (1 in flight)", "fio_read_1m"),
    ("old_read_t8", "cold read: old path (values in LMDB, through its map), 8 threads", "fio_read_1m"),
    ("old_get", "cold read: old path, per-key get (what the old store did)", "fio_read_1m"),
    ("demotion_write_cold", "write: TieredStore demotions + sync, right after a cache drop", "fio_write"),
    ("demotion_write_warm", "write: TieredStore demotions + sync, again at once", "fio_write"),
    ("demotion_sync_write_warm", "write: TieredStore, each put writing its own demotions (no demoter) + sync, "
     "again at once", "fio_write"),
    ("put_many_write_cold", "write: DiskTier.put_many (~8 MiB batches) + sync, right after a cache drop", "fio_write"),
    ("put_many_write_warm", "write: DiskTier.put_many (~8 MiB batches) + sync, again at once", "fio_write"),
    ("old_write_cold", "write: old path (LMDB values, ~8 MiB txns) + sync, right after a cache drop", "fio_write"),
    ("old_write_warm", "write: old path (LMDB values, ~8 MiB txns) + sync, again at once", "fio_write"),
]
# Ratios are to the ceilings pooled over every round and both value sizes (one quantity measured
# 2 x rounds times: its median is steadier than one group's).


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder for the store and the fio file (default: a new one under /tmp)")
    ap.add_argument("--mib-1m", type=int, default=768, help="MiB of 1 MiB values")
    ap.add_argument("--mib-64k", type=int, default=512, help="MiB of 64 KiB values")
    ap.add_argument("--dram-mib", type=int, default=64, help="the store's DRAM tier")
    ap.add_argument("--batch", type=int, default=32, help="keys per acquire_many / read_many")
    ap.add_argument("--old-mib", type=int, default=128, help="MiB read through the old (map) path")
    ap.add_argument("--reps", type=int, default=3, help="rounds; medians reported")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--from-json", metavar="PATH", help="measure nothing: report (table, plot, docs) the rounds "
                    "saved in PATH (a bench/out/disk_bench.json)")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        write_docs = args.write_docs
        args = argparse.Namespace(**saved["args"])
        args.write_docs = write_docs
        cold, ceiling, wall = saved["cold"], saved["ceiling"], saved["wall_s"]
        raw = {int(k): v for k, v in saved["rounds"].items()}
        sizes = [(MiB, args.mib_1m), (64 << 10, args.mib_64k * MiB // (64 << 10))]
    else:
        if args.quick:
            args.mib_1m, args.mib_64k, args.dram_mib, args.old_mib, args.reps = 128, 128, 16, 32, 1
        cold = drop_caches()
        if not cold:
            log("cannot drop the page cache (not root?): the read figures below are WARM, not cold")
        if not FIO:
            log("fio not found: the ceilings are a Python O_DIRECT sequential preadv/pwritev loop")
        ceiling = "fio" if FIO else "Python O_DIRECT loop (no fio)"
        folder = tempfile.mkdtemp(prefix="crescent-disk-", dir=args.dir)
        t_start = time.perf_counter()
        sizes = [(MiB, args.mib_1m), (64 << 10, args.mib_64k * MiB // (64 << 10))]
        raw: dict[int, list[dict]] = {vb: [] for vb, _ in sizes}
        try:
            for rep in range(args.reps):
                for vb, n in sizes:
                    raw[vb].append(one_round(folder, vb, n, args, cold, rep))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        wall = time.perf_counter() - t_start

    med = {vb: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
           for vb, rs in raw.items()}
    pooled = {k: [r[k] for rs in raw.values() for r in rs] for k in ("fio_read_1m", "fio_write")}
    ceil = {k: statistics.median(v) for k, v in pooled.items()}

    def fmt(x: float) -> str:
        return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"

    def spread(vals: list[float]) -> str:
        return f"{fmt(min(vals))}–{fmt(max(vals))}" if len(vals) > 1 else ""

    rows = [["both", f"ceiling: {ceiling} seq read, 1 MiB blocks (every round, both sizes)",
             fmt(ceil["fio_read_1m"]), spread(pooled["fio_read_1m"]), "1.00×"],
            ["both", f"ceiling: {ceiling} seq write, 1 MiB blocks, end fsync (every round, both sizes)",
             fmt(ceil["fio_write"]), spread(pooled["fio_write"]), "1.00×"]]
    for vb, n in sizes:
        v = f"{vb // MiB} MiB" if vb >= MiB else f"{vb >> 10} KiB"
        m = med[vb]
        for k, phase, den in ROWS:
            if k == "fio_read_bs" and vb == MiB:
                continue
            name = phase.format(c=ceiling, v=v)
            if k in ("old_read_t8", "old_get", "new_read_t1"):
                name += f" (first {m['old_values'] * vb / MiB:.0f} MiB)"
            rows.append([v, name, fmt(m[k]), spread([r[k] for r in raw[vb]]), f"{m[k] / ceil[den]:.2f}×"])
    headers = ["values", "phase", "GB/s (median)", "range over rounds", "× ceiling"]
    md = table(headers, rows)
    print()
    print(md)

    r1, r64 = med[MiB], med[64 << 10]
    cr, cw = ceil["fio_read_1m"], ceil["fio_write"]

    def met(x: float, target: float) -> str:
        return f"{x:.2f}× (target ≥ {target}×: {'met' if x >= target else 'NOT met'})"

    verdict = (f"cold reads through the store: 1 MiB values {met(r1['store_read'] / cr, 0.8)} {ceiling}'s 1 MiB "
               f"sequential O_DIRECT reads, 64 KiB values {met(r64['store_read'] / cr, 0.5)}; demotion writes "
               f"{met(r1['demotion_write_warm'] / cw, 0.7)} (1 MiB values) and "
               f"{met(r64['demotion_write_warm'] / cw, 0.7)} (64 KiB values) {ceiling}'s sequential writes "
               f"({r1['demotion_write_cold'] / cw:.2f}× and {r64['demotion_write_cold'] / cw:.2f}× right after a "
               f"cache drop). Against the old disk tier (values inside LMDB): cold reads "
               f"{r1['store_read'] / r1['old_get']:.1f}× (1 MiB) and {r64['store_read'] / r64['old_get']:.1f}× "
               f"(64 KiB) the old store's per-key gets ({r1['new_read_t8'] / r1['old_read_t8']:.1f}× and "
               f"{r64['new_read_t8'] / r64['old_read_t8']:.1f}× the old path given the same 8 reads in flight); "
               f"demotion writes {r1['demotion_write_warm'] / r1['old_write_warm']:.1f}× and "
               f"{r64['demotion_write_warm'] / r64['old_write_warm']:.1f}× its LMDB puts; the demoter "
               f"{r1['demotion_write_warm'] / r1['demotion_sync_write_warm']:.2f}× (1 MiB) and "
               f"{r64['demotion_write_warm'] / r64['demotion_sync_write_warm']:.2f}× (64 KiB) each put writing "
               f"its own demotions.")
    print()
    print(verdict)
    print(f"wall time {wall:.0f} s")

    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "disk_bench.json"), "w") as f:  # (rewritten as is under --from-json)
        json.dump({"args": vars(args), "cold": cold, "ceiling": ceiling, "wall_s": wall, "ceilings_pooled": ceil,
                   "median": {str(k): v for k, v in med.items()}, "rounds": {str(k): v for k, v in raw.items()}},
                  f, indent=1)
    print(f"json: {os.path.join(OUT, 'disk_bench.json')}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [3, 2]})
    groups = ["1 MiB values", "64 KiB values"]
    read_bars = [("fio_read_1m", f"{'fio' if FIO else 'py'} seq read 1 MiB (ceiling, pooled)"),
                 ("fio_read_bs", f"{'fio' if FIO else 'py'} seq read, value-size blocks"),
                 ("store_read", "new: TieredStore.acquire_many"),
                 ("new_read_t1", "new: DiskTier.read_many, 1 in flight"),
                 ("old_read_t8", "old: LMDB values via the map, 8 threads"),
                 ("old_get", "old: LMDB values via the map, per key")]
    write_bars = [("fio_write", f"{'fio' if FIO else 'py'} seq write (ceiling, pooled)"),
                  ("demotion_write_cold", "new: TieredStore demotions, after a cache drop"),
                  ("demotion_write_warm", "new: TieredStore demotions, again"),
                  ("demotion_sync_write_warm", "new: TieredStore, no demoter, again"),
                  ("put_many_write_warm", "new: DiskTier.put_many, again"),
                  ("old_write_warm", "old: LMDB value puts, again")]
    for ax, bars, title in ((a, read_bars, "cold batch reads"), (b, write_bars, "writes (through the sync)")):
        w = 0.8 / len(bars)
        for j, (k, lab) in enumerate(bars):
            ys = [ceil[k] if k in ceil else med[vb][k] for vb, _ in sizes]
            xs = [g + (j - (len(bars) - 1) / 2) * w for g in range(len(groups))]
            ax.bar(xs, ys, w, label=lab)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.suptitle("Disk tier vs the disk (same run, page cache dropped)" if cold else "Disk tier vs the disk (WARM)")
    fig.tight_layout()

    cmd = "`.venv/bin/python bench/disk_bench.py --write-docs`" + (" (as root, to drop the page cache)" if cold else "")
    body = (
        "## Disk tier (bench/disk_bench.py)\n\n"
        f"Machine: 2-core VM, Python {sys.version.split()[0]}, ext4 on a virtual disk (`/tmp`), whose "
        "throughput is noisy (writes more than reads); figures are medians over "
        f"{args.reps} interleaved round(s), the range shows the spread. Ceiling: {ceiling} in the same run, on a "
        "file in the store's folder (psync, one job, `--direct=1`; writes with `--end_fsync=1`). "
        + ("The page cache is dropped before every read phase. " if cold else
           "**The page cache could not be dropped: read figures are warm.** ")
        + "Writes into memory a cache drop has just freed run up to 3x slower here than a second pass (LMDB "
        "puts and commits of 384 MiB: 1.19 s vs 0.37 s in a probe), most likely because this VM hands freed "
        "memory back to the hypervisor (virtio-balloon free page reporting) and fresh buffers must fault it "
        "back in; fio does not pay that, so each write phase runs twice, right after a drop and again at once, "
        "and the target is judged on the second. Ratios are to the ceilings pooled over every round and both "
        "value sizes (one quantity measured 2 × rounds times). "
        f"{args.mib_1m} MiB of 1 MiB values, {args.mib_64k} MiB of 64 KiB values. Writes: every value `put` into a "
        f"TieredStore with {args.dram_mib} MiB of DRAM (nearly all are demoted to disk: by the store's two "
        "demoter threads, in runs of half the room above the high watermark (1.6 MiB here), back to back "
        "from the high watermark down to the low one while the puts go on; and, for comparison, by each put "
        "itself, `--no-background-demotion`), the store made before the clock starts, as a node is at "
        "start (its DRAM arena populated, its data file's blocks reserved, as fio's are: fio fallocates "
        "its file before it writes), timed through the demoters' last run and an "
        "fdatasync of the tier's files (data file and LMDB index), GB/s of `disk_bytes_written` (the values "
        "left in DRAM are not counted, the time that put them there is); `put_many` "
        "writes the same values straight into a DiskTier in ~8 MiB batches. Reads: every disk-resident value, "
        f"cold, in batches of {args.batch} keys (`acquire_many`/`read_many`, released per batch, some bytes "
        "checked). The old path is the disk tier before issue 19, reproduced in the bench with the same py-lmdb "
        "calls and flags: values inside LMDB (header ‖ value records, one write transaction per batch), read by "
        "copying them out of LMDB's `MADV_RANDOM` map, which py-lmdb faults in a 4 KiB page at a time; it and "
        f"`read_many` with one read in flight read the first {args.old_mib} MiB only. "
        f"GB/s = 10^9 value bytes per second. Command: {cmd}.\n\n"
        f"{md}\n\n**{verdict[0].upper() + verdict[1:]}**\n")
    publish(fig, "disk_bench", body, args.write_docs)


if __name__ == "__main__":
    main()
