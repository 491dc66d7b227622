"""The store node: TieredStore behind the ``crescent.v1.KVStore`` gRPC service.

``StoreNode(config).start()`` binds the gRPC listener, the bulk data channel
and (optionally) the metrics endpoint; ``stop()`` shuts all of them. Tests bind
port 0 on 127.0.0.1 and run the node in-process or as a real subprocess.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import threading
import time


from kvstore import auth, dataserver, tls
from kvstore.arena import reap_stale_segments
from kvstore.config import MAX_KEY_BYTES, StoreConfig
from kvstore.datachannel import DATA_OPS
from kvstore.dataserver import DataChannelServer
from kvstore.liveness import rpc_server, server_options
from kvstore.errors import CrescentError, InvalidArgumentError, ResourceExhaustedError
from kvstore.health import HealthStatus, advertised_host
from kvstore.metrics import StoreMetrics, stop_http
from kvstore.procs import StopSignals, say, wait_in_slices
from kvstore.store import Reservation, TieredStore, check_key
from kvstore.transport.descriptors import Mover
from kvstore.transport.service import DescriptorRpcs, NodeTransport
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_GET_WINDOW = 16
"""Values a streamed Get leases (and reads from disk, in parallel) ahead of sending them."""
_CHANNEL_OPS = {"acquire": "acquire_read", "release": "release_read", "reserve": "reserve_write",
                "commit": "commit_write", "abort": "abort_write", "report": "report_local_reads",
                "prove": "prove_shm", "lookup": "lookup", "exists": "exists"}
VERSION = "0.1.0"
FRAME_BYTES = 4 << 20
GRPC_OPTIONS = server_options(FRAME_BYTES + (1 << 20))


def _rpc(op: str):
    """Maps CrescentError to its gRPC status and times the call."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, request, context):
            t0 = time.perf_counter()
            try:
                return fn(self, request, context)
            except CrescentError as exc:
                context.abort(exc.grpc_code, str(exc))
            finally:
                self.metrics.observe(op, time.perf_counter() - t0)

        return inner

    return wrap


class _Filler:
    """Copies incoming frames into a reservation's views, in order."""

    def __init__(self, res: Reservation) -> None:
        self.res = res
        self.views = list(res.views)
        self.remaining = res.size

    def write(self, data: bytes) -> None:
        if len(data) > self.remaining:
            raise InvalidArgumentError(
                f"more data than the {self.res.size} bytes announced for key {self.res.key.hex()}")
        mv = memoryview(data)
        while mv.nbytes:
            v = self.views[0]
            n = min(v.nbytes, mv.nbytes)
            v[:n] = mv[:n]
            mv = mv[n:]
            self.views[0] = v[n:]
            if not self.views[0].nbytes:
                self.views.pop(0)
        self.remaining -= len(data)


class StallWatch:
    """Cancels a streamed call (Put, Get) that goes ``dataserver.STALL_S`` without progress: a
    client that stops sending a Put's frames, or stops reading a Get's, held the reservations or
    leases of its call for as long as it stayed open (the data channel's rule, on gRPC). One
    thread, started with the first call watched, checking a few times per STALL_S."""

    def __init__(self) -> None:
        self._calls: dict[int, list] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, context) -> list:
        """A call's entry: set ``entry[1] = time.monotonic()`` at each sign of progress; ``done`` at its end."""
        entry = [context, time.monotonic()]
        with self._lock:
            self._calls[id(entry)] = entry
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="grpc-stalls", daemon=True)
                self._thread.start()
        return entry

    def done(self, entry: list) -> None:
        with self._lock:
            self._calls.pop(id(entry), None)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, dataserver.STALL_S / 4)):
            now, limit = time.monotonic(), dataserver.STALL_S
            with self._lock:
                stalled = [e for e in self._calls.values() if now - e[1] > limit]
                for e in stalled:
                    self._calls.pop(id(e), None)
            for context, since in stalled:
                log.info("cancelling a call from %s: no progress for %.0f s", context.peer(), now - since)
                context.cancel()  # (its handler unwinds: reservations aborted, leases released)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout=10)


class KVStoreServicer(DescriptorRpcs, pb_grpc.KVStoreServicer):
    def __init__(self, node: StoreNode) -> None:
        self.node = node
        self.store = node.store
        self.metrics = node.metrics
        self.stalls = node.stalls

    @_rpc("put")
    def Put(self, request_iterator, context):
        pending: list[Reservation] = []
        filler: _Filler | None = None
        committed = False
        prefix = auth.prefix_of(context, self.node.principals)
        watch = self.stalls.watch(context)
        try:
            for frame in request_iterator:
                watch[1] = time.monotonic()
                which = frame.WhichOneof("frame")
                if which == "header":
                    if filler is not None:
                        raise InvalidArgumentError(
                            f"value for key {filler.res.key.hex()} truncated: "
                            f"{filler.remaining} bytes missing before the next header")
                    key, = auth.scoped(prefix, [frame.header.key])
                    try:
                        filler = _Filler(self.store.reserve(key, frame.header.size))
                    except ResourceExhaustedError as exc:
                        if not pending:
                            raise
                        raise ResourceExhaustedError(  # (its own values may be what fills the node)
                            f"{exc}; this Put holds {len(pending)} values ({sum(r.size for r in pending)} bytes) "
                            "not committed until it ends: put fewer at a time") from None
                elif which == "data":
                    if filler is None:
                        raise InvalidArgumentError("a data frame without a header")
                    filler.write(frame.data)
                else:
                    raise InvalidArgumentError("an empty frame")
                if filler is not None and filler.remaining == 0:
                    pending.append(filler.res)
                    filler = None
            if filler is not None:
                raise InvalidArgumentError(
                    f"value for key {filler.res.key.hex()} truncated: {filler.remaining} bytes missing")
            self.store.commit_many(pending)
            committed = True
            self.node.transport.count(Mover.GRPC, "write", sum(r.size for r in pending))
            return pb.PutResponse(num_stored=len(pending), num_bytes=sum(r.size for r in pending))
        finally:
            self.stalls.done(watch)
            if filler is not None:
                self.store.abort(filler.res)
            if not committed:
                for r in pending:
                    self.store.abort(r)

    def Get(self, request, context):
        t0 = time.perf_counter()
        try:
            keys = auth.scoped(auth.prefix_of(context, self.node.principals), request.keys)
            for key in keys:
                check_key(key)
        except CrescentError as exc:
            context.abort(exc.grpc_code, str(exc))
        nbytes = 0
        watch = self.stalls.watch(context)  # (progress: each frame the client took)
        try:
            for w in range(0, len(keys), _GET_WINDOW):  # a window's disk values are read in parallel
                watch[1] = time.monotonic()
                leases = self.store.acquire_many(keys[w : w + _GET_WINDOW])
                try:
                    for i, lease in enumerate(leases, w):
                        if lease is None:
                            yield pb.GetFrame(header=pb.GetHeader(index=i, found=False))
                            continue
                        nbytes += lease.size
                        yield pb.GetFrame(header=pb.GetHeader(index=i, found=True, size=lease.size,
                                                              tier=int(lease.tier)))
                        watch[1] = time.monotonic()
                        for frame in _frames(lease.views):
                            yield pb.GetFrame(data=frame)
                            watch[1] = time.monotonic()
                        self.store.release(lease)
                finally:
                    self.store.release_many(ls for ls in leases if ls is not None)
        finally:
            self.stalls.done(watch)
        self.node.transport.count(Mover.GRPC, "read", nbytes)
        self.metrics.observe("get", time.perf_counter() - t0)

    @_rpc("lookup")
    def Lookup(self, request, context):
        keys = auth.scoped(auth.prefix_of(context, self.node.principals), request.keys)
        for k in keys:
            check_key(k)
        n, tiers = self.store.lookup(keys)
        return pb.LookupResponse(num_prefix=n, tiers=[int(t) for t in tiers])

    @_rpc("exists")
    def Exists(self, request, context):
        keys = auth.scoped(auth.prefix_of(context, self.node.principals), request.keys)
        for k in keys:
            check_key(k)
        return pb.ExistsResponse(present=self.store.exists(keys))

    @_rpc("delete")
    def Delete(self, request, context):
        keys = auth.scoped(auth.prefix_of(context, self.node.principals), request.keys)
        for k in keys:
            check_key(k)
        return pb.DeleteResponse(num_deleted=self.store.delete(keys))

    @_rpc("clear")
    def Clear(self, request, context):
        return pb.DeleteResponse(num_deleted=self.store.clear())

    @_rpc("pin")
    def Pin(self, request, context):
        keys = auth.scoped(auth.prefix_of(context, self.node.principals), request.keys)
        for k in keys:
            check_key(k)
        if not 0 <= request.ttl_s < math.inf:  # also rejects NaN; inf pinned for good (the conductor refuses it too)
            raise InvalidArgumentError("ttl_s must be a finite number >= 0")
        return pb.PinResponse(num_pinned=self.store.pin(keys, request.ttl_s))

    @_rpc("stats")
    def Stats(self, request, context):
        s = self.store.stats()
        return pb.StatsResponse(
            tiers=[pb.TierStats(tier=int(t), capacity_bytes=v["capacity_bytes"],
                                used_bytes=v["used_bytes"], num_entries=v["num_entries"],
                                hits=v["hits"], evictions=v["evictions"])
                   for t, v in s["tiers"].items()],
            misses=s["misses"], demotions=s["demotions"], promotions=s["promotions"],
            drops=s["drops"], num_leases=s["num_leases"], num_pinned=s["num_pinned"],
            node_id=self.node.node_id, **self.node.transport.stats_fields())

    @_rpc("health")
    def Health(self, request, context):
        dc = self.node.data_server
        prefix = auth.prefix_of(context, self.node.principals)  # the data channel session works in the caller's key space
        return pb.HealthResponse(serving=not self.node.stopping, node_id=self.node.node_id,
                                 version=VERSION, max_key_bytes=MAX_KEY_BYTES - len(prefix),
                                 max_value_bytes=self.store.config.max_value_size,
                                 data_port=dc.port if dc else 0, data_token=dc.token_for(prefix) if dc else b"",
                                 data_ops=DATA_OPS if dc else 0)


def _frames(views: list[memoryview]):
    """Joins slot views into frames of up to FRAME_BYTES."""
    batch, size = [], 0
    for v in views:
        while v.nbytes:
            n = min(v.nbytes, FRAME_BYTES - size)
            batch.append(v[:n])
            size += n
            v = v[n:]
            if size == FRAME_BYTES:
                yield b"".join(batch)
                batch, size = [], 0
    if batch:
        yield b"".join(batch)


class StoreNode:
    """One store node process's parts: tiers, gRPC service, data channel, metrics."""

    def __init__(self, config: StoreConfig, listener=None) -> None:
        self.config = config
        reap_stale_segments()
        self.agent = None  # conductor membership + KV events (kvstore/conductor/agent.py)
        if config.conductor or config.etcd:
            from kvstore.conductor.agent import StoreAgent

            self.agent = StoreAgent(config.conductor or "", etcd=config.etcd)
            listener = self.agent.listener(listener)
        self.kv_events = None  # vLLM-format KV events (kvstore/kvevents.py)
        if config.kv_events_endpoint:
            from kvstore.kvevents import KvEventPublisher

            try:
                self.kv_events = KvEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
            except Exception as exc:  # zmq.ZMQError: a bad or busy endpoint
                raise OSError(f"cannot publish KV events on {config.kv_events_endpoint}: {exc}") from None
            listener = self.kv_events.listener(listener)
        self.transport = None
        try:
            self.store = TieredStore(config, listener=listener, quotas=auth.quotas(auth.table()))
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.stop()
            raise
        try:
            self._make_parts(config)
        except BaseException:  # a node that cannot start leaves nothing behind (its arena is --dram of memory)
            if self.kv_events is not None:
                self.kv_events.stop()
            if self.transport is not None:
                self.transport.stop()
            self.store.close()
            raise

    def _make_parts(self, config: StoreConfig) -> None:
        self.metrics = StoreMetrics(self.store)
        self.transport = NodeTransport(config, self.store, self.metrics)
        self.stopping = False
        self._drained = threading.Event()  # set: cut a drain short (a second signal)
        self.principals = auth.table()  # the auth file's tokens (None: every call is taken)
        self.stalls = StallWatch()
        self.server, self._handlers, rpcs = rpc_server("grpc", GRPC_OPTIONS, auth.server_interceptors(self.principals))
        self.metrics.watch_rpcs(rpcs)
        pb_grpc.add_KVStoreServicer_to_server(KVStoreServicer(self), self.server)
        self.health = HealthStatus(self.server, "crescent.v1.KVStore")
        host = config.listen.rpartition(":")[0]
        self.port = tls.add_port(self.server, config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen} (address in use or not local)")
        self.host = host
        self.address = f"{advertised_host(host, config.advertise_host)}:{self.port}"
        self.node_id = config.node_id or f"{socket.gethostname()}:{self.port}"
        self.data_server = None
        if config.data_port >= 0:
            try:
                self.data_server = DataChannelServer(
                    self.store, host, config.data_port,
                    on_op=self._on_tcp_op, grants=self.transport)
            except OSError as exc:
                raise OSError(f"cannot listen on --data-port {config.data_port}: {exc.strerror or exc}") from None
        self._metrics_server = None

    @property
    def metrics_port(self) -> int | None:
        """The /metrics port once started (with ``metrics_port=0``: the one it got); None without one."""
        return self._metrics_server.server_port if self._metrics_server is not None else None

    def _on_tcp_op(self, op: str, seconds: float, path: str) -> None:
        if op in ("get", "get_layered", "put"):  # (a layered get is a get: its bytes come in another order)
            self.metrics.observe("put" if op == "put" else "get", seconds, path)
            self.transport.count(Mover.TCP, "write" if op == "put" else "read")
        else:  # the control half of shm/rdma and the queries, named as their RPCs (mover counts: the lease table)
            self.metrics.observe(_CHANNEL_OPS[op], seconds, path)

    def start(self) -> StoreNode:
        try:
            if self.config.metrics_port is not None:  # first: a busy port stops the node before it serves
                try:
                    self._metrics_server = self.metrics.serve(self.config.metrics_port, self.host)
                except OSError as exc:
                    raise OSError(f"cannot serve metrics on --metrics-port {self.config.metrics_port}: "
                                  f"{exc.strerror or exc}") from None
            if self.agent is not None:
                self.agent.attach(self)  # before serving: the agent must see every event
            if self.kv_events is not None:
                self.kv_events.start(self.store)
            self.transport.start()
            self.server.start()
            if self.data_server:
                self.data_server.start()
        except BaseException:
            self._drained.set()  # no drain: nothing was served
            self.stop(grace=0)
            raise
        return self

    def stop(self, grace: float = 2.0) -> None:
        self.stopping = True  # Health says serving=false from here
        self.health.stop()  # ... and so does grpc.health.v1 (NOT_SERVING: probes look away)
        if self.config.drain_s > 0:  # ... while every call is still served
            wait_in_slices(self._drained, self.config.drain_s)  # a second signal ends it
        if self.agent is not None:
            self.agent.stop()  # deregisters: the conductor drops this node's chunks at once
        if self.data_server:
            self.data_server.stop()
        self.server.stop(grace).wait()
        # NOTE: that fires once gRPC has cancelled the calls left, not once their handlers
        # have returned their leases and reservations: wait for those before the store closes.
        drain = threading.Thread(target=self._handlers.shutdown, name="grpc-drain", daemon=True)
        drain.start()
        drain.join(timeout=max(grace, 0.0) + 10.0)
        self.stalls.stop()
        if self._metrics_server is not None:
            stop_http(self._metrics_server)
        if self.kv_events is not None:
            self.kv_events.stop()
        self.transport.stop()
        self.store.close()


def serve(config: StoreConfig) -> None:
    """Runs a node until SIGTERM or SIGINT, then stops it gracefully."""
    node = StoreNode(config).start()
    stop = StopSignals(on_again=node._drained.set)  # a second signal: stop draining now
    dc = f", data channel :{node.data_server.port}" if node.data_server else ""
    tiers = ", ".join(t.name.lower() for t in node.store.stats()["tiers"])
    ev = f", KV events {node.kv_events.endpoint}" if node.kv_events else ""
    m = f", metrics :{node.metrics_port}" if node.metrics_port is not None else ""
    say(f"crescent store {node.node_id} listening on {node.address}{dc}{m} (tiers: {tiers}){ev}")
    stop.wait()
    say("crescent store: stopping")
    node.stop()
