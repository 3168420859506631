"""Prometheus metrics for the server, named like vLLM's (``vllm:x`` becomes ``pagedllm:x``).

Each ServerMetrics owns its own CollectorRegistry (not prometheus-client's global default), so a
process can build several apps (tests do) without "Duplicated timeseries" errors.

Two sources:
* engine state (running/waiting requests, KV usage, counters) comes from LLMEngine.get_stats(),
  snapshotted by the engine thread and pushed here with ``update_engine_stats`` right before a
  scrape; a custom collector exposes it, so counters keep the engine's own cumulative values;
* per-request latencies are observed by ``observe_output``, called in the engine thread for
  every output (prometheus-client's metric objects are thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.outputs import RequestOutput

PREFIX = "pagedllm:"

# vLLM's buckets, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]

# (metric name without prefix, key in LLMEngine.get_stats(), help). Gauges, then counters.
_GAUGES = [
    ("num_requests_running", "num_requests_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    (
        "kv_cache_waste_perc",
        "kv_waste",
        "Fraction of reserved KV slots not holding a token (1 - used / reserved). 0 means no waste.",
    ),
    ("kv_blocks_shared", "kv_shared_blocks", "KV blocks referenced by more than one sequence."),
    ("num_free_kv_blocks", "num_free_kv_blocks", "KV blocks free for new tokens."),
]
_COUNTERS = [
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
]


class _EngineStatsCollector(Collector):
    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        stats = self.owner.engine_stats
        labels = ["model_name"]
        values = [self.owner.model_name]
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, float(stats.get(key, 0) or 0))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(values, float(stats.get(key, 0) or 0))
            yield c


class ServerMetrics:
    """The /metrics registry of one server instance."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_stats: dict = {}
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: tuple | list) -> Histogram:
            return Histogram(PREFIX + name, help_text, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in the WAITING phase for a request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(self))

    def update_engine_stats(self, stats: dict) -> None:
        self.engine_stats = dict(stats)

    def observe_output(self, out: RequestOutput, prev_token_time: float | None) -> None:
        """Latency observations for one step's output of one request (engine thread)."""
        m = out.metrics
        arrival = m.get("arrival_time")
        last = m.get("last_token_time")
        if prev_token_time is None:
            first = m.get("first_token_time")
            if first is not None and arrival is not None:
                self.ttft.observe(max(0.0, first - arrival))
            scheduled = m.get("first_scheduled_time")
            if scheduled is not None and arrival is not None:
                self.queue_time.observe(max(0.0, scheduled - arrival))
        elif last is not None:
            self.itl.observe(max(0.0, last - prev_token_time))
        if out.finished:
            end = m.get("finished_time", last)
            if end is not None and arrival is not None:
                self.e2e.observe(max(0.0, end - arrival))
            for c in out.outputs:
                self._success.labels(self.model_name, c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this registry."""
        return generate_latest(self.registry)
