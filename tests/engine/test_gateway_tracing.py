"""Gateway tracing: one SERVER span per request, W3C traceparent in and out, GenAI attributes the platform reads."""
from __future__ import annotations

import aiohttp
import orjson
from gateway_fakes import MODEL, FakeReplica, chat, gateway, groups, run, settings, sse_events, tracing
from ingest.otlp import Limits, decode_protobuf
from multidict import CIMultiDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.trace import SpanKind, StatusCode
from replica_harness import start_replica

from collectors.base import Role
from collectors.registry import normalise_span
from engine.config import EngineConfig
from engine.gateway import GATEWAY_KEY, build_gateway_app

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"


def _platform_view(span):
    """The span as the platform sees it: OTLP protobuf from the SDK's encoder, decoded by the ingest path."""
    decoded = decode_protobuf(encode_spans([span]).SerializeToString(), Limits())
    assert len(decoded.spans) == 1, decoded.rejected
    return decoded.spans[0]


def test_streaming_span_is_the_gateway_hop_and_the_engine_parent():
    provider, exporter = tracing()

    async def scenario():
        replica = FakeReplica("a", chunks=4, delay=0.05)
        await replica.start()
        async with gateway(groups(("baseline", 9, [replica]), ("canary", 0, ["http://127.0.0.1:9"])),
                           tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            headers = {"traceparent": TRACEPARENT}
            async with session.post(gw.url + "/v1/chat/completions", json=chat(stream=True), headers=headers) as r:
                assert r.status == 200
                await r.read()
        await replica.stop()
        return replica

    replica = run(scenario())
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, "no client span for the upstream call"
    span = spans[0]
    assert span.name == f"chat {MODEL}" and span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == CLIENT_SPAN_ID
    # The replica got the gateway span's own context: its llm_request span becomes the gateway span's child.
    upstream_traceparent = replica.requests[0]["headers"]["traceparent"]
    assert upstream_traceparent == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"

    attrs = span.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "vllm"
    assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.response.id"].startswith("chatcmpl-a-")
    assert attrs["gen_ai.usage.input_tokens"] == 7 and attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert 0.05 <= attrs["gen_ai.response.time_to_first_chunk"] < (span.end_time - span.start_time) / 1e9
    assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == replica.port
    assert attrs["http.response.status_code"] == 200
    assert attrs["llm_observatory.replica_group"] == "baseline"
    assert "error.type" not in attrs and span.status.status_code == StatusCode.UNSET
    assert span.resource.attributes["service.name"] == "llm-gateway"

    call = normalise_span(_platform_view(span))
    assert call is not None and call.role == Role.GATEWAY and call.convention == "genai"
    assert call.model == MODEL and call.request_id == attrs["gen_ai.response.id"]
    assert (call.prompt_tokens, call.completion_tokens) == (7, 4)
    assert call.streaming is True and call.ttft_ms >= 50 and not call.is_error
    assert call.parent_span_id == CLIENT_SPAN_ID


def test_request_without_traceparent_starts_a_trace_and_completion_operation_is_named():
    provider, exporter = tracing()

    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), tracer_provider=provider) as gw, \
                aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as resp:
                assert resp.status == 200
        await replica.stop()
        return replica

    replica = run(scenario())
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.request.stream"] is False
    assert "gen_ai.response.time_to_first_chunk" not in span.attributes
    assert replica.requests[0]["headers"]["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"
    assert normalise_span(_platform_view(span)).role == Role.GATEWAY


def test_correlation_headers_of_a_caller_without_traceparent_are_recorded():
    """A caller that passed no traceparent (LiteLLM by default) still sends ids: the caller's request id and
    LiteLLM's call id are recorded on the span as http.request.header.*; junk values are left out."""
    provider, exporter = tracing()
    sent = [("X-Request-Id", "req-1234"), ("x-litellm-call-id", "6f1c0a52-1111-2222-3333-444455556666"),
            ("X-Request-Id", "x" * 300), ("x-litellm-call-id", "bad\u00e9value")]

    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), tracer_provider=provider) as gw, \
                aiohttp.ClientSession() as session:
            headers = CIMultiDict()
            for name, value in sent:
                headers.add(name, value)
            async with session.post(gw.url + "/v1/chat/completions", json=chat(), headers=headers) as resp:
                assert resp.status == 200
        await replica.stop()
        return replica

    replica = run(scenario())
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert list(span.attributes["http.request.header.x-request-id"]) == ["req-1234"]
    assert list(span.attributes["http.request.header.x-litellm-call-id"]) == ["6f1c0a52-1111-2222-3333-444455556666"]
    forwarded = {k.lower(): v for k, v in replica.requests[0]["headers"].items()}
    assert forwarded["x-request-id"] == "req-1234"  # passed on: vLLM adopts it as its request id


def test_failures_mark_the_span_as_an_error():
    provider, exporter = tracing()

    async def scenario():
        replica = FakeReplica("a", status=500)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), tracer_provider=provider) as gw, \
                aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 500
            async with session.post(gw.url + "/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
        await replica.stop()

    run(scenario())
    upstream_error, bad_input = exporter.get_finished_spans()
    assert upstream_error.attributes["error.type"] == "500"
    assert upstream_error.attributes["http.response.status_code"] == 500
    assert upstream_error.status.status_code == StatusCode.ERROR
    assert normalise_span(_platform_view(upstream_error)).is_error
    assert bad_input.attributes["error.type"] == "invalid_json"
    assert bad_input.attributes["http.response.status_code"] == 400
    assert "llm_observatory.replica_group" not in bad_input.attributes


def test_default_tracer_provider_names_the_service_llm_gateway():
    app = build_gateway_app(settings([{"name": "g", "weight": 1, "upstreams": ["http://127.0.0.1:9"]}]))
    provider = app[GATEWAY_KEY].tracer_provider
    assert provider.resource.attributes["service.name"] == "llm-gateway"


def test_prefix_cache_hits_of_a_simulated_replica_are_on_the_span_streamed_and_not():
    """The simulator with prompt-token details on (as the launcher starts it): the same long system prompt twice,
    then a stream whose usage chunk the gateway asked for itself. Each span carries the replica's own count."""
    provider, exporter = tracing()
    replica, replica_spans = start_replica(EngineConfig(), served_model_name=MODEL, enable_prompt_tokens_details=True)
    system = {"role": "system", "content": "Harbour pilots board inbound ships at the fairway buoy. " * 12}

    def body(question: str, **extra) -> dict:
        return chat(messages=[system, {"role": "user", "content": question}], **extra)

    async def scenario():
        async with gateway(groups(("baseline", 1, [replica.url])), tracer_provider=provider) as gw, \
                aiohttp.ClientSession() as session:
            answers = []
            for question in ("When is high water?", "Who boards at dawn?"):
                async with session.post(gw.url + "/v1/chat/completions", json=body(question)) as resp:
                    answers.append(await resp.json())
            async with session.post(gw.url + "/v1/chat/completions", json=body("And at dusk?", stream=True)) as resp:
                events = [orjson.loads(e) for e in sse_events(await resp.read()) if e != b"[DONE]"]
        return answers, events

    try:
        answers, events = run(scenario())
    finally:
        replica.stop()
    assert all("usage" not in event for event in events)  # the usage chunk the client did not ask for is hidden
    spans = {span.attributes["gen_ai.response.id"]: span for span in exporter.get_finished_spans()}
    engine_spans = {span.attributes["gen_ai.request.id"]: span for span in replica_spans.get_finished_spans()}
    cached = [spans[answer["id"]].attributes["gen_ai.usage.cache_read.input_tokens"] for answer in answers]
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % EngineConfig().resolved().block_size == 0
    assert cached == [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    streamed = events[0]["id"]
    assert spans[streamed].attributes["gen_ai.usage.cache_read.input_tokens"] == cached[1] == (
        engine_spans[streamed].attributes["gen_ai.usage.cache_read.input_tokens"])


def test_malformed_cached_token_counts_are_left_out():
    provider, exporter = tracing()
    sent = [{"cached_tokens": 0}, {"cached_tokens": 5}, None, {"cached_tokens": "5"}, {"cached_tokens": True},
            {"cached_tokens": -1}, {"cached_tokens": 5.0}, {"cached_tokens": 8}, {"cached_tokens": 10**30},
            {"cached_tokens": None}, [5], "5"]

    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), tracer_provider=provider) as gw, \
                aiohttp.ClientSession() as session:
            for details in sent:
                replica.prompt_tokens_details = details
                for stream in (False, True):
                    async with session.post(gw.url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
                        assert resp.status == 200
                        await resp.read()
        await replica.stop()

    run(scenario())
    # In the order the replica answered (its ids end in a running number).
    spans = sorted(exporter.get_finished_spans(),
                   key=lambda span: int(span.attributes["gen_ai.response.id"].split("-")[-1]))
    recorded = [span.attributes.get("gen_ai.usage.cache_read.input_tokens") for span in spans]
    # 7 prompt tokens: a count above that, or anything but a whole number, is no count of the prompt's tokens.
    assert recorded == [0, 0, 5, 5] + [None] * 2 * (len(sent) - 2)
