"""Hostile and malformed input gets a clear vLLM-style 4xx; the replica never crashes."""
from __future__ import annotations

import pytest
from replica_harness import get, post, spans_by_request_id, start_replica, wait_until

from engine.config import EngineConfig

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

CASES = [
    (COMPLETIONS, b"this is not json", 400, "not valid JSON"),
    (COMPLETIONS, b"", 400, "empty"),
    (COMPLETIONS, b"[1, 2, 3]", 400, "JSON object"),
    (COMPLETIONS, b"\xff\xfe\x00garbage", 400, "not valid JSON"),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 1e400}', 400, "not valid JSON"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 123456789012345678901234567890}', 400, "must be an integer"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "'prompt' is required"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt cannot be empty"),
    (COMPLETIONS, {"prompt": "   "}, 400, "prompt cannot be empty"),
    (COMPLETIONS, {"prompt": []}, 400, "one prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "one prompt"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt cannot be empty"),
    (COMPLETIONS, {"prompt": [1, -2]}, 400, "token ids"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, 400, "'prompt' must be"),
    (COMPLETIONS, {"prompt": "x", "model": 7}, 400, "'model' must be a string"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "at least 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -5}, 400, "at least 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}, 400, "maximum context length"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "12"}, 400, "must be an integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, 400, "must be an integer"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "'stream' must be true or false"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=True"),
    (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": []}, 400, "stream_options"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "non-negative"),
    (COMPLETIONS, {"prompt": "x", "temperature": "warm"}, 400, "must be a number"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 3}, 400, "n=1"),
    (COMPLETIONS, {"prompt": "x", "priority": 5}, 400, "Priority scheduling is not enabled"),
    (COMPLETIONS, {"prompt": "x", "ignore_eos": 1}, 400, "'ignore_eos' must be true or false"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 3, "min_tokens": 9}, 400, "min_tokens"),
    (COMPLETIONS, {"prompt": "word " * 131072}, 400, "maximum context length"),
    (CHAT, {"messages": "hello"}, 400, "'messages'"),
    (CHAT, {"messages": []}, 400, "at least one message"),
    (CHAT, {"messages": [42]}, 400, "must be an object"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content must be"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "text-only"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "'text'"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "at least 1"),
]


@pytest.fixture(scope="module")
def replica():
    server, exporter = start_replica(EngineConfig(), seed=8)
    try:
        yield server, exporter
    finally:
        server.stop()


@pytest.mark.parametrize(("path", "body", "status", "fragment"), CASES)
def test_bad_input_is_refused_with_a_clear_message(replica, path, body, status, fragment):
    server, _ = replica
    if isinstance(body, bytes):
        reply = post(server.url + path, raw=body)
    else:
        reply = post(server.url + path, body)
    assert reply.status == status, reply.body
    error = reply.json()
    assert error["object"] == "error" and error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert fragment in error["message"]


def test_body_over_the_limit_is_413():
    server, _ = start_replica(EngineConfig(), max_body_bytes=4096)
    try:
        reply = post(server.url + COMPLETIONS, {"prompt": "x" * 10_000})
        assert reply.status == 413
        assert "too large" in reply.json()["message"]
    finally:
        server.stop()


def test_unknown_routes_and_methods_answer_like_vllm(replica):
    server, _ = replica
    assert get(server.url + "/v1/no-such-route").status == 404
    assert get(server.url + COMPLETIONS).status == 405
    assert get(server.url + "/v1/embeddings").status == 405  # served (the stand-in embedding model), by POST


def test_still_serving_after_hostile_input_and_a_broken_traceparent(replica):
    server, exporter = replica
    reply = post(server.url + COMPLETIONS, {"prompt": "still alive?", "max_tokens": 2},
                 headers={"traceparent": "00-zzzz-not-a-trace-01"})
    assert reply.status == 200
    request_id = reply.json()["id"]
    assert wait_until(lambda: request_id in spans_by_request_id(exporter), timeout=5)
    assert spans_by_request_id(exporter)[request_id].parent is None
    assert get(server.url + "/health").status == 200
