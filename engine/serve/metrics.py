"""Prometheus metrics of an engine, labelled by role so prefill and decode SLOs alert apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.metrics import serve_http

_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class EngineMetrics:
    def __init__(self, role: str, engine) -> None:
        self.role = role
        self.engine = engine
        self.registry = CollectorRegistry()
        self.ttft = Histogram("crescent_engine_ttft_seconds", "Arrival to first token, in this engine",
                              ["role"], buckets=_TTFT, registry=self.registry).labels(role)
        self.itl = Histogram("crescent_engine_itl_seconds", "Time between consecutive tokens of a request",
                             ["role"], buckets=_ITL, registry=self.registry).labels(role)
        self.step = Histogram("crescent_engine_step_seconds", "Duration of an engine step (one forward pass)",
                              ["role"], buckets=_STEP, registry=self.registry).labels(role)
        self.prefill = Histogram("crescent_engine_prefill_seconds",
                                 "Duration of an engine step that computed prompt tokens (a prefill chunk)",
                                 ["role"], buckets=_STEP, registry=self.registry).labels(role)
        self.requests = Counter("crescent_engine_requests", "Requests finished, by reason",
                                ["role", "reason"], registry=self.registry)
        self.registry.register(self)
        self._last: dict[int, float] = {}

    def on_token(self, seq, now: float) -> None:
        last = self._last.get(seq.seq_id)
        if last is None:
            self.ttft.observe(now - seq.arrival_time)
        else:
            self.itl.observe(now - last)
        self._last[seq.seq_id] = now

    def watch_rpcs(self, rpcs) -> None:
        """The gRPC server's calls in flight (``kvstore.liveness.InFlight``) as a gauge."""
        Gauge("crescent_engine_rpcs_in_flight", "gRPC calls in flight at this engine (a Generate stream holds "
              "one of its 1,024 call threads until it ends; past them calls are refused with RESOURCE_EXHAUSTED)",
              ["role"], registry=self.registry).labels(self.role).set_function(lambda: rpcs.count)

    def on_step_time(self, seconds: float, prefill_tokens: int) -> None:
        """After each step that ran something: its duration, and how many prompt tokens it computed."""
        self.step.observe(seconds)
        if prefill_tokens:
            self.prefill.observe(seconds)

    def on_finish(self, seq, now: float) -> None:
        self._last.pop(seq.seq_id, None)
        self.requests.labels(self.role, seq.finish_reason or "unknown").inc()

    def collect(self):
        eng = self.engine
        g = GaugeMetricFamily("crescent_engine_queue_depth", "Requests waiting or running", labels=["role", "state"])
        g.add_metric([self.role, "waiting"], len(eng.scheduler.waiting))
        g.add_metric([self.role, "running"], len(eng.scheduler.running))
        yield g
        p = GaugeMetricFamily("crescent_engine_kv_pages", "KV pages, by state", labels=["role", "state"])
        used, total = eng.blocks.num_pages - eng.blocks.num_free, eng.blocks.num_pages
        p.add_metric([self.role, "used"], used)
        p.add_metric([self.role, "free"], eng.blocks.num_free)
        yield p
        r = GaugeMetricFamily("crescent_engine_kv_usage_ratio", "KV pages in use / all KV pages", labels=["role"])
        r.add_metric([self.role], used / total if total else 0.0)
        yield r
        if eng.async_scheduling:
            o = CounterMetricFamily("crescent_engine_overlapped_steps", "Steps launched before the tokens of the "
                                    "step before them were on the host (async scheduling)", labels=["role"])
            o.add_metric([self.role], eng.num_overlapped_steps)
            yield o
        if eng.drafter is not None:
            s = CounterMetricFamily("crescent_engine_spec_tokens", "Speculative tokens verified (drafted) and of "
                                    "those accepted", labels=["role", "kind"])
            s.add_metric([self.role, "drafted"], eng.num_draft_tokens)
            s.add_metric([self.role, "accepted"], eng.num_accepted_tokens)
            yield s
            n = CounterMetricFamily("crescent_engine_spec_steps", "Sequence-steps that verified drafts (each "
                                    "emits its accepted tokens plus one)", labels=["role"])
            n.add_metric([self.role], eng.num_spec_steps)
            yield n
        if eng.connector is not None:
            st = eng.connector.stats
            b = GaugeMetricFamily("crescent_engine_store_bytes", "Bytes moved to/from the store",
                                  labels=["role", "direction"])
            b.add_metric([self.role, "loaded"], st.bytes_loaded)
            b.add_metric([self.role, "saved"], st.bytes_saved)
            yield b
            c = CounterMetricFamily("crescent_engine_store_chunks", "KV chunks moved to/from the store",
                                    labels=["role", "direction"])
            c.add_metric([self.role, "loaded"], st.chunks_loaded)
            c.add_metric([self.role, "saved"], st.chunks_saved)
            yield c
            f = CounterMetricFamily("crescent_engine_store_failures",
                                    "Chunks the store reported present that failed to load or verify (load; "
                                    "of those, verify: corrupt or mislabelled), chunks that could not be saved "
                                    "(save), failed store calls (error), loads found bad after the step that computed beside them "
                                    "(late: that step was thrown away and recomputed)",
                                    labels=["role", "op"])
            f.add_metric([self.role, "load"], st.load_failures)
            f.add_metric([self.role, "verify"], st.verify_failures)
            f.add_metric([self.role, "save"], st.save_failures)
            f.add_metric([self.role, "error"], st.store_errors)
            f.add_metric([self.role, "late"], st.late_failures)
            yield f

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Starts the /metrics HTTP endpoint; returns its server (``kvstore.metrics.stop_http`` stops it)."""
        return serve_http(self.registry, port, host)
