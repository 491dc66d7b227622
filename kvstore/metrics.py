"""Prometheus metrics of a store node, read from the store's own counters at scrape time."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from kvstore.procs import HTTP_IDLE_S, HTTP_POLL_S, QuietDrops
from kvstore.store import TieredStore

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _QuietHandler(WSGIRequestHandler):
    timeout = HTTP_IDLE_S  # (a silent client's connection ends in TimeoutError, below)

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass  # a scrape every few seconds is not news


class _Server(QuietDrops, ThreadingWSGIServer):
    pass


def serve_http(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> ThreadingWSGIServer:
    """Serves ``registry`` at http://host:port/metrics from a daemon thread (``prometheus_client``'s
    ``start_http_server``, with a loop that stops within ``HTTP_POLL_S``); stop it with :func:`stop_http`."""
    server_cls = _Server
    if ":" in host:
        server_cls = type("ThreadingWSGIServerV6", (_Server,), {"address_family": socket.AF_INET6})
    httpd = make_server(host.strip("[]"), port, make_wsgi_app(registry), server_cls, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": HTTP_POLL_S}, name="metrics-http",
                     daemon=True).start()
    return httpd


def stop_http(httpd) -> None:
    """Stops a server from :func:`serve_http` and frees its port."""
    httpd.shutdown()
    httpd.server_close()


class StoreCollector:
    """Turns ``TieredStore.stats()`` into metric families on each scrape (no hot-path cost)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def collect(self):
        s = self.store.stats()
        hits = CounterMetricFamily("crescent_store_hits", "Reads served, by tier", labels=["tier"])
        evictions = CounterMetricFamily("crescent_store_evictions", "Values evicted, by tier",
                                        labels=["tier"])
        used = GaugeMetricFamily("crescent_store_bytes", "Bytes in use, by tier", labels=["tier"])
        cap = GaugeMetricFamily("crescent_store_capacity_bytes", "Capacity, by tier", labels=["tier"])
        entries = GaugeMetricFamily("crescent_store_entries", "Values held, by tier", labels=["tier"])
        for tier, t in s["tiers"].items():
            name = tier.name.lower()
            hits.add_metric([name], t["hits"])
            evictions.add_metric([name], t["evictions"])
            used.add_metric([name], t["used_bytes"])
            cap.add_metric([name], t["capacity_bytes"])
            entries.add_metric([name], t["num_entries"])
        yield from (hits, evictions, used, cap, entries)
        for name, doc in (("misses", "Reads of absent keys"), ("demotions", "Values moved to a slower tier"),
                          ("promotions", "Values moved to a faster tier"),
                          ("drops", "Values evicted from the last tier"),
                          ("corrupt", "Stored values that failed verification"),
                          ("bytes_in", "Value bytes committed"), ("bytes_out", "Value bytes read"),
                          ("disk_bytes_read", "Value bytes read from the disk tier"),
                          ("disk_bytes_written", "Value bytes written to the disk tier (puts and demotions)"),
                          ("promotions_deferred", "Disk reads that did not earn a place in a full faster tier"),
                          ("demotions_clean", "Demotions that wrote nothing (the value's disk copy was kept)"),
                          ("disk_full", "Disk writes refused for want of room (map or file system full)"),
                          ("disk_errors", "Disk writes or deletes that failed otherwise"),
                          ("written_behind", "DRAM values written to disk in the background ahead of eviction"),
                          ("quota_refused", "Writes refused: the tenant's namespace was at its quota"),
                          ("quota_evictions", "A tenant's own values evicted to keep its namespace within its quota")):
            yield CounterMetricFamily(f"crescent_store_{name}", doc, value=s[name])
        held = GaugeMetricFamily("crescent_store_tenant_bytes", "Bytes a quota'd namespace holds, by tier group",
                                 labels=["namespace", "tier"])
        bound = GaugeMetricFamily("crescent_store_tenant_quota_bytes", "A namespace's quota, by tier group",
                                  labels=["namespace", "tier"])
        for ns, mem, disk, qmem, qdisk in self.store.tenant_usage():
            for tier, used, q in (("dram", mem, qmem), ("disk", disk, qdisk)):
                held.add_metric([ns, tier], used)
                if q is not None:
                    bound.add_metric([ns, tier], q)
        yield from (held, bound)
        yield GaugeMetricFamily("crescent_store_leases", "Read leases held", value=s["num_leases"])
        yield GaugeMetricFamily("crescent_store_pinned", "Values pinned", value=s["num_pinned"])


class StoreMetrics:
    def __init__(self, store: TieredStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.op_latency = Histogram("crescent_store_op_seconds", "Latency of store operations",
                                    ["op", "path"], buckets=_BUCKETS, registry=self.registry)

    def watch_rpcs(self, rpcs) -> None:
        """The gRPC server's calls in flight (``kvstore.liveness.InFlight``) as a gauge."""
        Gauge("crescent_store_rpcs_in_flight", "gRPC calls in flight at this node (each holds one of its 1,024 "
              "call threads; past them calls are refused with RESOURCE_EXHAUSTED)",
              registry=self.registry).set_function(lambda: rpcs.count)

    def observe(self, op: str, seconds: float, path: str = "grpc") -> None:
        self.op_latency.labels(op, path).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> ThreadingWSGIServer:
        """Starts the /metrics HTTP endpoint; returns its server (``stop_http`` stops it)."""
        return serve_http(self.registry, port, host)
