"""Request knobs reach the simulated scheduler: ``priority`` under scheduling_policy=priority, prefix caching."""
from __future__ import annotations

import threading

from replica_harness import metric, post, spans_by_request_id, start_replica, wait_until

from engine.config import EngineConfig


def test_priority_requests_jump_the_queue():
    replica, exporter = start_replica(EngineConfig(scheduling_policy="priority", max_num_seqs=1), seed=9)
    replies = {}

    def client(name, priority, max_tokens):
        replies[name] = post(replica.url + "/v1/completions",
                             {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority})

    try:
        # Long enough (~2.5 s) that the blocker still runs while the other two queue behind it, even when the
        # metric polls are slow on a loaded host (40 tokens, ~0.3 s, finished first in one CI run).
        blocker = threading.Thread(target=client, args=("blocker", 0, 400))
        blocker.start()
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 1, timeout=3)
        low = threading.Thread(target=client, args=("low", 5, 2))
        low.start()
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_waiting") == 1, timeout=3)
        high = threading.Thread(target=client, args=("high", -5, 2))
        high.start()
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_waiting") == 2, timeout=3)
        for thread in (blocker, low, high):
            thread.join(20)
        assert all(reply.status == 200 for reply in replies.values())
        ids = {name: reply.json()["id"] for name, reply in replies.items()}
        assert wait_until(lambda: set(ids.values()) <= set(spans_by_request_id(exporter)), timeout=5)
        spans = spans_by_request_id(exporter)
        low_span, high_span = spans[ids["low"]], spans[ids["high"]]
        # The later, more urgent request ran first and so waited less.
        assert high_span.end_time < low_span.end_time
        assert (high_span.attributes["gen_ai.latency.time_in_queue"]
                < low_span.attributes["gen_ai.latency.time_in_queue"])
    finally:
        replica.stop()


def test_repeated_prompt_hits_the_prefix_cache():
    replica, exporter = start_replica(EngineConfig(), seed=10)
    try:
        prompt = "A long shared system prompt that many requests repeat word for word. " * 40
        first = post(replica.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        hits_before = metric(replica.url, "vllm:prefix_cache_hits_total")
        second = post(replica.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert first.status == second.status == 200
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        queries = metric(replica.url, "vllm:prefix_cache_queries_total")
        hits = metric(replica.url, "vllm:prefix_cache_hits_total")
        assert queries == 2 * prompt_tokens
        # Every full block of the repeated prompt is a hit (the last partial block never is, as in vLLM).
        assert hits - hits_before >= prompt_tokens - 16
        assert hits_before == 0
        ids = [first.json()["id"], second.json()["id"]]
        assert wait_until(lambda: set(ids) <= set(spans_by_request_id(exporter)), timeout=5)
        spans = spans_by_request_id(exporter)
        # A cached prompt prefills faster.
        assert (spans[ids[1]].attributes["gen_ai.latency.time_in_model_prefill"]
                < spans[ids[0]].attributes["gen_ai.latency.time_in_model_prefill"])
    finally:
        replica.stop()
