"""Gateway relaying: SSE streams pass through chunk by chunk, usage chunks, JSON bodies and upstream errors."""
from __future__ import annotations

import asyncio

import aiohttp
import orjson
from gateway_fakes import MODEL, FakeReplica, chat, gateway, groups, run, sse_events


async def _next_event(resp: aiohttp.ClientResponse) -> bytes:
    """Read one SSE event (up to its blank line) from the client side."""
    lines = []
    while True:
        line = await asyncio.wait_for(resp.content.readline(), timeout=5)
        if not line:
            raise AssertionError("stream ended early")
        if line in (b"\n", b"\r\n"):
            return b"".join(lines)
        lines.append(line)


def test_stream_reaches_the_client_chunk_by_chunk():
    # The replica only produces chunk i+1 after the client has received chunk i through the gateway:
    # a gateway that buffered anything would deadlock here (and time out).
    async def scenario():
        replica = FakeReplica("a", chunks=5)
        replica.steps = asyncio.Queue()
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                for index in range(5):
                    event = await _next_event(resp)
                    chunk = orjson.loads(event.removeprefix(b"data: "))
                    assert chunk["choices"][0]["delta"]["content"] == f"t{index}"
                    replica.steps.put_nowait(None)
                assert await _next_event(resp) == b"data: [DONE]\n"
        await replica.stop()

    run(scenario())


def test_usage_chunk_is_hidden_unless_the_client_asked_for_it():
    async def scenario():
        replica = FakeReplica("a", chunks=3)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                plain = await resp.read()
            asked = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False})
            async with session.post(gw.url + "/v1/chat/completions", json=asked) as resp:
                with_usage = await resp.read()
        await replica.stop()
        return replica, plain, with_usage

    replica, plain, with_usage = run(scenario())
    plain_events = sse_events(plain)
    assert len(plain_events) == 4 and plain_events[-1] == b"[DONE]"
    assert all(b'"usage"' not in event for event in plain_events)
    usage_events = sse_events(with_usage)
    assert len(usage_events) == 5
    assert orjson.loads(usage_events[3])["usage"]["completion_tokens"] == 3
    # The replica was asked for usage both times; the client's other stream options were kept.
    assert replica.requests[0]["body"]["stream_options"] == {"include_usage": True}
    assert replica.requests[1]["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_non_streaming_answers_and_completions_pass_through_unchanged():
    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200 and resp.content_type == "application/json"
                chat_answer = await resp.json()
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await replica.stop()
        return replica, chat_answer

    replica, answer = run(scenario())
    assert answer["id"].startswith("cmpl-a-") and answer["usage"]["prompt_tokens"] == 7
    assert [r["path"] for r in replica.requests] == ["/v1/chat/completions", "/v1/completions"]
    # A non-streaming body goes upstream as the client sent it (no stream_options added).
    assert "stream_options" not in replica.requests[0]["body"]


def test_upstream_error_bodies_pass_through():
    async def scenario():
        replica = FakeReplica("a", status=400)
        await replica.start()
        results = []
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as session:
            for stream in (False, True):
                async with session.post(gw.url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
                    results.append((resp.status, await resp.json()))
            replica.status = 503
            async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                results.append((resp.status, await resp.json()))
        await replica.stop()
        return results

    results = run(scenario())
    assert [status for status, _ in results] == [400, 400, 503]
    for _, document in results:
        assert document["error"]["message"] == "a refuses"


def _relay_all(relay, reads: list[bytes]) -> bytes:
    return b"".join(relay.feed(read) for read in reads) + relay.flush()


def test_sse_relay_handles_split_events_crlf_comments_and_multiline_data():
    from engine.gateway.sse import SseRelay

    first = b'data: {"id":"chatcmpl-1","model":"m","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}'
    last = b'data: {"id":"chatcmpl-1","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
    usage = b'data: {"id":"chatcmpl-1","model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    stream = first + b"\n\n: keep-alive\n\n" + last + b"\n\n" + usage + b"\n\ndata: [DONE]\n\n"

    # Every split point: the output never depends on how the upstream's bytes were cut.
    expected = first + b"\n\n: keep-alive\n\n" + last + b"\n\ndata: [DONE]\n\n"
    for cut in range(1, len(stream)):
        relay = SseRelay(keep_usage_chunk=False)
        assert _relay_all(relay, [stream[:cut], stream[cut:]]) == expected, cut
        assert relay.response_id == "chatcmpl-1" and relay.model == "m"
        assert relay.usage == {"prompt_tokens": 3, "completion_tokens": 2}
        assert relay.finish_reasons == {0: "length"} and relay.done

    kept = SseRelay(keep_usage_chunk=True)
    assert _relay_all(kept, [stream]) == stream

    crlf = stream.replace(b"\n", b"\r\n")
    relay = SseRelay(keep_usage_chunk=False)
    assert _relay_all(relay, [crlf[:50], crlf[50:]]) == expected.replace(b"\n", b"\r\n")
    assert relay.usage["completion_tokens"] == 2

    # Multi-line data and an upstream error event; a stream cut without its final blank line still counts.
    multiline = b'data: {"id": "x", "model": "m",\ndata: "error": {"message": "boom"}}\n\ndata: [DONE]'
    relay = SseRelay(keep_usage_chunk=False)
    assert _relay_all(relay, [multiline]) == multiline
    assert relay.error == {"message": "boom"} and relay.done
