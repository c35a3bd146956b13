"""The response cache's parts on their own: configuration (routes and fleet files), keys and namespaces, stream
assembly and replay, the vector index, and the simulated replica's stand-in embeddings endpoint."""
from __future__ import annotations

import asyncio
import base64

import aiohttp
import numpy as np
import orjson
import pytest
from multidict import CIMultiDict

from engine.config import EngineConfig
from engine.gateway import RoutesError, parse_routes
from engine.gateway.cache_answers import Unassemblable, assemble_stream, finished_cleanly, render_stream
from engine.gateway.cache_config import CacheConfigError, parse_cache
from engine.gateway.cache_keys import NotCacheable, canonical_request, key_bytes, namespace, semantic_query
from engine.gateway.routing import RouteTable
from engine.gateway.semantic import EXACT_ROWS, VectorIndex
from engine.launcher.control_api import build_control_app
from engine.launcher.fleet_controller import FleetController
from engine.launcher.fleet_spec import FleetSpec, FleetSpecError
from engine.replica.embeddings import embed_text
from engine.replica.server import ReplicaServer

FULL = {"nondeterministic": True, "max_entry_bytes": 4096, "store": "redis://cache.internal:6379/2",
        "key_prefix": "gw:cache", "store_timeout_s": 0.1, "password_env": "REDIS_PASSWORD",
        "exact": {"enabled": True, "ttl_s": 60, "max_entries": 5},
        "semantic": {"enabled": True, "embeddings_url": "http://127.0.0.1:8101/v1/embeddings", "model": "bge",
                     "threshold": 0.95, "ttl_s": 30, "max_entries": 7, "timeout_s": 0.2, "api_key_env": "EMBED_KEY",
                     "client_threshold": True}}


@pytest.mark.parametrize("cache, message", [
    ({"exact": {"enabled": True, "ttl_s": 0}}, "cache.exact.ttl_s: must be > 0"),
    ({"exact": {"enabled": "yes"}}, "cache.exact.enabled: must be true or false"),
    ({"exact": {"enabled": True, "max_entries": 2.5}}, "cache.exact.max_entries: must be an integer"),
    ({"exact": {"enabled": True, "size": 1}}, "cache.exact: unknown field(s) size"),
    ({"semantic": {"enabled": True, "model": "m"}}, "cache.semantic.embeddings_url: required"),
    ({"semantic": {"enabled": True, "embeddings_url": "http://h/v1/embeddings"}}, "cache.semantic.model"),
    ({"semantic": {"enabled": True, "embeddings_url": "ftp://h/e", "model": "m"}}, "must start with http://"),
    ({"semantic": {"enabled": True, "embeddings_url": "http://u:p@h/e", "model": "m"}}, "must not carry credentials"),
    ({"semantic": {"threshold": 1.5}}, "cache.semantic.threshold: must be > 0 and ≤ 1"),
    ({"semantic": {"timeout_s": float("nan")}}, "cache.semantic.timeout_s: must be a number"),
    ({"semantic": {"client_threshold": "yes"}}, "cache.semantic.client_threshold: must be true or false"),
    ({"store": "mysql://h/1"}, "cache.store: 'mysql://h/1' must start with redis:// or rediss://"),
    ({"store": "redis://h:6379/x"}, "the database in"),
    ({"store": 5}, "cache.store: must be 'memory' or a redis:// URL"),
    ({"key_prefix": "a b"}, "cache.key_prefix"),
    ({"max_entry_bytes": 10}, "cache.max_entry_bytes: must be an integer in 1024..67108864"),
    ({"exact": {"enabled": True}, "stream": True}, "cache: unknown field(s) stream"),
    ([1], "cache: must be an object"),
])
def test_every_cache_setting_is_checked(cache, message):
    with pytest.raises(CacheConfigError) as caught:
        parse_cache(cache)
    assert message in str(caught.value)
    with pytest.raises(RoutesError, match="group 'g': cache"):
        parse_routes([{"name": "g", "weight": 1, "upstreams": ["http://127.0.0.1:9"], "cache": cache}])


def test_cache_settings_round_trip_through_routes_and_fleet_files(tmp_path):
    spec = parse_cache(FULL)
    assert spec.semantic.threshold == 0.95 and spec.exact.max_entries == 5 and spec.store.endswith("/2")
    without = {key: value for key, value in FULL["semantic"].items() if key != "client_threshold"}
    assert spec.semantic.client_threshold and not parse_cache({"semantic": without}).semantic.client_threshold
    assert parse_cache(spec.as_dict()) == spec
    assert parse_cache(None) is None and parse_cache({}) is None  # nothing enabled: off
    [group] = parse_routes([{"name": "g", "weight": 1, "upstreams": ["http://127.0.0.1:9"], "cache": FULL}])
    assert group.cache == spec and parse_routes([group.as_dict()])[0] == group
    table = RouteTable([group])
    table.set_weights({"g": 3})
    assert table.specs()[0].cache == spec and table.snapshot()["groups"][0]["cache"] == spec.as_dict()

    fleet = {"run_dir": str(tmp_path), "groups": [{"name": "baseline", "config": {}, "cache": FULL},
                                                  {"name": "plain", "config": {}}]}
    loaded = FleetSpec.from_dict(fleet, env={})
    assert loaded.groups[0].cache == spec and loaded.groups[1].cache is None
    routes = FleetController(loaded, control_app=build_control_app)._routes()
    assert [route["cache"] for route in routes] == [spec.as_dict(), None]
    assert [g.cache for g in parse_routes([dict(r, upstreams=["http://127.0.0.1:9"]) for r in routes[:1]])] == [spec]
    with pytest.raises(FleetSpecError, match=r"group 'baseline': cache.semantic.threshold"):
        FleetSpec.from_dict({"groups": [{"name": "baseline", "config": {},
                                         "cache": {"semantic": {"threshold": -1}}}]}, env={})


def test_the_key_ignores_delivery_and_caller_fields_and_keeps_everything_else():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5}

    def key(**changes):
        return key_bytes("g", "ns", "chat", canonical_request(dict(base, **changes)))

    same = [key(stream=True, stream_options={"include_usage": True}), key(user="alice", metadata={"a": 1}),
            key(temperature=0.0), key(observatory_cache="refresh")]
    assert all(k == key() for k in same)
    different = [key(max_tokens=6), key(temperature=0.5), key(seed=1), key(stop=["\n"]), key(n=2), key(top_p=0.9),
                 key(tools=[{"type": "function", "function": {"name": "f"}}]), key(logprobs=True),
                 key(response_format={"type": "json_object"}), key(some_engine_knob=1), key(model="m2"),
                 key(messages=[{"role": "user", "content": "hi!"}])]
    assert len({key(), *different}) == len(different) + 1
    assert key_bytes("g", "ns", "text_completion", canonical_request(base)) != key()
    assert key_bytes("other", "ns", "chat", canonical_request(base)) != key()
    assert orjson.loads(key())["request"] == {"max_tokens": 5, "messages": [{"content": "hi", "role": "user"}],
                                              "model": "m", "temperature": 0}
    with pytest.raises(NotCacheable, match="invalid_number"):
        canonical_request(dict(base, top_p=float("inf")))


def test_namespaces_separate_projects_and_credentials():
    def ns(**headers):
        return namespace(CIMultiDict({k.replace("_", "-"): v for k, v in headers.items()}))

    assert ns() == "anonymous"
    spaces = {ns(OpenAI_Project="A"), ns(OpenAI_Project="B"), ns(Authorization="Bearer 1"),
              ns(Authorization="Bearer 2"), ns(Authorization="Bearer 1", OpenAI_Project="A"), ns(Authorization="")}
    assert len(spaces) == 6 and "anonymous" not in spaces
    assert ns(Authorization="Bearer 1") == ns(Authorization="Bearer 1")
    assert "Bearer" not in ns(Authorization="Bearer 1")  # a hash, never the credential


def test_the_semantic_query_is_the_last_user_text_and_the_rest_is_context():
    request = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "old"},
                            {"role": "assistant", "content": "A"},
                            {"role": "user", "content": [{"type": "text", "text": "new"},
                                                         {"type": "text", "text": "question"}]}]}
    text, context = semantic_query("chat", request)
    assert text == "new\nquestion" and context["messages"][3]["content"] is None
    assert context["messages"][1]["content"] == "old"
    assert semantic_query("text_completion", {"prompt": ["p"]})[0] == "p"
    for operation, bad, reason in (
            ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "not_text"),
            ("chat", {"messages": [{"role": "system", "content": "only"}]}, "not_text"),
            ("text_completion", {"prompt": [1, 2, 3]}, "not_text"),
            ("text_completion", {"prompt": "x" * 20_000}, "too_large")):
        with pytest.raises(NotCacheable, match=reason):
            semantic_query(operation, bad)


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"


def test_streams_assemble_into_the_answer_and_replay_as_one():
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    raw = _sse(
        dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
        dict(base, choices=[{"index": 0, "delta": {"content": "Hel"}, "logprobs": {"content": [{"token": "Hel"}]},
                             "finish_reason": None}]),
        dict(base, choices=[{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"a\""}}]},
            "finish_reason": None}]),
        dict(base, choices=[{"index": 0, "delta": {"content": "lo", "tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}, "logprobs": {"content": [{"token": "lo"}]},
            "finish_reason": "tool_calls"}]),
        dict(base, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    answer = assemble_stream(raw, "chat")
    [choice] = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"a\": 1}"}}]}
    assert choice["logprobs"] == {"content": [{"token": "Hel"}, {"token": "lo"}]}
    assert choice["finish_reason"] == "tool_calls" and answer["usage"]["total_tokens"] == 5
    assert answer["object"] == "chat.completion" and finished_cleanly(answer)
    replayed = assemble_stream(render_stream(answer, "chat", include_usage=True), "chat")
    assert replayed == answer

    text = _sse({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
                 {"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}},
                 {"index": 1, "text": "b", "finish_reason": "length"}]},
                {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
                 {"index": 0, "text": "c", "logprobs": {"tokens": ["c"], "token_logprobs": [-2.0]},
                  "finish_reason": "stop", "stop_reason": None}]})
    completion = assemble_stream(text, "text_completion")
    assert [c["text"] for c in completion["choices"]] == ["ac", "b"]
    assert completion["choices"][0]["logprobs"] == {"tokens": ["a", "c"], "token_logprobs": [-1.0, -2.0]}
    assert assemble_stream(render_stream(completion, "text_completion", False), "text_completion") == completion

    unfinished = assemble_stream(_sse(dict(base, choices=[{"index": 0, "delta": {"content": "x"}}])), "chat")
    assert not finished_cleanly(unfinished)
    for bad in (_sse(dict(base, choices=[{"index": 0, "delta": {"audio": {"data": "..."}}}])),
                _sse({"error": {"message": "boom"}}), b"data: {not json\n\n", _sse(dict(base, choices=[]))):
        with pytest.raises(Unassemblable):
            assemble_stream(bad, "chat")


def _unit(*values) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_the_vector_index_matches_within_a_context_and_stays_bounded():
    evictions = []
    index = VectorIndex(3, on_evict=lambda reason, count: evictions.append((reason, count)))
    index.add("p", "a", 1, _unit(1, 0, 0), expires=100, now=0)
    index.add("p", "b", 2, _unit(0.9, 0.1, 0), expires=100, now=0)  # another context (tag)
    index.add("q", "c", 1, _unit(0, 1, 0), expires=100, now=0)
    entry, score, _ = index.search("p", 1, _unit(0.95, 0.05, 0), now=1, threshold=0.9)
    assert entry == "a" and 0.99 < score <= 1.0
    assert index.search("p", 1, _unit(0, 0, 1), now=1, threshold=0.9)[0] is None  # below the threshold
    assert index.search("p", 1, _unit(1, 0, 0), now=100, threshold=0.5)[0] is None  # expired
    index.add("q", "d", 1, _unit(0, 0, 1), expires=100, now=0)  # over the bound: "b", the least recently used, goes
    assert len(index) == 3 and "b" not in index and "a" in index and evictions == [("capacity", 1)]
    index.add("p", "e", 1, np.ones(5, dtype=np.float32) / np.sqrt(5), expires=100, now=0)  # a new embedding model
    assert "a" not in index and ("dimension", 1) in evictions
    assert index.search("p", 1, _unit(1, 0, 0), now=1, threshold=0.0) == (None, -1.0, None)

    # Past EXACT_ROWS a lookup scores only the rows nearest by sign bits: it must find what the full product finds.
    rows = EXACT_ROWS + 1000
    big = VectorIndex(2 * rows)
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((rows, 128)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for number, vector in enumerate(vectors):
        big.add("p", str(number), number % 2, vector, expires=50 if number % 4 == 1 else 500, now=0)
    for number in range(0, rows, 50):  # holes filled by the last rows
        big.remove(str(number))
    for number in (n for n in range(1, rows, 97) if n % 50):
        query = vectors[number] + rng.standard_normal(128).astype(np.float32) * 0.05
        query /= np.linalg.norm(query)
        live = [row for row in range(rows) if row % 2 == number % 2 and row % 50]
        expected = live[int(np.argmax(vectors[live] @ query))]
        found, score, _ = big.search("p", number % 2, query, now=1, threshold=0.8)
        assert found == str(expected) and abs(score - float(vectors[expected] @ query)) < 1e-5
    # Every bit counts: 300 rows agree with the query on its first 64 signs only; the match differs in 3 of them.
    query = vectors[3]
    decoys = rng.standard_normal((300, 128)).astype(np.float32)
    decoys[:, :64] = np.abs(decoys[:, :64]) * np.sign(query[:64])
    match = query.copy()
    match[np.argsort(np.abs(query[:64]))[:3]] *= -1
    for number, vector in enumerate([*decoys, match]):
        big.add("d", f"d{number}", 0, vector / np.linalg.norm(vector), expires=500, now=0)
    for number, vector in enumerate(vectors[10:EXACT_ROWS + 10]):
        big.add("d", f"filler-{number}", 0, vector, expires=500, now=0)
    assert big.search("d", 0, query, now=1, threshold=0.9)[0] == "d300"
    big.add("p", "late", 0, vectors[0], expires=500, now=60)
    assert big.search("p", 1, vectors[1], now=60, threshold=0.99)[0] is None  # rows 1, 5, 9... expired at 50
    assert big.search("p", 1, vectors[3], now=60, threshold=0.99)[0] == "3"


def test_the_stand_in_embedding_model_and_its_endpoint():
    france = embed_text("What is the capital of France?")
    assert france.dtype == np.float32 and france.shape == (384,) and abs(np.linalg.norm(france) - 1) < 1e-5
    assert np.array_equal(france, embed_text("What is the capital of France?"))
    assert float(france @ embed_text("what is the capital city of France")) > 0.9
    assert float(france @ embed_text("How do I reverse a list in Python?")) < 0.3
    assert not embed_text("   ").any()

    async def scenario():
        replica = ReplicaServer(EngineConfig(), served_model_name="stand-in", embedding_dimension=64)
        async with replica, aiohttp.ClientSession() as session:
            replies = []
            for body in ({"model": "stand-in", "input": ["a b", "c"]},
                         {"input": "a b", "encoding_format": "base64"},
                         {"model": "other", "input": "x"}, {"input": [1, 2]}, {"input": ""},
                         {"input": "x", "dimensions": 32}, {"input": "x", "encoding_format": "int8"}):
                async with session.post(replica.url + "/v1/embeddings", json=body) as resp:
                    replies.append((resp.status, await resp.json()))
            return replies

    replies = asyncio.run(scenario())
    (status, listed), (_, encoded), *refused = replies
    assert status == 200 and listed["object"] == "list" and listed["model"] == "stand-in"
    assert [d["index"] for d in listed["data"]] == [0, 1] and len(listed["data"][0]["embedding"]) == 64
    assert listed["usage"] == {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0,
                               "prompt_tokens_details": None}
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, listed["data"][0]["embedding"])
    assert [status for status, _ in refused] == [404, 400, 400, 400, 400]
    assert all(body["object"] == "error" for _, body in refused)
