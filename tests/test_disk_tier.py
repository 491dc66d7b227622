"""The disk tier: large offset reads, kept copies of promoted values, a full file system, no thrash."""

import contextlib
import os
import random
import threading
import subprocess
import time
import uuid

import lmdb
import pytest

from kvstore.config import StoreConfig
from kvstore.disk import BLOCK, DATA_FILE, DiskFullError, DiskTier, DiskTierError, disk_cost, index_map_bytes
from kvstore.errors import DataLossError, ResourceExhaustedError
from kvstore.store import Tier, TieredStore
from tests.helpers import wait_for
from tests.test_store import _OPEN, _close_stores, close_opened, flip_disk_byte  # noqa: F401 (autouse fixture)

SLOT = 4096


def make(path, slots=4, **kw):
    kw.setdefault("write_behind", False)  # deterministic unless a test asks for the background writer
    kw.setdefault("background_demotion", False)  # each put's own demotion, unless a test asks for the demoter
    cfg = StoreConfig(dram=slots * SLOT, slot_size=SLOT, high_watermark=kw.pop("high", 1.0),
                      low_watermark=kw.pop("low", 1.0), disk=str(path), disk_size=kw.pop("disk_size", 8 << 20), **kw)
    s = TieredStore(cfg)
    _OPEN.append(s)
    return s


def val(tag: int, size: int = SLOT) -> bytes:
    head = b"<%d>" % tag
    return (head * (size // len(head) + 1))[:size]


# ---- DiskTier: the data file and its index -------------------------------------------


def test_values_round_trip_through_aligned_extents_in_parallel(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 64 << 20, read_threads=4)
    _OPEN.append(d)
    sizes = [0, 1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 1 << 20, (1 << 20) + 5]
    locs = d.put_many([(b"k%d" % i, val(i, n)) for i, n in enumerate(sizes)])
    for loc, n in zip(locs, sizes):
        assert loc.size == n and all(o % BLOCK == 0 and ln % BLOCK == 0 for o, ln in loc.extents)
        assert sum(ln for _, ln in loc.extents) == (disk_cost(n) if n else 0)
    assert [bytes(v) for v in d.read_many(locs)] == [val(i, n) for i, n in enumerate(sizes)]
    assert d.lookup(b"k7") == locs[7] and d.lookup(b"absent") is None
    d.close()
    d = DiskTier(str(tmp_path / "d"), 64 << 20)  # the index alone rebuilds where everything is
    _OPEN.append(d)
    assert dict(d.scan()) == {b"k%d" % i: loc for i, loc in enumerate(locs)}
    assert d.space.free_bytes == d.capacity_bytes - sum(ln for loc in locs for _, ln in loc.extents)


def test_a_batch_written_together_is_read_in_runs_into_reused_buffers(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 64 << 20, read_threads=4)
    _OPEN.append(d)
    locs = d.put_many([(b"k%d" % i, val(i, 70_000)) for i in range(40)])  # adjacent, first fit
    assert all(b.extents[0][0] == a.extents[0][0] + a.extents[0][1] for a, b in zip(locs, locs[1:]))
    order = list(range(40))
    random.Random(3).shuffle(order)  # asked for in any order, with one key twice
    asked = [locs[i] for i in order] + [locs[order[0]]]
    holds: list = []
    got = d.read_many(asked, holds)
    assert [bytes(v) for v in got] == [val(i, 70_000) for i in order] + [val(order[0], 70_000)]
    runs = {id(h) for h in holds}
    assert len(runs) <= 4, "40 adjacent values of 72 KiB are read in runs of up to 8 MiB"
    assert d._buffers._idle == {n: [] for n in d._buffers.SIZES}
    for h in holds:
        h.release()
    idle = sum(len(v) for v in d._buffers._idle.values())
    assert idle == len(runs), "every buffer went back once all its values were released"
    again = d.read_many(asked[:5], [])
    assert [bytes(v) for v in again] == [val(i, 70_000) for i in order[:5]]
    assert sum(len(v) for v in d._buffers._idle.values()) == idle - 1  # one buffer reused


def test_free_space_first_fit_coalescing_and_fragmented_values(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 16 * BLOCK)
    _OPEN.append(d)
    locs = d.put_many([(b"k%d" % i, val(i, 2 * BLOCK)) for i in range(8)])  # the file is full
    assert [loc.extents for loc in locs] == [((2 * BLOCK * i, 2 * BLOCK),) for i in range(8)]
    with pytest.raises(DiskFullError):
        d.put_many([(b"more", b"x")])
    d.delete_many([(b"k1", locs[1]), (b"k3", locs[3]), (b"k4", locs[4])])  # 3+4 coalesce
    assert list(zip(d.space.starts, d.space.lens)) == [(2 * BLOCK, 2 * BLOCK), (6 * BLOCK, 4 * BLOCK)]
    (big,) = d.put_many([(b"big", val(9, 5 * BLOCK))])  # no hole of 5 blocks: it takes two pieces
    assert big.extents == ((2 * BLOCK, 2 * BLOCK), (6 * BLOCK, 3 * BLOCK))
    assert bytes(d.get(b"big")) == val(9, 5 * BLOCK)
    assert d.space.free_bytes == BLOCK


def test_replacing_a_key_keeps_the_old_blocks_until_they_are_freed(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 64 * BLOCK)
    _OPEN.append(d)
    (old,) = d.put_many([(b"k", val(1, 3 * BLOCK))])
    (new,) = d.put_many([(b"k", val(2, 3 * BLOCK))])
    assert new.extents != old.extents and d.lookup(b"k") == new
    assert bytes(d.read(old)) == val(1, 3 * BLOCK)  # a reader of the old value still reads it
    d.delete_many([(b"k", old)])  # frees the old blocks, keeps the record of the new value
    assert d.lookup(b"k") == new and bytes(d.get(b"k")) == val(2, 3 * BLOCK)
    d.delete_many([(b"k", new)])
    assert d.lookup(b"k") is None and d.space.free_bytes == d.capacity_bytes


def test_direct_io_where_the_file_system_takes_it(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 1 << 20)
    _OPEN.append(d)
    assert d.direct, "ext4 and tmpfs take O_DIRECT on this kernel"
    (loc,) = d.put_many([(b"k", val(3, 70_000))])
    assert bytes(d.read(loc)) == val(3, 70_000)
    buffered = DiskTier(str(tmp_path / "b"), 1 << 20, direct=False)
    _OPEN.append(buffered)
    assert not buffered.direct
    (loc,) = buffered.put_many([(b"k", [memoryview(val(3, 70_000))[:5], memoryview(val(3, 70_000))[5:]])])
    assert bytes(buffered.read(loc)) == val(3, 70_000)


def test_padded_aligned_parts_are_written_as_they_are_and_others_through_staging(tmp_path, monkeypatch):
    import mmap

    import kvstore.disk as disk_mod

    d = DiskTier(str(tmp_path / "d"), 8 << 20)
    _OPEN.append(d)
    slots = mmap.mmap(-1, 4 * BLOCK)  # page-aligned, like DRAM arena slots
    slots[: 3 * BLOCK] = val(5, 3 * BLOCK)
    aligned = [memoryview(slots)[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    written = []
    real = disk_mod._pwrite
    monkeypatch.setattr(disk_mod, "_pwrite", lambda fd, views, off: (written.append(views), real(fd, views, off)))
    size = 2 * BLOCK + 100  # its parts run to the end of its last block
    (loc,) = d.put_many([(b"slot", aligned, size)])
    assert loc.size == size and bytes(d.read(loc)) == val(5, 3 * BLOCK)[:size]
    assert all(v.obj is slots for v in written[-1]), "aligned parts went to the device as they are"
    (loc2,) = d.put_many([(b"buf", [memoryview(bytearray(val(6, 5000)))[1:]], 4999)])  # unaligned: staged
    assert bytes(d.read(loc2)) == val(6, 5000)[1:]
    assert written[-1][0].obj is d._stage


def test_bit_rot_reads_as_data_loss_never_as_other_bytes(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 1 << 20)
    _OPEN.append(d)
    (loc,) = d.put_many([(b"k", val(4, 10_000))])
    with open(tmp_path / "d" / DATA_FILE, "r+b") as f:
        f.seek(loc.extents[0][0] + 5000)
        f.write(b"\x00")
    with pytest.raises(DataLossError, match="checksum"):
        d.read(loc)
    assert isinstance(d.read_many([loc, loc])[0], DataLossError)


def test_an_older_format_folder_and_a_shrunk_tier_are_clear_startup_errors(tmp_path):
    env = lmdb.open(str(tmp_path / "old"), max_dbs=1)
    env.open_db(b"values")
    env.close()
    with pytest.raises(DiskTierError, match="older disk-tier format"):
        DiskTier(str(tmp_path / "old"), 1 << 20)
    d = DiskTier(str(tmp_path / "d"), 1 << 20)
    d.put_many([(b"k%d" % i, val(i, 100_000)) for i in range(8)])
    d.close()
    with pytest.raises(DiskTierError, match="larger --disk-size"):
        DiskTier(str(tmp_path / "d"), 256 << 10)


def test_a_folder_one_tier_has_open_is_refused_to_a_second_until_the_first_closes(tmp_path):
    """Two tiers on one folder would each allocate blocks from a free list of their own and write over
    each other's values (LMDB lets both open it): the second is a startup error naming the holder."""
    path = str(tmp_path / "d")
    d = DiskTier(path, 1 << 20)
    _OPEN.append(d)
    [loc] = d.put_many([(b"k", val(1, 10_000))])
    with pytest.raises(DiskTierError, match=rf"--disk {path} is in use by another store node \(pid {os.getpid()} "):
        DiskTier(path, 1 << 20)
    assert bytes(d.read(loc)) == val(1, 10_000), "the refused tier touched the open one's files"
    d.close()
    with pytest.raises(DiskTierError, match="larger --disk-size"):
        DiskTier(path, BLOCK)  # a start that fails after taking the folder lets it go again
    d = DiskTier(path, 1 << 20)
    _OPEN.append(d)
    assert bytes(d.read(d.lookup(b"k"))) == val(1, 10_000)
    d.close()


def test_the_index_has_room_for_a_record_per_block(tmp_path):
    """A tier full of one-block values has a record per block. Measure what the index takes per
    record (one-block values under random keys, as chunk keys are, in batches, with the pages
    LMDB's copy-on-write has freed) and check that every tier size's map holds that per block. A
    16 GiB tier's map was 64 MiB, full at a few hundred thousand such records: the tier said it was
    full with most of its blocks free."""
    d = DiskTier(str(tmp_path / "d"), 512 << 20, preallocate=False)
    _OPEN.append(d)
    n = 60_000
    for _ in range(0, n, 500):
        d.put_many([(os.urandom(32), b"x") for _ in range(500)])
    per_record = (d.env.info()["last_pgno"] + 1) * d.env.stat()["psize"] / n
    assert 60 < per_record < 400, per_record
    d.close()
    for capacity in (1 << 30, 16 << 30, 1 << 40):
        assert index_map_bytes(capacity) >= per_record * (capacity // BLOCK), capacity


def test_a_corrupt_value_in_a_batch_is_a_counted_miss_and_the_rest_read(tmp_path):
    s = make(tmp_path / "d", slots=1)
    for i in range(6):
        s.put(b"k%d" % i, val(i, 3 * SLOT + 10))  # 4 slots: each goes straight to disk
    assert all(s.tier_of(b"k%d" % i) is Tier.DISK for i in range(6))
    s.close()
    flip_disk_byte(tmp_path / "d", b"k2", 3 * SLOT)
    s = make(tmp_path / "d", slots=1)
    leases = s.acquire_many([b"k%d" % i for i in range(6)])
    assert leases[2] is None
    assert [b"".join(ls.views) for i, ls in enumerate(leases) if i != 2] == [
        val(i, 3 * SLOT + 10) for i in range(6) if i != 2]
    s.release_many(ls for ls in leases if ls)
    st = s.stats()
    assert st["corrupt"] == 1 and s.exists([b"k2"]) == [False] and st["num_leases"] == 0
    assert s.disk.lookup(b"k2") is None  # its record and blocks are gone too


# ---- kept copies (inclusive tiering) ------------------------------------------------


def _promote(s, key):
    """Reads ``key`` until it is in DRAM (its second read earns it a place in a full DRAM)."""
    for _ in range(3):
        assert s.get(key) is not None
        if s.tier_of(key) is Tier.DRAM:
            return
    raise AssertionError(f"{key!r} was not promoted")


def test_a_promoted_value_goes_down_again_without_a_write(tmp_path):
    s = make(tmp_path / "d", slots=4)
    for i in range(8):
        s.put(b"k%d" % i, val(i))
    assert [s.tier_of(b"k%d" % i) for i in range(8)] == [Tier.DISK] * 4 + [Tier.DRAM] * 4
    w0 = s.stats()["disk_bytes_written"]
    for i in range(4):  # the four disk values move up, pushing the four DRAM ones down (written once)
        _promote(s, b"k%d" % i)
    st = s.stats()
    assert st["disk_bytes_written"] - w0 == 4 * SLOT and st["tiers"][Tier.DISK]["num_copies"] == 4
    for i in range(4, 8):  # and back: the promoted ones go down with nothing written
        _promote(s, b"k%d" % i)
    st = s.stats()
    assert st["disk_bytes_written"] - w0 == 4 * SLOT
    assert st["demotions_clean"] == 4
    assert st["tiers"][Tier.DISK]["used_bytes"] == 8 * disk_cost(SLOT)  # 4 on disk + 4 kept copies
    assert all(s.get(b"k%d" % i) == val(i) for i in range(8))
    s.close()
    s = make(tmp_path / "d", slots=4)  # a restart finds every value (the copies are the values)
    assert len(s) == 8 and all(s.get(b"k%d" % i) == val(i) for i in range(8))


def test_replacing_or_deleting_a_copied_value_deletes_its_record(tmp_path):
    """A kept record must never outlive its value: after a restart the old bytes would come back."""
    s = make(tmp_path / "d", slots=4)
    for i in range(8):
        s.put(b"k%d" % i, val(i))
    for k in (b"k0", b"k1"):
        _promote(s, k)
    assert s.stats()["tiers"][Tier.DISK]["num_copies"] == 2
    s.put(b"k0", val(100))  # replaced in DRAM
    s.delete([b"k1"])
    assert s.stats()["tiers"][Tier.DISK]["num_copies"] == 0
    assert s.get(b"k0") == val(100) and s.get(b"k1") is None
    s.close()
    s = make(tmp_path / "d", slots=4)
    assert s.get(b"k1") is None
    assert s.get(b"k0") in (None, val(100))  # DRAM is volatile; never the old value
    assert s.stats()["tiers"][Tier.DISK]["used_bytes"] == len(s) * disk_cost(SLOT)


def test_a_lease_on_a_replaced_disk_value_ends_without_deleting_the_new_values_copy(tmp_path):
    """Old and new value share the LMDB key: freeing the old (at its lease's end) must keep the
    record when it now holds the new value's kept copy."""
    s = make(tmp_path / "d", slots=4)
    for i in range(8):
        s.put(b"k%d" % i, val(i))
    old = s.acquire(b"k0")  # a disk value, leased
    assert old.tier is Tier.DISK
    res = s.reserve(b"k0", SLOT, Tier.DISK)  # replaced by a new disk value, which is then promoted
    res.views[0][:] = val(100)
    s.commit(res)
    _promote(s, b"k0")
    assert s.stats()["tiers"][Tier.DISK]["num_copies"] == 1
    s.release(old)
    for i in range(1, 5):  # push k0 down again (a clean demotion: it reads from its kept record)
        _promote(s, b"k%d" % i)
    assert s.tier_of(b"k0") is Tier.DISK and s.get(b"k0") == val(100)
    s.close()
    s = make(tmp_path / "d", slots=4)
    assert s.get(b"k0") == val(100)


def test_the_disk_drops_kept_copies_before_values(tmp_path):
    s = make(tmp_path / "d", slots=4, disk_size=48 * disk_cost(SLOT), high=0.95, low=0.85)
    cap = s.disk.capacity_bytes // disk_cost(SLOT)  # values the disk admits
    n = cap + 4 - 2
    for i in range(n):
        s.put(b"k%d" % i, val(i))
    on_disk = [b"k%d" % i for i in range(n) if s.tier_of(b"k%d" % i) is Tier.DISK]
    for k in on_disk[:2]:
        _promote(s, k)
    assert s.stats()["tiers"][Tier.DISK]["num_copies"] == 2
    drops = s.stats()["drops"]
    for i in range(n, n + 6):  # the disk needs room: the copies go first
        s.put(b"k%d" % i, val(i))
        if s.stats()["tiers"][Tier.DISK]["num_copies"] < 2:
            break
    st = s.stats()
    assert st["tiers"][Tier.DISK]["num_copies"] < 2 and st["drops"] == drops
    assert all(s.get(k) is not None for k in on_disk[:2])


def test_a_read_mostly_zipf_stream_over_4x_dram_writes_little(tmp_path):
    """Bytes written to disk per byte read from it stay under 0.1 (issue 19's bound); with
    exclusive tiers (no kept copies) every promotion into the full DRAM wrote a value down."""
    n_keys, dram = 256, 64
    rng = random.Random(7)
    weights = [1.0 / (i + 1) ** 0.9 for i in range(n_keys)]
    order = list(range(n_keys))
    rng.shuffle(order)
    stream = [order[i] for i in rng.choices(range(n_keys), weights=weights, k=6000)]
    ratios = {}
    for copies in (True, False):
        s = make(tmp_path / f"c{copies}", slots=dram, disk_copies=copies, high=0.95, low=0.85)
        for k in range(n_keys):
            s.put(b"k%d" % k, val(k))
        base = s.stats()
        for k in stream:
            assert s.get(b"k%d" % k) == val(k)
        st = s.stats()
        read = st["disk_bytes_read"] - base["disk_bytes_read"]
        ratios[copies] = (st["disk_bytes_written"] - base["disk_bytes_written"]) / read
    assert ratios[True] <= 0.1, ratios
    assert ratios[False] > 0.5, ratios  # the bound is the copies' doing


# ---- write-behind ----------------------------------------------------------------------


def test_write_behind_keeps_the_coldest_values_on_disk_so_eviction_writes_nothing(tmp_path):
    s = make(tmp_path / "d", slots=64, write_behind=True, high=0.95, low=0.85)
    for i in range(58):  # 58 of 64 slots: within two eviction rounds of the high watermark
        s.put(b"k%d" % i, val(i))
    window = int(2 * (0.95 - 0.85) * 64)  # the coldest slots the writer keeps clean
    wait_for(lambda: s.stats()["written_behind"] >= window, timeout_s=120, interval_s=0.01,
             what="the background writer")
    time.sleep(0.2)
    st = s.stats()
    assert st["written_behind"] == window and st["tiers"][Tier.DISK]["num_copies"] == window
    assert list(s._copies) == [b"k%d" % i for i in range(window)]  # the coldest, in order
    assert st["disk_bytes_written"] == window * SLOT and st["demotions"] == 0
    for i in range(58, 62):  # past the high watermark: one eviction round takes the coldest
        s.put(b"k%d" % i, val(i))
    st = s.stats()
    assert st["demotions"] >= 1 and st["demotions_clean"] == st["demotions"], st
    assert st["disk_bytes_written"] == st["written_behind"] * SLOT  # nothing written in the put's path
    assert all(s.get(b"k%d" % i) == val(i) for i in range(62))
    s.close()
    s = make(tmp_path / "d", slots=64)  # restart: everything that reached disk is there
    assert all(s.get(b"k%d" % i) == val(i) for i in range(st["demotions"]))


def test_put_many_only_new_keeps_an_existing_record(tmp_path):
    d = DiskTier(str(tmp_path / "d"), 1 << 20)
    _OPEN.append(d)
    (first,) = d.put_many([(b"k", val(1, 5000))])
    got = d.put_many([(b"k", val(2, 5000)), (b"j", val(3, 5000))], only_new=True)
    assert got[0] is None and got[1] is not None
    assert d.lookup(b"k") == first and bytes(d.get(b"j")) == val(3, 5000)
    assert d.space.free_bytes == d.capacity_bytes - 2 * disk_cost(5000)  # the refused one's blocks came back


# ---- a full file system (ENOSPC) --------------------------------------------------


@contextlib.contextmanager
def _mounted(mnt, source: list[str], why: str):
    """Mounts ``source`` (mount's arguments before the mount point) on ``mnt`` for a test, or skips
    it with ``why``; after it, closes what the test opened there and unmounts it."""
    r = subprocess.run(["mount", *source, str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{why}: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        close_opened()
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB file system (tmpfs), mounted for the test and unmounted after."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    with _mounted(mnt, ["-t", "tmpfs", "-o", "size=2m", "tmpfs"], "cannot mount a small tmpfs here (needs root)"):
        yield mnt


def test_the_data_file_is_reserved_at_start_where_the_file_system_has_room(tmp_path):
    cap = 32 << 20
    d = DiskTier(str(tmp_path / "d"), cap)
    _OPEN.append(d)
    st = os.stat(tmp_path / "d" / DATA_FILE)
    assert d.preallocated and st.st_size == cap and st.st_blocks * 512 >= cap  # every block taken at start
    locs = d.put_many([(b"k%d" % i, val(i, 70_000)) for i in range(8)])
    assert [bytes(d.get(b"k%d" % i)) for i in range(8)] == [val(i, 70_000) for i in range(8)]
    d.close()
    d = DiskTier(str(tmp_path / "d"), cap)  # a restart: the reserved file is kept, its free space from the index
    _OPEN.append(d)
    assert d.preallocated and dict(d.scan()) == {b"k%d" % i: loc for i, loc in enumerate(locs)}
    assert d.space.free_bytes == cap - sum(disk_cost(70_000) for _ in range(8))
    assert bytes(d.get(b"k7")) == val(7, 70_000)
    sparse = DiskTier(str(tmp_path / "s"), cap, preallocate=False)  # --no-disk-preallocate
    _OPEN.append(sparse)
    assert not sparse.preallocated and os.stat(tmp_path / "s" / DATA_FILE).st_blocks * 512 < cap // 4
    sparse.put_many([(b"x", val(1, 70_000))])
    assert bytes(sparse.get(b"x")) == val(1, 70_000)


@pytest.fixture
def small_ext4(tmp_path):
    """A real 128 MiB ext4 file system on a loop device, mounted for the test and unmounted after."""
    img, mnt = tmp_path / "fs.img", tmp_path / f"ext4-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(128 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system here: {r.stderr.strip()}")
    with _mounted(mnt, ["-o", "loop", str(img)], "cannot mount a small ext4 here (needs root and loop devices)"):
        yield mnt


def test_a_tier_is_reserved_only_where_its_file_system_has_the_room(small_ext4, small_fs):
    fits = DiskTier(str(small_ext4 / "fits"), 32 << 20)  # 32 MiB and the index's 64 MiB fit in ~120
    _OPEN.append(fits)
    assert fits.preallocated and os.stat(small_ext4 / "fits" / DATA_FILE).st_blocks * 512 >= 32 << 20
    big = DiskTier(str(small_ext4 / "big"), 64 << 20)  # 64 + 64 do not fit beside the first
    _OPEN.append(big)
    assert not big.preallocated and os.stat(small_ext4 / "big" / DATA_FILE).st_blocks * 512 < 1 << 20
    big.put_many([(b"k", val(1, 100_000))])  # sparse, it takes blocks as values land
    assert bytes(big.get(b"k")) == val(1, 100_000)
    mem = DiskTier(str(small_fs / "mem"), 1 << 20)  # tmpfs: its blocks are memory, never reserved
    _OPEN.append(mem)
    assert not mem.preallocated


def test_a_full_file_system_is_a_clear_error_and_nothing_committed_is_lost(small_fs):
    d = DiskTier(str(small_fs / "d"), 64 << 20)  # the tier is far larger than the file system
    _OPEN.append(d)
    assert not d.preallocated  # too little room to reserve the tier: a sparse file, which fills up
    written = []
    with pytest.raises(DiskFullError, match="file system is full"):
        for i in range(16):
            d.put_many([(b"k%d" % i, val(i, 256 << 10))])
            written.append(i)
    assert written, "some values fit before the file system filled up"
    for i in written:  # every committed value reads back
        assert bytes(d.get(b"k%d" % i)) == val(i, 256 << 10)
    assert d.get(b"k%d" % (written[-1] + 1)) is None  # the refused batch left nothing
    # freed blocks are reused: a write fits again
    d.delete_many([(b"k%d" % i, d.lookup(b"k%d" % i)) for i in written[:2]])
    d.put_many([(b"again", val(99, 200 << 10))])
    assert bytes(d.get(b"again")) == val(99, 200 << 10)


@pytest.mark.parametrize("background", [False, True], ids=["put-demotes", "demoter"])
def test_the_store_keeps_serving_when_the_disk_fills(small_fs, background):
    s = make(small_fs / "d", slots=8, disk_size=64 << 20, high=0.95, low=0.85, background_demotion=background)
    size = 3 * SLOT
    acked = {}
    for i in range(200):  # far more than DRAM and the file system hold together
        try:
            s.put(b"k%d" % i, val(i, size))
            acked[b"k%d" % i] = val(i, size)
        except ResourceExhaustedError as exc:
            assert "full" in str(exc)
    st = s.stats()
    assert st["disk_full"] >= 1, "the file system filled up"
    assert len(acked) >= 150, "puts kept landing (DRAM, and disk room made by evicting its LRU)"
    present = [k for k in acked if s.exists([k]) == [True]]
    assert present and s.stats()["tiers"][Tier.DRAM]["num_entries"] >= 1
    for k in present:  # every value the store still lists reads back exactly
        assert s.get(k) == acked[k]
    assert os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize < 1 << 20
    if background:
        assert s.settle()
        _accounting(s)


# ---- the demoter (background demotion) ---------------------------------------------------


class Gate:
    """Holds the demoters' disk writes until opened: each then goes on to the real
    ``DiskTier.put_many`` (the bytes really reach the data file)."""

    def __init__(self, disk) -> None:
        self.real, self.opened, self.entered = disk.put_many, threading.Event(), threading.Semaphore(0)
        self.runs: list[list[bytes]] = []  # the keys of each run held, in the order they came
        disk.put_many = self

    def __call__(self, items, **kw):
        if threading.current_thread().name.startswith("crescent-demoter"):
            self.runs.append([key for key, *_ in items])
            self.entered.release()
            assert self.opened.wait(120), "the gate was never opened"
        return self.real(items, **kw)


def _accounting(s) -> None:
    """The disk's charge is what its values and kept copies take, once nothing is in flight (reads
    promote: the demoter may have runs to write first)."""
    assert s.settle()
    with s._lock:
        want = sum(disk_cost(e.size) for e in s._lru[Tier.DISK].values())
        want += sum(disk_cost(e.size) for e in s._copies.values())
        assert s._disk_used == want and s._demoting == 0


def test_the_demoter_writes_runs_while_their_values_stay_readable_and_puts_go_on(tmp_path):
    s = make(tmp_path / "d", slots=64, high=0.95, low=0.85, background_demotion=True)
    gate = Gate(s.disk)
    done = threading.Event()
    try:
        for i in range(64):  # past the high watermark (60 of 64): runs start, held at the gate
            s.put(b"k%d" % i, val(i))
        assert gate.entered.acquire(timeout=120)
        st = s.stats()
        assert st["demotions"] == 0 and st["tiers"][Tier.DRAM]["num_entries"] == 64  # all 64 slots taken
        assert all(s.get(b"k%d" % i) == val(i) for i in range(64))  # being written, and readable

        def put_one_more():  # DRAM is full: waits for a run, never fails
            s.put(b"k64", val(64))
            done.set()

        t = threading.Thread(target=put_one_more)
        t.start()
        assert not done.wait(0.5) and t.is_alive()  # held by the gate: it cannot have gone through
        gate.opened.set()
        t.join(120)
        assert done.is_set()
    finally:
        gate.opened.set()
    assert s.settle()
    st = s.stats()
    used = st["tiers"][Tier.DRAM]["used_bytes"] // SLOT
    assert used <= int(0.95 * 64) and st["demotions"] == 65 - used
    assert st["disk_bytes_written"] == st["demotions"] * SLOT and st["demotions_clean"] == 0
    offsets = [s._index[b"k%d" % i].loc.extents[0][0] for i in range(65) if s.tier_of(b"k%d" % i) is Tier.DISK]
    assert len(offsets) == st["demotions"] and offsets == sorted(offsets)  # runs lie on disk in LRU order
    assert all(s.get(b"k%d" % i) == val(i) for i in range(65))
    _accounting(s)
    s.close()
    s = make(tmp_path / "d", slots=64)  # restart: every demoted value is on disk
    assert all(s.get(b"k%d" % i) == val(i) for i in range(st["demotions"]))


def test_once_past_the_high_watermark_the_demoters_go_on_down_to_the_low_one(tmp_path):
    s = make(tmp_path / "d", slots=64, high=0.95, low=0.85, background_demotion=True)
    for i in range(int(0.95 * 64)):  # up to the high watermark: nothing to do
        s.put(b"k%d" % i, val(i))
    assert s.settle() and s.stats()["demotions"] == 0
    s.put(b"one-more", val(99))  # past it: runs follow one another down to the low watermark (54 of 64)
    assert s.settle()
    st = s.stats()
    assert st["tiers"][Tier.DRAM]["used_bytes"] // SLOT == int(0.85 * 64) and st["demotions"] == 61 - 54
    assert [s.tier_of(b"k%d" % i) for i in range(8)] == [Tier.DISK] * 7 + [Tier.DRAM]  # the coldest went
    _accounting(s)


def test_a_value_leased_deleted_or_replaced_during_its_run_keeps_a_copy_goes_or_stays_new(tmp_path):
    s = make(tmp_path / "d", slots=128, high=0.95, low=0.85, background_demotion=True)
    gate = Gate(s.disk)
    try:
        for i in range(122):  # 122 > 121 (the high watermark): runs of 3 (half the room above it), coldest first
            s.put(b"k%d" % i, val(i))
        while [b"k0", b"k1", b"k2"] not in gate.runs:  # the other demoter may bring the next run first
            assert gate.entered.acquire(timeout=120), gate.runs
        assert all(run in ([b"k0", b"k1", b"k2"], [b"k3", b"k4", b"k5"]) for run in gate.runs), gate.runs
        lease = s.acquire(b"k0")  # read during its run
        s.delete([b"k1"])
        s.put(b"k2", val(1002))  # replaced: the new value in a free slot
        gate.opened.set()
        assert s.settle()
    finally:
        gate.opened.set()
    e0 = s._index[b"k0"]
    assert e0.tier is Tier.DRAM and e0.on_disk  # stays (leased), with its disk copy
    assert bytes(b"".join(lease.views)) == val(0)
    s.release(lease)
    assert s.get(b"k1") is None and s.get(b"k2") == val(1002)
    # the first run wrote 3 values (k0's copy, k1 and the old k2, which then went); the runs after it
    # (the demoters go on down to the low watermark) each wrote and moved their values
    st = s.stats()
    assert st["demotions_clean"] == 0 and st["disk_bytes_written"] == (3 + st["demotions"]) * SLOT
    _accounting(s)
    i = 122
    while s._index[b"k0"].tier is Tier.DRAM and i < 600:  # until k0 (read last, so not the coldest) goes
        s.put(b"k%d" % i, val(i))
        i += 1
        assert s.settle()
    st = s.stats()
    assert s._index[b"k0"].tier is Tier.DISK and st["demotions_clean"] == 1  # its copy was there: no write
    # the first run wrote 3 values (k0's copy, k1 and the old k2, which then went); every later
    # demotion but k0's wrote its value
    assert st["disk_bytes_written"] == (3 + st["demotions"] - 1) * SLOT and s.get(b"k0") == val(0)
    _accounting(s)
    s.close()
    s = make(tmp_path / "d", slots=128)  # restart: the deleted key is gone, the replaced one never old
    assert s.get(b"k1") is None and s.get(b"k2") in (None, val(1002)) and s.get(b"k0") == val(0)


def test_disk_bound_values_held_in_memory_until_their_puts_end_are_bounded(tmp_path):
    """A value bound for the disk tier is received whole in memory, then written at its commit: before,
    a batch of them (one gRPC Put stream, one data-channel PUT) held as many bytes of RAM as the disk
    tier had room (16 GiB by default). Now ``disk_staging`` at once: a reservation past it is refused
    until those before it are committed or aborted."""
    with pytest.raises(ValueError, match="--disk-staging"):
        StoreConfig(disk_staging=1 << 20, max_value_size=2 << 20)
    s = make(tmp_path / "d", slots=1, disk_staging=64 * SLOT, max_value_size=32 * SLOT, promote=False)
    s.put(b"dram", val(0))
    s.pin([b"dram"], 3600)  # the one DRAM slot, held: every reservation below is bound for the disk
    a = s.reserve(b"a", 32 * SLOT)
    b = s.reserve(b"b", 32 * SLOT)
    assert (a.tier, b.tier) == (Tier.DISK, Tier.DISK)
    with pytest.raises(ResourceExhaustedError, match="--disk-staging"):
        s.reserve(b"c", 1)
    s.abort(a)
    c = s.reserve(b"c", 32 * SLOT)
    for r, tag in ((b, 2), (c, 3)):
        r.views[0][:] = val(tag, 32 * SLOT)
    s.commit_many([b, c])
    d = s.reserve(b"d", 32 * SLOT)  # the committed ones are on disk, no longer in memory
    s.abort(d)
    assert s.get(b"b") == val(2, 32 * SLOT) and s.get(b"c") == val(3, 32 * SLOT) and s.get(b"a") is None
