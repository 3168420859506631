"""Prometheus metrics for the server, with vLLM's names and ``model_name`` label.

The prefix is one per server: ``pagedllm:`` by default, or ``vllm:`` (``--metrics-prefix vllm``)
so that dashboards and alerts written for vLLM read this server unchanged. Not both at once: each
series twice would double every sum() over a fleet.

Each ServerMetrics owns its own CollectorRegistry (not prometheus-client's global default), so a
process can build several apps (tests do) without "Duplicated timeseries" errors.

Three sources:
* engine state (running/waiting requests, KV usage, counters, tokens per step) comes from
  LLMEngine.get_stats(), as the engine thread last published it (at most once a second while it
  steps: AsyncLLMEngine.get_stats_snapshot, so a scrape never queries the engine thread), passed
  here with ``update_engine_stats`` right before a scrape; a custom collector exposes it, so counters keep
  the engine's own cumulative values. With data-parallel replicas (``update_replica_stats``) each
  replica's series carries a ``replica`` label, next to the router's counters per replica;
* per-request latencies and token counts are observed by ``observe_output``, called in the
  engine thread for every output (prometheus-client's metric objects are thread-safe);
* request parameters (n, max_tokens) by ``observe_params`` as a request is added.

``exposition`` renders the registry for a scrape, and only when something changed: a render takes
milliseconds (4 ms for the default model's buckets), so 300 scrapes rendered one by one cost the
event loop more than a second. While requests run, at most once per RENDER_INTERVAL_S (as often
as the engine publishes its stats); once the engine is idle, as soon as anything changed, so a
scrape after a response counts that response.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.outputs import RequestOutput
from pagedllm.spec_decode.metrics import spec_decode_metrics

PREFIXES = ("pagedllm", "vllm")
# vLLM's, for a histogram of tokens per engine step
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_N_BUCKETS = [1, 2, 5, 10, 20]
RENDER_INTERVAL_S = 1.0  # see the module docstring


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for token counts)."""
    out, mantissa, exponent = [], [1, 2, 5], 0
    while True:
        for m in mantissa:
            v = m * 10**exponent
            if v > limit:
                return out
            out.append(v)
        exponent += 1


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
    ("kv_cache_capacity_tokens", "kv_slots_total", "Tokens the KV cache holds (all blocks)."),
    (
        "kv_cache_capacity_bytes",
        "kv_cache_bytes",
        "Bytes of the KV cache (its kv_cache_dtype elements, and int8 caches' scales).",
    ),
]
_COUNTERS = [
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache block lookups (prompt blocks, to the first miss)."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache block lookups that hit a cached block."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
]


# Data parallel only: (metric name without prefix, key in a replica's /stats entry, help), per replica.
_ROUTER_COUNTERS = [
    ("router_requests_routed", "router_requests_routed", "Requests the router sent to this replica."),
    (
        "router_prefix_matched_tokens",
        "router_prefix_matched_tokens",
        "Prompt tokens of the requests sent to this replica that the router's record of its prefix cache matched.",
    ),
]


class _EngineStatsCollector(Collector):
    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        owner = self.owner
        replicas = owner.replica_stats
        if replicas is None:  # one engine: the model_name label only
            series = [([owner.model_name], owner.engine_stats)]
            labels = ["model_name"]
        else:
            series = [([owner.model_name, str(r["replica"])], r) for r in replicas if r.get("alive")]
            labels = ["model_name", "replica"]
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(owner.prefix + name, doc, labels=labels)
            for values, stats in series:
                g.add_metric(values, float(stats.get(key, 0) or 0))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(owner.prefix + name, doc, labels=labels)
            for values, stats in series:
                c.add_metric(values, float(stats.get(key, 0) or 0))
            yield c
        yield from spec_decode_metrics(owner.prefix, labels, series)
        h = HistogramMetricFamily(
            owner.prefix + "iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=labels
        )
        for values, stats in series:
            per_step = stats.get("iteration_tokens") or {}
            buckets = [(str(b), sum(c for n, c in per_step.items() if n <= b)) for b in ITERATION_TOKENS_BUCKETS]
            buckets.append(("+Inf", sum(per_step.values())))
            h.add_metric(values, buckets, sum_value=float(sum(n * c for n, c in per_step.items())))
        yield h
        if replicas is not None:
            yield from self._replica_metrics(replicas)
        if owner.cache_config:
            name = owner.prefix + "cache_config_info"
            info = GaugeMetricFamily(name, "Information of the LLMEngine CacheConfig", labels=list(owner.cache_config))
            info.add_metric(list(owner.cache_config.values()), 1.0)
            yield info

    def _replica_metrics(self, replicas: list[dict]) -> Iterator[Metric]:
        """Every replica's liveness and router counters, dead ones included (their counts stay)."""
        owner = self.owner
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily(owner.prefix + "replica_up", "1 while this data-parallel replica runs.", labels=labels)
        for r in replicas:
            up.add_metric([owner.model_name, str(r["replica"])], 1.0 if r.get("alive") else 0.0)
        yield up
        for name, key, doc in _ROUTER_COUNTERS:
            c = CounterMetricFamily(owner.prefix + name, doc, labels=labels)
            for r in replicas:
                c.add_metric([owner.model_name, str(r["replica"])], float(r.get(key, 0)))
            yield c


class ServerMetrics:
    """The /metrics registry of one server instance.

    ``prefix``: "pagedllm" or "vllm" (see the module docstring). ``max_model_len`` bounds the
    token-count histograms' buckets, as in vLLM. ``cache_config``: the labels of cache_config_info
    (block_size, num_gpu_blocks, ...), as strings.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix: str = "pagedllm",
        max_model_len: int = 2048,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}.")
        self.model_name = model_name
        self.prefix = prefix + ":"
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_stats: dict = {}
        self.replica_stats: list[dict] | None = None  # data parallel: each replica's stats
        self.cache_config = dict(cache_config or {})
        self._observations = 0  # bumped by every observe_*: a changed count means a changed exposition
        self._rendered: tuple[tuple, bytes, float] | None = None  # (what it showed, body, when)
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: tuple | list) -> Histogram:
            return Histogram(self.prefix + name, help_text, labels, buckets=buckets, registry=self.registry).labels(
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
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in the PREFILL phase for a request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in the DECODE phase for a request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in the RUNNING phase for a request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self._success = Counter(
            self.prefix + "request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(self))

    def update_engine_stats(self, stats: dict) -> None:
        self.engine_stats = dict(stats)

    def update_replica_stats(self, replicas: list[dict]) -> None:
        """Data parallel: each replica's /stats entry (``replica``, ``alive``, router counters)."""
        self.replica_stats = [dict(r) for r in replicas]

    def observe_params(self, n: int, max_tokens: int) -> None:
        """One engine request's parameters, as it is added (max_tokens as resolved: the request's
        or the rest of the context)."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        self._observations += 1

    def observe_output(self, out: RequestOutput, prev_token_time: float | None) -> None:
        """Latency observations for one step's output of one request (engine thread)."""
        self._observations += 1  # a lost update of two threads still changes it
        m = out.metrics
        arrival = m.get("arrival_time")
        last = m.get("last_token_time")
        first = m.get("first_token_time")
        scheduled = m.get("first_scheduled_time")
        if prev_token_time is None:
            if first is not None and arrival is not None:
                self.ttft.observe(max(0.0, first - arrival))
            if scheduled is not None and arrival is not None:
                self.queue_time.observe(max(0.0, scheduled - arrival))
            if scheduled is not None and first is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
        elif last is not None:
            self.itl.observe(max(0.0, last - prev_token_time))
        if out.finished:
            self._observe_finished(out, arrival, scheduled, first, m.get("finished_time", last))

    def _observe_finished(
        self,
        out: RequestOutput,
        arrival: float | None,
        scheduled: float | None,
        first: float | None,
        end: float | None,
    ) -> None:
        if end is not None and arrival is not None:
            self.e2e.observe(max(0.0, end - arrival))
        if end is not None and scheduled is not None:
            self.inference_time.observe(max(0.0, end - scheduled))
        if end is not None and first is not None:
            decode = max(0.0, end - first)
            self.decode_time.observe(decode)
            generated = len(out.outputs[0].token_ids) if out.outputs else 0
            if generated > 1:  # the first token's time is the prefill's
                self.tpot.observe(decode / (generated - 1))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        for c in out.outputs:
            self.generation_tokens.observe(len(c.token_ids))
            self._success.labels(self.model_name, c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this registry."""
        return generate_latest(self.registry)

    def exposition(self, stats: dict) -> bytes:
        """The /metrics body for the engine's published ``stats`` (with a ``replicas`` list under
        data parallelism), rendered again only when needed (see the module docstring)."""
        shown = (self._observations, stats)  # read before rendering: what changes during it shows next time
        if self._rendered is not None:
            last, body, when = self._rendered
            if last == shown:
                return body
            busy = stats.get("num_requests_running") or stats.get("num_requests_waiting")
            if busy and time.monotonic() - when < RENDER_INTERVAL_S:
                return body
        if "replicas" in stats:  # data parallel: one series per replica
            self.update_replica_stats(stats["replicas"])
        else:
            self.update_engine_stats(stats)
        body = self.render()
        self._rendered = (shown, body, time.monotonic())
        return body
