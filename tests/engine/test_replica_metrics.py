"""The replica's ``/metrics`` is vLLM's: names, labels, buckets; and it shows queueing under load."""
from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_harness import MODEL, get, metric, post, spans_by_request_id, start_replica, stream, wait_until

from engine.config import EngineConfig

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": ITL_BUCKETS,
    "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_BUCKETS,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
}
LABELS = {"model_name": MODEL, "engine": "0"}


def _families(url):
    return {family.name: family for family in text_string_to_metric_families(get(url + "/metrics").body.decode())}


def _buckets(family):
    bounds = [float(sample.labels["le"]) for sample in family.samples if sample.name.endswith("_bucket")]
    assert bounds[-1] == float("inf")
    return bounds[:-1]


def test_exposition_names_labels_and_buckets():
    replica, _ = start_replica(EngineConfig(), seed=1)
    try:
        assert post(replica.url + "/v1/completions", {"prompt": "warm up", "max_tokens": 4, "ignore_eos": True}).status == 200
        reply = get(replica.url + "/metrics")
        assert reply.headers["content-type"].startswith("text/plain")
        text = reply.body.decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample.labels)
        for name in GAUGES + COUNTERS:
            assert name in samples, f"{name} missing from /metrics"
            assert samples[name] == [LABELS], name
        assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}' in text
        families = _families(replica.url)
        for name, buckets in HISTOGRAMS.items():
            assert name in families, f"{name} missing from /metrics"
            assert _buckets(families[name]) == [float(b) for b in buckets], name
            assert {k: v for k, v in families[name].samples[0].labels.items() if k != "le"} == LABELS
        # Token-count histograms use vLLM's 1-2-5 buckets up to max_model_len.
        prompt_buckets = _buckets(families["vllm:request_prompt_tokens"])
        assert prompt_buckets[:6] == [1, 2, 5, 10, 20, 50] and prompt_buckets[-1] == 100000
        reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
                   if s.name == "vllm:request_success_total"}
        assert {"stop", "length", "abort"} <= reasons
        # The request above is accounted for.
        assert metric(replica.url, "vllm:request_success_total", finished_reason="length") == 1
        assert metric(replica.url, "vllm:generation_tokens_total") == 4
        assert metric(replica.url, "vllm:prompt_tokens_total") == 2
        assert metric(replica.url, "vllm:e2e_request_latency_seconds_count") == 1
        assert metric(replica.url, "vllm:inter_token_latency_seconds_count") == 3
        # Without speculative decoding vLLM does not register the spec-decode counters.
        assert "vllm:spec_decode_num_drafts_total" not in samples
    finally:
        replica.stop()


def test_speculative_config_exports_spec_decode_counters():
    config = EngineConfig.from_dict({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    replica, _ = start_replica(config, seed=2)
    try:
        prompt = "the cat sat on the mat and the cat sat on the mat " * 8
        assert post(replica.url + "/v1/completions", {"prompt": prompt, "max_tokens": 24, "ignore_eos": True}).status == 200
        drafts = metric(replica.url, "vllm:spec_decode_num_drafts_total")
        draft_tokens = metric(replica.url, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(replica.url, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0
        assert draft_tokens == pytest.approx(3 * drafts)
        assert 0 <= accepted <= draft_tokens
        positions = [metric(replica.url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                     for p in range(3)]
        assert sum(positions) == pytest.approx(accepted)
    finally:
        replica.stop()


def test_tiny_max_num_seqs_under_load_queues_requests():
    replica, exporter = start_replica(EngineConfig(max_num_seqs=2), seed=4)
    try:
        results = []

        def client(index):
            results.append(stream(replica.url + "/v1/completions",
                                  {"prompt": f"request number {index}", "max_tokens": 25, "ignore_eos": True,
                                   "stream": True}))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        peak_waiting = 0.0
        peak_running = 0.0
        while any(thread.is_alive() for thread in threads):
            peak_waiting = max(peak_waiting, metric(replica.url, "vllm:num_requests_waiting"))
            peak_running = max(peak_running, metric(replica.url, "vllm:num_requests_running"))
        for thread in threads:
            thread.join()
        assert len(results) == 8 and all(result.status == 200 for result in results)
        assert peak_running <= 2
        assert peak_waiting >= 1
        ids = [result.events[0]["id"] for result in results]
        assert wait_until(lambda: set(ids) <= set(spans_by_request_id(exporter)), timeout=5)
        spans = spans_by_request_id(exporter)
        queue_times = sorted(spans[i].attributes["gen_ai.latency.time_in_queue"] for i in ids)
        # Only two run at a time: the last pair waited for at least two earlier requests' 25 decode steps.
        assert queue_times[-1] > 2 * queue_times[0] + 0.05
        for request_id in ids:
            a = spans[request_id].attributes
            overhead = a["gen_ai.latency.e2e"] - (a["gen_ai.latency.time_in_queue"]
                                                  + a["gen_ai.latency.time_in_model_prefill"]
                                                  + a["gen_ai.latency.time_in_model_decode"])
            assert overhead >= 0
        assert metric(replica.url, "vllm:request_queue_time_seconds_sum") > 0.05
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 0, timeout=5)
        assert metric(replica.url, "vllm:num_requests_waiting") == 0
    finally:
        replica.stop()
