"""The bulk data channel: raw TCP for value bytes, gRPC for everything else.

Python gRPC tops out near 0.9 GB/s for MiB-sized messages (every frame is
copied into and out of protobuf objects). This channel moves value bytes
between the node's DRAM arena and the caller's own buffers with one
``sendmsg`` from the arena slots on the node and ``recv_into`` the destination
buffer on the client: no intermediate copy on either side.

A client learns the port and a per-node token from ``KVStore.Health`` and
opens a TCP connection that starts with ``b"CRDC" + token``. Then, any number
of requests, each answered before the next (all integers little-endian)::

    request   "CRRQ" u8 op (1 GET, 2 PUT) u8 0 u16 0 u32 n
              n × (u16 key_len, key, i64 arg)      GET: capacity (-1 any); PUT: size
              PUT only: the n values' bytes, back to back
    response  "CRRS" u32 n
              n × (u8 status, u64 size)
              u16 msg_len, msg (UTF-8; why the first failed key failed)
              GET only: the bytes of every OK value, back to back

A malformed request closes the connection; nothing of a PUT whose bytes did
not all arrive becomes visible (its reservations are aborted).
"""

from __future__ import annotations

import enum
import hmac
import socket
import struct
import threading
from collections.abc import Sequence

from kvstore.config import MAX_KEY_BYTES
from kvstore.errors import CrescentError, DataLossError, UnavailableError

HELLO = b"CRDC"
TOKEN_BYTES = 16
_REQ = struct.Struct("<4sBBHI")
_RES = struct.Struct("<4sI")
_ITEM = struct.Struct("<BQ")
_KEYLEN = struct.Struct("<H")
_ARG = struct.Struct("<q")
MAX_BATCH = 1 << 16
_IOV_MAX = 512
_SOCK_BUF = 4 << 20


class Op(enum.IntEnum):
    GET = 1
    PUT = 2


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    TOO_LARGE = 2  # GET: the value does not fit the caller's buffer
    INVALID = 3
    EXHAUSTED = 4


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
    """Gather-writes every view in order (``sendmsg``, resuming after partial sends)."""
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        batch = pending[:_IOV_MAX]
        sent = sock.sendmsg(batch)
        i = 0
        while i < len(batch) and sent >= batch[i].nbytes:
            sent -= batch[i].nbytes
            i += 1
        pending = pending[i:]
        if sent:
            pending[0] = pending[0][sent:]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def encode_request(op: Op, keys: Sequence[bytes], args: Sequence[int]) -> bytes:
    parts = [_REQ.pack(b"CRRQ", op, 0, 0, len(keys))]
    for k, a in zip(keys, args, strict=True):
        parts += [_KEYLEN.pack(len(k)), bytes(k), _ARG.pack(a)]
    return b"".join(parts)


def encode_response(items: Sequence[tuple[Status, int]], msg: str = "") -> bytes:
    m = msg.encode()[:4096]
    return b"".join([_RES.pack(b"CRRS", len(items)), *(_ITEM.pack(s, n) for s, n in items),
                     _KEYLEN.pack(len(m)), m])


def read_request(sock: socket.socket) -> tuple[Op, list[bytes], list[int]] | None:
    """Reads one request header; None when the peer closed cleanly between requests."""
    first = sock.recv(_REQ.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) < _REQ.size:
        raise ProtocolError("truncated request header")
    magic, op, _, _, n = _REQ.unpack(first)
    if magic != b"CRRQ" or op not in (Op.GET, Op.PUT):
        raise ProtocolError("bad request magic or op")
    if n > MAX_BATCH:
        raise ProtocolError(f"batch of {n} keys exceeds {MAX_BATCH}")
    keys, args = [], []
    for _ in range(n):
        (klen,) = _KEYLEN.unpack(recv_exact(sock, 2))
        if klen > MAX_KEY_BYTES:
            raise ProtocolError(f"key of {klen} bytes exceeds {MAX_KEY_BYTES}")
        keys.append(recv_exact(sock, klen))
        (arg,) = _ARG.unpack(recv_exact(sock, 8))
        args.append(arg)
    return Op(op), keys, args


def read_response(sock: socket.socket) -> tuple[list[tuple[Status, int]], str]:
    magic, n = _RES.unpack(recv_exact(sock, _RES.size))
    if magic != b"CRRS":
        raise ProtocolError("bad response magic")
    raw = recv_exact(sock, n * _ITEM.size)
    items = [(Status(s), size) for s, size in _ITEM.iter_unpack(raw)]
    (mlen,) = _KEYLEN.unpack(recv_exact(sock, 2))
    return items, recv_exact(sock, mlen).decode(errors="replace")


class DataChannelClient:
    """One connection to a node's data channel. Not thread-safe: use one per thread."""

    def __init__(self, host: str, port: int, token: bytes, timeout_s: float = 60.0) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise UnavailableError(f"data channel {host}:{port} unreachable: {exc}") from exc
        tune(self.sock)
        self.sock.sendall(HELLO + token)

    def close(self) -> None:
        self.sock.close()

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[tuple[Status, int]]:
        """Reads values straight into ``buffers`` (one per key, each at least the value's size)."""
        try:
            self.sock.sendall(encode_request(Op.GET, keys, [b.nbytes for b in buffers]))
            items, _ = read_response(self.sock)
            if len(items) != len(keys):
                raise ProtocolError("response does not match the request")
            for (status, size), buf in zip(items, buffers):
                if status is Status.OK:
                    if size > buf.nbytes:
                        raise ProtocolError("node sent more bytes than the buffer holds")
                    recv_exact_into(self.sock, buf[:size])
            return items
        except (OSError, ProtocolError) as exc:
            self.close()
            raise DataLossError(f"data channel broke: {exc}") from exc

    def get(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        try:
            self.sock.sendall(encode_request(Op.GET, keys, [-1] * len(keys)))
            items, _ = read_response(self.sock)
            out: list[bytearray | None] = []
            for status, size in items:
                if status is Status.OK:
                    buf = bytearray(size)
                    recv_exact_into(self.sock, memoryview(buf))
                    out.append(buf)
                else:
                    out.append(None)
            return out
        except (OSError, ProtocolError) as exc:
            self.close()
            raise DataLossError(f"data channel broke: {exc}") from exc

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview | bytes]]
            ) -> tuple[list[tuple[Status, int]], str]:
        """Writes values, each given as a list of parts sent back to back."""
        sizes = [sum(memoryview(p).nbytes for p in parts) for parts in values]
        try:
            self.sock.sendall(encode_request(Op.PUT, keys, sizes))
            send_views(self.sock, [p for parts in values for p in parts])
            return read_response(self.sock)
        except (OSError, ProtocolError) as exc:
            self.close()
            raise DataLossError(f"data channel broke: {exc}") from exc


class _Connections:
    """Per-thread connections to one node."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self.host, self.port, self.token = host, port, token
        self._local = threading.local()
        self._all: list[DataChannelClient] = []
        self._lock = threading.Lock()

    def get(self) -> DataChannelClient:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.sock.fileno() < 0:
            conn = DataChannelClient(self.host, self.port, self.token)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for c in self._all:
                c.close()
            self._all.clear()


def check_token(got: bytes, want: bytes) -> bool:
    return hmac.compare_digest(got, want)
