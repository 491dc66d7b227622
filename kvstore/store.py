"""TieredStore: opaque values under byte keys across HBM, DRAM and disk.

Tiers, fastest first: DEVICE (GPU HBM, when configured), DRAM (a shared-memory
slot arena) and DISK (LMDB). Each key lives in exactly one tier.

- Put lands in the fastest tier with room, in two phases: ``reserve`` (slots
  are taken, nothing is visible), fill the reservation's buffers, then
  ``commit`` (the value appears whole) or ``abort``. Committing a key that
  exists replaces it.
- Eviction order: within a tier, least recently used first, where a commit and
  a read (``acquire``) count as uses and ``lookup``/``exists`` do not. Entries
  under a read lease or a live pin are skipped. Eviction starts when a
  reservation would lift a tier above its high watermark and stops at its low
  watermark. An evicted value is demoted to the next tier (write-back), or
  dropped from the last one. The disk also evicts (least recently used first,
  as much as the write needs) when LMDB refuses a write below that watermark.
- A read in a slower tier promotes the value to the fastest arena with room
  (``promote=True``); into a full one (demoting others) only on its
  ``promote_after``-th read among the recent disk reads, so a scan does not
  turn reads into writes.
- A value promoted from disk keeps its disk copy (the tiers are inclusive for
  it): demoting it again writes nothing, so a read-mostly working set larger
  than DRAM moves up and down without disk writes. Replacing or deleting the
  key frees the copy; the disk drops such copies first when it needs room.
- Disk reads of a batch run in parallel (``DiskTier.read_many``).
- A read lease keeps its value in place: it is neither evicted nor freed while
  leased; a delete or replace under a lease frees the old bytes on release.
- Quotas (``quotas``: a namespace's key prefix → ``auth.Quota``) bound the bytes a
  tenant's namespace holds in the arena tiers and on disk. A write that would pass
  a bound first evicts the namespace's own least recently used values (arena values
  are demoted to disk, within its disk bound); if they are leased or pinned, or the
  value is larger than the bound, it is refused (RESOURCE_EXHAUSTED). Promotions stay
  within the bound. Other tenants' values are never evicted to make a tenant room.

All index and allocator state is guarded by one lock; bulk copies into and out
of DRAM slots happen outside it, protected by reservations and leases.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from kvstore.arena import DeviceArena, HostArena, SlotAllocator
from kvstore.config import MAX_KEY_BYTES, StoreConfig
from kvstore.disk import DiskFullError, DiskTier, DiskWriteError, Loc, disk_cost
from kvstore.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError

log = logging.getLogger(__name__)

U64_MAX = (1 << 64) - 1
"""The largest counter ``Stats`` can carry (its fields are uint64)."""


class Tier(enum.IntEnum):
    """Where a value lives; numbers match ``crescent.v1.Tier``."""

    DEVICE = 1
    DRAM = 2
    DISK = 3


@dataclass(slots=True, eq=False)
class _Entry:
    key: bytes
    size: int
    tier: Tier
    slots: list[int] | None  # arena tiers only
    leases: int = 0
    pinned_until: float = 0.0
    live: bool = True  # False once deleted or replaced; storage freed on last release
    loc: Loc | None = None  # where its bytes are on disk: a disk value's, or an arena value's kept copy
    no_flush: bool = False  # write-behind could not store it: left to eviction

    @property
    def on_disk(self) -> bool:
        """An arena value with a kept disk copy (promoted from disk, or written behind)."""
        return self.loc is not None and self.tier is not Tier.DISK


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """A change to the index, for listeners (tests, the conductor's KV events)."""

    kind: Literal["stored", "moved", "removed"]
    key: bytes
    tier: Tier
    """New tier for stored/moved; the tier it left for removed."""
    reason: str = ""
    """For removed: ``evicted``, ``deleted``, ``replaced`` or ``corrupt``."""


@dataclass(slots=True, eq=False)
class Reservation:
    """Space for one value being written; invisible to readers until committed."""

    key: bytes
    size: int
    tier: Tier
    slots: list[int] | None = None
    buffer: bytearray | None = None  # disk-bound values are staged in memory
    views: list[memoryview] = field(default_factory=list)
    """Writable buffers to fill, in order; they hold exactly ``size`` bytes."""
    done: bool = False


@dataclass(slots=True, eq=False)
class Lease:
    """A read lease: ``views`` stay valid and unchanged until ``release``."""

    key: bytes
    size: int
    tier: Tier
    views: list[memoryview]
    _entry: _Entry
    released: bool = False
    _hold: object = None  # a disk read's pooled buffer (kvstore.disk.Hold), returned at release


def check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidArgumentError(f"a key must be bytes, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("empty key")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"key of {len(key)} bytes exceeds the limit of {MAX_KEY_BYTES}")


class TieredStore:
    """A node's tiers behind one index. Thread-safe."""

    def __init__(self, config: StoreConfig,
                 listener: Callable[[StoreEvent], None] | None = None, quotas: dict | None = None) -> None:
        self.config = config
        self._quotas = dict(quotas or {})
        """Namespace key prefix → ``auth.Quota``."""
        self._usage: dict[bytes, list[int]] = {p: [0, 0] for p in self._quotas}
        """Namespace key prefix → [arena bytes, disk bytes] held or reserved (quota'd namespaces only)."""
        self._prefix_len = len(next(iter(self._quotas), b""))
        self._listener = listener
        self._lock = threading.Lock()
        self._arenas: list[tuple[Tier, SlotAllocator]] = []
        if config.device > 0:
            self._arenas.append((Tier.DEVICE, DeviceArena(config.device, config.slot_size)))
        self.dram = HostArena(config.dram, config.slot_size, populate=config.dram_populate)
        self._arenas.append((Tier.DRAM, self.dram))
        try:
            self.disk = (DiskTier(config.disk, config.disk_size, config.disk_sync, config.disk_read_threads,
                                  preallocate=config.disk_preallocate) if config.disk else None)
        except BaseException:
            for _, arena in self._arenas:  # no arena file outlives a failed start
                arena.close()
            raise
        self._index: dict[bytes, _Entry] = {}
        self._lru: dict[Tier, OrderedDict[bytes, _Entry]] = {t: OrderedDict() for t in Tier}
        self._disk_used = 0  # committed and reserved disk cost
        self._disk_staged = 0  # bytes of disk-bound reservations held in memory until their commit
        self.counters = {"hits": {t: 0 for t in Tier}, "evictions": {t: 0 for t in Tier},
                         "misses": 0, "demotions": 0, "promotions": 0, "drops": 0,
                         "corrupt": 0, "bytes_in": 0, "bytes_out": 0,
                         "disk_bytes_read": 0, "disk_bytes_written": 0, "promotions_deferred": 0,
                         "demotions_clean": 0, "disk_full": 0, "disk_errors": 0, "written_behind": 0,
                         "quota_refused": 0, "quota_evictions": 0}
        self._disk_reads: OrderedDict[bytes, int] = OrderedDict()
        """Keys recently read from disk and not promoted -> reads counted (``promote_after``)."""
        self._copies: OrderedDict[bytes, _Entry] = OrderedDict()
        """Arena entries whose disk record is kept (``on_disk``), oldest promotion first."""
        self._num_leases = 0
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._flusher: threading.Thread | None = None
        if self.disk is not None:
            for key, loc in sorted(self.disk.scan(), key=lambda r: r[1].written_at):
                e = _Entry(key, loc.size, Tier.DISK, None, loc=loc)
                self._index[key] = e
                self._lru[Tier.DISK][key] = e
                self._disk_used += disk_cost(loc.size)
                self._charge(key, Tier.DISK, loc.size)
        self._reclaim = threading.Condition(self._lock)
        """The demoter waits on it for DRAM to pass its high watermark; puts wait on it for a run."""
        self._demoting = 0  # DRAM slots of the runs being written now
        self._draining = False  # the demoters work down to the low watermark (see _demoter_has_work)
        self._runs = 0  # demoter passes finished
        self._demoters: list[threading.Thread] = []
        if self.disk is not None and config.background_demotion:
            # NOTE: two, so that one hashes and commits a run while the other's is on its way to the device
            self._demoters = [threading.Thread(target=self._demote_behind, name=f"crescent-demoter-{i}", daemon=True)
                              for i in range(_DEMOTERS)]
            for t in self._demoters:
                t.start()
        if self.disk is not None and config.write_behind:
            self._flusher = threading.Thread(target=self._write_behind, name="crescent-write-behind", daemon=True)
            self._flusher.start()

    # ---- writes -------------------------------------------------------------

    def reserve(self, key: bytes, size: int, tier: Tier | None = None) -> Reservation:
        """Takes room for a value in the fastest tier that has (or can make) it.

        Args:
            key: the value's key.
            size: the value's size in bytes.
            tier: only this tier (e.g. DRAM for a client that fills arena slots itself).

        Raises:
            InvalidArgumentError: bad key or size.
            ResourceExhaustedError: no tier can make room (all leased or pinned, or full).
        """
        check_key(key)
        key = bytes(key)
        if not 0 <= size <= self.config.max_value_size:
            raise InvalidArgumentError(
                f"value of {size} bytes exceeds the limit of {self.config.max_value_size}")
        only = tier
        with self._lock:
            if self._demoters and only in (None, Tier.DRAM) and self._arenas[0][0] is Tier.DRAM:
                n = self.dram.slots_for(size)
                if self.dram.num_free < n <= self.dram.num_slots:
                    self._await_run(n)
            ns, bounded = self._ns(key), False
            for pos, (tier, arena) in enumerate(self._arenas):
                if only is not None and tier is not only:
                    continue
                n = arena.slots_for(size)
                if n > arena.num_slots:
                    continue
                if ns is not None and not self._quota_room(ns, tier, size):
                    bounded = True
                    continue
                if self._make_room(pos, n):
                    slots = arena.alloc(n)
                    assert slots is not None
                    self._charge(key, tier, size)
                    res = Reservation(key, size, tier, slots=slots)
                    if isinstance(arena, HostArena):
                        res.views = arena.views(slots, size)
                    else:
                        res.buffer = bytearray(size)
                        res.views = [memoryview(res.buffer)]
                    return res
            if only in (None, Tier.DISK) and self.disk is not None:
                if ns is not None and not self._quota_room(ns, Tier.DISK, size):
                    self._quota_refusal(ns, size)
                if self._disk_staged + size > self.config.disk_staging:
                    raise ResourceExhaustedError(
                        f"no room for {size} bytes: the faster tiers are full and {self._disk_staged} bytes bound for "
                        f"the disk tier are held in memory until their puts end (--disk-staging "
                        f"{self.config.disk_staging})")
                if self._make_disk_room(disk_cost(size)):
                    self._disk_used += disk_cost(size)
                    self._disk_staged += size
                    self._charge(key, Tier.DISK, size)
                    buf = bytearray(size)
                    return Reservation(key, size, Tier.DISK, buffer=buf, views=[memoryview(buf)])
            if bounded:
                self._quota_refusal(ns, size)
            if only not in (None, Tier.DISK):
                raise ResourceExhaustedError(f"the {only.name} tier cannot hold {size} bytes now")
            room = {t.name.lower(): a.num_slots * a.slot_bytes for t, a in self._arenas}
            if self.disk is not None:
                room["disk"] = self.disk.capacity_bytes
        if all(disk_cost(size) > n if t == "disk" else size > n for t, n in room.items()):
            raise ResourceExhaustedError(f"a value of {size} bytes is larger than every tier of this node ("
                                         + ", ".join(f"{t} {n} bytes" for t, n in room.items()) + ")")
        raise ResourceExhaustedError(
            f"no tier can hold {size} bytes: every resident value is leased or pinned, or the store is full")

    def commit(self, res: Reservation) -> None:
        self.commit_many([res])

    def commit_many(self, reservations: list[Reservation]) -> None:
        """Makes reserved values visible, whole; disk-bound ones in one LMDB transaction.

        Raises:
            FailedPreconditionError: a reservation was already committed or aborted.
            ResourceExhaustedError: the disk filled up (the disk-bound values are aborted).
        """
        with self._lock:
            for r in reservations:
                if r.done:
                    raise FailedPreconditionError("reservation already committed or aborted")
            to_disk = [r for r in reservations if r.tier is Tier.DISK]
            locs = {}
            if to_disk:
                try:
                    locs = dict(zip(map(id, to_disk), self._disk_put(
                        [(r.key, r.buffer) for r in to_disk], sum(disk_cost(r.size) for r in to_disk))))
                except (ResourceExhaustedError, DiskWriteError):
                    for r in reservations:
                        self._abort_locked(r)
                    raise
            for r in reservations:
                r.done = True
                if r.tier is Tier.DISK:
                    self._disk_staged -= r.size
                slots = r.slots
                if r.tier is Tier.DEVICE:
                    self._arena(Tier.DEVICE).write(slots, r.views)
                self._install(_Entry(r.key, r.size, r.tier, slots, loc=locs.get(id(r))))
                self.counters["bytes_in"] += r.size
                r.views = []
                r.buffer = None
            if self._flusher is not None:
                self._wake.notify()

    def abort(self, res: Reservation) -> None:
        """Returns a reservation's room; its bytes are never visible. Idempotent."""
        with self._lock:
            self._abort_locked(res)

    def put(self, key: bytes, value: bytes | bytearray | memoryview) -> Tier:
        """Reserve, copy and commit one value; returns the tier it landed in."""
        mv = memoryview(value).cast("B")
        res = self.reserve(key, mv.nbytes)
        try:
            off = 0
            for v in res.views:
                v[:] = mv[off : off + len(v)]
                off += len(v)
            self.commit(res)
        except BaseException:
            self.abort(res)
            raise
        return res.tier

    # ---- reads --------------------------------------------------------------

    def acquire(self, key: bytes) -> Lease | None:
        """A read lease on ``key``'s value, or None on a miss.

        A DRAM value is leased in place (views into the arena); a device or disk
        value is copied out (and promoted if configured).
        """
        check_key(key)
        return self.acquire_many([key])[0]

    def acquire_many(self, keys: list[bytes]) -> list[Lease | None]:
        """``acquire`` for a batch of checked keys: their disk values are read in parallel."""
        out: list[Lease | None] = [None] * len(keys)
        on_disk: list[tuple[int, _Entry]] = []
        with self._lock:
            c = self.counters
            for i, key in enumerate(keys):
                key = bytes(key)
                e = self._index.get(key)
                if e is None:
                    c["misses"] += 1
                    continue
                e.leases += 1
                self._num_leases += 1
                self._lru[e.tier].move_to_end(key)
                c["hits"][e.tier] += 1
                c["bytes_out"] += e.size
                if e.tier is Tier.DRAM:
                    out[i] = Lease(key, e.size, e.tier, self.dram.views(e.slots, e.size), e)
                elif e.tier is Tier.DEVICE:
                    out[i] = Lease(key, e.size, e.tier, [memoryview(self._arena(Tier.DEVICE).read(e.slots, e.size))], e)
                else:
                    on_disk.append((i, e))
        if not on_disk:
            return out
        holds: list = []
        got = self.disk.read_many([e.loc for _, e in on_disk], holds)
        read = []
        with self._lock:
            for (i, e), data, hold in zip(on_disk, got, holds):
                if isinstance(data, memoryview):
                    self.counters["disk_bytes_read"] += len(data)
                    out[i] = Lease(e.key, len(data), Tier.DISK, [data], e, _hold=hold)
                    read.append((e, data))
                    continue
                self.counters["corrupt"] += 1  # its blocks are its own while leased: they rotted
                if e.live and e.tier is Tier.DISK:
                    self._remove(e, "corrupt")
                self._release_locked(Lease(e.key, 0, Tier.DISK, [], e, _hold=hold))
        if self.config.promote and self._arenas:
            for e, data in read:
                self._promote(e, data)
        return out

    def release(self, lease: Lease) -> None:
        """Ends a read lease. Idempotent."""
        self.release_many((lease,))

    def release_many(self, leases: Iterable[Lease]) -> None:
        """Ends read leases in one lock hold. Idempotent."""
        with self._lock:
            for lease in leases:
                self._release_locked(lease)

    def _release_locked(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        lease.views = []
        if lease._hold is not None:
            lease._hold.release()
            lease._hold = None
        e = lease._entry
        e.leases -= 1
        self._num_leases -= 1
        if not e.live and e.leases == 0:
            self._free_storage(e)

    def acquire_in_place(self, keys: list[bytes], tier: Tier = Tier.DRAM
                         ) -> list[tuple[Lease, list[int] | None] | None]:
        """Read leases for a batch of checked keys: per key None (a miss) or (lease, DRAM slots).

        DRAM values are leased in one lock hold, without views: the caller
        copies their slots itself (the descriptor protocol), and the slots stay
        valid as ``arena_slots`` says. Other values go through ``acquire``
        (copied out, promoted when configured); their slots are None unless the
        promotion put them in DRAM. A value that would not be promoted (a device-tier
        value, a disk value that stays) is not read: its lease comes back already
        released, with slots None.

        With ``tier`` DEVICE, device-tier values are leased in place the same way (slots of
        the device arena, which a same-host GPU client maps) and the others are not read.
        """
        out: list[tuple[Lease, list[int] | None] | None] = []
        elsewhere = []
        with self._lock:
            lru, c = self._lru[tier], self.counters
            for i, key in enumerate(keys):
                e = self._index.get(key)
                if e is None or e.tier is not tier:
                    if e is None:
                        c["misses"] += 1
                        out.append(None)
                    elif tier is Tier.DRAM and self._would_promote(e):
                        elsewhere.append(i)
                        out.append(None)
                    else:  # stays where it is: said so without reading it (the caller reads it its own way)
                        out.append((Lease(key, e.size, e.tier, [], e, released=True), None))
                    continue
                e.leases += 1  # held in place: a leased entry is never demoted, evicted or freed
                self._num_leases += 1
                lru.move_to_end(key)
                c["hits"][tier] += 1
                c["bytes_out"] += e.size
                out.append((Lease(key, e.size, tier, [], e), list(e.slots)))
        for i, lease in zip(elsewhere, self.acquire_many([keys[i] for i in elsewhere])):
            out[i] = None if lease is None else (lease, self.arena_slots(lease))
        return out

    def device_arena(self):
        """The device tier's arena (``DeviceArena``), or None without one."""
        return next((a for t, a in self._arenas if t is Tier.DEVICE), None)

    def arena_slots(self, lease: Lease) -> list[int] | None:
        """The DRAM slots holding a leased value in place, or None when it is elsewhere.

        A DRAM value, or a disk value that ``acquire`` just promoted into DRAM,
        stays in these slots, unchanged, until the lease is released: a leased
        entry is never evicted or moved, and a delete or replace frees its slots
        only at the last release.
        """
        with self._lock:
            e = lease._entry
            if lease.released or e.tier is not Tier.DRAM or e.slots is None:
                return None
            return list(e.slots)

    def note_hits(self, tier: Tier, values: int, nbytes: int) -> None:
        """Counts reads served without this store seeing them (a same-host client's local reads)."""
        with self._lock:  # (stats() saturates them at the u64 of Stats)
            self.counters["hits"][tier] += values
            self.counters["bytes_out"] += nbytes

    def get(self, key: bytes) -> bytes | None:
        lease = self.acquire(key)
        if lease is None:
            return None
        try:
            return b"".join(lease.views)
        finally:
            self.release(lease)

    # ---- metadata -----------------------------------------------------------

    def lookup(self, keys: Iterable[bytes]) -> tuple[int, list[Tier]]:
        """Length of the longest present prefix of ``keys`` and the tier of each key in it."""
        tiers = []
        with self._lock:
            for k in keys:
                e = self._index.get(bytes(k))
                if e is None:
                    break
                tiers.append(e.tier)
        return len(tiers), tiers

    def exists(self, keys: Iterable[bytes]) -> list[bool]:
        with self._lock:
            return [bytes(k) in self._index for k in keys]

    def delete(self, keys: Iterable[bytes]) -> int:
        """Removes keys; returns how many were present."""
        n = 0
        with self._lock:
            for k in keys:
                e = self._index.get(bytes(k))
                if e is not None:
                    self._remove(e, "deleted")
                    n += 1
        return n

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        """The first ``nbytes`` of a DRAM or device value, counting no hit and moving nothing (for
        readers of headers, such as the KV-event publisher); None on a miss or a disk value."""
        with self._lock:
            e = self._index.get(bytes(key))
            if e is None or e.tier is Tier.DISK:
                return None
            n = min(nbytes, e.size)
            if e.tier is Tier.DRAM:
                out = bytearray()
                for v in self.dram.views(e.slots, e.size):
                    out += v[: n - len(out)]
                    if len(out) >= n:
                        break
                return bytes(out)
            return bytes(memoryview(self._arena(Tier.DEVICE).read(e.slots, e.size))[:n])

    def clear(self) -> int:
        """Removes every value (pinned ones too; a leased one goes when its lease ends); returns how many."""
        with self._lock:
            entries = list(self._index.values())
            for e in entries:
                self._remove(e, "deleted")
        return len(entries)

    def pin(self, keys: Iterable[bytes], ttl_s: float) -> int:
        """Protects keys from eviction for ``ttl_s`` seconds (0 unpins); returns keys found."""
        if not 0 <= ttl_s < math.inf:
            raise InvalidArgumentError("pin ttl must be a finite number >= 0")
        until = time.monotonic() + ttl_s if ttl_s > 0 else 0.0
        n = 0
        with self._lock:
            for k in keys:
                e = self._index.get(bytes(k))
                if e is not None:
                    e.pinned_until = until
                    n += 1
        return n

    def tier_of(self, key: bytes) -> Tier | None:
        with self._lock:
            e = self._index.get(bytes(key))
            return e.tier if e else None

    def stats(self) -> dict:
        """Counters and per-tier capacity/use, as plain data."""
        now = time.monotonic()
        with self._lock:
            tiers = {}
            for tier, arena in self._arenas:
                tiers[tier] = {"capacity_bytes": arena.capacity_bytes, "used_bytes": arena.used_bytes,
                               "num_entries": len(self._lru[tier])}
            if self.disk is not None:
                tiers[Tier.DISK] = {"capacity_bytes": self.disk.capacity_bytes,
                                    "used_bytes": self._disk_used,
                                    "num_entries": len(self._lru[Tier.DISK]),
                                    "num_copies": len(self._copies)}
            # NOTE: saturated at 2^64 - 1, the u64 of Stats and of the conductor's heartbeat (clients
            # report reads the node did not see; a sum over them once killed the heartbeat's thread)
            for tier, t in tiers.items():
                t["hits"] = min(self.counters["hits"][tier], U64_MAX)
                t["evictions"] = self.counters["evictions"][tier]
            c = {k: min(v, U64_MAX) if isinstance(v, int) else v for k, v in self.counters.items()}
            return {"tiers": tiers, "misses": c["misses"], "demotions": c["demotions"],
                    "promotions": c["promotions"], "drops": c["drops"], "corrupt": c["corrupt"],
                    "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
                    "disk_bytes_read": c["disk_bytes_read"], "disk_bytes_written": c["disk_bytes_written"],
                    "promotions_deferred": c["promotions_deferred"],
                    "demotions_clean": c["demotions_clean"], "disk_full": c["disk_full"],
                    "disk_errors": c["disk_errors"], "written_behind": c["written_behind"],
                    "quota_refused": c["quota_refused"], "quota_evictions": c["quota_evictions"],
                    "num_leases": self._num_leases,
                    "num_pinned": sum(e.pinned_until > now for e in self._index.values())}

    def __len__(self) -> int:
        return len(self._index)

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Waits until the demoter has nothing left to do: DRAM at or under its high watermark (or
        nothing over it evictable: leased or pinned) and no run being written. True unless it
        timed out. For tests and benchmarks that look at where values are."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._demoters and (self._demoting or self._demoter_has_work()):
                if not self._demoting:
                    now = time.monotonic()
                    if all(e.leases or e.pinned_until > now for e in self._lru[Tier.DRAM].values()):
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._reclaim.notify_all()
                self._reclaim.wait(timeout=min(left, 0.1))
            return True

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            self._reclaim.notify_all()
        if self._flusher is not None:
            self._flusher.join()
        for t in self._demoters:
            t.join()
        with self._lock:
            for _, arena in self._arenas:
                arena.close()
            if self.disk is not None:
                self.disk.close()

    # ---- internals (lock held) ---------------------------------------------

    def _arena(self, tier: Tier):
        for t, a in self._arenas:
            if t is tier:
                return a
        raise AssertionError(tier)

    def _emit(self, kind, key, tier, reason="") -> None:
        if self._listener is not None:
            self._listener(StoreEvent(kind, key, tier, reason))

    def _install(self, e: _Entry) -> None:
        old = self._index.get(e.key)
        if old is not None:  # replaced: unlink first, free after the new entry is in place
            e.pinned_until = max(e.pinned_until, old.pinned_until)  # a pin is the key's, not one value's
            old.live = False
            del self._lru[old.tier][old.key]
            self._charge(old.key, old.tier, -old.size)
        self._index[e.key] = e
        self._lru[e.tier][e.key] = e
        if old is not None:
            self._unlinked(old)
        self._emit("stored", e.key, e.tier)

    def _remove(self, e: _Entry, reason: str) -> None:
        assert e.live
        e.live = False
        del self._index[e.key]
        del self._lru[e.tier][e.key]
        self._charge(e.key, e.tier, -e.size)
        self._emit("removed", e.key, e.tier, reason)
        self._unlinked(e)

    def _unlinked(self, e: _Entry) -> None:
        """Frees an entry that left the index, or (leased) retires its slots until the last release."""
        if e.on_disk:
            self._drop_copy(e)
        if e.leases == 0:
            self._free_storage(e)
        elif e.tier is not Tier.DISK:
            self._arena(e.tier).retire(e.slots)

    def _free_storage(self, e: _Entry) -> None:
        if e.tier is Tier.DISK:
            self._disk_used -= disk_cost(e.size)
            self._disk_delete([(e.key, e.loc)])
        else:
            self._arena(e.tier).free(e.slots)
            e.slots = None

    def _write_behind(self) -> None:
        """The background writer: keeps the coldest DRAM values written to disk (as kept copies),
        so that evicting them writes nothing. Works while DRAM is within two eviction rounds
        of its high watermark, a batch of up to 8 MiB at a time, only into free disk room."""
        while True:
            with self._lock:
                batch = self._flush_batch()
                while not batch and not self._closing:
                    self._wake.wait(timeout=0.5)
                    batch = self._flush_batch()
                if self._closing:
                    for e in batch:
                        self._flush_done(e, None)
                    return
                items = [(e.key, self.dram.views(e.slots, disk_cost(e.size)), e.size) for e in batch]
            try:
                locs = self.disk.put_many(items, only_new=True)
            except (ResourceExhaustedError, DiskWriteError) as exc:
                log.warning("write-behind: %s", exc)
                locs = [None] * len(batch)
            with self._lock:
                for e, loc in zip(batch, locs):
                    self._flush_done(e, loc)

    def _demote_behind(self) -> None:
        """The demoter: while DRAM is over its high watermark, writes its coldest values to disk a
        run at a time (the store's lock released meanwhile; the values stay readable), then frees
        their slots, down to the low watermark. A value leased or pinned by then keeps its disk
        copy (its eviction later writes nothing); one deleted or replaced meanwhile loses it."""
        while True:
            with self._lock:
                while not self._closing and not self._demoter_has_work():
                    self._reclaim.wait()
                if self._closing:
                    return
                run, extents = self._demotion_run()
                if not run:  # nothing to write (moved clean, dropped, or all leased): a pass all the same
                    self._runs += 1
                    self._reclaim.notify_all()
                    if self._demoter_has_work():
                        self._reclaim.wait(timeout=0.05)
                    continue
                nslots = sum(len(e.slots) for e in run)
                self._demoting += nslots
                items = [(e.key, self.dram.views(e.slots, disk_cost(e.size)), e.size) for e in run]
            locs, error = None, None
            try:  # only_new: a record that appeared meanwhile is a newer value's, never overwritten
                locs = self.disk.put_many(items, only_new=True, extents=extents)
            except (DiskFullError, DiskWriteError) as exc:
                error = exc
            with self._lock:
                self._demoting -= nslots
                self._finish_run(run, locs, error)
                self._runs += 1
                self._reclaim.notify_all()

    def _demoter_has_work(self) -> bool:
        """Whether the demoter has work: from when DRAM (less the runs being written) passes its high
        watermark until it is down to the low one. Runs follow one another while puts stream in,
        as a put's own demotion goes down to the low watermark at once; starting a run only when
        puts lift DRAM past the high watermark again would leave the disk idle between runs."""
        arena = self.dram
        held = arena.num_slots - arena.num_free - self._demoting
        if held > self._demote_from():
            self._draining = True
        elif held <= self._demote_to():
            self._draining = False
        return self._draining

    def _demote_from(self) -> int:
        """DRAM slots in use past which the demoter works: the high watermark's."""
        cfg = self.config
        return int(cfg.high_watermark * self.dram.num_slots + 1e-9)

    def _demote_to(self) -> int:
        """DRAM slots in use down to which the demoter works once started: the low watermark's."""
        return int(self.config.low_watermark * self.dram.num_slots)

    def _demotion_run(self) -> tuple[list[_Entry], list]:
        """The next run: DRAM's least recently used evictable values down to the low watermark, at
        most 4 MiB. Values with a disk copy move down now (nothing to write); values over their
        namespace's disk bound are evicted; the rest are held and their disk blocks are taken now,
        in LRU order (so the values of runs written at once still lie on disk in that order)."""
        arena = self.dram
        # NOTE: at most half the room above the high watermark, so that puts go on while two runs are written
        need = min(arena.num_slots - arena.num_free - self._demoting - self._demote_to(),
                   max(1, min(_RUN_BYTES // arena.slot_bytes, (arena.num_slots - self._demote_from()) // 2)))
        run = []
        for e in self._victims(Tier.DRAM, lambda freed: freed >= need, lambda e: len(e.slots)):
            ns = self._ns(e.key)
            if e.on_disk:  # its record is still there: nothing to write
                self.counters["evictions"][Tier.DRAM] += 1
                self.counters["demotions_clean"] += 1
                self._move(e, Tier.DISK, None)
            elif ns is not None and not self._quota_room(ns, Tier.DISK, e.size):
                self._evicted(e)
            else:
                run.append(e)
        cost = sum(disk_cost(e.size) for e in run)
        extents = self._alloc_run(run, cost) if run and self._make_disk_room(cost) else None
        if extents is None:
            for e in run:
                self._evicted(e)
            return [], []
        for e in run:
            e.leases += 1  # held: neither evicted nor freed while its slots are being written
        self._disk_used += cost
        return run, extents

    def _alloc_run(self, run: list[_Entry], cost: int) -> list | None:
        """Disk blocks for a run; when there are too few free ones (fragmented), drops kept copies
        or evicts the disk's LRU values, as a put's demotion does. None: nothing left to evict."""
        while True:
            try:
                return self.disk.alloc_many([e.size for e in run])
            except DiskFullError as exc:
                if not self._relieve_disk(exc, cost):
                    return None

    def _relieve_disk(self, exc: DiskFullError, cost: int) -> bool:
        """After a write the disk refused for want of room: counts it, then drops kept copies or
        else evicts the disk's LRU values worth ``cost``. False when nothing could be freed."""
        self.counters["disk_full"] += 1
        log.warning("%s; evicting from the disk tier", exc)
        if self._drop_copies(cost):
            return True
        victims = self._victims(Tier.DISK, lambda freed: freed >= cost, lambda e: disk_cost(e.size))
        for v in victims:
            self._evicted(v)
        return bool(victims)

    def _finish_run(self, run: list[_Entry], locs: list[Loc | None] | None, error: BaseException | None) -> None:
        """Moves a written run's values to disk (or keeps their copies). After a failed write, makes
        disk room the way a put's demotion does and leaves the run in DRAM for the next one, or,
        with nothing left to evict on disk, drops it (as a put's demotion does)."""
        now = time.monotonic()
        if locs is None:
            cost = sum(disk_cost(e.size) for e in run)
            self._disk_used -= cost
            retry = False
            if isinstance(error, DiskFullError):
                retry = self._relieve_disk(error, cost)
            else:
                self.counters["disk_errors"] += 1
                log.warning("%s", error)
            for e in run:
                e.leases -= 1
                if not e.live:
                    if e.leases == 0:
                        self._free_storage(e)
                elif not retry and e.leases == 0 and e.pinned_until <= now and e.tier is Tier.DRAM:
                    self._evicted(e)
            return
        for e, loc in zip(run, locs):
            e.leases -= 1
            if loc is not None:
                self.counters["disk_bytes_written"] += loc.size
            if loc is not None and e.live and e.tier is Tier.DRAM and not e.on_disk:
                e.loc = loc
                self._copies[e.key] = e
                if e.leases == 0 and e.pinned_until <= now:
                    self.counters["evictions"][Tier.DRAM] += 1
                    self._move(e, Tier.DISK, None)  # a clean demotion now: the copy is the value
                # else read or pinned meanwhile: it stays, and its eviction later writes nothing
                continue
            self._disk_used -= disk_cost(e.size)  # not stored, or deleted or replaced meanwhile
            if loc is not None:
                self._disk_delete([(e.key, loc)])
            if not e.live and e.leases == 0:
                self._free_storage(e)

    def _await_run(self, num_slots: int) -> None:
        """A put that finds DRAM full waits for the demoter's next run to end, instead of writing one
        itself under the store's lock; then it goes on (a put's own demotion is the fallback)."""
        runs = self._runs
        self._reclaim.notify_all()
        while (self._runs == runs and self.dram.num_free < num_slots and not self._closing
               and (self._demoting or self._demoter_has_work())):
            self._reclaim.wait(timeout=1.0)

    def _flush_batch(self) -> list[_Entry]:
        """Dirty DRAM values to write behind now (held, charged to the disk), coldest first."""
        arena, cfg = self.dram, self.config
        used = arena.num_slots - arena.num_free
        if used < (2 * cfg.low_watermark - cfg.high_watermark) * arena.num_slots:
            return []
        window = max(1, int(2 * (cfg.high_watermark - cfg.low_watermark) * arena.num_slots))
        room = cfg.high_watermark * self.disk.capacity_bytes - self._disk_used
        now, seen, nbytes, batch = time.monotonic(), 0, 0, []
        for e in self._lru[Tier.DRAM].values():
            if seen >= window or nbytes >= _FLUSH_BYTES or len(batch) * 4 >= arena.num_slots:
                break
            seen += len(e.slots)
            if e.on_disk or e.no_flush or e.leases or e.pinned_until > now:
                continue
            if nbytes + disk_cost(e.size) > room:
                break
            batch.append(e)
            nbytes += disk_cost(e.size)
        for e in batch:
            e.leases += 1  # held: neither evicted nor freed while its slots are being written
        self._disk_used += nbytes
        return batch

    def _flush_done(self, e: _Entry, loc: Loc | None) -> None:
        e.leases -= 1
        if loc is not None and e.live and e.tier is Tier.DRAM and not e.on_disk:
            e.loc = loc
            self._copies[e.key] = e
            self.counters["written_behind"] += 1
            self.counters["disk_bytes_written"] += e.size
        else:  # not stored, or the value changed meanwhile: its blocks (and record) go
            self._disk_used -= disk_cost(e.size)
            e.no_flush = loc is None
            if loc is not None:
                self.counters["disk_bytes_written"] += e.size
                self._disk_delete([(e.key, loc)])
        if not e.live and e.leases == 0:
            self._free_storage(e)

    def _drop_copy(self, e: _Entry) -> None:
        """Frees the disk copy kept for arena entry ``e``."""
        if self._copies.get(e.key) is e:
            del self._copies[e.key]
        self._free_copies([e])

    def _free_copies(self, entries: list[_Entry]) -> int:
        """Frees the kept disk copies of ``entries`` (already out of ``_copies``); returns bytes freed."""
        freed = sum(disk_cost(e.size) for e in entries)
        self._disk_used -= freed
        self._disk_delete([(e.key, e.loc) for e in entries])
        for e in entries:
            e.loc = None
        return freed

    def _disk_delete(self, items: list[tuple[bytes, Loc]]) -> None:
        """Frees disk values (their records, unless the key now maps to a newer value, and blocks)."""
        try:
            self.disk.delete_many(items)
        except DiskWriteError as exc:  # records and blocks stay until a restart finds them
            self.counters["disk_errors"] += 1
            log.warning("%s", exc)

    def _abort_locked(self, r: Reservation) -> None:
        if r.done:
            return
        r.done = True
        self._charge(r.key, r.tier, -r.size)
        if r.tier is Tier.DISK:
            self._disk_used -= disk_cost(r.size)
            self._disk_staged -= r.size
        else:
            self._arena(r.tier).free(r.slots)
        r.views = []
        r.buffer = None

    def _victims(self, tier: Tier, enough: Callable[[int], bool], cost: Callable[[_Entry], int]) -> list[_Entry]:
        """Least recently used evictable entries of ``tier`` until ``enough(freed)``.

        A DRAM entry a same-host client marked touched (it read the value with no
        call to the node) gets a second chance: its mark is cleared and it moves to
        the recent end (not counted as a hit: the client reports its reads). A second
        pass takes it if nothing else will do.
        """
        now = time.monotonic()
        lru = self._lru[tier]
        touched = getattr(self._arena(tier), "touched", None) if tier is not Tier.DISK else None
        out, freed, chosen = [], 0, set()
        for _ in range(2):
            again = []
            for e in lru.values():
                if enough(freed):
                    break
                if e.leases or e.pinned_until > now or e.key in chosen:
                    continue
                if touched is not None and touched[e.slots[0]]:
                    again.append(e)
                    continue
                out.append(e)
                chosen.add(e.key)
                freed += cost(e)
            for e in again:
                touched[e.slots[0]] = 0
                lru.move_to_end(e.key)
            if enough(freed) or not again:
                break
        return out

    def _make_room(self, pos: int, num_slots: int) -> bool:
        """Evicts from arena ``pos`` so that ``num_slots`` more fit; True if they do. With the
        demoter, DRAM's free slots above the high watermark are taken while it demotes."""
        tier, arena = self._arenas[pos]
        if self._demoters and tier is Tier.DRAM and arena.num_free >= num_slots:
            if arena.num_slots - arena.num_free + num_slots > self._demote_from():
                self._reclaim.notify_all()  # the demoter's turn
            return True
        if self._fits(arena, num_slots):
            return True
        in_use = arena.num_slots - arena.num_free
        low = int(self.config.low_watermark * arena.num_slots)
        need = max(num_slots - arena.num_free, in_use + num_slots - low)
        victims = self._victims(tier, lambda freed: freed >= need, lambda e: len(e.slots))
        self._demote(pos, victims)
        return arena.num_free >= num_slots

    def _make_disk_room(self, cost: int) -> bool:
        cap = self.disk.capacity_bytes
        if self._disk_used + cost <= self.config.high_watermark * cap:
            return True
        need = max(self._disk_used + cost - cap, self._disk_used + cost - self.config.low_watermark * cap)
        need -= self._drop_copies(need)
        victims = self._victims(Tier.DISK, lambda freed: freed >= need, lambda e: disk_cost(e.size))
        for e in victims:
            self._evicted(e)
        return self._disk_used + cost <= cap

    def _drop_copies(self, need: float) -> int:
        """Drops kept disk copies, oldest first, until ``need`` bytes are freed; returns bytes freed."""
        picked, freed = [], 0
        while freed < need and self._copies:
            picked.append(self._copies.popitem(last=False)[1])
            freed += disk_cost(picked[-1].size)
        return self._free_copies(picked)

    def _disk_put(self, items: list, cost: int) -> list[Loc]:
        """Writes ``items`` to disk, returning their locations; when the disk refuses for want of
        room (the file system is full, or blocks still held by leased values), drops kept copies
        or evicts the disk's LRU values worth ``cost`` and retries, while any is evictable.

        Raises:
            ResourceExhaustedError: still full with nothing left to evict.
            DiskWriteError: another write error.
        """
        while True:
            try:
                locs = self.disk.put_many(items)
                self.counters["disk_bytes_written"] += sum(loc.size for loc in locs)
                return locs
            except DiskFullError as exc:
                if not self._relieve_disk(exc, cost):
                    raise
            except DiskWriteError as exc:
                self.counters["disk_errors"] += 1
                log.warning("%s", exc)
                raise

    def _evicted(self, e: _Entry) -> None:
        self.counters["evictions"][e.tier] += 1
        self.counters["drops"] += 1
        self._remove(e, "evicted")

    def _demote(self, pos: int, victims: list[_Entry]) -> None:
        """Moves victims of arena ``pos`` to the next tier (write-back), or drops them."""
        tier, arena = self._arenas[pos]
        if not victims:
            return
        for e in victims:
            self.counters["evictions"][tier] += 1
        if pos + 1 < len(self._arenas):
            next_tier, nxt = self._arenas[pos + 1]
            for e in victims:
                n = nxt.slots_for(e.size)
                if n <= nxt.num_slots and self._make_room(pos + 1, n):
                    data = arena.read(e.slots, e.size)  # device → host bytes
                    slots = nxt.alloc(n)
                    for v, src in zip(nxt.views(slots, e.size), _split(data, nxt.slot_bytes)):
                        v[:] = src
                    self._move(e, next_tier, slots)
                else:
                    self.counters["evictions"][tier] -= 1
                    self._evicted(e)
            return
        if self.disk is not None:
            for e in victims:  # a quota'd namespace's within its disk bound
                ns = self._ns(e.key)
                if ns is not None and not self._quota_room(ns, Tier.DISK, e.size):
                    self.counters["evictions"][tier] -= 1
                    self._evicted(e)
            victims = [e for e in victims if e.live]
            for e in [e for e in victims if e.on_disk]:  # its record is still there: nothing to write
                self.counters["demotions_clean"] += 1
                self._move(e, Tier.DISK, None)
            victims = [e for e in victims if e.tier is tier]
            if not victims:
                return
            costs = sum(disk_cost(e.size) for e in victims)
            if self._make_disk_room(costs):
                try:
                    locs = self._disk_put(  # whole blocks of the slots: written to the device as they are
                        [(e.key, arena.views(e.slots, disk_cost(e.size)), e.size) for e in victims], costs)
                except (ResourceExhaustedError, DiskWriteError):
                    pass
                else:
                    self._disk_used += costs
                    for e, loc in zip(victims, locs):
                        self._move(e, Tier.DISK, None)
                        e.loc = loc
                    return
        for e in victims:
            self.counters["evictions"][tier] -= 1
            self._evicted(e)

    def _move(self, e: _Entry, tier: Tier, slots: list[int] | None) -> None:
        old_tier = e.tier
        del self._lru[old_tier][e.key]
        if old_tier is Tier.DISK:
            if self.config.disk_copies:  # promoted: its disk copy (e.loc) is kept, still charged
                self._copies[e.key] = e
            else:
                self._disk_used -= disk_cost(e.size)
                self._disk_delete([(e.key, e.loc)])
                e.loc = None
        else:
            self._arena(old_tier).free(e.slots)
            if tier is Tier.DISK and e.on_disk:  # a clean demotion: the copy is the value again
                del self._copies[e.key]
        e.tier, e.slots = tier, slots
        self._lru[tier][e.key] = e
        self._charge(e.key, old_tier, -e.size)
        self._charge(e.key, tier, e.size)
        if tier > old_tier:
            self.counters["demotions"] += 1
        else:
            self.counters["promotions"] += 1
        self._emit("moved", e.key, tier)

    def _promote(self, e: _Entry, data: bytes) -> None:
        """Moves a disk value just read into the fastest arena: at once where it fits without
        demoting anything; where it would push other values down, only on its
        ``promote_after``-th read among the last reads from disk. A value read once (a scan
        over more than DRAM holds) is served from disk and stays there: reads never turn
        into twice their bytes of disk writes."""
        with self._lock:
            if not e.live or e.tier is not Tier.DISK:
                return
            reads = self._disk_reads.pop(e.key, 0) + 1
            for pos, tier, arena, n in self._promotion_targets(e, reads):
                if self._make_room(pos, n):
                    slots = arena.alloc(n)
                    if isinstance(arena, HostArena):
                        for v, src in zip(arena.views(slots, e.size), _split(data, arena.slot_bytes)):
                            v[:] = src
                    else:
                        arena.write(slots, [memoryview(data)])
                    self._move(e, tier, slots)
                    return
            self.counters["promotions_deferred"] += 1
            self._disk_reads[e.key] = reads
            while len(self._disk_reads) > self._disk_reads_window():
                self._disk_reads.popitem(last=False)

    def _would_promote(self, e: _Entry) -> bool:
        """Whether a read of ``e`` (not in DRAM) now would move it up (``_promote``'s rule)."""
        if e.tier is not Tier.DISK:
            # NOTE: a device-tier value never moves to DRAM on a read: copying it out here would
            # only be thrown away (the caller reads it its own way: cuda_ipc or the streamed path)
            return False
        reads = self._disk_reads.get(e.key, 0) + 1
        return self.config.promote and next(self._promotion_targets(e, reads), None) is not None

    def _promotion_targets(self, e: _Entry, reads: int):
        """``(pos, tier, arena, slots needed)`` of each arena, fastest first, that a disk read of
        ``e`` (its ``reads``-th recent one) may move it into: one where it fits without
        demoting anything, or any once it has earned it (``promote_after``)."""
        ns = self._ns(e.key)
        for pos, (tier, arena) in enumerate(self._arenas):
            n = arena.slots_for(e.size)
            bound = self._quotas[ns].dram_bytes if ns is not None else None
            if bound is not None and self._usage[ns][0] + e.size > bound:
                continue  # promotions stay within the namespace's bound (they evict none of its values)
            if n <= arena.num_slots and (self._fits(arena, n) or reads >= self.config.promote_after):
                yield pos, tier, arena, n

    def _ns(self, key: bytes) -> bytes | None:
        """The quota'd namespace (its key prefix) ``key`` belongs to, or None."""
        if not self._quotas:
            return None
        p = key[: self._prefix_len]
        return p if p in self._quotas else None

    def _charge(self, key: bytes, tier: Tier, nbytes: int) -> None:
        """Counts ``nbytes`` more (or fewer) of ``key``'s namespace in ``tier``."""
        ns = self._ns(key)
        if ns is not None:
            self._usage[ns][tier is Tier.DISK] += nbytes

    def _quota_room(self, ns: bytes, tier: Tier, size: int) -> bool:
        """Whether namespace ``ns`` may hold ``size`` more bytes in ``tier`` (its arena tiers share one
        bound); makes the room by evicting its own least recently used values there if it must."""
        q, on_disk = self._quotas[ns], tier is Tier.DISK
        limit = q.disk_bytes if on_disk else q.dram_bytes
        if limit is None:
            return True
        over = self._usage[ns][on_disk] + size - limit
        if over <= 0:
            return True
        if size > limit:
            return False
        tiers = [Tier.DISK] if on_disk else [t for t, _ in reversed(self._arenas)]  # DRAM (demoted) first
        now, picked, freed = time.monotonic(), [], 0
        for t in tiers:
            for e in self._lru[t].values():
                if freed >= over:
                    break
                if e.key.startswith(ns) and not e.leases and e.pinned_until <= now:
                    picked.append(e)
                    freed += e.size
        if freed < over:
            return False
        self.counters["quota_evictions"] += len(picked)
        pos = len(self._arenas) - 1
        for e in picked:  # disk and HBM values are dropped; DRAM ones demoted to disk (within its bound)
            if e.tier is not self._arenas[pos][0]:
                self._evicted(e)
        self._demote(pos, [e for e in picked if e.live and e.tier is self._arenas[pos][0]])
        return self._usage[ns][on_disk] + size <= limit

    def _quota_refusal(self, ns: bytes, size: int) -> None:
        """Refuses a write that namespace ``ns``'s bounds leave no room for."""
        q = self._quotas[ns]
        self.counters["quota_refused"] += 1
        raise ResourceExhaustedError(
            f"namespace {q.namespace!r} is at its quota ({_bound(q)}): its own values are leased or pinned, "
            f"or {size} bytes exceed it")

    def tenant_usage(self) -> list[tuple[str, int, int, int | None, int | None]]:
        """``(namespace, arena bytes, disk bytes, dram quota, disk quota)`` of each quota'd namespace."""
        with self._lock:
            return [(q.namespace, *self._usage[p], q.dram_bytes, q.disk_bytes) for p, q in self._quotas.items()]

    def _fits(self, arena, num_slots: int) -> bool:
        """Whether ``num_slots`` more fit in ``arena`` without evicting (under the high watermark)."""
        return arena.num_slots - arena.num_free + num_slots <= int(self.config.high_watermark * arena.num_slots)

    def _disk_reads_window(self) -> int:
        """How many recent disk reads count towards ``promote_after``: as many as DRAM holds values
        of one slot (at least 64), so a value read again before DRAM turns over has earned it."""
        return max(64, sum(a.num_slots for _, a in self._arenas))


_FLUSH_BYTES = 8 << 20
"""Largest write-behind batch."""
_DEMOTERS = 2
"""Demoter threads (runs in flight)."""
_RUN_BYTES = 4 << 20
"""Largest run the demoter writes at once: small enough that puts go on into the room left
while it is written, large enough for sequential writes."""


def _bound(q) -> str:
    from kvstore.config import format_size

    return ", ".join(f"{name} {format_size(v)}" for name, v in (("dram", q.dram_bytes), ("disk", q.disk_bytes))
                     if v is not None)


def _split(data, step: int) -> list[memoryview]:
    mv = memoryview(data)
    return [mv[i : i + step] for i in range(0, len(mv), step)] or [mv]
