"""The node's remote leases: read leases and write reservations handed to clients.

A one-sided client (shm, rdma) copies bytes without the node's involvement, so
the node cannot know when it is done or whether it died. Every grant therefore
has a deadline, ``lease_ttl_s`` after it is made, and a sweeper thread ends
what passes it:

- An expired **read lease** releases its store leases at once (its slots may
  then be freed and reused). Its ``release`` fails with FAILED_PRECONDITION.
- An expired **write reservation** can no longer commit; its slots stay
  reserved (quarantined) for one more TTL and only then return to the free
  list, so a writer that was mid-copy at the deadline has a whole extra TTL to
  stop before its slots can belong to anyone else.

The read guarantee, precisely: a lease ends only by its release or by the
sweeper once its deadline (``ttl_s`` after the request arrived) has passed,
and a store lease keeps its slots allocated and unchanged (never evicted,
moved or freed) until it ends. The client's deadline for the same lease counts
from when it sent the request, so it comes first: a copy that ended before it
ran under a live lease and read the granted value whole; the client reports
only such copies as hits (kvstore/transport/session.py) and need not wait for
the release's answer. ``release`` still fails, and says so, when the lease had
expired; commit fails when the reservation expired or a slot's generation (it
grows on each free) moved on, before anything becomes visible.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from kvstore.store import Lease, Reservation, Tier, TieredStore, check_key
from kvstore.transport.descriptors import SHM_PROOF_NEEDED, ItemStatus, Mover, SlotDescriptor, gather

log = logging.getLogger(__name__)

MAX_KEYS = 1 << 16
"""Most keys in one grant."""


@dataclass(slots=True, eq=False)
class _Grant:
    lease_id: int
    mover: Mover
    expires_at: float
    slots: list[tuple[int, ...]]
    generations: list[tuple[int, ...]]
    nbytes: int
    leases: list[Lease] | None = None  # reads
    reservations: list[Reservation] | None = None  # writes


@dataclass(frozen=True, slots=True)
class GrantResult:
    """What the node hands out: the id (0 when nothing was granted), its TTL, one descriptor per key."""

    lease_id: int
    ttl_s: float
    items: list[SlotDescriptor]
    message: str = ""


class LeaseTable:
    """Remote read leases and write reservations with deadlines. Thread-safe.

    Args:
        store: the node's store (grants are of its DRAM arena).
        ttl_s: lifetime of every grant.
        on_done: ``callback(mover, "read" | "write", nbytes)`` after a successful
            release or commit (mover statistics).
        clock: the clock of every deadline (``time.monotonic``). The attribute
            ``clock`` may be replaced on a running table (tests advance one by
            hand); it must never go backwards, and should start where the old one is.
    """

    def __init__(self, store: TieredStore, ttl_s: float,
                 on_done: Callable[[Mover, str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self._on_done = on_done
        self._lock = threading.Lock()
        self._reads: dict[int, _Grant] = {}
        self._writes: dict[int, _Grant] = {}
        self._quarantine: deque[tuple[float, _Grant]] = deque()
        self.num_expired_reads = 0
        self.num_expired_writes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- reads ----------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes], mover: Mover, proven: bool = True) -> GrantResult:
        """Leases each present DRAM value in place; other keys get NOT_FOUND or ELSEWHERE.
        With ``cuda_ipc``, device-tier values instead (slots of the device arena).

        ``proven``: the caller showed the arena's shm proof (needed for shm and cuda_ipc).
        """
        _check_batch(keys)
        for k in keys:
            check_key(k)
        _check_proven(mover, proven)
        tier = mover.tier
        arena = self.store.device_arena() if tier is Tier.DEVICE else self.store.dram
        if arena is None:
            raise FailedPreconditionError("this node has no device tier (--device)")
        gen = arena.generation
        items: list[SlotDescriptor] = []
        g = _Grant(0, mover, 0.0, [], [], 0, leases=[])
        got = self.store.acquire_in_place([bytes(k) for k in keys], tier)
        try:
            for i, hit in enumerate(got):
                if hit is None:
                    items.append(SlotDescriptor(i, ItemStatus.NOT_FOUND, 0, None))
                    continue
                lease, slots = hit
                if slots is None:
                    self.store.release(lease)
                    items.append(SlotDescriptor(i, ItemStatus.ELSEWHERE, lease.size, lease.tier))
                    continue
                slots = tuple(slots)
                gens = gather(gen, slots)  # stable: leased slots are never freed
                g.leases.append(lease)
                g.slots.append(slots)
                g.generations.append(gens)
                g.nbytes += lease.size
                items.append(SlotDescriptor(i, ItemStatus.OK, lease.size, tier, slots, gens))
        except BaseException:
            for hit in got:
                if hit is not None:
                    self.store.release(hit[0])  # idempotent
            raise
        if not g.leases:
            return GrantResult(0, self.ttl_s, items)
        self._register(self._reads, g)
        return GrantResult(g.lease_id, self.ttl_s, items)

    def release(self, lease_id: int) -> tuple[int, int]:
        """Ends a read lease; returns (values, bytes).

        Raises:
            FailedPreconditionError: the lease expired (or never existed): the
                bytes the client copied cannot be trusted.
        """
        with self._lock:
            g = self._reads.pop(lease_id, None)
            if g is None:
                raise FailedPreconditionError(
                    f"read lease {lease_id:#x} expired or unknown: treat its keys as misses")
            expired = self.clock() > g.expires_at
            # no generation check: leased slots are never freed, and a generation that
            # moved on means only that the value was replaced or deleted under this read
            self.store.release_many(g.leases)
            if expired:
                self.num_expired_reads += 1
                raise FailedPreconditionError(
                    f"read lease {lease_id:#x} expired before its release: treat its keys as misses")
        if self._on_done is not None:
            self._on_done(g.mover, "read", g.nbytes)
        return len(g.leases), g.nbytes

    # ---- writes ---------------------------------------------------------------

    def reserve(self, values: Sequence[tuple[bytes, int]], mover: Mover, proven: bool = True) -> GrantResult:
        """Reserves DRAM slots per value; a value the arena cannot take now is EXHAUSTED.

        Raises:
            InvalidArgumentError: a bad key or size (nothing is reserved).
        """
        _check_batch(values)
        if mover is Mover.CUDA_IPC:
            raise InvalidArgumentError("cuda_ipc reads the device tier; writes go through shm, rdma, tcp or grpc")
        limit = self.store.config.max_value_size
        for k, size in values:
            check_key(k)
            if not 0 <= size <= limit:
                raise InvalidArgumentError(f"value of {size} bytes exceeds the limit of {limit}")
        _check_proven(mover, proven)
        gen = self.store.dram.generation
        items: list[SlotDescriptor] = []
        msg = ""
        g = _Grant(0, mover, 0.0, [], [], 0, reservations=[])
        try:
            for i, (key, size) in enumerate(values):
                try:
                    res = self.store.reserve(key, size, tier=Tier.DRAM)
                except ResourceExhaustedError as exc:
                    items.append(SlotDescriptor(i, ItemStatus.EXHAUSTED, size, None))
                    msg = msg or str(exc)
                    continue
                slots = tuple(res.slots)
                gens = gather(gen, slots)
                g.reservations.append(res)
                g.slots.append(slots)
                g.generations.append(gens)
                g.nbytes += size
                items.append(SlotDescriptor(i, ItemStatus.OK, size, Tier.DRAM, slots, gens))
        except BaseException:
            for r in g.reservations:
                self.store.abort(r)
            raise
        if not g.reservations:
            return GrantResult(0, self.ttl_s, items, msg)
        self._register(self._writes, g)
        return GrantResult(g.lease_id, self.ttl_s, items, msg)

    def commit(self, lease_id: int) -> tuple[int, int]:
        """Makes a reservation's values visible, whole; returns (values, bytes).

        Raises:
            FailedPreconditionError: the reservation expired, is unknown, or was
                already committed or aborted; nothing of it becomes visible.
        """
        with self._lock:
            g = self._writes.pop(lease_id, None)
            if g is None:
                raise FailedPreconditionError(
                    f"write reservation {lease_id:#x} expired, unknown or already ended: nothing was stored")
            if self.clock() > g.expires_at:
                self.num_expired_writes += 1
                self._quarantine.append((self.clock() + self.ttl_s, g))
                raise FailedPreconditionError(
                    f"write reservation {lease_id:#x} expired before its commit: nothing was stored")
            if not self._generations_match(g):
                for r in g.reservations:
                    self.store.abort(r)
                raise FailedPreconditionError(
                    f"write reservation {lease_id:#x}: a slot was reused (stale generation): nothing was stored")
            self.store.commit_many(g.reservations)
        if self._on_done is not None:
            self._on_done(g.mover, "write", g.nbytes)
        return len(g.reservations), g.nbytes

    def abort(self, lease_id: int) -> int:
        """Returns a live reservation's slots at once; idempotent. Returns the values aborted."""
        with self._lock:
            g = self._writes.pop(lease_id, None)
            if g is None:
                return 0
            for r in g.reservations:
                self.store.abort(r)
            return len(g.reservations)

    # ---- expiry -----------------------------------------------------------------

    def sweep(self) -> None:
        """Ends every grant past its deadline, and returns quarantined slots whose time came."""
        now = self.clock()
        with self._lock:
            for lease_id in [i for i, g in self._reads.items() if now > g.expires_at]:
                g = self._reads.pop(lease_id)
                self.store.release_many(g.leases)
                self.num_expired_reads += 1
                log.info("read lease %#x expired (%d values)", lease_id, len(g.leases))
            for lease_id in [i for i, g in self._writes.items() if now > g.expires_at]:
                g = self._writes.pop(lease_id)
                self._quarantine.append((now + self.ttl_s, g))
                self.num_expired_writes += 1
                log.info("write reservation %#x expired (%d values)", lease_id, len(g.reservations))
            while self._quarantine and self._quarantine[0][0] <= now:
                _, g = self._quarantine.popleft()
                for r in g.reservations:
                    self.store.abort(r)

    def start(self) -> LeaseTable:
        self._thread = threading.Thread(target=self._run, name="lease-sweeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the sweeper and ends every grant (reads released, reservations aborted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for g in self._reads.values():
                for lease in g.leases:
                    self.store.release(lease)
            for g in [*self._writes.values(), *(g for _, g in self._quarantine)]:
                for r in g.reservations:
                    self.store.abort(r)
            self._reads.clear()
            self._writes.clear()
            self._quarantine.clear()

    def stats(self) -> dict:
        with self._lock:
            return {"num_remote_leases": len(self._reads), "num_remote_reservations": len(self._writes),
                    "num_quarantined": len(self._quarantine),
                    "num_expired_leases": self.num_expired_reads,
                    "num_expired_reservations": self.num_expired_writes}

    # ---- internals ----------------------------------------------------------------

    def _run(self) -> None:
        interval = min(1.0, max(0.01, self.ttl_s / 4))
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad sweep
                log.exception("lease sweep failed")

    def _register(self, table: dict[int, _Grant], g: _Grant) -> None:
        with self._lock:
            lease_id = secrets.randbits(63) | 1
            while lease_id in self._reads or lease_id in self._writes:
                lease_id = secrets.randbits(63) | 1
            g.lease_id = lease_id
            g.expires_at = self.clock() + self.ttl_s
            table[lease_id] = g

    def _generations_match(self, g: _Grant) -> bool:
        gen = self.store.dram.generation
        return all(gather(gen, slots) == gens for slots, gens in zip(g.slots, g.generations))


def _check_batch(items: Sequence) -> None:
    if len(items) > MAX_KEYS:
        raise InvalidArgumentError(f"a batch of {len(items)} keys exceeds the limit of {MAX_KEYS}")


def _check_proven(mover: Mover, proven: bool) -> None:
    """shm and cuda_ipc grants go only to a client that proved it can open the arena file
    (kvstore/arena.py): one of this host and user."""
    if mover in (Mover.SHM, Mover.CUDA_IPC) and not proven:
        raise FailedPreconditionError(SHM_PROOF_NEEDED)
