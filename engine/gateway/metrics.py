"""The gateway's Prometheus metrics, in a registry of its own so several gateways can live in one process.

``llm_gateway_overhead_seconds`` is the time a request spends in the gateway itself:
from arrival until it is sent upstream (parsing, routing, failover; the admission
queue wait is measured apart) plus from the upstream's last byte until the client's.

The response cache's series are ``llm_gateway_cache_*`` (docs/response-cache.md lists them):
requests by result, lookups by kind and result, misses by reason, hits by where they were
served from, lookup time by kind, evictions, stores by outcome, and the entries and bytes
held in this process.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from engine.gateway.admission import AdmissionController
from engine.gateway.routing import RouteTable

_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_CACHE_LOOKUP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                         1.0)
NO_GROUP = "none"


class _RouteCollector:
    """Per-replica health, in-flight count and group weights, read from the route table at scrape time."""

    def __init__(self, table: RouteTable):
        self._table = table

    def collect(self):
        healthy = GaugeMetricFamily("llm_gateway_upstream_healthy", "1 when the replica is in rotation",
                                    labels=["group", "upstream"])
        in_flight = GaugeMetricFamily("llm_gateway_upstream_in_flight", "Requests in flight on the replica",
                                      labels=["group", "upstream"])
        weight = GaugeMetricFamily("llm_gateway_group_weight", "Routing weight of the replica group",
                                   labels=["group"])
        for group in self._table.groups:
            weight.add_metric([group.name], group.weight)
            for upstream in group.upstreams:
                healthy.add_metric([group.name, upstream.url], 1.0 if upstream.healthy else 0.0)
                in_flight.add_metric([group.name, upstream.url], upstream.in_flight)
        yield healthy
        yield in_flight
        yield weight


class _CacheSizeCollector:
    """Entries and bytes of the response caches held in this process, read at scrape time."""

    def __init__(self, caches):
        self._caches = caches  # anything with sizes() -> (group, kind, entries, bytes)

    def collect(self):
        entries = GaugeMetricFamily("llm_gateway_cache_entries", "Response-cache entries held by this gateway",
                                    labels=["group", "kind"])
        size = GaugeMetricFamily("llm_gateway_cache_bytes", "Bytes of the response-cache entries held by this "
                                 "gateway (keys, answers, vectors)", labels=["group", "kind"])
        for group, kind, count, total in self._caches.sizes():
            entries.add_metric([group, kind], count)
            size.add_metric([group, kind], total)
        yield entries
        yield size


class GatewayMetrics:
    def __init__(self, table: RouteTable, admission: AdmissionController):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("llm_gateway_requests", "Inference requests answered, by replica group and status",
                                ["group", "code"], registry=self.registry)
        self.shed = Counter("llm_gateway_requests_shed", "Requests refused with 429 by admission control",
                            ["reason"], registry=self.registry)
        self.upstream_errors = Counter("llm_gateway_upstream_errors",
                                       "Failed upstream attempts (unreachable, disconnected, timeout, bad_response)",
                                       ["group", "upstream", "kind"], registry=self.registry)
        self.rechecks = Counter("llm_gateway_recheck_rounds",
                                "Probe rounds of the replicas out of rotation started by requests that found none in "
                                "rotation, by outcome (back: one or more answered 200; down: none did)",
                                ["outcome"], registry=self.registry)
        self.failovers = Counter("llm_gateway_failovers", "Requests moved to another replica after a failed attempt",
                                 registry=self.registry)
        self.overhead = Histogram("llm_gateway_overhead_seconds", "Time spent in the gateway itself per request",
                                  buckets=_OVERHEAD_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("llm_gateway_queue_wait_seconds", "Time admitted requests waited for a slot",
                                    buckets=_QUEUE_BUCKETS, registry=self.registry)
        self.duration = Histogram("llm_gateway_request_duration_seconds", "Arrival to last byte, by replica group",
                                  ["group"], buckets=_DURATION_BUCKETS, registry=self.registry)
        in_flight = Gauge("llm_gateway_requests_in_flight", "Requests holding an admission slot",
                          registry=self.registry)
        in_flight.set_function(lambda: admission.in_flight)
        queued = Gauge("llm_gateway_requests_queued", "Requests waiting for an admission slot",
                       registry=self.registry)
        queued.set_function(lambda: admission.queued)
        self.registry.register(_RouteCollector(table))
        self.cache_requests = Counter("llm_gateway_cache_requests", "Inference requests by response-cache result "
                                      "(hit, miss, bypass, not_cacheable, error), for groups with a cache",
                                      ["group", "result"], registry=self.registry)
        self.cache_lookups = Counter("llm_gateway_cache_lookups", "Response-cache lookups by kind (exact, semantic) "
                                     "and result (hit, miss, error)", ["group", "kind", "result"],
                                     registry=self.registry)
        self.cache_misses = Counter("llm_gateway_cache_misses", "Response-cache lookups that found nothing, by kind "
                                    "and reason", ["group", "kind", "reason"], registry=self.registry)
        self.cache_hits = Counter("llm_gateway_cache_hits", "Requests answered from the response cache",
                                  ["group", "served_from"], registry=self.registry)
        self.cache_lookup_seconds = Histogram("llm_gateway_cache_lookup_seconds", "Time of a response-cache step "
                                              "(exact lookup, embedding call, semantic search)", ["kind"],
                                              buckets=_CACHE_LOOKUP_BUCKETS, registry=self.registry)
        self.cache_evictions = Counter("llm_gateway_cache_evictions", "Response-cache entries dropped by this "
                                       "gateway, by reason (capacity, expired, dimension)", ["group", "kind", "reason"],
                                       registry=self.registry)
        self.cache_stores = Counter("llm_gateway_cache_stores", "Answers offered to the response cache, by outcome "
                                    "(stored, too_large, unfinished, unassemblable, failover, store_unavailable)",
                                    ["group", "outcome"], registry=self.registry)

    def watch_caches(self, caches) -> None:
        """Report the entries and bytes of ``caches`` (a CacheRegistry) at each scrape."""
        self.registry.register(_CacheSizeCollector(caches))
