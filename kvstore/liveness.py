"""How every Crescent connection notices a dead peer within seconds, not minutes.

A peer whose host dies or whose link is cut sends nothing: no FIN, no RST. TCP
then waits for its retransmission timeout (~15 minutes on Linux) and a gRPC
call waits for its deadline (the gateway's is 10 minutes, for long prompts).
So every connection probes its peer instead:

- gRPC channels send HTTP/2 pings after ``KEEPALIVE_TIME_S`` without reads,
  during calls and between them, and give the connection up when a ping is not
  answered within ``KEEPALIVE_TIMEOUT_S``: calls on it fail with UNAVAILABLE
  (the gateway then prefills on the decode engine, a store read becomes a miss,
  a conductor client moves to the next replica). gRPC also sets
  ``TCP_USER_TIMEOUT`` from that timeout, so unacknowledged data fails as fast.
  Reconnection backs off at most ``RECONNECT_MAX_S``, so a peer that comes back
  is found within seconds (gRPC's default backoff grows to two minutes).
- gRPC servers accept those pings (by default a server answers a client that
  pings more often than every five minutes without data with GOAWAY).
- Raw TCP sockets (the data channel) use kernel keepalive with the same
  figures and ``TCP_USER_TIMEOUT``, and connect with a ``CONNECT_TIMEOUT_S``
  deadline.

A busy peer still answers pings and keepalive probes (its kernel and gRPC's
transport threads do), so a slow but live node is never cut off by these:
only the call deadlines bound a slow answer.

Both figures come from the environment when set (``CRESCENT_KEEPALIVE_TIME_S``,
``CRESCENT_KEEPALIVE_TIMEOUT_S``, seconds in [0.1, 3600]; a bad value is a
warning and the default): a dead peer is noticed within about their sum.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from concurrent import futures

import grpc


def _env_seconds(name: str, default: float) -> float:
    """A setting in seconds from the environment; a bad one is a one-line warning, and the default."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 3600:
        print(f"crescent: warning: {name}={raw!r} ignored (seconds in [0.1, 3600]); using {default:g}",
              file=sys.stderr)
        return default
    return value


KEEPALIVE_TIME_S = _env_seconds("CRESCENT_KEEPALIVE_TIME_S", 2.0)
"""Idle time after which a connection probes its peer."""
KEEPALIVE_TIMEOUT_S = _env_seconds("CRESCENT_KEEPALIVE_TIMEOUT_S", 4.0)
"""How long an unanswered probe (or unacknowledged data) is tolerated."""
RECONNECT_MAX_S = 2.0
CONNECT_TIMEOUT_S = 5.0


def channel_options(max_message_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options for a client ``grpc.insecure_channel`` to a Crescent server."""
    opts = [("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # default 2: the pings would stop mid-prefill
            # any ping (a flow-control probe too) blocks the keepalive ping while it is out, and has a
            # timeout of its own (default 60 s): a silent peer must fail it as fast
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.initial_reconnect_backoff_ms", 100),
            # NOTE: also gRPC's connect timeout (default 20 s): an attempt to a cut host gives up soon,
            # so calls fail fast (UNAVAILABLE) instead of waiting on it for their whole deadline
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000)),
            # a channel's own connections: by default channels to one address share them, so a new
            # channel to a server that came back on an address another channel saw die would inherit
            # that channel's reconnect backoff and fail its first calls (UNAVAILABLE) until it ends
            ("grpc.use_local_subchannel_pool", 1)]
    if max_message_bytes is not None:
        opts += [("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)]
    return opts


RPC_THREADS = 1024
"""Most calls a Crescent gRPC server runs at once. grpcio's server runs each call on a thread of its own
for the call's whole life, and some calls last: every store node's KV-event stream at the conductor,
every Generate at an engine (which must reach the engine's own queue, where its load reports count it).
A pool of 32 or 64 threads was filled by them, and every other call (Schedule, heartbeats, health
probes) then waited behind them for good. Threads are made as calls need them; a call past the limit
is refused at once (RESOURCE_EXHAUSTED) instead of waiting unseen."""


ENGINE_MESSAGE_BYTES = 1 << 30
"""Largest message between the gateway and an engine. A prompt's logprobs come in one message (the
Prefill answer, or Generate's first): ~130 bytes a prompt token with 20 top logprobs, so gRPC's
default of 4 MiB refused every prompt past ~32,000 tokens that asked for them (RESOURCE_EXHAUSTED)."""


class InFlight(grpc.ServerInterceptor):
    """Counts a server's calls in flight: each holds one of its ``RPC_THREADS`` threads while it runs
    (a stream, until it ends), and past them every new call is refused with RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def _add(self, n: int) -> None:
        with self._lock:
            self.count += n

    def _unary(self, behavior):
        def counted(request, context):
            self._add(1)
            try:
                return behavior(request, context)
            finally:
                self._add(-1)
        return counted

    def _stream(self, behavior):
        def counted(request, context):
            self._add(1)
            try:
                yield from behavior(request, context)
            finally:
                self._add(-1)  # the stream ended, failed, or was cancelled (grpc closes the generator)
        return counted

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not hasattr(handler, "_replace"):  # (grpc's handlers are named tuples)
            return handler
        for kind, wrap in (("unary_unary", self._unary), ("stream_unary", self._unary),
                           ("unary_stream", self._stream), ("stream_stream", self._stream)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrap(behavior)})
        return handler


def rpc_server(name: str, options: list[tuple[str, int]], interceptors=()) -> tuple[grpc.Server,
                                                                                  futures.ThreadPoolExecutor, InFlight]:
    """A gRPC server with ``RPC_THREADS`` handler threads (named ``name``-N), its pool (to drain),
    and the count of its calls in flight (each server's ``*_rpcs_in_flight`` gauge)."""
    pool = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix=name)
    in_flight = InFlight()
    server = grpc.server(pool, interceptors=(in_flight, *interceptors), options=options,
                         maximum_concurrent_rpcs=RPC_THREADS)
    return server, pool, in_flight


def server_options(max_message_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options for a Crescent ``grpc.server``: accepts the clients' keepalive pings."""
    opts = [("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000) // 2),
            ("grpc.http2.max_pings_without_data", 0),
            # the server's own probes of silent clients (a cut gateway's streams end instead of lingering)
            ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000) * 5),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000))]
    if max_message_bytes is not None:
        opts += [("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)]
    return opts


def tune_socket(sock: socket.socket) -> None:
    """Kernel keepalive and ``TCP_USER_TIMEOUT`` on a connected TCP socket (Linux; elsewhere a no-op)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval = max(1, round(KEEPALIVE_TIME_S)), max(1, round(KEEPALIVE_TIMEOUT_S / 3))
    for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                       ("TCP_USER_TIMEOUT", int(KEEPALIVE_TIMEOUT_S * 1000))):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection within ``CONNECT_TIMEOUT_S`` (a cut host never answers the SYN), then
    ``timeout_s`` for each operation on it (the caller adds ``tune_socket``'s probes)."""
    sock = socket.create_connection((host, port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    sock.settimeout(timeout_s)
    return sock
