"""The member side of the conductor protocol: register, heartbeat, report load and KV events.

One ``MemberAgent`` per store node or engine process. It runs in the
background and survives a conductor that is down, restarts or declared the
member dead: it keeps retrying with backoff and registers again when a
heartbeat comes back ``known = false``.

Store nodes (``StoreAgent``, started by ``StoreNode`` when
``StoreConfig.conductor`` is set) also stream KV events. The agent mirrors the
node's key → tier map from the store's listener; an event stream starts with a
snapshot of that mirror (``reset``), and events that happen while no stream is
open are not queued, so the conductor's view is exact after each resync
without any replay log. Events are batched: a batch goes out every
``flush_interval_s`` or as soon as ``max_batch`` events wait. A stream with no
event for ``stream_idle_s`` ends (the conductor has acknowledged every event
sent): each open stream holds one of the conductor's call threads, and an idle
node then holds none. The node's next events open a stream that carries on
from there, with no snapshot; a stream that fails starts over with one.

Engines call ``report_load`` whenever their queue changes and
``record_prefill`` after each prefill; both ride on the next heartbeat.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import grpc

from kvstore import tls
from kvstore.conductor.client import CHANNEL_OPTIONS, discover, split_addresses
from kvstore.conductor.membership import EngineLoad, MemberKind
from kvstore.errors import CrescentError, leader_hint
from kvstore.kvevents import reachable_endpoint
from kvstore.store import StoreEvent, Tier
from kvstore.transport.identity import host_identity
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc
from proto.crescent.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
_KIND = {"stored": cpb.EVENT_KIND_STORED, "moved": cpb.EVENT_KIND_MOVED, "removed": cpb.EVENT_KIND_REMOVED}


class MemberAgent:
    """Keeps one member registered with a conductor and reports its load (and events).

    Args:
        conductor: the conductor's ``host:port``.
        member_id: unique name of the member.
        kind: ``MemberKind.STORE``, ``PREFILL`` or ``DECODE``.
        address: where the member serves (a store node's KVStore address).
        store_node: engines: member id of the store node on the same host.
        kv_bytes_per_token, namespace, chunk_tokens: engines: what their chunks are.
        flush_interval_s: longest time a KV event waits before it is sent.
        max_batch: most events per batch.
        stream_idle_s: an event stream with no event for this long ends, and the next event opens
            another that carries on (no snapshot).
        timeout_s: deadline of each unary call to the conductor.
        etcd: etcd endpoints where conductor replicas register: added to ``conductor`` (which may then be
            empty), and read again whenever every known address has failed in turn.
    """

    def __init__(self, conductor: str, member_id: str, kind: MemberKind, address: str = "", *,
                 store_node: str | None = None, kv_bytes_per_token: int = 0, namespace: bytes = b"",
                 chunk_tokens: int = 0, flush_interval_s: float = 0.05, max_batch: int = 4096,
                 stream_idle_s: float = 5.0, timeout_s: float = 5.0, etcd: str | None = None) -> None:
        self.etcd = etcd
        self.conductors = split_addresses(conductor)
        self._rediscover()
        self.conductor = self.conductors[0] if self.conductors else ""
        """The conductor now talked to: one of ``conductors``, or the leader a follower named."""
        self.member_id = member_id
        self.kind = kind
        self.address = address
        self.store_node = store_node
        self.kv_bytes_per_token = kv_bytes_per_token
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.kv_events = ("", "")
        """Store nodes: (endpoint, replay endpoint) their KV events are published on, as others reach them."""
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.stream_idle_s = stream_idle_s
        self.timeout_s = timeout_s
        self.registered = threading.Event()
        """Set while the conductor knows this member."""
        self.draining = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._incarnation = 0
        self._interval = 1.0
        self._stopping = False
        self._wake = threading.Event()
        self._load = EngineLoad()
        self._samples: collections.deque[cpb.PrefillSample] = collections.deque(maxlen=256)
        self._decode_samples: collections.deque[cpb.DecodeSample] = collections.deque(maxlen=256)
        self._mirror: dict[bytes, Tier] = {}
        self._pending: list[cpb.ChunkEvent] = []
        self._stream: object | None = None  # token of the open event stream
        self._resumable = False
        """The last stream ended idle with every event acknowledged: events wait in ``_pending`` for the
        next stream, which carries on without a snapshot (False: the next one starts with one)."""
        self._threads: list[threading.Thread] = []
        self._channels: dict[str, grpc.Channel] = {}
        """One per conductor address talked to, kept until stop (a stream may still be opening on one)."""
        self._etcd_registration = None
        """With an etcd-backed conductor: this member's lease-held key (kvstore.coord.Registration)."""
        self._stub: cpb_grpc.ConductorStub | None = None

    # ---- lifecycle ------------------------------------------------------------

    def start(self) -> MemberAgent:
        if self.conductor:
            self._connect(self.conductor)
        loops = [self._heartbeat_loop] + ([self._events_loop] if self.kind is MemberKind.STORE else [])
        for fn in loops:
            t = threading.Thread(target=fn, name=f"agent-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, deregister: bool = True) -> None:
        """Stops the background threads; ``deregister`` leaves the cluster at once. Idempotent."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            incarnation = self._incarnation
            self._stream, self._resumable = None, False
            self._cond.notify_all()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=10)
        if self._etcd_registration is not None:
            self._etcd_registration.stop()  # the key goes with its lease
        if deregister and incarnation and self._stub is not None:
            try:
                self._stub.Deregister(cpb.DeregisterRequest(member_id=self.member_id, incarnation=incarnation),
                                      timeout=2.0)
            except grpc.RpcError as exc:
                log.info("deregister from %s failed: %s", self.conductor, exc.code().name)
        for ch in self._channels.values():
            ch.close()

    def _connect(self, address: str) -> None:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = tls.channel(address, CHANNEL_OPTIONS)
        self.conductor = address
        self._stub = cpb_grpc.ConductorStub(ch)

    def _rediscover(self) -> None:
        """Adds the conductor replicas registered in etcd (with ``etcd``) to the addresses known."""
        if not self.etcd:
            return
        try:
            found = discover(self.etcd)
        except CrescentError as exc:
            log.debug("cannot read the conductor replicas from etcd: %s", exc)
            return
        self.conductors += [a for a in found if a not in self.conductors]

    def _follow(self, exc: grpc.RpcError) -> None:
        """After a failed call: a follower conductor named the leader, go there; an unreachable or
        silent one, try the next address given (``--conductor a:p,b:p``)."""
        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return  # DEADLINE_EXCEEDED: silent (a cut host), or too slow to be the one to report to
        leader = leader_hint(exc)
        if leader and leader != self.conductor:
            log.info("the conductor at %s is a follower: following the leader at %s", self.conductor, leader)
            self._connect(leader)
        elif not leader:
            i = self.conductors.index(self.conductor) if self.conductor in self.conductors else -1
            if i + 1 >= len(self.conductors):  # every known address failed in turn
                self._rediscover()
            if len(self.conductors) > 1:
                self._connect(self.conductors[(i + 1) % len(self.conductors)])

    # ---- engine reports ---------------------------------------------------------

    def report_load(self, load: EngineLoad) -> None:
        """The engine's current load; sent with the next heartbeat."""
        self._load = load

    def record_prefill(self, num_new_tokens: int, num_cached_tokens: int, seconds: float) -> None:
        """One measured prefill, for the conductor's cost model."""
        self._samples.append(cpb.PrefillSample(num_new_tokens=num_new_tokens,
                                               num_cached_tokens=num_cached_tokens, seconds=seconds))

    def record_decode(self, num_seqs: int, num_context_tokens: int, seconds: float) -> None:
        """One measured decode step (no prompt tokens in it), for the conductor's cost model."""
        self._decode_samples.append(cpb.DecodeSample(num_seqs=num_seqs, num_context_tokens=num_context_tokens,
                                                     seconds=seconds))

    def heartbeat_now(self) -> None:
        """Sends the next heartbeat without waiting for the interval."""
        self._wake.set()

    # ---- store events -------------------------------------------------------------

    def seed(self, entries) -> None:
        """Adds ``(key, tier)`` pairs present before any event (e.g. a disk tier rebuilt at start)."""
        with self._lock:
            for key, tier in entries:
                self._mirror[bytes(key)] = tier

    def on_event(self, ev: StoreEvent) -> None:
        """The store's listener. Called under the store's lock: only bookkeeping here."""
        with self._lock:
            if ev.kind == "removed":
                self._mirror.pop(ev.key, None)
            else:
                self._mirror[ev.key] = ev.tier
            if self._stream is not None or self._resumable:
                self._pending.append(cpb.ChunkEvent(kind=_KIND[ev.kind], key=ev.key, tier=int(ev.tier)))
                if len(self._pending) >= self.max_batch or self._stream is None:  # (None: open a stream)
                    self._cond.notify_all()

    # ---- background -----------------------------------------------------------------

    def _store_load(self) -> cpb.StoreLoad | None:
        return None

    def _register(self) -> None:
        resp = self._stub.Register(cpb.RegisterRequest(
            member_id=self.member_id, kind=int(self.kind), address=self.address,
            store_node=self.store_node or "", kv_bytes_per_token=self.kv_bytes_per_token,
            namespace=self.namespace, chunk_tokens=self.chunk_tokens, host_id=host_identity().hostname,
            kv_events_endpoint=self.kv_events[0], kv_events_replay_endpoint=self.kv_events[1]),
            timeout=self.timeout_s)
        with self._cond:
            self._incarnation = resp.incarnation
            self._interval = resp.heartbeat_interval_s or 1.0
            self._stream, self._resumable = None, False  # the next stream: a snapshot for this incarnation
            self._cond.notify_all()
        self.registered.set()
        log.info("registered with the conductor at %s as %s", self.conductor, self.member_id)
        if resp.etcd:
            self._register_in_etcd(resp)

    def _register_in_etcd(self, resp: cpb.RegisterResponse) -> None:
        """An etcd-backed conductor asks members to keep their registration under a lease: when the
        lease ends (the process died or hung), the conductor takes the member out at once."""
        import json

        from kvstore.coord import Etcd, Registration, parse_endpoints

        value = json.dumps({"kind": self.kind.label, "address": self.address, "incarnation": resp.incarnation})
        key = f"{resp.etcd_prefix}/members/{self.member_id}"
        reg = self._etcd_registration
        if reg is not None and reg.etcd.endpoints == parse_endpoints(resp.etcd) and reg.key == key:
            reg.update(value)  # the same etcd: keep the lease, new incarnation
            return
        if reg is not None:
            reg.stop()
        self._etcd_registration = Registration(Etcd(resp.etcd, resp.etcd_prefix), key, value,
                                               resp.member_lease_ttl_s).start()

    def _forget(self) -> None:
        with self._cond:
            self._incarnation = 0
            self._stream, self._resumable = None, False
            self._cond.notify_all()
        self.registered.clear()

    def _heartbeat_loop(self) -> None:
        backoff = 0.05
        while not self._stopping:
            if self._stub is None:  # no conductor known yet: only etcd can name one
                self._rediscover()
                if self.conductors:
                    self._connect(self.conductors[0])
                else:
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, 2.0)
                    continue
            if not self._incarnation:
                try:
                    self._register()
                    backoff = 0.05
                except grpc.RpcError as exc:
                    log.debug("register with %s failed: %s", self.conductor, exc.code().name)
                    self._follow(exc)
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, 2.0)
                    continue
            req = cpb.HeartbeatRequest(member_id=self.member_id, incarnation=self._incarnation)
            try:
                self._add_load(req)
            except Exception:  # noqa: BLE001 - a beat without its load still keeps the member alive
                log.exception("heartbeat of %s sent without its load", self.member_id)
                req = cpb.HeartbeatRequest(member_id=self.member_id, incarnation=self._incarnation)
            try:
                resp = self._stub.Heartbeat(req, timeout=self.timeout_s)
                if resp.known:
                    self.draining = resp.draining
                else:
                    log.warning("the conductor at %s no longer knows %s: registering again",
                                self.conductor, self.member_id)
                    self._forget()
                    continue
            except grpc.RpcError as exc:
                log.debug("heartbeat to %s failed: %s", self.conductor, exc.code().name)
                self._follow(exc)
            self._wake.wait(self._interval)
            self._wake.clear()

    def _add_load(self, req: cpb.HeartbeatRequest) -> None:
        if self.kind is MemberKind.STORE:
            load = self._store_load()
            if load is not None:
                req.store.CopyFrom(load)
        else:
            req.engine.CopyFrom(self._load.to_pb())
            while self._samples:
                req.prefill_samples.append(self._samples.popleft())
            while self._decode_samples:
                req.decode_samples.append(self._decode_samples.popleft())

    def _events_loop(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:
                while not self._stopping and (not self._incarnation or self._resumable and not self._pending):
                    self._cond.wait(0.5)
                if self._stopping:
                    return
                token = self._stream = object()
                incarnation = self._incarnation
                snapshot = None  # resumed: the conductor has every event before the pending ones
                if not self._resumable:
                    snapshot = list(self._mirror.items())
                    self._pending.clear()
                self._resumable = False
            try:
                self._stub.StreamEvents(self._batches(token, incarnation, snapshot))
                backoff = 0.05
            except grpc.RpcError as exc:
                with self._cond:
                    self._resumable = False  # what reached the conductor is unknown: a snapshot next
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._forget()  # unknown to the conductor: the heartbeat thread registers again
                    self._wake.set()
                else:
                    log.debug("event stream to %s broke: %s", self.conductor, exc.code().name)
                with self._cond:
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with self._cond:
                    if self._stream is token:
                        self._stream = None
                    self._cond.notify_all()

    def _batches(self, token: object, incarnation: int, snapshot: list[tuple[bytes, Tier]] | None):
        step = self.max_batch
        for i in range(0, max(len(snapshot), 1), step) if snapshot is not None else ():
            yield cpb.EventBatch(member_id=self.member_id, incarnation=incarnation, reset=(i == 0),
                                 events=[cpb.ChunkEvent(kind=cpb.EVENT_KIND_STORED, key=k, tier=int(t))
                                         for k, t in snapshot[i : i + step]])
        last = time.monotonic()
        while True:
            with self._cond:
                if self._stream is token and not self._pending:
                    self._cond.wait(self.flush_interval_s)
                if self._stream is not token:
                    return
                batch = self._pending[:step]
                del self._pending[:step]
                if not batch and time.monotonic() - last >= self.stream_idle_s:
                    # idle: end the stream (its end waits for the conductor to take every batch);
                    # events wait for the next, which carries on. (If it fails, _events_loop
                    # makes the next one start with a snapshot.)
                    self._stream, self._resumable = None, True
                    return
            if batch:
                last = time.monotonic()
                yield cpb.EventBatch(member_id=self.member_id, incarnation=incarnation, events=batch)


class StoreAgent(MemberAgent):
    """The agent of a store node: its identity comes from the node once it has bound its port."""

    def __init__(self, conductor: str, **kwargs) -> None:
        super().__init__(conductor, "", MemberKind.STORE, **kwargs)
        self._node = None

    def listener(self, chained=None):
        """A store listener feeding this agent (and then ``chained``, if given)."""
        if chained is None:
            return self.on_event

        def both(ev: StoreEvent) -> None:
            self.on_event(ev)
            chained(ev)

        return both

    def attach(self, node) -> StoreAgent:
        """Takes ``node``'s id and address, seeds the mirror from its disk tier, and starts.

        Call before the node serves: until then no event can have been missed.
        """
        self._node = node
        self.member_id = node.node_id
        self.address = node.address
        if node.kv_events is not None:
            host = node.address.rpartition(":")[0]
            self.kv_events = (reachable_endpoint(node.kv_events.endpoint, host),
                              reachable_endpoint(node.kv_events.replay_endpoint or "", host))
        if node.store.disk is not None:
            self.seed((key, Tier.DISK) for key, _ in node.store.disk.scan())
        return self.start()

    def _store_load(self) -> cpb.StoreLoad | None:
        s = self._node.store.stats()
        return cpb.StoreLoad(
            tiers=[pb.TierStats(tier=int(t), capacity_bytes=v["capacity_bytes"], used_bytes=v["used_bytes"],
                                num_entries=v["num_entries"], hits=v["hits"], evictions=v["evictions"])
                   for t, v in s["tiers"].items()],
            misses=s["misses"], bytes_in=s["bytes_in"], bytes_out=s["bytes_out"],
            num_leases=s["num_leases"], num_pinned=s["num_pinned"])
