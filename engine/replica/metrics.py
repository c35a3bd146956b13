"""vLLM's Prometheus metrics for the simulated replica: same names, labels and buckets as vLLM V1.

Source: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and
``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingProm``) on vllm-project/vllm main. Every
metric carries the labels ``model_name`` (the served model name) and ``engine`` (the
engine-core index, always ``"0"`` here: one core per replica). Counters are declared
without ``_total`` because prometheus_client appends it, exactly as vLLM declares them, so
the exposition reads ``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total`` …
Speculative-decoding counters exist only when the config speculates, as in vLLM.

Each replica owns a ``CollectorRegistry`` so several replicas can live in one process.

Three families are the simulator's own, not vLLM's (prefix ``engine_sim_``): how late the busy engine loop woke up
and how much simulated time it lost to a host that could not keep pace (``driver.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.config import EngineConfig

LABEL_NAMES = ("model_name", "engine")
ENGINE_INDEX = "0"
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
SIMULATOR_PREFIX = "engine_sim_"  # the simulator's own families, which real vLLM does not have
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50 … up to ``max_value``."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ReplicaMetrics:
    """The metric families one replica exports, bound to its label values."""

    def __init__(self, config: EngineConfig, *, model_name: str, num_gpu_blocks: int | None = None):
        resolved = config.resolved()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (model_name, ENGINE_INDEX)
        max_model_len = resolved.max_model_len or 1

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABEL_NAMES, registry=self.registry).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABEL_NAMES, registry=self.registry).labels(*labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, LABEL_NAMES, buckets=buckets, registry=self.registry).labels(*labels)

        # Scheduler state.
        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")

        # Counters.
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABEL_NAMES, "finished_reason"),
            registry=self.registry,
        )
        self.request_success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}

        # Histograms of counts.
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )

        # Histograms of timing intervals.
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # Speculative decoding (vLLM registers these only when a speculative config is set).
        self.spec_enabled = resolved.speculative_config is not None
        if self.spec_enabled:
            self.spec_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_num_accepted_tokens = counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                (*LABEL_NAMES, "position"),
                registry=self.registry,
            )
            self.spec_accepted_per_pos = [
                per_pos.labels(*labels, str(position))
                for position in range(resolved.speculative_config.num_speculative_tokens)
            ]

        # The simulator's own: how far the real-time loop keeps pace on this host (engine/replica/driver.py).
        self.loop_wake_lag = histogram(
            "engine_sim_loop_wake_lag_seconds",
            "Simulator only: how late the busy engine loop woke up for its next step, in seconds.", LOOP_LAG_BUCKETS
        )
        self.timeline_resyncs = counter(
            "engine_sim_timeline_resyncs",
            "Simulator only: times the busy engine's timeline restarted at the real clock (the loop was too late).",
        )
        self.timeline_lost = counter(
            "engine_sim_timeline_lost_seconds",
            "Simulator only: simulated time lost to those restarts; each lengthens the requests then running.",
        )

        # vLLM's cache_config_info: an info-style gauge fixed at 1 whose labels describe the KV cache.
        info = {
            "block_size": str(resolved.block_size),
            "cache_dtype": resolved.kv_cache_dtype,
            "enable_prefix_caching": str(resolved.enable_prefix_caching),
            "gpu_memory_utilization": str(resolved.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks) if num_gpu_blocks is not None else "None",
            "engine": ENGINE_INDEX,
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", tuple(info), registry=self.registry
        ).labels(**info).set(1)
