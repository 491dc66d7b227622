"""Prometheus metrics of the conductor, read from its state at scrape time (no hot-path cost).

The recommended replica counts (P:D sizing over the recent requests) are
recomputed at most every ``SIZING_EVERY_S`` seconds: they drive autoscalers,
which scrape every 15-60 s.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.conductor.membership import MemberKind
from kvstore.errors import CrescentError

log = logging.getLogger(__name__)
SIZING_EVERY_S = 10.0


class ConductorCollector:
    def __init__(self, conductor) -> None:
        self.conductor = conductor
        self._sizing_lock = threading.Lock()
        self._sizing = None
        self._sizing_at = -float("inf")

    def _recommendation(self):
        with self._sizing_lock:
            now = time.monotonic()
            if now - self._sizing_at >= SIZING_EVERY_S:
                self._sizing_at = now
                try:
                    self._sizing = self.conductor.sizing(self.conductor.config.sizing_target_rps)
                except CrescentError as exc:  # nothing measured yet
                    log.debug("no sizing: %s", exc)
                    self._sizing = None
            return self._sizing

    def collect(self):
        c = self.conductor
        with c._lock:
            members = c.members.all()
            counters = dict(c.counters)
            num_chunks = c.index.num_chunks()
            num_copies = c.index.num_copies
            coefficients = c.cost.coefficients
            decode_coefficients = c.cost.decode_coefficients
        yield GaugeMetricFamily("crescent_conductor_is_leader",
                                "1 on the conductor that schedules (the elected leader, or the only conductor)",
                                value=int(c.is_leader))
        m = GaugeMetricFamily("crescent_conductor_members", "Live members, by kind and state",
                              labels=["kind", "state"])
        counts = {(k.label, s): 0 for k in MemberKind for s in ("alive", "draining")}
        for x in members:
            counts[(x.kind.label, x.state)] += 1
        for (kind, state), n in sorted(counts.items()):
            m.add_metric([kind, state], n)
        yield m
        for name, key, doc in (
                ("member_expiries", "expired", "Members declared dead: silent past the dead timeout (lease expired)"),
                ("scheduled", "scheduled", "Schedule calls answered"),
                ("rejected", "rejected", "Schedule calls rejected early: predicted to miss an SLO"),
                ("scheduled_chunks", "scheduled_chunks", "Prompt chunks Schedule saw"),
                ("cached_chunks", "cached_chunks", "Prompt chunks Schedule's decisions reuse from the store"),
                ("replications", "replications", "Hot prefixes Schedule asked to replicate")):
            yield CounterMetricFamily(f"crescent_conductor_{name}", doc, value=counters.get(key, 0))
        yield GaugeMetricFamily("crescent_conductor_event_streams",
                                "Store nodes' KV-event streams open now (each holds a call thread; an idle "
                                "node's stream ends)", value=counters.get("event_streams_open", 0))
        rpcs = getattr(self.conductor, "rpcs", None)
        if rpcs is not None:
            yield GaugeMetricFamily("crescent_conductor_rpcs_in_flight", "gRPC calls in flight at this conductor "
                                    "(each holds one of its 1,024 call threads; open event streams among them)",
                                    value=rpcs.count)
        yield GaugeMetricFamily("crescent_conductor_index_chunks", "Distinct chunks in the global index",
                                value=num_chunks)
        yield GaugeMetricFamily("crescent_conductor_index_copies", "(chunk, node) pairs in the global index",
                                value=num_copies)
        cm = GaugeMetricFamily("crescent_conductor_cost_coefficient", "The cost model's current coefficients",
                               labels=["phase", "term"])
        for term, v in zip(("overhead_s", "s_per_token", "s_per_token_pair"), coefficients):
            cm.add_metric(["prefill", term], v)
        for term, v in zip(("step_s", "s_per_seq", "s_per_context_token"), decode_coefficients):
            cm.add_metric(["decode", term], v)
        yield cm
        s = self._recommendation()
        rec = GaugeMetricFamily("crescent_conductor_recommended_replicas",
                                "Prefill and decode instances the measured load needs to meet the SLOs "
                                "(crescent ctl sizing); absent until requests were scheduled", labels=["role"])
        if s is not None:
            rec.add_metric(["prefill"], s.num_prefill)
            rec.add_metric(["decode"], s.num_decode)
        yield rec
        if s is not None:
            yield GaugeMetricFamily("crescent_conductor_sizing_feasible",
                                    "0 when no replica count meets an SLO at the measured load", value=int(s.feasible))
            yield GaugeMetricFamily("crescent_conductor_measured_rps",
                                    "Request rate over the sizing window", value=s.measured_rps)

