"""The conductor's web console and its HTTP endpoint.

One HTTP listener (``--metrics-port``) serves:

- ``/metrics``: the Prometheus exposition (kvstore.conductor.metrics);
- ``/ui``: a page with its script and style (files of this package, no build step, no CDN) that
  polls ``/api/console`` every second and draws the cluster live;
- ``/api/console``: one JSON snapshot — members with their tiers and load, counters, the time
  series (hit rates, bytes moved), the hottest prefixes, active pins and the last scheduling
  decisions.

``ConsoleLog`` keeps what the conductor's state alone does not: the recent decisions, the pins
asked through the conductor, and a counter sample every ``SAMPLE_EVERY_S`` seconds (15 minutes
of them). It is fed under the conductor's lock; everything it holds is bounded.
"""

from __future__ import annotations

import collections
import heapq
import http.server
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvstore.conductor.membership import MemberKind
from kvstore.procs import HTTP_IDLE_S, HTTP_POLL_S, QuietDrops

log = logging.getLogger(__name__)
SAMPLE_EVERY_S = 1.0
SERIES_LEN = 900
"""Samples kept: 15 minutes at one a second."""
DECISIONS_LEN = 200
DECISION_AGE_S = 600.0
"""Decisions older than this are not shown ("the last minutes")."""
TOP_PREFIXES = 12
_MAX_DEPTHS = 1 << 16
UI_DIR = os.path.join(os.path.dirname(__file__), "ui")
STATIC = {"/ui": ("index.html", "text/html; charset=utf-8"),
          "/ui/console.js": ("console.js", "text/javascript; charset=utf-8"),
          "/ui/console.css": ("console.css", "text/css; charset=utf-8")}


def finite(x: float) -> float | None:
    """JSON has no inf/nan: those become null."""
    return x if math.isfinite(x) else None


def short(key: bytes) -> str:
    """A chunk key as the console shows it: its first 8 bytes in hex."""
    return key[:8].hex()


class ConsoleLog:
    """Decisions, pins and counter samples for the console. Not thread-safe: the conductor's lock."""

    def __init__(self) -> None:
        self.decisions: collections.deque[dict] = collections.deque(maxlen=DECISIONS_LEN)
        self.series: collections.deque[dict] = collections.deque(maxlen=SERIES_LEN)
        self.pins: dict[bytes, tuple[float, int]] = {}
        """key → (wall-clock expiry, nodes pinned on), for pins asked through the conductor."""
        self.depths: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """key → its position in the prompts that use it (1 = a first chunk): prefix lengths."""

    def scheduled(self, keys: list[bytes], chunk_tokens: int, decision: dict) -> None:
        self.decisions.append({"t": time.time(), **decision})
        for i, k in enumerate(keys):
            self.depths[k] = (i + 1) * chunk_tokens
            self.depths.move_to_end(k)
        while len(self.depths) > _MAX_DEPTHS:
            self.depths.popitem(last=False)

    def pinned(self, keys: list[bytes], ttl_s: float, num_nodes: int) -> None:
        now = time.time()
        for k in keys:
            if ttl_s > 0:
                self.pins[k] = (now + ttl_s, num_nodes)
            else:
                self.pins.pop(k, None)
        for k in [k for k, (until, _) in self.pins.items() if until <= now]:
            del self.pins[k]


def sample(conductor) -> dict:
    """The conductor's cumulative counters now (the page turns consecutive samples into rates)."""
    c = conductor
    with c._lock:
        s = {"t": time.time(), "scheduled": c.counters["scheduled"], "rejected": c.counters["rejected"],
             "scheduled_chunks": c.counters["scheduled_chunks"], "cached_chunks": c.counters["cached_chunks"],
             "hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0}
        for m in c.members.of_kind(MemberKind.STORE):
            load = m.store_load
            if load is not None:
                s["hits"] += sum(t.hits for t in load.tiers)
                s["misses"] += load.misses
                s["bytes_in"] += load.bytes_in
                s["bytes_out"] += load.bytes_out
        c.console.series.append(s)
    return s


def _member(c, m, now: float) -> dict:
    out = {"id": m.member_id, "kind": m.kind.label, "address": m.address, "host": m.host_id, "state": m.state,
           "last_seen_s": round(max(0.0, now - m.last_seen), 2)}
    if m.kind is MemberKind.STORE:
        out["chunks"] = c.index.num_chunks(m.member_id)
        load = m.store_load
        if load is not None:
            from kvstore.store import Tier

            out["tiers"] = [{"tier": Tier(t.tier).name.lower(), "used": t.used_bytes, "capacity": t.capacity_bytes,
                             "entries": t.num_entries, "hits": t.hits, "evictions": t.evictions} for t in load.tiers]
            out.update(misses=load.misses, bytes_in=load.bytes_in, bytes_out=load.bytes_out,
                       pinned=load.num_pinned, leases=load.num_leases)
    else:
        e = m.engine_load
        if m.external:  # a vLLM instance followed through its KV events
            out.update(vllm=True, chunks=c.device_index.num_chunks(m.member_id))
        out.update(store_node=m.store_node or "", queued_tokens=e.num_queued_tokens, waiting=e.num_waiting,
                   running=e.num_running, kv_usage=e.kv_usage, generated_tokens=e.num_generated_tokens,
                   finished=e.num_finished, predicted_queue_s=finite(c._queue_s(m, now)))
    return out


def snapshot(conductor) -> dict:
    """Everything the page shows, as one JSON-able dict."""
    c = conductor
    wall = time.time()
    with c._lock:
        now = c.clock()
        log_ = c.console
        members = [_member(c, m, now) for m in c.members.all()]
        counters = {k: c.counters[k] for k in ("scheduled", "rejected", "scheduled_chunks", "cached_chunks",
                                                "replications", "expired", "elected")}
        top = heapq.nlargest(TOP_PREFIXES, log_.depths, key=lambda k: c.hot.count(k, now))
        hot = [{"key": short(k), "tokens": log_.depths[k], "uses": round(c.hot.count(k, now), 2),
                "holders": {n: t.name.lower() for n, t in sorted(c.index.holders(k).items())}}
               for k in top if c.hot.count(k, now) >= 0.05]
        pins = sorted(({"key": short(k), "expires_in_s": round(until - wall, 1), "nodes": nodes,
                        "holders": sorted(c.index.holders(k))}
                       for k, (until, nodes) in log_.pins.items() if until > wall), key=lambda p: p["expires_in_s"])
        decisions = [d for d in log_.decisions if wall - d["t"] <= DECISION_AGE_S][::-1]
        series = list(log_.series)
        state = {"address": c.address, "leader": c.is_leader, "policy": c.config.policy,
                 "chunk_tokens": c.config.chunk_tokens, "num_chunks": c.index.num_chunks(),
                 "num_copies": c.index.num_copies, "num_dead": c.members.num_dead}
    return {"now": wall, "conductor": state, "counters": counters, "members": members, "hot_prefixes": hot,
            "pins": pins[:50], "num_pins": len(pins), "decisions": decisions, "series": series,
            "sample_every_s": SAMPLE_EVERY_S}


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "crescent-conductor"
    timeout = HTTP_IDLE_S  # (http.server closes a connection whose request does not come in time)

    def log_message(self, fmt, *args) -> None:  # the default writes every request to stderr
        log.debug("http %s: " + fmt, self.address_string(), *args)

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        server = self.server
        try:
            if path == "/metrics":
                self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            elif path == "/api/console":
                self._send(200, json.dumps(snapshot(server.conductor)).encode(), "application/json")
            elif path in STATIC:
                name, ctype = STATIC[path]
                with open(os.path.join(UI_DIR, name), "rb") as f:
                    self._send(200, f.read(), ctype)
            elif path == "/":
                self.send_response(302)
                self.send_header("Location", "/ui")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._send(404, f"not found: {path} (try /ui, /api/console or /metrics)\n".encode(),
                           "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True

    do_HEAD = do_GET


class ConsoleServer:
    """The conductor's HTTP listener (/metrics, /ui, /api/console) and the sampler feeding the series."""

    def __init__(self, conductor, port: int, host: str) -> None:
        from kvstore.conductor.metrics import ConductorCollector

        self.conductor = conductor
        registry = CollectorRegistry()
        registry.register(ConductorCollector(conductor))
        server_cls = type("ConsoleHTTPServer", (QuietDrops, http.server.ThreadingHTTPServer), {})
        if ":" in host:
            server_cls = type("ConsoleHTTPServerV6", (server_cls,), {"address_family": socket.AF_INET6})
        self.httpd = server_cls((host.strip("[]"), port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.registry, self.httpd.conductor = registry, conductor
        self.port = self.httpd.server_port
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.httpd.serve_forever, name="conductor-http", daemon=True,
                                          kwargs={"poll_interval": HTTP_POLL_S}),
                         threading.Thread(target=self._sample_loop, name="conductor-console", daemon=True)]

    def start(self) -> ConsoleServer:
        for t in self._threads:
            t.start()
        return self

    def _sample_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + SAMPLE_EVERY_S, time.monotonic())
            try:
                sample(self.conductor)
            except Exception:  # noqa: BLE001 - the console must never take the conductor down
                log.exception("console sample failed")

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
