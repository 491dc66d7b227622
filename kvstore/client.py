"""Python client of a store node.

``StoreClient(address)`` speaks gRPC for control (lookup, exists, delete, pin,
stats, health) and moves value bytes over the node's bulk data channel when it
has one (raw TCP, straight into caller-owned buffers), else over gRPC frames.
Every failure surfaces as a ``CrescentError`` subclass; UNAVAILABLE is retried
with backoff by one ``Retry`` object.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, Union

from kvstore import tls
from kvstore.config import MAX_KEY_BYTES, check_address
from kvstore.datachannel import Op, Status, _Connections, new_buffer
from kvstore.liveness import channel_options
from kvstore.errors import (CrescentError, DataLossError, FailedPreconditionError, InvalidArgumentError,
                            ResourceExhaustedError, UnavailableError, call_grpc)
from kvstore.store import Tier
from kvstore.transport.gpu import host_to_cuda, is_cuda
from kvstore.transport.identity import REQUESTS
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

FRAME_BYTES = 4 << 20
MAX_TIMEOUT_S = 1e6
"""The longest deadline a call takes (gRPC turns much longer ones into an immediate DEADLINE_EXCEEDED)."""
_OPTIONS = channel_options(FRAME_BYTES + (1 << 20))
"""Dead nodes noticed within seconds, returning ones found within ~2 s (kvstore/liveness.py)."""

Buffer = Union[bytes, bytearray, memoryview, "torch.Tensor"]  # noqa: F821
Value = Union[Buffer, Sequence[Buffer]]
"""A value: one buffer, or a list of parts stored back to back (e.g. a chunk's header and payload)."""

T = TypeVar("T")
_SLAB_MAX = 64 << 20
"""The most a ReadSlabs slab grows to (bytes)."""
_QUERY_OPS = 1  # the data_ops from which a node answers LOOKUP and EXISTS on its data channel
_NO_CHANNEL = object()  # _dc_call: the node (maybe a restarted one) offers no data channel


@dataclass(frozen=True)
class Retry:
    """Retries a call that failed with UnavailableError, with jittered exponential backoff."""

    attempts: int = 5
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise InvalidArgumentError(f"Retry.attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 3600.0:  # also NaN
                raise InvalidArgumentError(f"Retry.{name} must be seconds in [0, 3600], got {v!r}")

    def call(self, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.attempts):
            try:
                return fn()
            except UnavailableError:
                if attempt == self.attempts - 1:
                    raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat byte view of a buffer-like or a contiguous CPU tensor (no copy).

    Raises:
        InvalidArgumentError: not a buffer (str, int, None...), or not contiguous.
    """
    if hasattr(buf, "data_ptr"):  # torch.Tensor
        from kvstore.chunk import tensor_bytes

        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise InvalidArgumentError(f"a tensor value or buffer must be a contiguous CPU or CUDA tensor, got "
                                       f"{'a non-contiguous one' if buf.device.type == 'cpu' else buf.device.type}")
        return tensor_bytes(buf)
    if isinstance(buf, str):
        raise InvalidArgumentError("a value or buffer is bytes-like (bytes, bytearray, memoryview, numpy array) "
                                   "or a tensor, got str: encode it first")
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidArgumentError(f"a value or buffer is bytes-like (bytes, bytearray, memoryview, numpy array) "
                                   f"or a tensor, got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgumentError("a value or buffer must be C-contiguous")
    return view.cast("B")


def _parts(value: Value) -> list:
    """Byte views of a value's parts; CUDA tensors stay tensors (movers stage them)."""
    if isinstance(value, (list, tuple)):
        return [p if is_cuda(p) else as_bytes_view(p) for p in value]
    return [value if is_cuda(value) else as_bytes_view(value)]


def _nbytes(part) -> int:
    return part.numel() * part.element_size() if is_cuda(part) else part.nbytes


def _host_parts(parts: list) -> list[memoryview]:
    """Host views for the streamed paths: a CUDA part is copied to host memory first."""
    return [as_bytes_view(p.contiguous().cpu()) if is_cuda(p) else p for p in parts]


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, str)) or not hasattr(keys, "__iter__"):
        raise InvalidArgumentError(f"keys must be a list of bytes, got {type(keys).__name__}")
    out = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray)):
            raise InvalidArgumentError(f"a key must be bytes, got {type(k).__name__}")
        if not k or len(k) > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"a key must be 1..{MAX_KEY_BYTES} bytes, got {len(k)}")
        out.append(bytes(k))
    return out


class ReadSlabs:
    """Buffers kept for reading values into and copying them out of. A value read into fresh
    memory page-faults it in 4 KiB at a time, and glibc gives large freed blocks back to the kernel,
    so a reader that allocates per call pays that on every call: a 1 MiB ``get`` took 1.0 ms from
    a same-host node that way (a ``bytearray`` read into, then ``bytes`` of it), 0.08 ms reading
    into a kept buffer. ``take`` a slab, read with its ``alloc`` (``StoreClient.batch_get``), copy
    out, ``give`` it back; one never given back is garbage, nothing more. Values past a slab's room
    get buffers of their own, and the slab is grown, up to ``_SLAB_MAX`` bytes, for the next call
    like it. Thread-safe: each caller holds its own slab."""

    def __init__(self) -> None:
        self._free: list[_Slab] = []
        self._lock = threading.Lock()

    def take(self) -> _Slab:
        with self._lock:
            return self._free.pop() if self._free else _Slab()

    def give(self, slab: _Slab) -> None:
        if len(slab.buf) < slab.used <= _SLAB_MAX:
            slab.buf = bytearray(-(-slab.used // (1 << 20)) << 20)  # (whole MiB)
        slab.used = 0
        with self._lock:
            self._free.append(slab)


class _Slab:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.used = 0  # bytes asked for since taken (the next call's size)

    def alloc(self, _: int, size: int) -> bytearray | memoryview:
        """A ``batch_get`` destination: the slab's next ``size`` bytes, or a new buffer past them."""
        self.used += size
        if self.used > len(self.buf):
            return bytearray(size)
        return memoryview(self.buf)[self.used - size:self.used]


class StoreClient:
    """Client of one store node.

    Args:
        address: ``host:port`` of the node's gRPC listener.
        timeout_s: deadline of each call.
        retry: retry policy for UNAVAILABLE.
        data_channel: use the node's raw TCP data channel when it has one: for value
            bytes (tcp), and for the grant calls of shm and rdma (else those are RPCs).
        transport: how value bytes move: ``auto`` (shm when the node is on this
            host, rdma when both ends have an ibverbs device, else the TCP data
            channel, else gRPC), or ``shm``, ``rdma``, ``tcp``, ``grpc``. A
            one-sided mover that cannot work here falls back, with a warning
            that says why (``transport_notes``).
        local_reads: shm only: read values whose descriptors this client remembers
            (from its earlier reads and writes) with no call to the node, checked
            against the node's slot generation table. False sends every read
            through a grant, so that the node sees (and counts) each one.
    """

    def __init__(self, address: str, *, timeout_s: float = 60.0, retry: Retry = Retry(),
                 data_channel: bool = True, transport: str = "auto", local_reads: bool = True) -> None:
        if transport not in REQUESTS:
            raise InvalidArgumentError(f"transport must be one of {', '.join(REQUESTS)}, got {transport!r}")
        try:
            check_address("the address", address)
        except ValueError:
            raise InvalidArgumentError(f"a node's address is host:port (port 0-65535), got {address!r}") from None
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise InvalidArgumentError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
        if retry is None:
            retry = Retry(attempts=1)
        if not isinstance(retry, Retry):
            raise InvalidArgumentError(f"retry must be a Retry (or None: no retries), got {type(retry).__name__}")
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry
        self._channel = tls.channel(address, _OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._want_dc = data_channel and transport != "grpc"
        self._dc: _Connections | None = None
        self._dc_lock = threading.Lock()
        self._limits: pb.HealthResponse | None = None
        self._transport_req = transport
        self._local_reads = local_reads
        self._selection = None  # kvstore.transport.session.Selection, resolved on first use
        self._selecting = threading.Lock()  # one thread resolves it; the others wait and take it
        self._slabs = ReadSlabs()  # what batch_get_bytes reads into
        self._closed = False

    # ---- plumbing -----------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        self._check_open()
        try:
            return call_grpc(fn, self.retry)
        except CrescentError as exc:
            if self._closed:  # closed by another thread during the call (gRPC says CANCELLED)
                raise FailedPreconditionError(f"the client of {self.address} was closed during the call") from exc
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError(f"the client of {self.address} is closed")

    def health(self) -> dict:
        h = self._read_health(self.retry)
        return {"serving": h.serving, "node_id": h.node_id, "version": h.version,
                "max_key_bytes": h.max_key_bytes, "max_value_bytes": h.max_value_bytes,
                "data_port": h.data_port}

    def _read_health(self, retry: Retry | None) -> pb.HealthResponse:
        """Health, remembered as the node's limits, data port and token."""
        self._check_open()
        h = call_grpc(lambda: self._stub.Health(pb.HealthRequest(), timeout=self.timeout_s), retry)
        self._limits = h
        return h

    def _data_channel(self, retry: bool = True) -> _Connections | None:
        """The node's data channel (None: it has none, or ``data_channel=False``).

        Opened from the node's last Health; ``_drop_data_channel`` forgets both, so the
        next use asks the node again (a restarted node listens on a new port, with a new token).
        """
        if not self._want_dc:
            return None
        with self._dc_lock:
            if self._dc is None:
                h = self._limits if self._limits is not None else self._read_health(self.retry if retry else None)
                if not h.data_port:
                    self._want_dc = False
                    return None
                self._dc = _Connections(self._host, h.data_port, h.data_token, ops=h.data_ops, timeout_s=self.timeout_s)
            return self._dc

    def _drop_data_channel(self, stale: _Connections) -> None:
        with self._dc_lock:
            if self._dc is not stale:
                return  # another thread dropped it first (and maybe reconnected)
            self._dc = None
            self._limits = None
        stale.close()

    @property
    def _host(self) -> str:
        """The node's host (its data channel listens there too)."""
        return self.address.rpartition(":")[0].strip("[]")

    def _control_channel(self) -> _Connections | None:
        """Fresh connections to the node's data channel for a descriptor session's grant
        calls (None: the node has none, or ``data_channel=False``: they go over gRPC)."""
        if not self._want_dc:
            return None
        h = self._read_health(self.retry)  # re-read: a restarted node listens on a new data port
        if not h.data_port:
            return None
        return _Connections(self._host, h.data_port, h.data_token, timeout_s=self.timeout_s)

    def _dc_call(self, fn: Callable, fallback: Callable[[], T], ops: int = 0) -> T:
        """Runs fn(conn) on this thread's data connection, or ``fallback()`` when the node
        has no data channel (or its ``data_ops`` are below ``ops``).

        A connection that broke is reopened at once (same port). One that cannot be
        opened, or breaks again, means the node went away: the channel is dropped and
        the call retried under the client's ``Retry``, each attempt re-reading the
        node's data port and token (Health) first, so a client follows a restarted node.
        """
        self._check_open()

        def once():
            self._check_open()  # (closed by another thread since the last attempt: no more)
            dc = self._data_channel(retry=False)  # this loop retries
            if dc is None or dc.ops < ops:
                return _NO_CHANNEL
            try:
                try:
                    return fn(dc.get())
                except DataLossError:
                    return fn(dc.get())  # the failed connection closed itself; get() reconnects
            except (DataLossError, UnavailableError, OSError) as exc:
                if self._closed:  # close() on another thread ended this call's exchange
                    raise FailedPreconditionError(f"the client of {self.address} was closed during the call") from exc
                self._drop_data_channel(dc)
                raise UnavailableError(f"data channel of {self.address}: {exc}") from exc

        out = self.retry.call(once)
        return fallback() if out is _NO_CHANNEL else out

    def descriptor_session(self):
        """The shm/rdma ``DescriptorSession`` with this node, or None (resolved once, on first use).

        Its step-wise calls (acquire/read/release, reserve/write/commit/abort)
        are for callers that drive the descriptor protocol themselves.
        """
        self._check_open()
        if self._selection is None:
            from kvstore.transport.session import select

            with self._selecting:  # (threads that each selected mapped the arena once apiece, for good)
                if self._selection is None:
                    sel = select(self._stub, self._call, self.timeout_s, self._transport_req,
                                 self._control_channel)
                    if sel.session is None and self._transport_req in ("shm", "rdma"):
                        log.warning("transport %s to %s unavailable, falling back: %s",
                                    self._transport_req, self.address, sel.notes)
                    if sel.session is not None:
                        sel.session.local_reads = self._local_reads
                    self._selection = sel
                    if self._closed and sel.session is not None:  # close() ran meanwhile and missed it
                        sel.session.close()
                        self._check_open()
        return self._selection.session

    @property
    def transport(self) -> str:
        """The mover in use with this node: ``shm``, ``rdma``, ``tcp`` or ``grpc``."""
        session = self.descriptor_session()
        if session is not None:
            return session.mover.value
        return "tcp" if self._data_channel() is not None else "grpc"

    @property
    def transport_notes(self) -> str:
        """Why faster movers are not in use (empty when nothing was left out)."""
        self.descriptor_session()
        return self._selection.notes

    # ---- values ---------------------------------------------------------------

    def put(self, key: bytes, value: Value) -> None:
        """Stores one value (replacing any under the same key).

        Raises:
            InvalidArgumentError: bad key or value size.
            ResourceExhaustedError: the node has no room (everything leased or pinned, or full).
        """
        if not self.batch_put([(key, value)], _raise=True)[0]:
            raise ResourceExhaustedError(f"no room for key {bytes(key).hex()}")

    def batch_put(self, items: Sequence[tuple[bytes, Value]], _raise: bool = False) -> list[bool]:
        """Stores several values; returns, per item, whether it was stored (False: no room).

        Raises:
            InvalidArgumentError: a bad key or value size (nothing is sent).
        """
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
            raise InvalidArgumentError("batch_put takes a list of (key, value) pairs")
        keys = _check_keys([k for k, _ in items])
        values = [_parts(v) for _, v in items]
        limit = (self._limits or self._read_health(self.retry)).max_value_bytes
        for k, parts in zip(keys, values):
            size = sum(_nbytes(p) for p in parts)
            if size > limit:
                raise InvalidArgumentError(f"value of {size} bytes for key {k.hex()} exceeds the limit of {limit}")
        if not keys:
            return []
        session = self.descriptor_session()
        if session is None:
            return self._streamed_put(keys, values, _raise)
        stored, other = session.put(keys, values)
        if other:  # no arena room now, or the reservation expired: the streamed path may use disk
            for i, ok in zip(other, self._streamed_put([keys[i] for i in other], [values[i] for i in other],
                                                       _raise)):
                stored[i] = ok
        return stored

    def _streamed_put(self, keys: list[bytes], values: list[list], _raise: bool) -> list[bool]:
        values = [_host_parts(parts) for parts in values]
        reply = self._dc_call(lambda c: c.put(keys, values), lambda: None)
        if reply is None:
            return self._grpc_put(keys, values, _raise)
        results, msg = reply
        out = []
        for status, _ in results:
            if status is Status.INVALID:
                raise InvalidArgumentError(msg)
            if status is Status.EXHAUSTED and _raise:
                raise ResourceExhaustedError(msg)
            out.append(status is Status.OK)
        return out

    def _grpc_put(self, keys, values, _raise) -> list[bool]:
        def frames():
            for k, parts in zip(keys, values):
                yield pb.PutFrame(header=pb.ValueHeader(key=k, size=sum(p.nbytes for p in parts)))
                for p in parts:
                    for off in range(0, p.nbytes, FRAME_BYTES):
                        yield pb.PutFrame(data=bytes(p[off : off + FRAME_BYTES]))

        try:
            self._call(lambda: self._stub.Put(frames(), timeout=self.timeout_s))
            return [True] * len(keys)
        except ResourceExhaustedError:
            if _raise or len(keys) == 1:
                if _raise:
                    raise
                return [False]
            # NOTE: a gRPC batch is all or nothing; retry value by value to store what fits.
            return [self._grpc_put([k], [v], False)[0] for k, v in zip(keys, values)]

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None on a miss."""
        return self.batch_get_bytes([key])[0]

    def batch_get(self, keys: Sequence[bytes], alloc: Callable[[int, int], Buffer] = new_buffer
                  ) -> list[Buffer | None]:
        """Values (None for misses), one per key, in order: each read into ``alloc(index, size)``,
        a writable buffer of exactly ``size`` bytes (by default a new bytearray; pass your own to
        read into pinned memory or a subclass). It may be called again for a value read again."""
        keys = _check_keys(keys)
        if not keys:
            return []
        session = self.descriptor_session()
        if session is None:
            return self._streamed_get(keys, alloc)
        out: list[Buffer | None] = [None] * len(keys)

        def dst_for(i: int, size: int) -> Buffer:
            out[i] = alloc(i, size)
            return out[i]

        sizes, elsewhere = session.get_into(keys, dst_for)
        result = [out[i] if s is not None else None for i, s in enumerate(sizes)]
        if elsewhere:
            for i, v in zip(elsewhere, self._streamed_get([keys[i] for i in elsewhere],
                                                          lambda j, size: alloc(elsewhere[j], size))):
                result[i] = v
        return result

    def batch_get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``batch_get`` as ``bytes`` (None for misses), with one allocation per value: the
        values are read into a buffer the client keeps (ReadSlabs) and copied out."""
        slab = self._slabs.take()
        try:
            return [bytes(v) if v is not None else None for v in self.batch_get(keys, slab.alloc)]
        finally:
            self._slabs.give(slab)

    def _streamed_get(self, keys: list[bytes], alloc: Callable[[int, int], Buffer] = new_buffer
                      ) -> list[Buffer | None]:
        return self._dc_call(lambda c: c.get(keys, alloc), lambda: self._call(lambda: self._grpc_get(keys, alloc)))

    def _grpc_get(self, keys, alloc: Callable[[int, int], Buffer] = new_buffer) -> list[Buffer | None]:
        out: list[Buffer | None] = [None] * len(keys)
        cur: memoryview | None = None
        for frame in self._stub.Get(pb.GetRequest(keys=keys), timeout=self.timeout_s):
            if frame.WhichOneof("frame") == "header":
                if cur is not None and cur.nbytes:
                    raise DataLossError("a value arrived truncated")
                if frame.header.found:
                    buf = out[frame.header.index] = alloc(frame.header.index, frame.header.size)
                    cur = memoryview(buf)
                else:
                    cur = None
            else:
                data = frame.data  # (each access of a bytes field makes a new copy of it)
                if cur is None or len(data) > cur.nbytes:
                    raise DataLossError("more value bytes than announced")
                cur[: len(data)] = data
                cur = cur[len(data):]
        if cur is not None and cur.nbytes:
            raise DataLossError("a value arrived truncated")
        return out

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[int | None]:
        """Reads values straight into caller-owned buffers.

        Args:
            keys: keys to read.
            buffers: one writable buffer per key (bytearray, writable memoryview or
                contiguous CPU tensor), each at least as large as its value.

        Returns:
            Per key, the value's size (bytes written at the buffer's start), or None on
            a miss (the buffer's contents are then unspecified: a same-host read may
            have copied into it before learning that the key is gone).

        Raises:
            InvalidArgumentError: a value is larger than its buffer.
        """
        keys = _check_keys(keys)
        if not isinstance(buffers, (list, tuple)):
            raise InvalidArgumentError(f"buffers must be a list, one per key, got {type(buffers).__name__}")
        views = [b if is_cuda(b) else as_bytes_view(b) for b in buffers]
        if len(views) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(views)} buffers")
        if any(not is_cuda(v) and v.readonly for v in views):
            raise InvalidArgumentError("batch_get_into needs writable buffers")
        if not keys:
            return []
        session = self.descriptor_session()
        if session is None:
            return self._streamed_get_into(keys, views)
        sizes, elsewhere = session.get_into(keys, lambda i, size: views[i])
        if elsewhere:
            for i, s in zip(elsewhere, self._streamed_get_into([keys[i] for i in elsewhere],
                                                               [views[i] for i in elsewhere])):
                sizes[i] = s
        return sizes

    def batch_get_layered(self, keys: Sequence[bytes], head: int, layer: int,
                          on_sizes: Callable[[list[int | None]], None],
                          dest: Callable[[int, int], memoryview], arrived: Callable[[int, int], None]) -> bool:
        """Reads values of ``head`` bytes and then layers of ``layer`` bytes (KV chunks)
        layer-major, for a load that lands layer ``l`` while later layers are on the wire:
        ``on_sizes`` gets each value's size (None: a miss, or not of that layout) before any
        bytes; then every present value's head lands in ``dest(value, -1)``, then layer 0 of
        each in ``dest(value, 0)``, layer 1, …, ``arrived(value, part)`` called as each part is
        complete (datachannel ``GET_LAYERED``: one request, one lease of each value on the node).

        Returns False, having called nothing, when the node has no data channel (read another
        way). Raises UnavailableError when the node cannot be reached or the stream breaks
        (some parts may have arrived: the caller treats the rest as missing); a callback's
        exception propagates. Not retried once bytes have arrived.
        """
        keys = _check_keys(keys)
        dc = self._data_channel()
        if dc is None:
            return False
        started = False

        def sizes(items):
            nonlocal started
            started = True
            on_sizes([size if status is Status.OK else None for status, size in items])

        for attempt in (0, 1):
            try:
                dc.get().get_layered(keys, head, layer, sizes, dest, arrived)
                return True
            except DataLossError as exc:
                if attempt == 0 and not started:  # a pooled connection the node had closed: once more
                    continue
                failure = exc
            except (UnavailableError, OSError) as exc:
                failure = exc
            if self._closed:
                raise FailedPreconditionError(f"the client of {self.address} was closed during the call") from failure
            self._drop_data_channel(dc)
            raise UnavailableError(f"data channel of {self.address}: {failure}") from failure

    def _streamed_get_into(self, keys: list[bytes], views: list) -> list[int | None]:
        if any(is_cuda(v) for v in views):  # through host memory, then one copy to the device
            vals = self._streamed_get(keys)
            sizes: list[int | None] = []
            for k, v, dst in zip(keys, vals, views):
                cap = _nbytes(dst)
                if v is not None and len(v) > cap:
                    raise InvalidArgumentError(f"value of key {k.hex()} ({len(v)} bytes) exceeds its buffer of {cap}")
                if v is not None:
                    if is_cuda(dst):
                        host_to_cuda(dst, memoryview(v))
                    else:
                        dst[: len(v)] = v
                sizes.append(len(v) if v is not None else None)
            return sizes
        items = self._dc_call(lambda c: c.get_into(keys, views), lambda: None)
        if items is None:  # no data channel: gRPC frames, then a copy into each buffer
            vals = self._streamed_get(keys)
            sizes = []
            for k, v, buf in zip(keys, vals, views):
                if v is not None and len(v) > buf.nbytes:
                    raise InvalidArgumentError(f"value of key {k.hex()} ({len(v)} bytes) exceeds its buffer")
                if v is not None:
                    buf[: len(v)] = v
                sizes.append(len(v) if v is not None else None)
            return sizes
        out: list[int | None] = []
        for k, (status, size), buf in zip(keys, items, views):
            if status is Status.TOO_LARGE:
                raise InvalidArgumentError(f"value of key {k.hex()} ({size} bytes) exceeds its buffer of {buf.nbytes}")
            out.append(size if status is Status.OK else None)
        return out

    # ---- metadata -------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present on the node (the hit prefix)."""
        return self.lookup_tiers(keys)[0]

    def lookup_tiers(self, keys: Sequence[bytes]) -> tuple[int, list[Tier]]:
        """The hit prefix's length and the tier of each of its keys."""
        keys = _check_keys(keys)
        if not keys:
            return 0, []

        def grpc() -> tuple[int, list[Tier]]:
            r = self._call(lambda: self._stub.Lookup(pb.KeysRequest(keys=keys), timeout=self.timeout_s))
            return r.num_prefix, [Tier(t) for t in r.tiers]

        def channel(c) -> tuple[int, list[Tier]]:
            items = c.query(Op.LOOKUP, keys)
            tiers = [Tier(t) for _, t in itertools.takewhile(lambda it: it[0] is Status.OK, items)]
            return len(tiers), tiers

        # (on the data channel when the node answers it there: a round trip of ~0.1 ms against
        # ~0.6 ms for a Python gRPC call)
        return self._dc_call(channel, grpc, ops=_QUERY_OPS)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        keys = _check_keys(keys)
        if not keys:
            return []

        def grpc() -> list[bool]:
            r = self._call(lambda: self._stub.Exists(pb.KeysRequest(keys=keys), timeout=self.timeout_s))
            return list(r.present)

        def channel(c) -> list[bool]:
            return [status is Status.OK for status, _ in c.query(Op.EXISTS, keys)]

        return self._dc_call(channel, grpc, ops=_QUERY_OPS)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Removes keys; returns how many were present."""
        keys = _check_keys(keys)
        r = self._call(lambda: self._stub.Delete(pb.KeysRequest(keys=keys), timeout=self.timeout_s))
        return r.num_deleted

    def clear(self) -> int:
        """Removes every value the node holds; returns how many it held."""
        r = self._call(lambda: self._stub.Clear(pb.ClearRequest(), timeout=self.timeout_s))
        return r.num_deleted

    def pin(self, keys: Sequence[bytes], ttl_s: float = 600.0) -> int:
        """Protects keys from eviction for ``ttl_s`` seconds; returns keys found."""
        keys = _check_keys(keys)
        if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool):
            raise InvalidArgumentError(f"ttl_s must be seconds, got {ttl_s!r}")
        r = self._call(lambda: self._stub.Pin(pb.PinRequest(keys=keys, ttl_s=ttl_s), timeout=self.timeout_s))
        return r.num_pinned

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self.pin(keys, 0.0)

    def stats(self) -> dict:
        """The node's counters, with every read this thread made through this client counted
        (one-sided releases and local-read reports, sent without waiting, are settled first)."""
        if self._selection is not None and self._selection.session is not None:
            self._selection.session.settle()
        r = self._call(lambda: self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s))
        return {"node_id": r.node_id, "transport": self.transport, "node_transport": r.transport,
                "movers": {pb.Mover.Name(m.mover).removeprefix("MOVER_").lower():
                           {"num_reads": m.num_reads, "num_writes": m.num_writes,
                            "bytes_read": m.bytes_read, "bytes_written": m.bytes_written}
                           for m in r.movers},
                "num_remote_leases": r.num_remote_leases,
                "num_remote_reservations": r.num_remote_reservations,
                "num_expired_leases": r.num_expired_leases,
                "num_expired_reservations": r.num_expired_reservations,
                "misses": r.misses, "demotions": r.demotions,
                "promotions": r.promotions, "drops": r.drops, "num_leases": r.num_leases,
                "num_pinned": r.num_pinned,
                "tiers": {Tier(t.tier).name.lower(): {"capacity_bytes": t.capacity_bytes,
                                                      "used_bytes": t.used_bytes,
                                                      "num_entries": t.num_entries, "hits": t.hits,
                                                      "evictions": t.evictions} for t in r.tiers}}

    def close(self) -> None:
        """Ends the client (a call under way on another thread finishes or fails cleanly; later
        calls raise FailedPreconditionError). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._selection is not None and self._selection.session is not None:
            self._selection.session.close()
        if self._dc is not None:
            self._dc.close()
        self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


from kvstore.cluster import ClusterClient  # noqa: E402  (at the end: kvstore.cluster imports this module lazily)

__all__ = ["StoreClient", "ClusterClient", "Retry", "CrescentError"]
