"""Client disconnects abort requests in the simulated engine promptly; shutdown drains, then aborts."""
from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

from replica_harness import get, metric, spans_by_request_id, start_replica, stream, wait_until

from engine.config import EngineConfig


def _idle(replica) -> bool:
    return (metric(replica.url, "vllm:num_requests_running") == 0
            and metric(replica.url, "vllm:num_requests_waiting") == 0
            and replica.call(lambda: replica.state.driver.num_in_flight) == 0)


def _open_raw_request(url: str, body: dict) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


def test_streaming_client_disconnect_aborts_and_emits_no_span():
    replica, exporter = start_replica(EngineConfig(), seed=5)
    try:
        result = stream(replica.url + "/v1/completions",
                        {"prompt": "a long story", "max_tokens": 5000, "ignore_eos": True, "stream": True},
                        stop_after_events=3)
        request_id = result.events[0]["id"]
        hung_up = time.monotonic()
        assert wait_until(lambda: _idle(replica), timeout=3), "the aborted request is still in the engine"
        assert time.monotonic() - hung_up < 1.0
        time.sleep(0.2)
        # vLLM emits no llm_request span (and no success count) for a request aborted by its client.
        assert request_id not in spans_by_request_id(exporter)
        assert metric(replica.url, "vllm:e2e_request_latency_seconds_count") == 0
        assert get(replica.url + "/health").status == 200
    finally:
        replica.stop()


def test_non_streaming_and_queued_clients_that_leave_are_aborted():
    replica, _ = start_replica(EngineConfig(max_num_seqs=1), seed=6)
    try:
        running = _open_raw_request(replica.url, {"prompt": "first", "max_tokens": 5000, "ignore_eos": True})
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 1, timeout=3)
        queued = _open_raw_request(replica.url, {"prompt": "second", "max_tokens": 5000, "ignore_eos": True})
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_waiting") == 1, timeout=3)
        queued.close()
        assert wait_until(lambda: metric(replica.url, "vllm:num_requests_waiting") == 0, timeout=2)
        assert metric(replica.url, "vllm:num_requests_running") == 1
        running.close()
        assert wait_until(lambda: _idle(replica), timeout=2)
    finally:
        replica.stop()


def test_shutdown_lets_short_requests_finish_and_aborts_long_ones():
    replica, exporter = start_replica(EngineConfig(), seed=7)
    results = {}

    def client(name, max_tokens):
        results[name] = stream(replica.url + "/v1/completions",
                               {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True})

    threads = [threading.Thread(target=client, args=("short", 30)), threading.Thread(target=client, args=("long", 5000))]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 2, timeout=3)
    replica.stop(timeout=1.0)
    for thread in threads:
        thread.join(10)
    short, long = results["short"], results["long"]
    assert short.events[-1] == "[DONE]" and short.events[-2]["choices"][0]["finish_reason"] == "length"
    assert long.events[-1] == "[DONE]"
    assert long.events[-2]["error"]["code"] == 503
    # Spans of finished requests were flushed before the replica closed.
    assert short.events[0]["id"] in spans_by_request_id(exporter)
    assert long.events[0]["id"] not in spans_by_request_id(exporter)
