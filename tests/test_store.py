"""TieredStore: exact eviction order, demotion/promotion, two-phase puts, leases, pins, disk faults."""

import os
import time

import pytest

from kvstore.config import StoreConfig
from kvstore.disk import DATA_FILE, DiskTier, DiskTierError, disk_cost
from kvstore.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from kvstore.store import StoreEvent, Tier, TieredStore

SLOT = 4096


_OPEN: list[TieredStore] = []


def close_opened() -> None:
    """Closes every store (or disk tier) in ``_OPEN``."""
    while _OPEN:
        try:
            _OPEN.pop().close()
        except Exception:  # noqa: BLE001 - already closed by the test
            pass


@pytest.fixture(autouse=True)
def _close_stores():
    """Every store a test opens is closed after it (its /dev/shm arena removed)."""
    yield
    close_opened()


def make(tmp_path=None, slots=4, disk=False, listener=None, **kw):
    kw.setdefault("write_behind", False)  # exact, single-threaded eviction (write-behind: test_disk_tier.py)
    cfg = StoreConfig(dram=slots * SLOT, slot_size=SLOT, high_watermark=kw.pop("high", 1.0),
                      low_watermark=kw.pop("low", 1.0),
                      disk=str(tmp_path / "disk") if disk else None, disk_size=kw.pop("disk_size", 4 << 20), **kw)
    store = TieredStore(cfg, listener=listener)
    _OPEN.append(store)
    return store


def val(tag: int, size: int = SLOT) -> bytes:
    return bytes([tag % 256]) * size


@pytest.fixture
def events():
    return []


def test_lru_eviction_order_is_exact(events):
    s = make(slots=4, listener=events.append)
    for k in b"abcd":
        s.put(bytes([k]), val(k))
    assert s.get(b"a") == val(ord("a"))  # a read touches a
    s.exists([b"b"])  # exists and lookup do not
    s.lookup([b"b"])
    s.put(b"e", val(1))
    assert [e for e in events if e.kind == "removed"] == [StoreEvent("removed", b"b", Tier.DRAM, "evicted")]
    s.put(b"f", val(2))
    s.put(b"g", val(3))
    assert s.exists([b"a", b"b", b"c", b"d", b"e", b"f", b"g"]) == [True, False, False, False, True, True, True]


def test_watermarks_evict_down_to_low(events):
    s = make(slots=10, high=0.8, low=0.5, listener=events.append)
    for i in range(8):
        s.put(b"k%d" % i, val(i))
    assert not [e for e in events if e.kind == "removed"]
    s.put(b"k8", val(8))  # 8 + 1 > 8 slots: evict until 8 + 1 - evicted <= 5
    evicted = [e.key for e in events if e.kind == "removed"]
    assert evicted == [b"k0", b"k1", b"k2", b"k3"]
    assert s.stats()["tiers"][Tier.DRAM]["num_entries"] == 5


def test_demotion_to_disk_then_promotion_on_hit(tmp_path, events):
    s = make(tmp_path, slots=4, disk=True, listener=events.append)
    for i in range(5):
        s.put(b"k%d" % i, val(i))
    assert s.tier_of(b"k0") is Tier.DISK
    assert events[-2] == StoreEvent("moved", b"k0", Tier.DISK)
    assert s.get(b"k0") == val(0)
    assert s.tier_of(b"k0") is Tier.DISK  # one read has not earned a place in a full DRAM tier
    assert s.stats()["promotions_deferred"] == 1
    assert s.get(b"k0") == val(0)
    assert s.tier_of(b"k0") is Tier.DRAM  # the second read has: promoted
    assert s.tier_of(b"k1") is Tier.DISK  # the LRU made room for it
    st = s.stats()
    assert (st["demotions"], st["promotions"], st["drops"]) == (2, 1, 0)
    assert st["tiers"][Tier.DISK]["hits"] == 2


def test_a_scan_larger_than_dram_does_not_turn_reads_into_writes(tmp_path):
    """Reading every disk value once: served from disk, nothing demoted, nothing written.
    With promote_after=1 each read promotes and demotes: only the four values first put in
    DRAM are written (once); the promoted ones keep their disk records, so pushing them
    down again writes nothing (before inclusive tiering every read wrote twice its bytes)."""
    for promote_after, writes in ((2, 0), (1, None)):
        s = make(tmp_path / f"p{promote_after}", slots=4, disk=True, promote_after=promote_after)
        for i in range(12):
            s.put(b"k%d" % i, val(i))
        on_disk = [b"k%d" % i for i in range(12) if s.tier_of(b"k%d" % i) is Tier.DISK]
        assert len(on_disk) == 8
        before = s.stats()
        for k in on_disk:
            assert s.get(k) == val(int(k[1:]))
        st = s.stats()
        written = st["disk_bytes_written"] - before["disk_bytes_written"]
        assert st["disk_bytes_read"] - before["disk_bytes_read"] == 8 * SLOT
        if writes is not None:
            assert written == writes and st["promotions"] == before["promotions"]
            assert st["promotions_deferred"] - before["promotions_deferred"] == 8
        else:
            assert written == 4 * SLOT and st["promotions"] - before["promotions"] == 8
            assert st["demotions_clean"] - before["demotions_clean"] == 4


def test_a_value_that_fits_is_promoted_on_its_first_read(tmp_path):
    s = make(tmp_path, slots=4, disk=True)
    for i in range(5):
        s.put(b"k%d" % i, val(i))
    s.delete([b"k2", b"k3"])  # DRAM has room again
    assert s.get(b"k0") == val(0) and s.tier_of(b"k0") is Tier.DRAM
    assert s.stats()["promotions_deferred"] == 0


def test_no_promotion_when_disabled(tmp_path):
    s = make(tmp_path, slots=2, disk=True, promote=False)
    for i in range(3):
        s.put(b"k%d" % i, val(i))
    assert s.get(b"k0") == val(0) and s.tier_of(b"k0") is Tier.DISK


def test_multi_slot_values_and_partial_slots(tmp_path):
    s = make(tmp_path, slots=8, disk=True)
    data = os.urandom(3 * SLOT + 17)
    assert s.put(b"big", data) is Tier.DRAM
    assert s.stats()["tiers"][Tier.DRAM]["used_bytes"] == 4 * SLOT
    assert s.get(b"big") == data
    assert s.put(b"empty", b"") is Tier.DRAM and s.get(b"empty") == b""
    huge = os.urandom(9 * SLOT)  # larger than the whole arena: lands on disk
    assert s.put(b"huge", huge) is Tier.DISK and s.get(b"huge") == huge


def test_freed_slots_come_back_as_one_ascending_run():
    from kvstore.arena import SlotAllocator

    a = SlotAllocator(64, 4096)
    first = a.alloc(16)
    assert first == list(range(16))
    gens = [a.generation[s] for s in first]
    a.free(first)
    assert [a.generation[s] for s in first] == [g + 1 for g in gens]  # every freed slot goes stale
    assert a.alloc(16) == first  # the same run, ascending: one copy for the movers, not 16
    assert a.num_free == 48
    singles = [a.alloc(1) for _ in range(16)]  # one-slot values, freed one by one in order:
    for one in singles:                         # the free list now holds their run descending
        a.free(one)
    assert a.alloc(16) == sorted(s for one in singles for s in one)  # handed out ascending


def test_two_phase_put():
    s = make(slots=4)
    res = s.reserve(b"k", 10)
    assert s.exists([b"k"]) == [False] and s.get(b"k") is None
    res.views[0][:] = b"0123456789"
    assert s.get(b"k") is None
    s.commit(res)
    assert s.get(b"k") == b"0123456789"
    res2 = s.reserve(b"k", 3)
    res2.views[0][:] = b"new"
    s.abort(res2)
    assert s.get(b"k") == b"0123456789"  # an aborted replace leaves the old value
    assert s.stats()["tiers"][Tier.DRAM]["used_bytes"] == SLOT
    with pytest.raises(FailedPreconditionError):
        s.commit(res2)


def test_leases_block_eviction_and_full_leased_dram_is_exhausted():
    s = make(slots=2)
    s.put(b"a", val(1))
    s.put(b"b", val(2))
    la = s.acquire(b"a")
    s.put(b"c", val(3))  # evicts b, not the leased a
    assert s.exists([b"a", b"b", b"c"]) == [True, False, True]
    lc = s.acquire(b"c")
    with pytest.raises(ResourceExhaustedError, match="leased or pinned"):
        s.put(b"d", val(4))
    with pytest.raises(ResourceExhaustedError, match=f"larger than every tier of this node \\(dram {2 * SLOT} bytes"):
        s.put(b"e", os.urandom(3 * SLOT))  # no eviction could ever make room: said so
    assert b"".join(la.views) == val(1)
    s.release(la)
    s.release(la)  # idempotent
    s.put(b"d", val(4))
    assert s.exists([b"a", b"c", b"d"]) == [False, True, True]
    s.release(lc)
    assert s.stats()["num_leases"] == 0


def test_delete_and_replace_under_lease_keep_the_leased_bytes():
    s = make(slots=4)
    s.put(b"a", val(1))
    s.put(b"b", val(2))
    la, lb = s.acquire(b"a"), s.acquire(b"b")
    assert s.delete([b"a", b"zz"]) == 1
    s.put(b"b", val(9))  # replace
    assert s.get(b"a") is None and s.get(b"b") == val(9)
    for i in range(3):  # churn: any reuse of the leased slots would show
        s.put(b"x%d" % i, val(100 + i))
    assert b"".join(la.views) == val(1) and b"".join(lb.views) == val(2)
    s.release(la)
    s.release(lb)
    assert s.stats()["tiers"][Tier.DRAM]["used_bytes"] <= 4 * SLOT


def test_pins_block_eviction_until_their_ttl():
    s = make(slots=2)
    s.put(b"a", val(1))
    s.put(b"b", val(2))
    assert s.pin([b"a", b"nope"], 60) == 1
    s.put(b"c", val(3))
    assert s.exists([b"a", b"b"]) == [True, False]
    s.pin([b"a"], 0)  # unpin
    s.put(b"d", val(4))
    assert s.exists([b"a"]) == [False]
    s.put(b"e", val(5))
    s.pin([b"d"], 0.05)
    time.sleep(0.2)  # the pin has lapsed
    s.put(b"f", val(6))
    s.put(b"g", val(7))
    assert s.exists([b"d"]) == [False]
    with pytest.raises(InvalidArgumentError):
        s.pin([b"e"], -1)


def test_a_pin_is_the_keys_a_new_value_under_it_stays_pinned():
    s = make(slots=2)
    s.put(b"a", val(1))
    assert s.pin([b"a"], 600) == 1
    s.put(b"a", val(9))  # replaced (a chunk re-saved after a recompute, say)
    s.put(b"b", val(2))
    s.put(b"c", val(3))  # evicts b, the only unpinned value, not a
    assert s.exists([b"a", b"b", b"c"]) == [True, False, True] and s.get(b"a") == val(9)
    assert s.stats()["num_pinned"] == 1


def test_bad_input():
    s = make(slots=2, max_value_size=3 * SLOT)
    with pytest.raises(InvalidArgumentError, match="empty key"):
        s.put(b"", b"x")
    with pytest.raises(InvalidArgumentError, match="exceeds the limit"):
        s.put(b"k" * 1025, b"x")
    with pytest.raises(InvalidArgumentError, match="exceeds the limit"):
        s.reserve(b"k", 3 * SLOT + 1)
    with pytest.raises(InvalidArgumentError):
        s.get(b"")
    assert len(s) == 0


def test_value_larger_than_dram_without_disk_is_exhausted():
    s = make(slots=2)
    with pytest.raises(ResourceExhaustedError):
        s.put(b"k", bytes(3 * SLOT))


def test_restart_rebuilds_the_disk_index(tmp_path):
    s = make(tmp_path, slots=2, disk=True)
    for i in range(6):
        s.put(b"k%d" % i, val(i, 1000 + i))
    on_disk = [b"k%d" % i for i in range(6) if s.tier_of(b"k%d" % i) is Tier.DISK]
    assert len(on_disk) == 4
    s.close()
    s2 = make(tmp_path, slots=2, disk=True)
    assert len(s2) == 4
    for k in on_disk:
        i = int(k[1:])
        assert s2.get(k) == val(i, 1000 + i)


def flip_disk_byte(folder, key: bytes, at: int) -> None:
    """Flips byte ``at`` of ``key``'s value in a closed disk tier's data file (bit rot)."""
    d = DiskTier(str(folder), 1 << 30)
    loc = d.lookup(key)
    d.close()
    off = loc.extents[0][0] + (at % loc.size)
    with open(os.path.join(folder, DATA_FILE), "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_disk_record_reads_as_a_miss(tmp_path, events):
    s = make(tmp_path, slots=1, disk=True, listener=events.append)
    s.put(b"a", val(1))
    s.put(b"b", val(2))
    assert s.tier_of(b"a") is Tier.DISK
    s.close()
    flip_disk_byte(tmp_path / "disk", b"a", -1)
    s = make(tmp_path, slots=1, disk=True, listener=events.append)
    assert s.get(b"a") is None
    assert events[-1] == StoreEvent("removed", b"a", Tier.DISK, "corrupt")
    assert s.stats()["corrupt"] == 1 and s.exists([b"a"]) == [False]
    s.put(b"a", val(3))  # the key is usable again
    assert s.get(b"a") == val(3)


def test_corrupt_lmdb_file_is_a_clear_startup_error(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    (d / "data.mdb").write_bytes(os.urandom(64 << 10))
    with pytest.raises(DiskTierError, match="disk tier"):
        make(tmp_path, slots=1, disk=True)


def test_disk_full_is_exhausted_and_the_store_keeps_serving(tmp_path):
    s = make(tmp_path, slots=1, disk=True, disk_size=256 << 10)
    s.put(b"a", val(1))
    lease_a = s.acquire(b"a")  # DRAM is full and leased: puts go to disk
    held = []  # a lease on every disk value: nothing there is evictable
    with pytest.raises(ResourceExhaustedError):
        for i in range(200):
            assert s.put(b"d%d" % i, val(i, 30_000)) is Tier.DISK
            held.append(s.acquire(b"d%d" % i))
    assert held, "some values fit before the disk filled up"
    keys = [b"d%d" % i for i in range(len(held))]
    failed = b"d%d" % len(held)

    def check_accounting(leases):
        st = s.stats()
        disk = st["tiers"][Tier.DISK]
        on_disk = [k for k in keys + [failed] if s.tier_of(k) is Tier.DISK]
        assert disk["num_entries"] == len(on_disk) and len(s) == len(on_disk) + 1  # + a in DRAM
        assert disk["used_bytes"] == len(on_disk) * disk_cost(30_000)
        assert st["tiers"][Tier.DRAM]["used_bytes"] == SLOT
        assert st["num_leases"] == leases
        return st

    # the failed put left nothing behind: no value, no bytes charged, no lease, nothing evicted
    st = check_accounting(len(held) + 1)
    assert s.exists([failed]) == [False] and st["drops"] == 0
    with pytest.raises(ResourceExhaustedError):  # still full: a retry fails the same way
        s.put(failed, val(99, 30_000))
    check_accounting(len(held) + 1)
    for i, lease in enumerate(held):
        assert b"".join(lease.views) == val(i, 30_000)
    s.release_many(held)
    s.release(lease_a)
    check_accounting(0)
    # with the leases gone a put succeeds again: the disk drops its least recently used value
    assert s.put(failed, val(99, 30_000)) is Tier.DISK
    assert s.get(failed) == val(99, 30_000)
    assert s.exists([keys[0]]) == [False] and s.get(keys[-1]) == val(len(held) - 1, 30_000)
    st = check_accounting(0)
    assert st["drops"] == st["tiers"][Tier.DISK]["evictions"] >= 1
    assert s.get(b"a") == val(1)


def test_the_dram_arena_is_reserved_at_start_and_a_too_small_dev_shm_is_a_clear_error(tmp_path, monkeypatch):
    import subprocess

    import kvstore.arena as arena_mod

    s = TieredStore(StoreConfig(dram=4 << 20, slot_size=64 << 10))
    _OPEN.append(s)
    st = os.stat(s.dram.path)
    assert st.st_blocks * 512 >= 4 << 20  # reserved (fallocate) and mapped in at start
    s.put(b"k", b"v" * 100_000)
    assert s.get(b"k") == b"v" * 100_000
    lazy = TieredStore(StoreConfig(dram=4 << 20, slot_size=64 << 10, dram_populate=False))
    _OPEN.append(lazy)
    assert os.stat(lazy.dram.path).st_blocks * 512 < 1 << 20  # taken page by page as values land
    shm = tmp_path / "shm"
    shm.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(shm)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        monkeypatch.setattr(arena_mod, "SHM_DIR", str(shm))
        with pytest.raises(OSError, match=r"cannot reserve \d+ bytes for the DRAM arena in .*lower --dram"):
            TieredStore(StoreConfig(dram=8 << 20, slot_size=64 << 10))
        assert os.listdir(shm) == []  # nothing left behind
    finally:
        subprocess.run(["umount", str(shm)], check=True)


def test_device_tier_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the error path does not apply")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        make(slots=2, device=1 << 20)


def _cuda():
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="the device tier needs CUDA; torch sees no GPU on this machine")
def test_device_tier_round_trip_demotion_and_promotion(tmp_path):
    s = make(tmp_path, slots=4, disk=True, device=2 * SLOT)
    a, b, c = os.urandom(SLOT), os.urandom(100), os.urandom(SLOT - 1)
    assert s.put(b"a", a) is Tier.DEVICE
    assert s.put(b"b", b) is Tier.DEVICE  # the device tier (2 slots) is now full
    assert s.put(b"c", c) is Tier.DEVICE  # a, the LRU, is demoted to DRAM
    assert [s.tier_of(k) for k in (b"a", b"b", b"c")] == [Tier.DRAM, Tier.DEVICE, Tier.DEVICE]
    assert s.get(b"b") == b and s.get(b"c") == c
    assert s.get(b"a") == a
