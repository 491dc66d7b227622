"""The node's side of the descriptor protocol: gRPC handlers, mover statistics, metrics.

``NodeTransport`` bundles what a node needs to serve one-sided movers (the
lease table and its sweeper, the RDMA endpoint when there is one, per-mover
counters); ``DescriptorRpcs`` is a mixin of the ``KVStore`` servicer that
serves the descriptor RPCs from it.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore import auth
from kvstore.config import StoreConfig
from kvstore.errors import CrescentError, FailedPreconditionError, InvalidArgumentError
from kvstore.store import U64_MAX, Tier, TieredStore
from kvstore.transport.descriptors import SHM_PROOF_HEADER, Mover, descriptor_pb
from kvstore.transport.identity import host_identity
from kvstore.transport.leases import GrantResult, LeaseTable
from kvstore.transport.rdma import MAX_QPS
from proto.crescent.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

_OFFER = {"auto": (Mover.SHM, Mover.RDMA), "shm": (Mover.SHM,), "rdma": (Mover.RDMA,), "tcp": ()}


class NodeTransport:
    """What a node needs to serve one-sided movers, and every mover's use counts.

    Args:
        config: the node's config (``transport``, ``lease_ttl_s``, ``data_port``).
        store: the node's store; its DRAM arena is what clients map or RDMA into.
        metrics: the node's ``StoreMetrics`` (a collector for mover metrics is added).
    """

    def __init__(self, config: StoreConfig, store: TieredStore, metrics=None) -> None:
        self.config = config
        self.store = store
        self.leases = LeaseTable(store, config.lease_ttl_s, on_done=self.count)
        self._lock = threading.Lock()
        self._counts = {m: [0, 0, 0, 0] for m in Mover}  # reads, writes, bytes read, bytes written
        self.rdma = None
        self.rdma_reason = "not offered (--transport)"
        if Mover.RDMA in _OFFER[config.transport]:
            from kvstore.transport import rdma

            try:
                self.rdma = rdma.NodeEndpoint(store.dram)
                self.rdma_reason = ""
            except rdma.RdmaUnavailableError as exc:
                self.rdma_reason = str(exc)
                if config.transport == "rdma":
                    log.warning("--transport rdma: %s; serving tcp only", exc)
        self.offered = [m for m in _OFFER[config.transport] if m is not Mover.RDMA or self.rdma is not None]
        if config.data_port >= 0:
            self.offered.append(Mover.TCP)
        self.offered.append(Mover.GRPC)
        st = os.stat(store.dram.path)
        self.arena = pb.ArenaInfo(name=store.dram.name, size=store.dram.capacity_bytes,
                                  slot_bytes=store.dram.slot_bytes, file_dev=st.st_dev, file_ino=st.st_ino,
                                  rdma_addr=self.rdma.addr if self.rdma else 0,
                                  rdma_rkey=self.rdma.rkey if self.rdma else 0,
                                  table_offset=store.dram.table_offset)
        self.shm_proof = store.dram.shm_proof
        """What a same-host client proves before shm grants (``kvstore/arena.py``)."""
        self.device_arena = self._export_device_tier(store)
        """The device tier as a same-host GPU client maps it (``cuda_ipc``), or why it cannot."""
        if self.device_arena.available:
            self.offered.insert(self.offered.index(Mover.SHM) + 1, Mover.CUDA_IPC)
        if metrics is not None:
            metrics.registry.register(MoverCollector(self))

    def _export_device_tier(self, store: TieredStore) -> pb.DeviceArenaInfo:
        device = store.device_arena()
        if device is None:
            return pb.DeviceArenaInfo(reason="no device tier (--device)")
        if Mover.SHM not in self.offered:
            return pb.DeviceArenaInfo(reason=f"cuda_ipc serves same-host clients beside shm (--transport {self.config.transport})")
        try:
            uuid, h = device.ipc_export()
        except Exception as exc:  # noqa: BLE001 - a driver or torch without CUDA IPC: clients read through the node
            log.warning("the device tier cannot be exported over CUDA IPC (%s): clients read it through the node", exc)
            return pb.DeviceArenaInfo(reason=f"CUDA IPC export failed: {exc}")
        return pb.DeviceArenaInfo(
            available=True, name=f"{store.dram.name}.hbm", size=device.capacity_bytes, slot_bytes=device.slot_bytes,
            device_uuid=uuid, device_index=int(h[0]), ipc_handle=h[1], storage_bytes=h[2], storage_offset=h[3],
            ref_counter_handle=h[4], ref_counter_offset=h[5], event_handle=h[6] or b"", event_sync_required=bool(h[7]))

    def arena_name(self, mover: Mover) -> str:
        """The arena a grant of ``mover`` names: the device tier's for cuda_ipc, else DRAM's."""
        return self.device_arena.name if mover is Mover.CUDA_IPC else self.arena.name

    def start(self) -> None:
        self.leases.start()

    def stop(self) -> None:
        self.leases.stop()
        if self.rdma is not None:
            self.rdma.close()

    def count(self, mover: Mover, op: str, nbytes: int | None = None, batches: int = 1) -> None:
        """Counts ``batches`` moved by ``mover`` (``op`` is ``read`` or ``write``)."""
        with self._lock:
            c = self._counts[mover]  # (saturating: u64 in Stats; REPORTs are a client's word)
            i = 0 if op == "read" else 1
            c[i] = min(c[i] + batches, U64_MAX)
            c[i + 2] = min(c[i + 2] + (nbytes or 0), U64_MAX)

    def local_reads(self, values: int, nbytes: int, batches: int) -> None:
        """Counts reads a same-host client made with no call to this node (its REPORT):
        DRAM hits and bytes out in the store's counters, shm reads in the mover counts."""
        self.store.note_hits(Tier.DRAM, values, nbytes)
        if batches:
            self.count(Mover.SHM, "read", nbytes, batches)

    def mover_counts(self) -> dict[Mover, list[int]]:
        with self._lock:
            return {m: list(c) for m, c in self._counts.items()}

    def stats_fields(self) -> dict:
        """Fields of ``StatsResponse`` about movers and remote leases."""
        s = self.leases.stats()
        movers = [pb.MoverStats(mover=m.pb, num_reads=c[0], num_writes=c[1], bytes_read=c[2],
                                bytes_written=c[3]) for m, c in self.mover_counts().items()]
        return {"movers": movers, "transport": self.config.transport,
                "num_remote_leases": s["num_remote_leases"],
                "num_remote_reservations": s["num_remote_reservations"],
                "num_expired_leases": s["num_expired_leases"],
                "num_expired_reservations": s["num_expired_reservations"]}

    def check_mover(self, value: int) -> Mover:
        try:
            mover = Mover.from_pb(value) if value else Mover.SHM
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if not mover.one_sided:
            raise InvalidArgumentError(f"descriptors are for shm, rdma and cuda_ipc, not {mover.value}")
        if mover not in self.offered:
            why = {Mover.RDMA: self.rdma_reason, Mover.CUDA_IPC: self.device_arena.reason}.get(mover)
            raise FailedPreconditionError(
                f"this node does not offer {mover.value} (--transport {self.config.transport}"
                + (f"; {mover.value}: {why}" if why else "") + ")")
        return mover


class MoverCollector:
    """Mover and remote-lease metrics, read at scrape time."""

    def __init__(self, transport: NodeTransport) -> None:
        self.transport = transport

    def collect(self):
        ops = CounterMetricFamily("crescent_store_mover_ops", "Batches moved, by mover and direction",
                                  labels=["mover", "op"])
        nbytes = CounterMetricFamily("crescent_store_mover_bytes",
                                     "Value bytes moved, by mover and direction (not counted for tcp)",
                                     labels=["mover", "op"])
        for m, c in self.transport.mover_counts().items():
            ops.add_metric([m.value, "read"], c[0])
            ops.add_metric([m.value, "write"], c[1])
            nbytes.add_metric([m.value, "read"], c[2])
            nbytes.add_metric([m.value, "write"], c[3])
        s = self.transport.leases.stats()
        yield ops
        yield nbytes
        yield GaugeMetricFamily("crescent_store_remote_leases", "Read leases held by clients",
                                value=s["num_remote_leases"])
        yield GaugeMetricFamily("crescent_store_remote_reservations", "Write reservations held by clients",
                                value=s["num_remote_reservations"])
        expired = CounterMetricFamily("crescent_store_expired_grants",
                                      "Leases and reservations that expired unreleased", labels=["kind"])
        expired.add_metric(["lease"], s["num_expired_leases"])
        expired.add_metric(["reservation"], s["num_expired_reservations"])
        yield expired
        rdma = self.transport.rdma
        yield GaugeMetricFamily("crescent_store_rdma_queue_pairs",
                                f"RDMA queue pairs of connected clients held (at most {MAX_QPS}; 0 without RDMA)",
                                value=rdma.num_qps if rdma is not None else 0)


def _rpc(op: str):
    """Maps CrescentError to its gRPC status and times the call (path = the mover)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, request, context):
            t0 = time.perf_counter()
            path = "grpc"
            try:
                result, path = fn(self, request, context)
                return result
            except CrescentError as exc:
                context.abort(exc.grpc_code, str(exc))
            finally:
                self.metrics.observe(op, time.perf_counter() - t0, path)

        return inner

    return wrap


def _grant_pb(cls, g: GrantResult, arena: str):
    items = [descriptor_pb(d.index, d.status, d.size, d.tier, d.slots, d.generations) for d in g.items]
    kw = {"message": g.message} if cls is pb.ReserveWriteResponse else {}
    return cls(lease_id=g.lease_id, expires_in_s=g.ttl_s, arena=arena, items=items, **kw)


def _proven(t: NodeTransport, context) -> bool:
    """Whether the call carries the arena's shm proof (``SHM_PROOF_HEADER``, hex)."""
    got = next((v for k, v in context.invocation_metadata() or () if k == SHM_PROOF_HEADER), "")
    try:
        return hmac.compare_digest(bytes.fromhex(got), t.shm_proof)
    except ValueError:
        return False


class DescriptorRpcs:
    """The descriptor RPCs of ``KVStore``; mixed into the servicer (needs ``self.node``, ``self.metrics``)."""

    @_rpc("transports")
    def Transports(self, request, context):
        t = self.node.transport
        ident = host_identity()
        r = t.rdma
        return pb.TransportsResponse(
            host=pb.HostIdentity(hostname=ident.hostname, boot_id=ident.boot_id), arena=t.arena,
            offered=[m.pb for m in t.offered], lease_ttl_s=t.config.lease_ttl_s,
            rdma=pb.RdmaEndpoint(available=r is not None, reason=t.rdma_reason, device=r.device if r else "",
                                 port=r.port if r else 0, num_queue_pairs=r.num_qps if r else 0),
            device_arena=t.device_arena), "grpc"

    @_rpc("acquire_read")
    def AcquireRead(self, request, context):
        t = self.node.transport
        mover = t.check_mover(request.mover)
        g = t.leases.acquire(auth.scoped(auth.prefix_of(context, self.node.principals), request.keys), mover,
                             _proven(t, context))
        return _grant_pb(pb.AcquireReadResponse, g, t.arena_name(mover)), mover.value

    @_rpc("release_read")
    def ReleaseRead(self, request, context):
        n, nbytes = self.node.transport.leases.release(request.lease_id)
        return pb.ReleaseReadResponse(num_values=n, num_bytes=nbytes), "grpc"

    @_rpc("reserve_write")
    def ReserveWrite(self, request, context):
        t = self.node.transport
        mover = t.check_mover(request.mover)
        keys = auth.scoped(auth.prefix_of(context, self.node.principals), [v.key for v in request.values])
        g = t.leases.reserve([(k, v.size) for k, v in zip(keys, request.values)], mover, _proven(t, context))
        return _grant_pb(pb.ReserveWriteResponse, g, t.arena.name), mover.value

    @_rpc("commit_write")
    def CommitWrite(self, request, context):
        n, nbytes = self.node.transport.leases.commit(request.lease_id)
        return pb.CommitWriteResponse(num_stored=n, num_bytes=nbytes), "grpc"

    @_rpc("abort_write")
    def AbortWrite(self, request, context):
        return pb.AbortWriteResponse(num_aborted=self.node.transport.leases.abort(request.lease_id)), "grpc"

    @_rpc("connect_rdma")
    def ConnectRdma(self, request, context):
        t = self.node.transport
        if t.rdma is None:
            raise FailedPreconditionError(f"this node has no RDMA endpoint: {t.rdma_reason}")
        info = t.rdma.connect(request.gid, request.lid, request.qp_num, request.psn, rd_atomic=request.rd_atomic,
                              replaces=(request.replaces_qp_num, request.replaces_client_qp_num))
        return pb.RdmaConnectResponse(gid=info.gid, lid=info.lid, qp_num=info.qp_num, psn=info.psn,
                                      addr=t.rdma.addr, rkey=t.rdma.rkey, rd_atomic=info.rd_atomic), "rdma"

    @_rpc("disconnect_rdma")
    def DisconnectRdma(self, request, context):
        t = self.node.transport
        if t.rdma is None:
            raise FailedPreconditionError(f"this node has no RDMA endpoint: {t.rdma_reason}")
        return pb.RdmaDisconnectResponse(closed=t.rdma.disconnect(request.gid, request.qp_num,
                                                                  request.client_qp_num)), "rdma"
