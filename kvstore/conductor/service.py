"""The conductor process: the ``crescent.v1.Conductor`` gRPC service over one state.

``Conductor(config).start()`` binds the listener and starts the reaper, which
declares members dead after the timeout (their chunks leave the index);
``stop()`` shuts both. Membership, the global index, hotness, the cost model
and the counters sit behind one lock; calls to store nodes (pin, evict) happen
outside it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import math
import threading
import time

import grpc

from kvstore import auth, tls
from kvstore.conductor.config import ConductorConfig
from kvstore.conductor.console import ConsoleLog, ConsoleServer, finite
from kvstore.conductor.costmodel import CostModel, DecodeSample, HardwareProfile, PrefillSample
from kvstore.conductor.index import GlobalIndex, HotTracker
from kvstore.conductor.membership import EngineLoad, Member, MemberKind, Membership
from kvstore.conductor.policy import (DecodeCandidate, PrefillCandidate, Prompt, make_policy,
                                      schedule)
from kvstore.conductor.vllm_events import DEFAULT_NAMESPACE, VllmSource, VllmSubscriber
from kvstore.conductor.sizing import (DEFAULT_QUANTILE, DEFAULT_SLO_ITL_S, DEFAULT_SLO_TTFT_S, Recommendation,
                                      RequestSample, recommend)
from kvstore.health import HealthStatus, advertised_host
from kvstore.errors import (LEADER_METADATA, CrescentError, FailedPreconditionError, InvalidArgumentError,
                            NotFoundError)
from kvstore.liveness import rpc_server, server_options
from kvstore.procs import StopSignals, say
from kvstore.store import Tier, check_key
from proto.crescent.v1 import conductor_pb2 as cpb
from proto.crescent.v1 import conductor_pb2_grpc as cpb_grpc
from proto.crescent.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
MAX_KEYS = 1 << 16
"""Most keys one call may carry."""
_REFIT_EVERY = 8
MAX_PROMPT_TOKENS = 1 << 24
"""Longest prompt (and output) a Schedule call or a measured sample may name: 16M tokens."""
MAX_SAMPLE_S = 3600.0
"""Longest measured prefill or decode step taken into the cost model."""
MAX_TIER_BYTES = 1 << 60
"""A tier's capacity or use beyond this (an exbibyte) is not a measurement."""
SWEEP_KEYS = 1024
"""Keys a dropped node's sweep clears per hold of the lock (a few ms; GlobalIndex.sweep)."""


def _rpc(fn):
    """Maps CrescentError to its gRPC status; a follower answers UNAVAILABLE naming the leader."""

    @functools.wraps(fn)
    def inner(self, request, context):
        self._check_leader(context)
        try:
            return fn(self, request, context)
        except CrescentError as exc:
            context.abort(exc.grpc_code, str(exc))

    return inner


class _SampleWindow:
    """The last 512 measured samples of one kind; refits its part of the cost model every
    ``_REFIT_EVERY`` new ones."""

    def __init__(self, fit) -> None:
        self.samples: collections.deque = collections.deque(maxlen=512)
        self._fit = fit
        self._new = 0

    def add(self, samples: list) -> None:
        self.samples.extend(samples)
        self._new += len(samples)
        if self._new >= _REFIT_EVERY:
            self._new = 0
            self._fit(list(self.samples))


def _add(msg, field: str, value: int) -> None:
    """``msg.field += value``, saturating at the uint64 a protobuf field holds (members report counters)."""
    setattr(msg, field, min(getattr(msg, field) + value, (1 << 64) - 1))


def _check_load(request: cpb.HeartbeatRequest) -> None:
    """INVALID_ARGUMENT for a reported load no member measures: it would be kept, summed (past
    64 bits) and shown (unknown tiers and NaN break the console and ctl)."""
    which = request.WhichOneof("load")
    if which == "engine":
        if not 0.0 <= request.engine.kv_usage <= 1.0:  # also NaN
            raise InvalidArgumentError(f"kv_usage must be a fraction in [0, 1], got {request.engine.kv_usage}")
    elif which == "store":
        for t in request.store.tiers:
            try:
                Tier(t.tier)
            except ValueError:
                raise InvalidArgumentError(f"unknown tier {t.tier}") from None
            if max(t.capacity_bytes, t.used_bytes) > MAX_TIER_BYTES:
                raise InvalidArgumentError(f"tier {Tier(t.tier).name.lower()}: more than {MAX_TIER_BYTES} bytes")


def _keys(keys) -> list[bytes]:
    if len(keys) > MAX_KEYS:
        raise InvalidArgumentError(f"{len(keys)} keys exceed the limit of {MAX_KEYS} per call")
    for k in keys:
        check_key(k)
    return list(keys)


class Conductor(cpb_grpc.ConductorServicer):
    """The conductor's state and its gRPC service."""

    def __init__(self, config: ConductorConfig, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.cost = CostModel(HardwareProfile.load(config.profile) if config.profile else None)
        self._lock = threading.Lock()
        self.members = Membership(config.dead_timeout)
        self.index = GlobalIndex()
        self.hot = HotTracker(config.hot_half_life)
        self._policies = {}
        self._prefill_window = _SampleWindow(self.cost.fit)
        self._num_samples_received = 0
        self._decode_window = _SampleWindow(self.cost.fit_decode)
        self.requests: collections.deque[RequestSample] = collections.deque(maxlen=config.sizing_window)
        """Recent Schedule requests, for P:D sizing."""
        self.counters = collections.Counter()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="conductor-reaper", daemon=True)
        self._sweep_wanted = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="conductor-sweeper", daemon=True)
        self.principals = auth.table()  # the auth file's tokens (None: every call is taken)
        self.server, _, self.rpcs = rpc_server("conductor", server_options(64 << 20),
                                               auth.server_interceptors(self.principals))
        cpb_grpc.add_ConductorServicer_to_server(self, self.server)
        self.health = HealthStatus(self.server, "crescent.v1.Conductor")
        self.port = tls.add_port(self.server, config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen} (address in use or not local)")
        self.host = config.listen.rpartition(":")[0]
        self.address = f"{advertised_host(self.host, config.advertise_host)}:{self.port}"
        self.election = None
        """With --etcd: this replica's candidacy; None: the only conductor, always the leader."""
        self._etcd_seen: set[str] = set()
        """Members whose etcd registration the last scan saw."""
        if config.etcd:
            from kvstore.coord import Etcd, LeaderElection

            self.health.set_serving(False, "crescent.v1.Conductor")  # a follower until elected
            # NOTE: etcd calls time out in half the TTL: a leader cut off from etcd has stepped down
            # (renewals failing for 2/3 of it) before its lease can lapse and a new leader be elected
            etcd = Etcd(config.etcd, timeout_s=min(5.0, config.leader_ttl / 2))
            self.election = LeaderElection(etcd, "conductor", self.address, config.leader_ttl,
                                           on_change=self._on_leadership)
        self.replica = None
        """With --etcd: ``conductor/replicas/<address>`` under a lease, so clients given only etcd find
        every replica (kvstore.conductor.client.discover)."""
        if config.etcd:
            from kvstore.coord import Registration

            key = etcd.key("conductor", "replicas", self.address)
            self.replica = Registration(Etcd(config.etcd), key, self.address, max(2.0, config.leader_ttl))
        self.device_index = GlobalIndex()
        """Chunks in engines' own prefix caches (vLLM instances, from their KV events): a prefill there
        reuses them, but nobody loads from them. Kept across leadership changes: every replica follows
        the instances."""
        self.vllm: dict[str, VllmSubscriber] = {}
        if config.vllm_kv_events:
            ns = bytes.fromhex(config.vllm_namespace) if config.vllm_namespace else DEFAULT_NAMESPACE
            for spec in config.vllm_kv_events:
                src = VllmSource.parse(spec)
                self.vllm[src.member_id] = VllmSubscriber(self, src, ns, config.chunk_tokens)
        self.kv_events = None
        """With --kv-events-endpoint: the cluster's KV events, relayed from its store nodes."""
        if config.kv_events_endpoint:
            from kvstore.conductor.kvrelay import ClusterKvEvents

            try:
                self.kv_events = ClusterKvEvents(config.kv_events_endpoint, config.kv_events_replay_endpoint)
            except Exception as exc:  # zmq.ZMQError: a bad or busy endpoint
                self.server.stop(0)
                raise OSError(f"cannot publish KV events on {config.kv_events_endpoint}: {exc}") from None
        self.console = ConsoleLog()
        self._http = None
        self.metrics_port: int | None = None
        """The HTTP port (/metrics, /ui, /api/console) once started (with --metrics-port 0: the one picked)."""

    def start(self) -> Conductor:
        self.server.start()
        for sub in self.vllm.values():
            sub.start()
        self._keep_vllm_members()
        if self.kv_events is not None:
            self.kv_events.start()
        self._reaper.start()
        self._sweeper.start()
        if self.election is not None:
            self.election.start()
            self.replica.start()
        if self.config.metrics_port is not None:
            self._http = ConsoleServer(self, self.config.metrics_port, self.host).start()
            self.metrics_port = self._http.port
        return self

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        self._sweep_wanted.set()
        self.health.stop()
        if self.election is not None:
            self.election.stop(resign=True)  # a follower takes over now, not after the lease
            self.replica.stop()
        if self._http is not None:
            self._http.stop()
        for sub in self.vllm.values():
            sub.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        self.server.stop(grace).wait()

    # ---- leadership -----------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.election is None or self.election.is_leader

    def _check_leader(self, context) -> None:
        """Aborts the call with UNAVAILABLE and the leader's address unless this replica leads."""
        if self.is_leader:
            return
        leader = self.election.leader()
        if leader:
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"this conductor ({self.address}) is a follower; the leader is at {leader or 'none yet'}")

    def _on_leadership(self, is_leader: bool, leader: str | None) -> None:
        """A replica starts leading empty-handed: members register again with it (a follower told
        them where) and store nodes resend their chunk sets, which rebuilds the index. One that
        stops leading drops its view, stale from now on."""
        with self._lock:
            self.members = Membership(self.config.dead_timeout)
            self.index = GlobalIndex()
            self.hot = HotTracker(self.config.hot_half_life)
            self.requests.clear()
            self._etcd_seen = set()
            if is_leader:
                self.counters["elected"] += 1
        self.health.set_serving(is_leader, "crescent.v1.Conductor")
        log.warning("conductor %s: %s", self.address, "now the leader" if is_leader else
                    f"following {leader or 'nobody yet'}")

    # ---- membership ---------------------------------------------------------

    def _keep_vllm_members(self) -> None:
        """Registers each followed vLLM instance that is alive (again) and refreshes the others; one
        that stops answering is left to the reaper, which forgets its chunks."""
        for member_id, sub in self.vllm.items():
            if not sub.alive():  # NOTE: an HTTP probe: outside the lock
                continue
            with self._lock:
                m = self.members.get(member_id)
                if m is None:
                    self.members.register(Member(
                        member_id, MemberKind.PREFILL, sub.source.url or "", 0, self.clock(),
                        namespace=sub.rekeyer.namespace, chunk_tokens=sub.rekeyer.chunk_tokens, external=True))
                    log.info("vLLM instance %s followed through its KV events at %s", member_id, sub.source.endpoint)
                else:
                    m.last_seen = self.clock()

    def _relay_kv_events(self) -> None:
        """Has the cluster relay follow exactly the live store nodes that publish KV events."""
        if self.kv_events is None:
            return
        with self._lock:
            nodes = {m.member_id: (m.incarnation, m.kv_events_endpoint, m.kv_events_replay_endpoint)
                     for m in self.members.of_kind(MemberKind.STORE) if m.kv_events_endpoint}
        self.kv_events.follow(nodes)

    def forget(self, index: GlobalIndex, member_id: str) -> int:
        """(Under the lock.) Drops ``member_id``'s chunks from ``index`` at once; the sweeper clears
        their bits in batches of SWEEP_KEYS, letting go of the lock between them, so that a node of
        half a million chunks does not hold every Schedule and event for half a second."""
        n = index.drop_node(member_id, lazy=True)
        if n:
            self._sweep_wanted.set()
        return n

    def _sweep_loop(self) -> None:
        while True:
            self._sweep_wanted.wait()
            if self._stop.is_set():
                return
            self._sweep_wanted.clear()
            more = True
            while more and not self._stop.is_set():
                t0 = time.perf_counter()
                with self._lock:
                    more = self.index.sweep(SWEEP_KEYS)
                    more = self.device_index.sweep(SWEEP_KEYS) or more
                # the lock and the GIL left to the calls for as long as the batch took: the sweep takes
                # at most half of the process's time, and a waiting call gets the lock between batches
                time.sleep(time.perf_counter() - t0)

    def _reap_loop(self) -> None:
        period = min(self.config.heartbeat_interval, self.config.dead_timeout / 4)
        while not self._stop.wait(period):
            self._keep_vllm_members()
            with self._lock:
                for m in self.members.reap(self.clock()):
                    self.counters["expired"] += 1
                    n = self.forget(self.index, m.member_id) + self.forget(self.device_index, m.member_id)
                    log.warning("member %s (%s) is dead: silent for %.1f s; %d chunks left the index",
                                m.member_id, m.kind.label, self.config.dead_timeout, n)
            self._relay_kv_events()
            if self.election is not None and self.election.is_leader:
                self._reap_lapsed_leases()

    def _member_leases(self) -> dict[str, int]:
        """member id → lease id of the registrations held in etcd (members/<id>)."""
        etcd = self.election.etcd
        prefix = etcd.key("members", "")
        return {meta.key.decode()[len(prefix):]: meta.lease_id
                for _, meta in etcd.call(etcd.client.get_prefix, prefix)}

    def _reap_lapsed_leases(self) -> None:
        """Members whose etcd registration was seen and is gone (its lease ended: the process died,
        hung or lost etcd) leave scheduling and the index now, not after --dead-timeout. One that
        comes back gets known=false on its next heartbeat, registers again and resends its chunks."""
        try:
            leases = self._member_leases()
        except CrescentError as exc:
            log.warning("cannot read member registrations: %s", exc)
            return
        with self._lock:
            for member_id in self._etcd_seen - leases.keys():
                m = self.members.get(member_id)
                if m is not None:
                    self.members.remove(member_id)
                    n = self.forget(self.index, member_id)
                    self.counters["expired"] += 1
                    log.warning("member %s (%s): its etcd lease ended; %d chunks left the index",
                                member_id, m.kind.label, n)
            self._etcd_seen = set(leases)

    @_rpc
    def Register(self, request, context):
        if not request.member_id or len(request.member_id) > 256:
            raise InvalidArgumentError("member_id must be 1..256 characters")
        try:
            kind = MemberKind(request.kind)
        except ValueError:
            raise InvalidArgumentError(f"unknown member kind {request.kind}") from None
        if kind is MemberKind.STORE:
            host, _, port = request.address.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise InvalidArgumentError(f"a store node needs its address as host:port, got {request.address!r}")
        if request.namespace and len(request.namespace) != 16:
            raise InvalidArgumentError(f"a namespace is 16 bytes, got {len(request.namespace)}")
        m = Member(request.member_id, kind, request.address, 0, self.clock(),
                   store_node=request.store_node or None,
                   kv_bytes_per_token=request.kv_bytes_per_token or None,
                   namespace=bytes(request.namespace), chunk_tokens=request.chunk_tokens,
                   host_id=request.host_id[:256], kv_events_endpoint=request.kv_events_endpoint[:1024],
                   kv_events_replay_endpoint=request.kv_events_replay_endpoint[:1024])
        with self._lock:
            old = self.members.register(m)
            if old is not None and old.kind is MemberKind.STORE:
                self.forget(self.index, old.member_id)
        log.info("member %s (%s) registered at %s", m.member_id, kind.label, m.address or "-")
        resp = cpb.RegisterResponse(incarnation=m.incarnation, heartbeat_interval_s=self.config.heartbeat_interval,
                                    dead_timeout_s=self.config.dead_timeout)
        if self.election is not None:
            resp.etcd, resp.etcd_prefix = self.config.etcd, self.election.etcd.prefix
            resp.member_lease_ttl_s = self.config.member_lease_ttl or self.config.dead_timeout
        return resp

    @_rpc
    def Heartbeat(self, request, context):
        _check_load(request)
        # NOTE: a sample beyond what any engine measures (an hour) would skew the cost model for all
        samples = [PrefillSample(s.num_new_tokens, s.num_cached_tokens, s.seconds)
                   for s in request.prefill_samples if 0 < s.seconds <= MAX_SAMPLE_S
                   and s.num_new_tokens <= MAX_PROMPT_TOKENS and s.num_cached_tokens <= MAX_PROMPT_TOKENS]
        steps = [DecodeSample(s.num_seqs, s.num_context_tokens, s.seconds)
                 for s in request.decode_samples if s.num_seqs and 0 < s.seconds <= MAX_SAMPLE_S]
        with self._lock:
            m = self.members.get(request.member_id, request.incarnation)
            if m is None:
                return cpb.HeartbeatResponse(known=False)
            m.last_seen = self.clock()
            which = request.WhichOneof("load")
            if which == "engine":
                m.engine_load = EngineLoad.from_pb(request.engine)
                m.busy_until = 0.0  # the engine's own queue now counts what was scheduled
            elif which == "store":
                m.store_load = request.store
            self._num_samples_received += len(samples)
            self._prefill_window.add(samples)
            self._decode_window.add(steps)
            m.prefill_tokens += sum(x.num_new_tokens for x in samples)
            m.prefill_seconds += sum(x.seconds for x in samples)
            m.decode_tokens += sum(x.num_seqs for x in steps)
            m.decode_seconds += sum(x.seconds for x in steps)
            m.num_samples += len(samples) + len(steps)
            return cpb.HeartbeatResponse(known=True, draining=m.draining)

    def StreamEvents(self, request_iterator, context):
        self._check_leader(context)
        num = 0
        with self._lock:
            self.counters["event_streams_open"] += 1  # (each holds one of the call threads while open)
        try:
            for batch in request_iterator:
                with self._lock:
                    m = self.members.get(batch.member_id, batch.incarnation)
                    if m is None or m.kind is not MemberKind.STORE:
                        raise FailedPreconditionError(
                            f"{batch.member_id!r} is not a registered store node (register again)")
                    if batch.reset:
                        self.forget(self.index, m.member_id)
                    for e in batch.events:
                        if not e.key or len(e.key) > 1024:
                            raise InvalidArgumentError("an event with an empty or oversized key")
                        if e.kind in (cpb.EVENT_KIND_STORED, cpb.EVENT_KIND_MOVED):
                            if e.tier not in (1, 2, 3):
                                raise InvalidArgumentError(f"an event with tier {e.tier}")
                            self.index.stored(m.member_id, e.key, Tier(e.tier))
                        elif e.kind == cpb.EVENT_KIND_REMOVED:
                            self.index.removed(m.member_id, e.key)
                        else:
                            raise InvalidArgumentError(f"an event of unknown kind {e.kind}")
                    num += len(batch.events)
        except CrescentError as exc:
            context.abort(exc.grpc_code, str(exc))
        finally:
            with self._lock:
                self.counters["event_streams_open"] -= 1
        return cpb.EventsAck(num_events=num)

    @_rpc
    def Deregister(self, request, context):
        with self._lock:
            m = self.members.get(request.member_id, request.incarnation)
            if m is not None:
                self.members.remove(m.member_id)
                self.forget(self.index, m.member_id)
        return cpb.DeregisterResponse()

    # ---- scheduling ---------------------------------------------------------

    def _policy(self, name: str):
        p = self._policies.get(name)
        if p is None:
            try:
                p = self._policies[name] = make_policy(name, self.config.seed)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        return p

    def _queue_s(self, e: Member, now: float) -> float:
        """Predicted wait at engine ``e``: its reported queue plus what was scheduled since it reported."""
        load = e.engine_load
        return self.cost.queue_s(load.num_queued_tokens, load.num_waiting) + max(0.0, e.busy_until - now)

    @_rpc
    def Schedule(self, request, context):
        keys = _keys(auth.scoped(auth.prefix_of(context, self.principals), request.keys))  # a tenant's chunks: its namespace
        chunk_tokens = request.chunk_tokens or self.config.chunk_tokens
        if request.num_tokens > MAX_PROMPT_TOKENS or request.num_output_tokens > MAX_PROMPT_TOKENS:
            raise InvalidArgumentError(f"num_tokens and num_output_tokens must be at most {MAX_PROMPT_TOKENS}")
        if request.num_tokens < max(1, len(keys) * chunk_tokens):
            raise InvalidArgumentError(
                f"num_tokens ({request.num_tokens}) must be >= 1 and cover the {len(keys)} keys "
                f"of {chunk_tokens} tokens")
        name = request.policy or self.config.policy
        prompt = Prompt(request.num_tokens, len(keys), chunk_tokens, request.num_output_tokens)
        now = self.clock()
        with self._lock:
            policy = self._policy(name)
            # Crescent engines, or (request.vllm) the vLLM instances followed through their KV events:
            # the two pools key chunks under different namespaces and speak different APIs
            engines = [e for e in self.members.of_kind(MemberKind.PREFILL, include_draining=False)
                       if e.external == request.vllm]
            if not engines:
                raise FailedPreconditionError("no live vLLM instance is followed (--vllm-kv-events)" if request.vllm
                                              else "no live prefill engine is registered")
            if request.vllm:
                on_device = self.device_index.node_prefixes(keys)
                cands, decodes = [], []
                cache_engines = [(PrefillCandidate(e.member_id, None, self._queue_s(e, now)),
                                  on_device.get(e.member_id, 0)) for e in engines]
            else:
                cands = [PrefillCandidate(e.member_id, e.store_node, self._queue_s(e, now), e.kv_bytes_per_token)
                         for e in engines]
                cache_engines = []
                decodes = [DecodeCandidate(d.member_id, d.engine_load.num_running, d.engine_load.num_context_tokens)
                           for d in self.members.of_kind(MemberKind.DECODE, include_draining=False)]
            hot = self.config.hot_threshold
            d = schedule(policy, prompt, cands, decodes, self.index.match(keys), self.cost,
                         slo_ttft_s=self.config.slo_ttft, slo_tbt_s=self.config.slo_tbt,
                         is_hot=lambda n: n > 0 and self.hot.count(keys[n - 1], now) >= hot,
                         cache_engines=cache_engines)
            self.hot.touch(keys, now)
            self.requests.append(RequestSample(now, request.num_tokens, d.num_cached_tokens,
                                               request.num_output_tokens))
            c = self.counters
            c["scheduled"] += 1
            c["scheduled_chunks"] += len(keys)
            resp = cpb.ScheduleResponse(accepted=not d.rejected, reject_reason=d.rejected, policy=name,
                                        predicted_ttft_s=d.ttft_s, predicted_tbt_s=d.tbt_s)
            decision = {"tokens": request.num_tokens, "chunks": len(keys), "cached_chunks": d.num_cached_chunks,
                        "policy": name, "ttft_s": finite(d.ttft_s), "tbt_s": finite(d.tbt_s),
                        "rejected": d.rejected or "", "prefill": d.prefill or "", "decode": d.decode or "",
                        "source": d.source_node or "", "replicate_to": d.replicate_to or ""}
            self.console.scheduled(keys, chunk_tokens, decision)
            if d.rejected:
                c["rejected"] += 1
                return resp
            c["cached_chunks"] += d.num_cached_chunks
            pre = self.members.get(d.prefill)
            service_s = d.ttft_s - next(x.queue_s for x in cands + [c for c, _ in cache_engines]
                                        if x.member_id == d.prefill)
            pre.busy_until = max(now, pre.busy_until) + service_s
            resp.prefill.CopyFrom(cpb.EngineRef(member_id=pre.member_id, address=pre.address))
            if d.decode is not None:
                dec = self.members.get(d.decode)
                resp.decode.CopyFrom(cpb.EngineRef(member_id=dec.member_id, address=dec.address))
            if d.source_node is not None and d.num_cached_chunks:
                src = self.members.get(d.source_node)
                resp.source_node = d.source_node
                resp.source_address = src.address if src else ""
            resp.num_cached_chunks = d.num_cached_chunks
            resp.num_cached_tokens = d.num_cached_tokens
            if d.replicate_to is not None:
                c["replications"] += 1
                resp.replicate_to = d.replicate_to
            return resp

    @_rpc
    def Locate(self, request, context):
        keys = _keys(auth.scoped(auth.prefix_of(context, self.principals), request.keys))
        resp = cpb.LocateResponse()
        with self._lock:
            for k in keys:  # store nodes, then engines' own caches (vLLM instances)
                holders = sorted(self.index.holders(k).items()) + sorted(self.device_index.holders(k).items())
                resp.keys.add(holders=[cpb.Holder(node_id=n, tier=int(t)) for n, t in holders])
            resp.num_prefix = max(self.index.match(keys).num_global, self.device_index.match(keys).num_global)
            prefixes = self.index.node_prefixes(keys) | self.device_index.node_prefixes(keys)
            for node, n in sorted(prefixes.items(), key=lambda kv: (-kv[1], kv[0])):
                m = self.members.get(node)
                resp.nodes.add(node_id=node, address=m.address if m else "", num_prefix=n)
        return resp

    # ---- admin --------------------------------------------------------------

    @_rpc
    def ListMembers(self, request, context):
        now = self.clock()
        resp = cpb.ListMembersResponse(dead_timeout_s=self.config.dead_timeout)
        with self._lock:
            for m in self.members.all():
                info = resp.members.add(member_id=m.member_id, kind=int(m.kind), address=m.address,
                                        state=m.state, last_seen_s=max(0.0, now - m.last_seen),
                                        incarnation=m.incarnation, store_node=m.store_node or "",
                                        namespace=m.namespace, chunk_tokens=m.chunk_tokens, host_id=m.host_id)
                if m.kind is MemberKind.STORE:
                    info.num_chunks = self.index.num_chunks(m.member_id)
                    if m.store_load is not None:
                        info.store.CopyFrom(m.store_load)
                else:
                    info.num_chunks = self.device_index.num_chunks(m.member_id)
                    info.vllm = m.external
                    info.engine.CopyFrom(m.engine_load.to_pb())
                    info.predicted_queue_s = self._queue_s(m, now)
                info.lease_ttl_s = -1
        if self.election is not None:  # each member's etcd lease, outside the lock (etcd round trips)
            try:
                etcd = self.election.etcd
                leases = self._member_leases()
                for info in resp.members:
                    if info.member_id in leases:
                        info.lease_ttl_s = etcd.call(etcd.client.get_lease_info, leases[info.member_id]).TTL
            except CrescentError as exc:
                log.warning("cannot read member leases: %s", exc)
        return resp

    @_rpc
    def ClusterStats(self, request, context):
        with self._lock:
            tiers: dict[int, pb.TierStats] = {}
            resp = cpb.ClusterStatsResponse(num_members=len(self.members), num_chunks=self.index.num_chunks(),
                                            num_copies=self.index.num_copies, policy=self.config.policy,
                                            num_dead=self.members.num_dead)
            for m in self.members.of_kind(MemberKind.STORE):
                s = m.store_load
                if s is None:
                    continue
                for t in s.tiers:
                    acc = tiers.setdefault(t.tier, pb.TierStats(tier=t.tier))
                    for f in ("capacity_bytes", "used_bytes", "num_entries", "hits", "evictions"):
                        _add(acc, f, getattr(t, f))
                for f in ("misses", "bytes_in", "bytes_out"):
                    _add(resp, f, getattr(s, f))
            resp.tiers.extend(tiers[t] for t in sorted(tiers))
            c = self.counters
            resp.num_scheduled, resp.num_rejected = c["scheduled"], c["rejected"]
            resp.num_replications = c["replications"]
            resp.num_scheduled_chunks, resp.num_cached_chunks = c["scheduled_chunks"], c["cached_chunks"]
            resp.cost_coefficients.extend(self.cost.coefficients)
            resp.num_cost_samples = self.cost.num_samples
            resp.num_prefill_samples_received = self._num_samples_received
        return resp

    @_rpc
    def Drain(self, request, context):
        with self._lock:
            m = self.members.get(request.member_id)
            if m is None:
                raise NotFoundError(f"no live member {request.member_id!r}")
            m.draining = not request.undo
            return cpb.DrainResponse(state=m.state)

    def _holders_by_node(self, keys: list[bytes]) -> dict[str, tuple[str, list[bytes]]]:
        """node id → (address, its keys among ``keys``)."""
        out: dict[str, tuple[str, list[bytes]]] = {}
        with self._lock:
            for k in keys:
                for node in self.index.holders(k):
                    m = self.members.get(node)
                    if m is not None and m.kind is MemberKind.STORE:
                        out.setdefault(node, (m.address, []))[1].append(k)
        return out

    def _on_nodes(self, by_node: dict[str, tuple[str, list[bytes]]], op) -> tuple[int, int]:
        """Runs ``op(client, node_keys)`` on each node of ``by_node``; sums the results."""
        from kvstore.client import Retry, StoreClient

        total = nodes = 0
        failed = []
        for node, (address, node_keys) in sorted(by_node.items()):
            client = None
            try:
                client = StoreClient(address, timeout_s=10.0, retry=Retry(attempts=2), data_channel=False)
                total += op(client, node_keys)
                nodes += 1
            except CrescentError as exc:  # (one node failing is said below; the others are still done)
                failed.append(f"{node}: {exc}")
            finally:
                if client is not None:
                    client.close()
        if failed:
            raise FailedPreconditionError(f"{len(failed)} of {len(by_node)} store node(s) failed: "
                                          f"{'; '.join(failed)}")
        return total, nodes

    @_rpc
    def PinChunks(self, request, context):
        keys = _keys(request.keys)
        if not request.ttl_s >= 0 or math.isinf(request.ttl_s):
            raise InvalidArgumentError("ttl_s must be a finite number >= 0")
        n, nodes = self._on_nodes(self._holders_by_node(keys), lambda c, ks: c.pin(ks, request.ttl_s))
        with self._lock:
            self.console.pinned(keys, request.ttl_s, nodes)
        return cpb.PinChunksResponse(num_pinned=n, num_nodes=nodes)

    @_rpc
    def EvictChunks(self, request, context):
        keys = _keys(request.keys)
        by_node = self._holders_by_node(keys)
        n, nodes = self._on_nodes(by_node, lambda c, ks: c.delete(ks))
        with self._lock:  # the nodes' events will say so too; don't route to them meanwhile
            for node, (_, node_keys) in by_node.items():
                for k in node_keys:
                    self.index.removed(node, k)
        return cpb.EvictChunksResponse(num_evicted=n, num_nodes=nodes)

    # ---- P:D sizing -----------------------------------------------------------

    def sizing(self, target_rps: float | None = None, slo_ttft_s: float | None = None,
               slo_itl_s: float | None = None, q: float | None = None) -> Recommendation:
        """Prefill and decode instances for ``target_rps`` (None: the measured rate) under the SLOs
        (None: the conductor's, else the defaults), from the recent requests and the cost model.

        Output lengths: what requests asked for (``num_output_tokens``), scaled to the
        mean that decode engines report generating when they report any.

        Raises:
            InvalidArgumentError: nothing measured yet, or a bad target, SLO or quantile.
        """
        with self._lock:
            samples = list(self.requests)
            cost = copy.copy(self.cost)
            engines = self.members.of_kind(MemberKind.DECODE) or self.members.of_kind(MemberKind.PREFILL)
            generated = sum(e.engine_load.num_generated_tokens for e in engines)
            finished = sum(e.engine_load.num_finished for e in engines)
        asked = sum(r.output_tokens for r in samples)
        if finished:  # the lengths asked for, scaled to the mean the engines really generate
            mean = generated / finished
            scale = mean * len(samples) / asked if asked else None
            samples = [dataclasses.replace(r, output_tokens=max(1, round(r.output_tokens * scale if scale else mean)))
                       for r in samples]
        elif not asked:  # nobody said how long outputs are: one token each
            samples = [dataclasses.replace(r, output_tokens=1) for r in samples]
        try:
            return recommend(samples, cost, target_rps=target_rps,
                             slo_ttft_s=slo_ttft_s or self.config.slo_ttft or DEFAULT_SLO_TTFT_S,
                             slo_itl_s=slo_itl_s or self.config.slo_tbt or DEFAULT_SLO_ITL_S,
                             q=q or DEFAULT_QUANTILE)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None

    @_rpc
    def Sizing(self, request, context):
        for name in ("target_rps", "slo_ttft_s", "slo_itl_s", "quantile"):
            v = getattr(request, name)
            if not (v >= 0 and math.isfinite(v)):
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {v}")
        if request.quantile >= 1:
            raise InvalidArgumentError(f"quantile must be in (0, 1), got {request.quantile}")
        s = self.sizing(request.target_rps or None, request.slo_ttft_s or None, request.slo_itl_s or None,
                        request.quantile or None)
        resp = cpb.SizingResponse(
            num_prefill=s.num_prefill, num_decode=s.num_decode, feasible=s.feasible, target_rps=s.target_rps,
            slo_ttft_s=s.slo_ttft_s, slo_itl_s=s.slo_itl_s, quantile=s.quantile, num_requests=s.num_requests,
            measured_rps=s.measured_rps, mean_prompt_tokens=s.mean_prompt_tokens,
            mean_cached_tokens=s.mean_cached_tokens, mean_output_tokens=s.mean_output_tokens,
            predicted_ttft_s=s.predicted_ttft_s, predicted_itl_s=s.predicted_itl_s,
            prefill_utilization=s.prefill_utilization, decode_batch=s.decode_batch, reasoning=s.reasoning)
        with self._lock:
            for e in sorted(self.members.of_kind(MemberKind.PREFILL) + self.members.of_kind(MemberKind.DECODE),
                            key=lambda m: m.member_id):
                resp.engines.add(member_id=e.member_id, kind=int(e.kind),
                                 prefill_tokens_per_s=e.prefill_tokens / e.prefill_seconds if e.prefill_seconds else 0,
                                 decode_tokens_per_s=e.decode_tokens / e.decode_seconds if e.decode_seconds else 0,
                                 num_samples=e.num_samples)
        return resp


def serve(config: ConductorConfig) -> None:
    """Runs a conductor until SIGTERM or SIGINT, then stops it gracefully."""
    conductor = Conductor(config).start()
    stop = StopSignals()
    metrics = f", metrics :{conductor.metrics_port}" if conductor.metrics_port is not None else ""
    if conductor.kv_events is not None:
        metrics += f", cluster KV events {conductor.kv_events.endpoint}"
    say(f"crescent conductor listening on {conductor.address}{metrics} (policy {config.policy}, "
        f"heartbeat {config.heartbeat_interval:g} s, dead after {config.dead_timeout:g} s)")
    stop.wait()
    say("crescent conductor: stopping")
    conductor.stop()
