"""Node side of the bulk data channel (protocol in kvstore/datachannel.py)."""

from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import logging
import math
import secrets
import socket
import threading
import time

from kvstore import tls
from kvstore.datachannel import (HELLO, MAX_LAYERS, TOKEN_BYTES, Op, ProtocolError, Status,
                                 encode_grant, encode_response, layered_parts, read_request, recv_exact,
                                 recv_exact_into, send_views, split_layered_arg, tune)
from kvstore.errors import CrescentError, FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from kvstore.store import Lease, Reservation, TieredStore, check_key
from kvstore.transport.descriptors import ItemStatus, Mover

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 30.0
"""How long a new connection has for its TLS handshake and its hello (``CRDC`` + session token)."""
STALL_S = 60.0
"""How long a request may go without progress once its first byte is in: a client that stops
sending a PUT's bytes, or stops reading a GET's, loses its connection, and the reservations or
leases it held go back (an idle connection between requests is kept: keepalive finds a dead one)."""
ACCEPT_RETRY_S = 0.1
"""The pause before accepting again after an accept failed (out of descriptors: connections closing free them)."""
_DRAIN = 1 << 20


def _cut(views: list[memoryview], starts: list[int], off: int, n: int) -> list[memoryview]:
    """Bytes ``off .. off+n`` of a value laid out as ``views`` back to back (``starts``: each
    view's offset in the value, to find the first view by bisection)."""
    out = []
    i = bisect.bisect_right(starts, off) - 1
    off -= starts[i]
    for v in views[i:]:
        if n <= 0:
            break
        if off >= v.nbytes:
            off -= v.nbytes
            continue
        take = min(n, v.nbytes - off)
        out.append(v[off : off + take])
        n -= take
        off = 0
    return out


class DataChannelServer:
    """Accepts data-channel connections, one thread each.

    Args:
        store: the node's store.
        host, port: where to listen (port 0: any free port).
        on_op: ``callback(op_name, seconds, path)`` after each request (metrics;
            ``path`` is ``tcp``, or the mover of an ACQUIRE/RESERVE).
        grants: the node's ``NodeTransport``: serves the descriptor ops
            (ACQUIRE .. ABORT) from its lease table; None refuses them.
    """

    def __init__(self, store: TieredStore, host: str, port: int = 0,
                 on_op=None, grants=None) -> None:
        self.store = store
        self.grants = grants
        self.token = secrets.token_bytes(TOKEN_BYTES)
        """The session token of the keys as they are (no auth, or an admin caller)."""
        self._prefixes: dict[bytes, bytes] = {self.token: b""}
        """Session token → the key prefix of its namespace (``token_for``)."""
        self._on_op = on_op  # callback(op_name, seconds, nbytes) for metrics
        self._tls = tls.ServerFiles() if tls.config() is not None else None
        """Under TLS: every connection is wrapped (``--tls-cert``; kvstore/tls.py), with the files as they
        are when it connects (rotated certificates without a restart)."""
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._accept_warned = -math.inf
        self._thread = threading.Thread(target=self._accept_loop, name="data-accept", daemon=True)

    def token_for(self, prefix: bytes) -> bytes:
        """The session token of a namespace (``Health`` hands it to the namespace's callers): a session
        opened with it works on that namespace's keys only."""
        if not prefix:
            return self.token
        token = hmac.new(self.token, prefix, hashlib.sha256).digest()[:TOKEN_BYTES]
        with self._lock:
            self._prefixes[token] = prefix
        return token

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
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors (EMFILE, ENFILE) or memory, or a connection gone before it was
                # taken: the listener is fine, and connections closing free what the next one needs.
                # (This loop used to end here, and the node took no data-channel client again.)
                now = time.monotonic()
                if now - self._accept_warned >= 10.0:  # (one line per 10 s, not one per try)
                    self._accept_warned = now
                    log.warning("data channel: cannot accept a connection (%s); trying again", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: that client is refused, not the next
                log.warning("data channel: no thread for a connection (%s)", exc)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            tune(conn)
            # the TLS handshake and the hello within HELLO_TIMEOUT_S: a client that connects and stalls
            # (or never speaks) gives its connection and thread back, as one with a wrong token does
            conn.settimeout(HELLO_TIMEOUT_S)
            if self._tls is not None:  # the handshake runs here, on the connection's own thread
                plain, conn = conn, tls.TlsStream(conn, self._tls.ssl_context(), server_side=True)
                with self._lock:
                    self._conns.discard(plain)
                    self._conns.add(conn)
            hello = recv_exact(conn, len(HELLO) + TOKEN_BYTES)
            prefix = self._prefixes.get(hello[4:]) if hello[:4] == HELLO else None
            if prefix is None:
                return
            proven = False  # shm grants wait for a PROVE (kvstore/datachannel.py)
            while not self._closed:
                conn.settimeout(None)
                req = read_request(conn, stall_s=STALL_S)  # (STALL_S from its first byte to the answer's last)
                if req is None:
                    return
                op, keys, args, mover = req
                if prefix and op is not Op.PROVE:
                    keys = [prefix + k if k else k for k in keys]
                t0 = time.perf_counter()
                path = "tcp"
                if op is Op.GET:
                    self._get(conn, keys, args)
                elif op is Op.GET_LAYERED:
                    self._get(conn, keys, args, layered=True)
                elif op is Op.PUT:
                    self._put(conn, keys, args)
                elif op in (Op.LOOKUP, Op.EXISTS):
                    conn.sendall(self._query(op, keys))
                elif op is Op.PROVE:
                    proven = self._prove(keys)
                    conn.sendall(encode_response([(Status.OK if proven else Status.FAILED_PRECONDITION, 0)],
                                                 "" if proven else "wrong shm proof"))
                else:
                    conn.sendall(self._descriptor_op(op, keys, args, mover, proven))
                    if op in (Op.ACQUIRE, Op.RESERVE):
                        path = _MOVER_NAMES.get(mover, path)
                if self._on_op is not None:
                    self._on_op(op.name.lower(), time.perf_counter() - t0, path)
        except (OSError, ProtocolError) as exc:
            log.debug("data channel connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _get(self, conn: socket.socket, keys: list[bytes], args: list[int], layered: bool = False) -> None:
        """GET (``args``: capacities) or GET_LAYERED (``args``: head and layer sizes; the bytes
        sent layer-major)."""
        items: list[tuple[Status, int]] = []
        msg = ""
        ok = []
        for key in keys:
            try:
                check_key(key)
                ok.append(True)
            except CrescentError as exc:
                ok.append(False)
                msg = msg or str(exc)
        # NOTE: each key leased once (disk reads in parallel), its views sent as often as it is named:
        # a key named 64 times once read its disk value 64 times into memory before anything was sent
        unique = list(dict.fromkeys(bytes(k) for k, v in zip(keys, ok) if v))
        held = dict(zip(unique, self.store.acquire_many(unique)))
        leases = [held[bytes(k)] if v else None for k, v in zip(keys, ok)]
        sending: list[Lease] = []
        try:
            head, layer = split_layered_arg(args[0]) if layered and args else (0, 0)  # (one layout per request)
            for valid, lease, arg in zip(ok, leases, args):
                if not valid:
                    items.append((Status.INVALID, 0))
                elif lease is None:
                    items.append((Status.NOT_FOUND, 0))
                elif layered and (layer == 0 or not 0 <= head <= lease.size or (lease.size - head) % layer):
                    items.append((Status.INVALID, lease.size))
                    msg = msg or f"value of {lease.size} bytes is not {head} + layers of {layer}"
                elif layered and (lease.size - head) // layer > MAX_LAYERS:
                    items.append((Status.INVALID, lease.size))
                    msg = msg or (f"value of {lease.size} bytes is {(lease.size - head) // layer} layers of {layer}, "
                                  f"more than the {MAX_LAYERS} a layered read takes")
                elif not layered and 0 <= arg < lease.size:
                    items.append((Status.TOO_LARGE, lease.size))
                    msg = msg or f"value of {lease.size} bytes does not fit a buffer of {arg}"
                else:
                    sending.append(lease)
                    items.append((Status.OK, lease.size))
            if not layered:
                body = [v for ls in sending for v in ls.views]
            else:  # every OK value's head, then layer 0 of each, layer 1, … (datachannel.layered_parts)
                ok_leases = [ls if st is Status.OK else None for ls, (st, _) in zip(leases, items)]
                starts = [None if ls is None else list(itertools.accumulate((v.nbytes for v in ls.views[:-1]),
                                                                            initial=0)) for ls in ok_leases]
                body = [v for j, _, off, n in layered_parts([None if ls is None else ls.size for ls in ok_leases],
                                                           head, layer)
                        for v in _cut(ok_leases[j].views, starts[j], off, n)]
            send_views(conn, [encode_response(items, msg), *body])
        finally:
            self.store.release_many(ls for ls in held.values() if ls is not None)

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

    def _query(self, op: Op, keys: list[bytes]) -> bytes:
        """LOOKUP or EXISTS, answered as the KVStore RPC of the same name would be."""
        try:
            for key in keys:
                check_key(key)
        except CrescentError as exc:
            return encode_response([(Status.INVALID, 0)] * len(keys), str(exc))
        if op is Op.LOOKUP:
            n, tiers = self.store.lookup(keys)
            return encode_response([(Status.OK, int(t)) for t in tiers] + [(Status.NOT_FOUND, 0)] * (len(keys) - n))
        return encode_response([(Status.OK if p else Status.NOT_FOUND, 0) for p in self.store.exists(keys)])

    def _prove(self, keys: list[bytes]) -> bool:
        want = getattr(self.grants, "shm_proof", None)
        return len(keys) == 1 and want is not None and hmac.compare_digest(bytes(keys[0]), want)

    def _descriptor_op(self, op: Op, keys: list[bytes], args: list[int], mover: int, proven: bool) -> bytes:
        """One descriptor request, answered as the KVStore RPC of the same name would be."""
        t = self.grants
        try:
            if t is None:
                raise FailedPreconditionError("this node serves no descriptors on its data channel")
            if op in (Op.ACQUIRE, Op.RESERVE):
                m = t.check_mover(mover)
                if op is Op.ACQUIRE:
                    g = t.leases.acquire(keys, m, proven)
                else:
                    g = t.leases.reserve(list(zip(keys, args)), m, proven)
                items = [(_GRANT_STATUS[d.status], d.size) for d in g.items]
                grant = encode_grant(g.lease_id, g.ttl_s, t.arena_name(m), [d.slots for d in g.items],
                                     [d.generations for d in g.items])
                return encode_response(items, g.message, grant)
            if op is Op.REPORT:
                if len(args) != 3 or min(args) < 0 or args[2] > args[0] or args[0] > MAX_REPORT[0] \
                        or args[1] > MAX_REPORT[1]:
                    raise InvalidArgumentError(f"REPORT takes (values >= batches >= 0, bytes >= 0), at most "
                                               f"{MAX_REPORT[0]} values and {MAX_REPORT[1]} bytes")
                t.local_reads(*args)
                return encode_response([(Status.OK, 0)] * 3)
            if op is Op.RELEASE:
                items, msg = [], ""
                for lease_id in args:
                    try:
                        items.append((Status.OK, t.leases.release(lease_id)[1]))
                    except FailedPreconditionError as exc:
                        items.append((Status.FAILED_PRECONDITION, 0))
                        msg = msg or str(exc)
                return encode_response(items, msg)
            if len(args) != 1:
                raise InvalidArgumentError(f"{op.name} takes one lease id, got {len(args)}")
            if op is Op.COMMIT:
                _, nbytes = t.leases.commit(args[0])
            else:
                nbytes = t.leases.abort(args[0])
            return encode_response([(Status.OK, nbytes)])
        except InvalidArgumentError as exc:
            return encode_response([(Status.INVALID, 0)] * len(keys), str(exc))
        except FailedPreconditionError as exc:
            return encode_response([(Status.FAILED_PRECONDITION, 0)] * len(keys), str(exc))


MAX_REPORT = (1 << 32, 1 << 50)
"""The most values and bytes one REPORT may count (a client reports every second): the node's
counters are u64 in its Stats, and a report beyond any real second's reads is a broken client."""
_MOVER_NAMES = {m.pb: m.value for m in Mover}
_GRANT_STATUS = {ItemStatus.OK: Status.OK, ItemStatus.NOT_FOUND: Status.NOT_FOUND,
                 ItemStatus.ELSEWHERE: Status.ELSEWHERE, ItemStatus.EXHAUSTED: Status.EXHAUSTED}


def _drain(conn: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DRAIN)))
    while n > 0:
        k = min(n, scratch.nbytes)
        recv_exact_into(conn, scratch[:k])
        n -= k
