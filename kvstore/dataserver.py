"""Node side of the bulk data channel (protocol in kvstore/datachannel.py)."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

from kvstore.datachannel import (HELLO, TOKEN_BYTES, Op, ProtocolError, Status, check_token,
                                 encode_response, read_request, recv_exact, recv_exact_into,
                                 send_views, tune)
from kvstore.errors import CrescentError, InvalidArgumentError, ResourceExhaustedError
from kvstore.store import Lease, Reservation, TieredStore

log = logging.getLogger(__name__)
_DRAIN = 1 << 20


class DataChannelServer:
    """Accepts data-channel connections, one thread each."""

    def __init__(self, store: TieredStore, host: str, port: int = 0,
                 on_op=None) -> None:
        self.store = store
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._on_op = on_op  # callback(op_name, seconds, nbytes) for metrics
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="data-accept", daemon=True)

    def start(self) -> DataChannelServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            tune(conn)
            conn.settimeout(None)
            hello = recv_exact(conn, len(HELLO) + TOKEN_BYTES)
            if hello[:4] != HELLO or not check_token(hello[4:], self.token):
                return
            while not self._closed:
                req = read_request(conn)
                if req is None:
                    return
                op, keys, args = req
                t0 = time.perf_counter()
                if op is Op.GET:
                    self._get(conn, keys, args)
                else:
                    self._put(conn, keys, args)
                if self._on_op is not None:
                    self._on_op(op.name.lower(), time.perf_counter() - t0)
        except (OSError, ProtocolError) as exc:
            log.debug("data channel connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _get(self, conn: socket.socket, keys: list[bytes], capacities: list[int]) -> None:
        leases: list[Lease] = []
        items: list[tuple[Status, int]] = []
        msg = ""
        try:
            for key, cap in zip(keys, capacities):
                try:
                    lease = self.store.acquire(key)
                except CrescentError as exc:
                    items.append((Status.INVALID, 0))
                    msg = msg or str(exc)
                    continue
                if lease is None:
                    items.append((Status.NOT_FOUND, 0))
                elif 0 <= cap < lease.size:
                    self.store.release(lease)
                    items.append((Status.TOO_LARGE, lease.size))
                    msg = msg or f"value of {lease.size} bytes does not fit a buffer of {cap}"
                else:
                    leases.append(lease)
                    items.append((Status.OK, lease.size))
            send_views(conn, [encode_response(items, msg), *(v for ls in leases for v in ls.views)])
        finally:
            for lease in leases:
                self.store.release(lease)

    def _put(self, conn: socket.socket, keys: list[bytes], sizes: list[int]) -> None:
        reservations: list[Reservation | None] = []
        items: list[tuple[Status, int]] = []
        msg = ""
        committed = False
        try:
            limit = self.store.config.max_value_size
            if any(not 0 <= size <= limit for size in sizes):
                # NOTE: the bytes of an impossible value cannot be drained sanely:
                # answer, then close the connection.
                conn.sendall(encode_response([(Status.INVALID, 0)] * len(keys),
                                             f"a value exceeds the limit of {limit} bytes"))
                raise ProtocolError("value size out of range")
            for key, size in zip(keys, sizes):
                res, status = None, Status.OK
                try:
                    res = self.store.reserve(key, size)
                except InvalidArgumentError as exc:
                    status, msg = Status.INVALID, msg or str(exc)
                except ResourceExhaustedError as exc:
                    status, msg = Status.EXHAUSTED, msg or str(exc)
                reservations.append(res)  # NOTE: before the bytes: a cut mid-value aborts it too
                if res is not None:
                    for v in res.views:
                        recv_exact_into(conn, v)
                else:
                    _drain(conn, size)
                items.append((status, size if res else 0))
            live = [r for r in reservations if r is not None]
            try:
                self.store.commit_many(live)
            except ResourceExhaustedError as exc:
                items = [(Status.EXHAUSTED if r else s, 0) for r, (s, _) in zip(reservations, items)]
                msg = msg or str(exc)
            committed = True
            conn.sendall(encode_response(items, msg))
        finally:
            if not committed:
                for r in reservations:
                    if r is not None:
                        self.store.abort(r)


def _drain(conn: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DRAIN)))
    while n > 0:
        k = min(n, scratch.nbytes)
        recv_exact_into(conn, scratch[:k])
        n -= k
