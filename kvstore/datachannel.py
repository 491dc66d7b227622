"""The bulk data channel: raw TCP for value bytes, gRPC for everything else.

Python gRPC tops out near 0.9 GB/s for MiB-sized messages (every frame is
copied into and out of protobuf objects). This channel moves value bytes
between the node's DRAM arena and the caller's own buffers with one
``sendmsg`` from the arena slots on the node and ``recv_into`` the destination
buffer on the client: no intermediate copy on either side.

A client learns the port and a session token from ``KVStore.Health`` (per node, and
under auth per namespace: the session works in the caller's key space) and
opens a TCP connection that starts with ``b"CRDC" + token`` (within ``HELLO_TIMEOUT_S`` of
connecting, kvstore/dataserver.py, or the node closes it). Then, any number
of requests, each answered before the next (all integers little-endian)::

    request   "CRRQ" u8 op u8 mover u16 0 u32 n u32 body_len
              body: n × (u16 key_len, key, i64 arg)
              PUT only: the n values' bytes, back to back
    response  "CRRS" u32 n u32 tail_len
              tail: n × (u8 status, u64 size)
                    u16 msg_len, msg (UTF-8; why the first failed key failed)
                    ACQUIRE/RESERVE only: the grant (below)
              GET only: the bytes of every OK value, back to back
              GET_LAYERED only: the same bytes, layer-major (below)

    op    arg per key              mover        size per item
    GET      capacity (-1 any)     0            value size
    GET_LAYERED  head << 40 | layer   0        value size (the first key's arg: one layout)
    PUT      value size            0            value size
    ACQUIRE  0                     shm or rdma  value size (a read lease)
    RESERVE  value size            shm or rdma  value size (a write reservation)
    RELEASE  lease id (key empty; any number)   bytes released
    COMMIT   lease id (one key, empty)          bytes stored
    ABORT    lease id (one key, empty)          values aborted
    PROVE    0 (one key: the shm proof)         0
    LOOKUP   0                     0            the tier (OK for each key of the hit prefix,
                                                NOT_FOUND from the first key absent on)
    EXISTS   0                     0            0 (OK: present, NOT_FOUND: absent)

    grant     u64 lease_id  f64 ttl_s  u16 arena_len  u32 num_slots  arena
              u32 slot_count[n]  u32 slots[num_slots]  u64 generations[num_slots]

GET_LAYERED sends a value of ``head`` bytes followed by ``L`` layers of ``layer``
bytes each (a KV chunk: its header, then ``[L, 2, KVH, T, D]``) in the order a
layer-by-layer load consumes it: every OK value's head, then layer 0 of every
one, then layer 1, … (a value of fewer layers simply ends sooner). A reader can
land layer 0 while layer 1 is on the wire, from one request and one lease of
each value. A value whose size is not ``head + L × layer`` is INVALID (no bytes).

The descriptor ops (ACQUIRE .. ABORT) are the control half of the shm and rdma
movers (kvstore/transport/): the same grants as the ``KVStore`` RPCs of the
same names, without gRPC's per-call cost (a round trip here costs a few tens
of microseconds; a Python gRPC call, about a millisecond).

LOOKUP and EXISTS answer as the ``KVStore`` RPCs of the same names (a key that is not
valid makes the whole batch INVALID, with the message); a node offers them when its
Health says ``data_ops`` >= 1 (``DATA_OPS``).

A connection takes shm ACQUIRE/RESERVE only after a PROVE whose key is the
node's ``shm_proof``: an HMAC of the secret at the end of its arena file, which
only a process that can open that file (0600, the node's user) reads. A wrong
proof is FAILED_PRECONDITION. A malformed request closes the connection; nothing of a PUT whose bytes did
not all arrive becomes visible (its reservations are aborted).
"""

from __future__ import annotations

import enum
import socket
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from itertools import chain

from kvstore import tls
from kvstore.config import MAX_KEY_BYTES
from kvstore.errors import (CrescentError, DataLossError, FailedPreconditionError, InvalidArgumentError,
                             UnavailableError)
from kvstore.liveness import connect, tune_socket

HELLO = b"CRDC"
TOKEN_BYTES = 16
_REQ = struct.Struct("<4sBBHII")
_RES = struct.Struct("<4sII")
_ITEM = struct.Struct("<BQ")
_KEYLEN = struct.Struct("<H")
_KEY_ARG = struct.Struct("<Hq")  # a zero-length key and its arg
_ARG = struct.Struct("<q")
_GRANT = struct.Struct("<QdHI")
MAX_BATCH = 1 << 16
MAX_BODY = MAX_BATCH * (2 + MAX_KEY_BYTES + 8)
MAX_TAIL = 1 << 30  # a sanity bound: a grant lists at most every slot of the arena
_IOV_MAX = 512
_SOCK_BUF = 4 << 20
CLOSE_WAIT_S = 5.0  # how long close() waits for the answers of deferred releases


class Op(enum.IntEnum):
    GET = 1
    PUT = 2
    ACQUIRE = 3
    RELEASE = 4
    RESERVE = 5
    COMMIT = 6
    ABORT = 7
    REPORT = 8  # reads a same-host client made with no call (values, bytes, batches): the node counts them
    PROVE = 9  # one key: the shm proof (kvstore/arena.py, ``shm_proof``); shm grants need it first
    GET_LAYERED = 10  # a GET whose bytes come layer-major (below)
    LOOKUP = 11  # the hit prefix and its tiers, as the KVStore.Lookup RPC (no bytes)
    EXISTS = 12  # per key present or not, as the KVStore.Exists RPC


DATA_OPS = 1
"""What ``HealthResponse.data_ops`` says of a node of this version: 1, LOOKUP and EXISTS answered."""


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    TOO_LARGE = 2  # GET: the value does not fit the caller's buffer
    INVALID = 3
    EXHAUSTED = 4
    ELSEWHERE = 5  # ACQUIRE: present outside the DRAM arena
    FAILED_PRECONDITION = 6  # a lease or reservation expired or unknown; a mover not offered


class ProtocolError(CrescentError):
    """The peer broke the data-channel protocol or the connection."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``; raises ProtocolError if the peer closes first."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ProtocolError("connection closed mid-message")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """Gather-writes every view in order (``sendmsg``, resuming after partial sends; under TLS, the
    stream encrypts them and sends the records a MiB at a time)."""
    if isinstance(sock, tls.TlsStream):
        sock.send_views(views)
        return
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    at = 0  # (an index, not a shorter list per call: a list of many views cost its square)
    while at < len(pending):
        sent = sock.sendmsg(pending[at : at + _IOV_MAX])
        while sent and sent >= pending[at].nbytes:
            sent -= pending[at].nbytes
            at += 1
        if sent:
            pending[at] = pending[at][sent:]


def tune(sock: socket.socket) -> None:
    """Both ends: no Nagle delay, big buffers, and probes that notice a dead peer (kvstore/liveness.py)."""
    tune_socket(sock)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


LAYER_BITS = 40


def layered_arg(head: int, layer: int) -> int:
    """GET_LAYERED's per-key arg: ``head`` bytes, then layers of ``layer`` bytes."""
    if not (0 <= head < 1 << (63 - LAYER_BITS) and 0 < layer < 1 << LAYER_BITS):
        raise ValueError(f"a layered read of head {head} and layers of {layer} bytes is out of range")
    return head << LAYER_BITS | layer


MAX_LAYERS = 1024
"""Layers of one value in a GET_LAYERED read, at most (a model has a few hundred at the most: the
node does work and holds memory per part, so 1-byte layers of a large value would cost it far
more than the value)."""


def split_layered_arg(arg: int) -> tuple[int, int]:
    return arg >> LAYER_BITS, arg & ((1 << LAYER_BITS) - 1)


def layered_parts(sizes: Sequence[int | None], head: int, layer: int) -> list[tuple[int, int, int, int]]:
    """The order GET_LAYERED sends the values of ``sizes`` (None: not sent) in: ``(value, part,
    offset, length)``, part -1 the head, then ``l`` for layer ``l`` (the same list on both ends)."""
    sent = [(j, (n - head) // layer) for j, n in enumerate(sizes) if n is not None]
    out = [(j, -1, 0, head) for j, _ in sent] if head else []
    for l in range(max((n for _, n in sent), default=0)):
        out += [(j, l, head + l * layer, layer) for j, n in sent if l < n]
    return out


def encode_request(op: Op, keys: Sequence[bytes], args: Sequence[int], mover: int = 0) -> bytes:
    parts = []
    for k, a in zip(keys, args, strict=True):
        parts += [_KEYLEN.pack(len(k)), bytes(k), _ARG.pack(a)]
    body = b"".join(parts)
    return _REQ.pack(b"CRRQ", op, mover, 0, len(keys), len(body)) + body


def encode_response(items: Sequence[tuple[Status, int]], msg: str = "", grant: bytes = b"") -> bytes:
    m = msg.encode()[:4096]
    tail = b"".join([*(_ITEM.pack(s, n) for s, n in items), _KEYLEN.pack(len(m)), m, grant])
    return _RES.pack(b"CRRS", len(items), len(tail)) + tail


def read_request(sock: socket.socket, stall_s: float) -> tuple[Op, list[bytes], list[int], int] | None:
    """Reads one request header and body: ``(op, keys, args, mover)``; None when the
    peer closed cleanly between requests. The wait for the request's first byte keeps the
    socket's timeout; from that byte on it is ``stall_s``."""
    first = sock.recv(_REQ.size)
    sock.settimeout(stall_s)
    if not first:
        return None
    if len(first) < _REQ.size:
        first += recv_exact(sock, _REQ.size - len(first))
    magic, op, mover, _, n, body_len = _REQ.unpack(first)
    if magic != b"CRRQ" or op not in _OPS:
        raise ProtocolError("bad request magic or op")
    if n > MAX_BATCH:
        raise ProtocolError(f"batch of {n} keys exceeds {MAX_BATCH}")
    if body_len > MAX_BODY:
        raise ProtocolError(f"request body of {body_len} bytes is too large")
    body = recv_exact(sock, body_len)
    keys, args, pos = [], [], 0
    try:
        for _ in range(n):
            (klen,) = _KEYLEN.unpack_from(body, pos)
            if klen > MAX_KEY_BYTES:
                raise ProtocolError(f"key of {klen} bytes exceeds {MAX_KEY_BYTES}")
            keys.append(body[pos + 2 : pos + 2 + klen])
            (arg,) = _ARG.unpack_from(body, pos + 2 + klen)
            args.append(arg)
            pos += 10 + klen
    except struct.error:
        raise ProtocolError("request body shorter than its keys") from None
    if pos != body_len:
        raise ProtocolError("request body longer than its keys")
    return Op(op), keys, args, mover


_OPS = frozenset(int(o) for o in Op)


def read_response(sock: socket.socket) -> tuple[list[tuple[Status, int]], str]:
    """Reads a response's items and message (a grant, if any, is ``read_grant_response``'s)."""
    items, msg, _ = read_grant_response(sock)
    return items, msg


def read_grant_response(sock: socket.socket) -> tuple[list[tuple[Status, int]], str, memoryview]:
    """Reads a response: its items, its message, and what follows them in the tail (a grant)."""
    magic, n, tail_len = _RES.unpack(recv_exact(sock, _RES.size))
    if magic != b"CRRS":
        raise ProtocolError("bad response magic")
    if tail_len > MAX_TAIL or tail_len < n * _ITEM.size + 2:
        raise ProtocolError("bad response length")
    tail = memoryview(recv_exact(sock, tail_len))
    try:
        items = [(Status(s), size) for s, size in _ITEM.iter_unpack(tail[: n * _ITEM.size])]
    except ValueError:
        raise ProtocolError("unknown item status") from None
    pos = n * _ITEM.size
    (mlen,) = _KEYLEN.unpack_from(tail, pos)
    msg = bytes(tail[pos + 2 : pos + 2 + mlen]).decode(errors="replace")
    return items, msg, tail[pos + 2 + mlen :]


def encode_grant(lease_id: int, ttl_s: float, arena: str, slots: Sequence[Sequence[int]],
                 generations: Sequence[Sequence[int]]) -> bytes:
    """The grant part of an ACQUIRE/RESERVE response: ``slots[i]`` are item i's (empty unless OK)."""
    name = arena.encode()
    counts = array("I", map(len, slots))
    flat_slots = array("I", chain.from_iterable(slots))
    flat_gens = array("Q", chain.from_iterable(generations))
    if sys.byteorder != "little":
        for a in (flat_slots, flat_gens, counts):
            a.byteswap()
    return b"".join([_GRANT.pack(lease_id, ttl_s, len(name), len(flat_slots)), name,
                     counts.tobytes(), flat_slots.tobytes(), flat_gens.tobytes()])


def decode_grant(blob: memoryview, n: int) -> tuple[int, float, str, list[list[int]], list[list[int]]]:
    """``(lease_id, ttl_s, arena, slots per item, generations per item)`` of a grant."""
    try:
        lease_id, ttl_s, alen, total = _GRANT.unpack_from(blob, 0)
        pos = _GRANT.size
        arena = bytes(blob[pos : pos + alen]).decode()
        pos += alen
        counts, flat, gens = array("I"), array("I"), array("Q")
        counts.frombytes(blob[pos : pos + 4 * n])
        pos += 4 * n
        flat.frombytes(blob[pos : pos + 4 * total])
        pos += 4 * total
        gens.frombytes(blob[pos : pos + 8 * total])
    except (struct.error, UnicodeDecodeError, ValueError):
        raise ProtocolError("malformed grant") from None
    if sys.byteorder != "little":
        for a in (counts, flat, gens):
            a.byteswap()
    if len(counts) != n or len(flat) != total or len(gens) != total or sum(counts) != total:
        raise ProtocolError("malformed grant")
    slots, generations, at = [], [], 0
    flat_l, gens_l = flat.tolist(), gens.tolist()
    for c in counts:
        slots.append(flat_l[at : at + c])
        generations.append(gens_l[at : at + c])
        at += c
    return lease_id, ttl_s, arena, slots, generations


def new_buffer(index: int, size: int) -> bytearray:
    """The default destination of a value read: a new bytearray of its size."""
    return bytearray(size)


class DataChannelClient:
    """One connection to a node's data channel. Its calls are for one thread at a time (use one
    connection per thread); ``close`` may come from any thread.

    ``end_later`` sends a RELEASE/ABORT without waiting for its answer; the node
    answers in order, so the answers are read (and checked) just before the
    next request's own answer, never on the caller's critical path.
    """

    def __init__(self, host: str, port: int, token: bytes, timeout_s: float = 60.0, proof: bytes = b"") -> None:
        sock = None
        try:
            sock = connect(host, port, timeout_s)
            tune(sock)
            ctx = tls.client_context()
            if ctx is not None:
                sock = tls.TlsStream(sock, ctx, server_hostname=host)
            # (a node that dies as it accepts resets the hello: unreachable too, never a raw OSError)
            sock.sendall(HELLO + token)
        except OSError as exc:  # ssl.SSLError included: a failed handshake
            if sock is not None:
                sock.close()
            raise UnavailableError(f"data channel {host}:{port} unreachable: {exc}") from exc
        self.sock = sock
        self._deferred: list[tuple[int, Callable | None]] = []
        self._busy = threading.RLock()  # held through each exchange, and by close
        if proof:  # its answer is read before the next request's, off the critical path
            with self._guard():
                self.sock.sendall(encode_request(Op.PROVE, [proof], [0]))
            self._deferred.append((1, _proved))

    def close(self, deadline: float | None = None) -> None:
        """Closes the connection once the node has answered every deferred release,
        so a closed client holds no lease and its ``on_answer`` checks have run. It waits for
        them until ``deadline`` (``time.monotonic()``; default ``CLOSE_WAIT_S`` from now).

        From another thread, while a call is under way on this connection: the socket is shut down
        first, so that call's wait for the node ends at once (it fails as DataLossError), and the
        descriptor is closed once the call has let go of it. (Closing it under a blocked recv would
        not wake the recv, and the number could be reused by a new connection that recv then reads.)
        """
        if deadline is None:
            deadline = time.monotonic() + CLOSE_WAIT_S
        if not self._busy.acquire(blocking=False):
            with suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            if not self._busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return  # the call is in a caller's callback: it closes the connection as it fails
        try:
            if self._deferred and self.sock.fileno() >= 0:
                try:
                    self.sock.settimeout(max(0.0, deadline - time.monotonic()))  # (0: only what has come)
                    self._read_deferred()
                except (OSError, ProtocolError):
                    pass  # the node ends the leases by their deadline anyway
            self._deferred.clear()
            self.sock.close()
        finally:
            self._busy.release()

    @contextmanager
    def _guard(self):
        """One exchange, under the connection's lock. A connection that breaks mid-exchange closes
        itself and surfaces as DataLossError."""
        with self._busy:
            try:
                yield
            except (OSError, ProtocolError) as exc:
                self._deferred.clear()  # the stream is out of step: nothing more to read
                self.close()
                raise DataLossError(f"data channel broke: {exc}") from exc

    def _answer(self, n: int) -> tuple[list[tuple[Status, int]], str, memoryview]:
        """The next answer (after those of earlier ``end_later`` requests), of ``n`` items."""
        self._read_deferred()
        items, msg, tail = read_grant_response(self.sock)
        if len(items) != n:
            raise ProtocolError("response does not match the request")
        return items, msg, tail

    def end_later(self, op: Op, lease_ids: Sequence[int],
                  on_answer: Callable[[list[tuple[Status, int]], str], None] | None = None) -> None:
        """Sends RELEASE (any number of grants), ABORT (one) or REPORT (its three
        counts) without waiting; the answer goes to ``on_answer(items, message)`` once read."""
        with self._guard():
            self.sock.sendall(_end_request(op, lease_ids))
        self._deferred.append((len(lease_ids), on_answer))

    def settle(self) -> None:
        """Waits for the answers of earlier ``end_later`` requests: once it returns, the node has
        done every release and report this connection sent."""
        with self._guard():
            self._read_deferred()

    def _read_deferred(self) -> None:
        """Reads the answers of earlier ``end_later`` requests (they precede any other)."""
        while self._deferred:
            n, on_answer = self._deferred.pop(0)
            items, msg = read_response(self.sock)
            if len(items) != n:
                raise ProtocolError("response does not match the request")
            if on_answer is not None:
                on_answer(items, msg)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[tuple[Status, int]]:
        """Reads values straight into ``buffers`` (one per key, each at least the value's size)."""
        with self._guard():
            self.sock.sendall(encode_request(Op.GET, keys, [b.nbytes for b in buffers]))
            items, _, _ = self._answer(len(keys))
            for (status, size), buf in zip(items, buffers):
                if status is Status.OK:
                    if size > buf.nbytes:
                        raise ProtocolError("node sent more bytes than the buffer holds")
                    recv_exact_into(self.sock, buf[:size])
            return items

    def get_layered(self, keys: Sequence[bytes], head: int, layer: int,
                    on_items: Callable[[list[tuple[Status, int]]], None],
                    dest: Callable[[int, int], memoryview], arrived: Callable[[int, int], None]
                    ) -> list[tuple[Status, int]]:
        """GET_LAYERED: ``on_items(items)`` once the statuses are read (before any bytes); then
        each OK value's parts land in ``dest(value, part)`` (part -1: its head, else its layer
        ``part``; a view of exactly that many bytes) in the node's order, ``arrived(value,
        part)`` called as each is complete. A connection that breaks mid-stream, or a callback
        that raises, closes the connection (the stream is out of step): the first as
        DataLossError, the second as itself."""
        with self._guard():
            self.sock.sendall(encode_request(Op.GET_LAYERED, keys, [layered_arg(head, layer)] * len(keys)))
            items, _, _ = self._answer(len(keys))
            try:
                on_items(items)
                sizes = [size if status is Status.OK else None for status, size in items]
                for j, part, _, n in layered_parts(sizes, head, layer):
                    view = dest(j, part)
                    if view.nbytes != n:
                        raise ValueError(f"dest({j}, {part}) gave {view.nbytes} bytes for a part of {n}")
                    recv_exact_into(self.sock, view)
                    arrived(j, part)
            except (OSError, ProtocolError):
                raise
            except BaseException:
                self._deferred.clear()
                self.close()
                raise
            return items

    def get(self, keys: Sequence[bytes], alloc: Callable[[int, int], object] = new_buffer
            ) -> list[bytearray | memoryview | None]:
        """The values (None: a miss), each read into ``alloc(index, size)`` (a writable buffer of
        ``size`` bytes; default a new bytearray)."""
        with self._guard():
            self.sock.sendall(encode_request(Op.GET, keys, [-1] * len(keys)))
            items, _, _ = self._answer(len(keys))
            out: list[bytearray | memoryview | None] = []
            for i, (status, size) in enumerate(items):
                if status is Status.OK:
                    buf = alloc(i, size)
                    recv_exact_into(self.sock, memoryview(buf))
                    out.append(buf)
                else:
                    out.append(None)
            return out

    def query(self, op: Op, keys: Sequence[bytes]) -> list[tuple[Status, int]]:
        """LOOKUP or EXISTS: the items (InvalidArgumentError when the node refused the batch)."""
        with self._guard():
            self.sock.sendall(encode_request(op, keys, [0] * len(keys)))
            items, msg, _ = self._answer(len(keys))
        if any(status is Status.INVALID for status, _ in items):
            raise InvalidArgumentError(msg)
        return items

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview | bytes]]
            ) -> tuple[list[tuple[Status, int]], str]:
        """Writes values, each given as a list of parts sent back to back."""
        sizes = [sum(memoryview(p).nbytes for p in parts) for parts in values]
        with self._guard():
            self.sock.sendall(encode_request(Op.PUT, keys, sizes))
            send_views(self.sock, [p for parts in values for p in parts])
            items, msg, _ = self._answer(len(keys))
            return items, msg

    def grant(self, op: Op, keys: Sequence[bytes], args: Sequence[int], mover: int
              ) -> tuple[list[tuple[Status, int]], str, tuple | None]:
        """ACQUIRE or RESERVE: the items, the message and the decoded grant (None when the
        node answered with an error for the whole batch)."""
        with self._guard():
            self.sock.sendall(encode_request(op, keys, args, mover))
            items, msg, blob = self._answer(len(keys))
            return items, msg, (decode_grant(blob, len(keys)) if blob.nbytes else None)

    def end(self, op: Op, lease_id: int) -> tuple[Status, int, str]:
        """RELEASE, COMMIT or ABORT of a grant: ``(status, size, message)``."""
        with self._guard():
            self.sock.sendall(_end_request(op, [lease_id]))
            items, msg, _ = self._answer(1)
            return items[0][0], items[0][1], msg


def _end_request(op: Op, lease_ids: Sequence[int]) -> bytes:
    body = b"".join(_KEY_ARG.pack(0, i) for i in lease_ids)
    return _REQ.pack(b"CRRQ", op, 0, 0, len(lease_ids), len(body)) + body


def _proved(items: list[tuple[Status, int]], msg: str) -> None:
    if items[0][0] is not Status.OK:
        raise FailedPreconditionError(f"data channel: the node refused this client's shm proof: {msg}")


class _Connections:
    """Per-thread connections to one node (``proof``: sent on each, for shm grants)."""

    def __init__(self, host: str, port: int, token: bytes, proof: bytes = b"", ops: int = 0,
                 timeout_s: float = 60.0) -> None:
        self.host, self.port, self.token, self.proof = host, port, token, proof
        self.timeout_s = timeout_s  # each connection's wait for the node (the client's call deadline)
        self.ops = ops  # the node's HealthResponse.data_ops (DATA_OPS)
        self._local = threading.local()
        self._all: list[DataChannelClient] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> DataChannelClient:
        """This thread's connection, opened (or reopened, after it broke) as needed.

        Raises:
            UnavailableError: the node is unreachable, or these connections were closed (a client
                that follows a restarted node closes the old node's; the call retries on the new).
        """
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.sock.fileno() < 0:
            self._check_open()
            conn = DataChannelClient(self.host, self.port, self.token, self.timeout_s, proof=self.proof)
            with self._lock:
                if self._closed:  # closed while this one opened
                    conn.close()
                    self._check_open()
                self._all = [c for c in self._all if c.sock.fileno() >= 0]  # (the broken ones are closed)
                self._all.append(conn)
            self._local.conn = conn
        return conn

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"data channel {self.host}:{self.port}: its connections were closed")

    def current(self) -> DataChannelClient | None:
        """This thread's open connection, or None (opens none)."""
        conn = getattr(self._local, "conn", None)
        return conn if conn is not None and conn.sock.fileno() >= 0 else None

    def close(self, deadline: float | None = None) -> None:
        """Closes every thread's connection (a call under way on one fails at once; see
        ``DataChannelClient.close``), all of them waiting for their deferred answers until one
        ``deadline`` (default ``CLOSE_WAIT_S`` from now); later ``get`` calls raise UnavailableError."""
        if deadline is None:
            deadline = time.monotonic() + CLOSE_WAIT_S
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
        for c in conns:
            c.close(deadline)
