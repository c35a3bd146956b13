"""The gateway's response cache, through real gateways on real sockets: exact and semantic hits, streamed and not,
expiry, bounds, isolation, collisions, bypass, an embeddings endpoint that is down, Redis shared by two gateways,
and the span attributes of every outcome (docs/response-cache.md)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import aiohttp
import orjson
import pytest
import redis
from gateway_fakes import MODEL, FakeReplica, chat, free_port, gateway, groups, run, sse_events, tracing

from engine.config import EngineConfig
from engine.gateway.cache_keys import BODY_FLAG
from engine.replica.server import ReplicaServer
from engine.telemetry import CACHE_READ_ATTRIBUTE

REDIS_URL = os.environ.get("GATEWAY_CACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
GREEDY = {"temperature": 0}


def cached(members, name: str = "baseline", **cache) -> list[dict]:
    """One group over ``members`` whose cache is ``cache`` (exact on by default)."""
    cache.setdefault("exact", {"enabled": True})
    [group] = groups((name, 1, members))
    return [dict(group, cache=cache)]


async def ask(session, gw, body: dict, headers: dict | None = None, path: str = "/v1/chat/completions"):
    """(status, response headers, body bytes) of one request through the gateway."""
    async with session.post(gw.url + path, json=body, headers=headers or {}) as resp:
        return resp.status, resp.headers, await resp.read()


async def settle(gw) -> None:
    """Wait for the answers being stored in the background (the client has them before the cache does)."""
    for group in gw.gateway.table.groups:
        cache = gw.gateway.caches.get(group.name)
        if cache is not None:
            await cache.flush()


def cache_attributes(span) -> dict:
    return {k.removeprefix("observatory.cache."): v for k, v in span.attributes.items()
            if k.startswith("observatory.cache.")}


def metric(gw, name: str, **labels) -> float:
    return gw.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def test_exact_hit_as_json_and_its_span():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        replica.prompt_tokens_details = {"cached_tokens": 5}  # the engine's prefix-cache hit on the first request
        async with gateway(cached([replica]), tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            first = await ask(session, gw, chat(**GREEDY))
            await settle(gw)
            second = await ask(session, gw, chat(**GREEDY))
            hits = metric(gw, "llm_gateway_cache_hits_total", group="baseline", served_from="exact_cache")
        await replica.stop()
        return replica, first, second, hits

    replica, (status1, headers1, body1), (status2, headers2, body2), hits = run(scenario())
    assert status1 == status2 == 200 and len(replica.requests) == 1 and hits == 1
    engine_answer, cached_answer = orjson.loads(body1), orjson.loads(body2)
    assert "X-Observatory-Cache" not in headers1 and headers2["X-Observatory-Cache"] == "exact_cache"
    assert cached_answer["choices"] == engine_answer["choices"]
    # The stored usage less the engine's prefix-cache figures, which were the first request's.
    assert engine_answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert "prompt_tokens_details" not in cached_answer["usage"]
    assert cached_answer["usage"] == {k: v for k, v in engine_answer["usage"].items() if k != "prompt_tokens_details"}
    # A new id: the platform joins hops by response id, and the engine's id belongs to the first request.
    assert cached_answer["id"].startswith("chatcmpl-cache-") and cached_answer["id"] != engine_answer["id"]
    miss, hit = exporter.get_finished_spans()
    assert cache_attributes(miss)["result"] == "miss" and cache_attributes(miss)["miss_reason"] == "absent"
    assert miss.attributes["server.port"] == replica.port
    assert miss.attributes[CACHE_READ_ATTRIBUTE] == 5 and CACHE_READ_ATTRIBUTE not in hit.attributes
    found = cache_attributes(hit)
    assert found["result"] == "hit" and found["served_from"] == "exact_cache" and "miss_reason" not in found
    assert found["key"] == cache_attributes(miss)["key"] and len(found["key"]) == 64
    assert 0 < found["lookup_ms"] < 1000
    assert hit.name == f"chat {MODEL}" and hit.attributes["gen_ai.response.model"] == MODEL
    assert hit.attributes["gen_ai.response.id"] == cached_answer["id"]
    assert (hit.attributes["gen_ai.usage.input_tokens"], hit.attributes["gen_ai.usage.output_tokens"]) == (7, 3)
    assert hit.attributes["llm_observatory.replica_group"] == "baseline"
    assert hit.attributes["http.response.status_code"] == 200 and "server.address" not in hit.attributes


def test_a_streamed_answer_serves_streamed_and_json_hits():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a", chunks=4).start()
        async with gateway(cached([replica]), tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            original = await ask(session, gw, chat(stream=True, **GREEDY))
            await settle(gw)
            streamed = await ask(session, gw, chat(stream=True, **GREEDY))
            with_usage = await ask(session, gw, chat(stream=True, stream_options={"include_usage": True}, **GREEDY))
            as_json = await ask(session, gw, chat(**GREEDY))
        await replica.stop()
        return replica, original, streamed, with_usage, as_json

    replica, original, streamed, with_usage, as_json = run(scenario())
    assert len(replica.requests) == 1
    assert streamed[0] == 200 and streamed[1]["Content-Type"].startswith("text/event-stream")
    events = sse_events(streamed[2])
    assert events[-1] == b"[DONE]" and len(events) == 2  # one chunk with the whole answer, no usage chunk
    chunk = orjson.loads(events[0])
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"].startswith("chatcmpl-cache-")
    assert chunk["choices"][0]["delta"]["content"] == "t0t1t2t3" and chunk["choices"][0]["finish_reason"] == "stop"
    usage_events = [orjson.loads(e) for e in sse_events(with_usage[2])[:-1]]
    assert usage_events[-1]["choices"] == [] and usage_events[-1]["usage"]["completion_tokens"] == 4
    answer = orjson.loads(as_json[2])
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == "t0t1t2t3"
    assert answer["usage"]["prompt_tokens"] == 7
    spans = exporter.get_finished_spans()
    assert [cache_attributes(s)["result"] for s in spans] == ["miss", "hit", "hit", "hit"]
    stream_hit = spans[1]
    assert 0 < stream_hit.attributes["gen_ai.response.time_to_first_chunk"] < 1
    assert stream_hit.attributes["gen_ai.usage.output_tokens"] == 4


def test_entries_expire_and_the_store_is_bounded():
    async def scenario():
        replica = await FakeReplica("a").start()
        routes = cached([replica], exact={"enabled": True, "ttl_s": 0.3, "max_entries": 2})
        async with gateway(routes) as gw, aiohttp.ClientSession() as session:
            async def send(text):
                await ask(session, gw, chat(messages=[{"role": "user", "content": text}], **GREEDY))
                await settle(gw)
            await send("one")
            await asyncio.sleep(0.35)
            await send("one")  # expired: to the engine again
            await send("two")
            await send("three")  # evicts "one" (least recently used)
            await send("one")
            served = len(replica.requests)
            await send("three")  # still there
            evicted = metric(gw, "llm_gateway_cache_evictions_total", group="baseline", kind="exact",
                             reason="capacity")
            expired = metric(gw, "llm_gateway_cache_misses_total", group="baseline", kind="exact", reason="expired")
            [(_, _, entries, size)] = list(gw.gateway.caches.sizes())
        await replica.stop()
        return served, len(replica.requests), evicted, expired, entries, size

    served, total, evicted, expired, entries, size = run(scenario())
    assert (served, total) == (5, 5)
    assert evicted >= 1 and expired == 1 and entries == 2 and size > 0


def test_oversized_answers_are_not_stored():
    async def scenario():
        # Its answer (and answer id) holds its name; streamed, its 8 chunks outgrow even the stream's bound (8 x 2 KiB).
        replica = await FakeReplica("x" * 3000, chunks=8).start()
        async with gateway(cached([replica], max_entry_bytes=2048)) as gw, aiohttp.ClientSession() as session:
            for stream in (False, True, False):
                assert (await ask(session, gw, chat(stream=stream, **GREEDY)))[0] == 200
                await settle(gw)
            skipped = metric(gw, "llm_gateway_cache_stores_total", group="baseline", outcome="too_large")
        await replica.stop()
        return len(replica.requests), skipped

    assert run(scenario()) == (3, 3)


def test_projects_credentials_and_models_never_share_answers():
    async def scenario():
        first = await FakeReplica("a", model="model-a").start()
        second = await FakeReplica("b", model="model-b").start()
        async with gateway(cached([first, second])) as gw, aiohttp.ClientSession() as session:
            await gw.gateway.monitor.refresh_models(0)
            answers = []
            for model, headers in (("model-a", {"OpenAI-Project": "proj_A"}), ("model-a", {"OpenAI-Project": "proj_B"}),
                                   ("model-a", {"Authorization": "Bearer key-1"}),
                                   ("model-a", {"Authorization": "Bearer key-2"}),
                                   ("model-a", {"Authorization": "Bearer key-1", "OpenAI-Project": "proj_A"}),
                                   ("model-a", {}), ("model-b", {}),
                                   ("model-a", {"OpenAI-Project": "proj_A"})):  # the only repeat
                status, _, body = await ask(session, gw, chat(model=model, **GREEDY), headers)
                assert status == 200
                answers.append(orjson.loads(body)["id"])
                await settle(gw)
        await first.stop()
        await second.stop()
        return answers, len(first.requests), len(second.requests)

    answers, to_first, to_second = run(scenario())
    assert (to_first, to_second) == (6, 1)
    assert [a.startswith("chatcmpl-cache-") for a in answers] == [False] * 7 + [True]


def test_a_digest_collision_never_serves_another_requests_answer():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        async with gateway(cached([replica]), tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            gw.gateway.caches.get("baseline").digest = lambda data: b"\0" * 8  # every key collides
            bodies = []
            for text in ("first question", "second question", "second question"):
                status, _, body = await ask(session, gw, chat(messages=[{"role": "user", "content": text}],
                                                              **GREEDY))
                bodies.append(orjson.loads(body))
                await settle(gw)
        await replica.stop()
        return replica, bodies

    replica, bodies = run(scenario())
    assert [r["body"]["messages"][0]["content"] for r in replica.requests] == ["first question", "second question"]
    results = [cache_attributes(span) for span in exporter.get_finished_spans()]
    assert [(r["result"], r.get("miss_reason")) for r in results] == [
        ("miss", "absent"), ("miss", "collision"), ("hit", None)]
    assert not bodies[1]["id"].startswith("chatcmpl-cache-") and bodies[2]["id"].startswith("chatcmpl-cache-")


def test_sampling_requests_are_cached_only_where_the_group_opts_in():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        other = await FakeReplica("b").start()
        routes = cached([replica]) + cached([other], name="sampling", nondeterministic=True)
        async with gateway(routes, tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            for group in ("baseline", "baseline", "sampling", "sampling"):
                await ask(session, gw, chat(temperature=0.7), {"X-Engine-Group": group})
                await settle(gw)
            await ask(session, gw, chat(temperature=0.7, seed=5), {"X-Engine-Group": "baseline"})
            await settle(gw)
            await ask(session, gw, chat(temperature=0.7, seed=5), {"X-Engine-Group": "baseline"})
        await replica.stop()
        await other.stop()
        return len(replica.requests), len(other.requests)

    assert run(scenario()) == (3, 1)
    results = [cache_attributes(span) for span in exporter.get_finished_spans()]
    assert results[0] == {"result": "not_cacheable", "miss_reason": "not_deterministic"}
    assert [r["result"] for r in results] == ["not_cacheable", "not_cacheable", "miss", "hit", "miss", "hit"]


def test_clients_bypass_or_refresh_the_cache_by_header_or_body_flag():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        async with gateway(cached([replica]), tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            statuses = []
            for body, headers in ((chat(**GREEDY), {}),
                                  (chat(**GREEDY), {"X-Observatory-Cache": "bypass"}),
                                  (chat(**GREEDY), {"Cache-Control": "no-store"}),
                                  (chat(**GREEDY, **{BODY_FLAG: "bypass"}), {}),
                                  (chat(**GREEDY, **{BODY_FLAG: False}), {}),
                                  (chat(**GREEDY), {"Cache-Control": "no-cache"}),
                                  (chat(**GREEDY), {}),
                                  (chat(**GREEDY, **{BODY_FLAG: "sometimes"}), {}),
                                  (chat(**GREEDY), {"X-Observatory-Cache": "maybe"})):
                statuses.append((await ask(session, gw, body, headers))[0])
                await settle(gw)
        await replica.stop()
        return replica, statuses

    replica, statuses = run(scenario())
    assert statuses == [200] * 7 + [400, 400]
    assert len(replica.requests) == 6  # the last 200 is the only hit
    assert all(BODY_FLAG not in request["body"] for request in replica.requests)  # stripped before forwarding
    results = [cache_attributes(span).get("result") for span in exporter.get_finished_spans()]
    assert results == ["miss", "bypass", "bypass", "bypass", "bypass", "bypass", "hit", None, None]


@contextlib.asynccontextmanager
async def simulated_replica(served_model_name: str = MODEL):
    """A real simulated replica: the LLM, and the stand-in embedding model on /v1/embeddings."""
    replica = ReplicaServer(EngineConfig(), served_model_name=served_model_name, tracer_provider=tracing()[0])
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop(0)


def semantic(url: str, **overrides) -> dict:
    return {"enabled": True, "embeddings_url": url + "/v1/embeddings", "model": MODEL, "threshold": 0.9, **overrides}


def question(text: str, **extra) -> dict:
    return chat(messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}],
                max_tokens=6, **GREEDY, **extra)


def test_semantic_hit_on_a_paraphrase_and_miss_below_the_threshold():
    provider, exporter = tracing()

    async def scenario():
        async with simulated_replica() as replica:
            routes = cached([replica.url], semantic=semantic(replica.url))
            async with gateway(routes, tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
                original = await ask(session, gw, question("What is the capital of France?"))
                await settle(gw)
                paraphrase = await ask(session, gw, question("what is the capital city of France", stream=True))
                other = await ask(session, gw, question("What is the capital of Germany?"))
                await settle(gw)
                other_context = await ask(session, gw, chat(messages=[
                    {"role": "system", "content": "Answer at length."},
                    {"role": "user", "content": "What is the capital of France?"}], max_tokens=6, **GREEDY))
        return original, paraphrase, other, other_context

    original, paraphrase, other, other_context = run(scenario())
    content = orjson.loads(original[2])["choices"][0]["message"]["content"]
    assert paraphrase[1]["X-Observatory-Cache"] == "semantic_cache"
    chunk = orjson.loads(sse_events(paraphrase[2])[0])
    assert chunk["choices"][0]["delta"]["content"] == content
    assert not orjson.loads(other[2])["id"].startswith("chatcmpl-cache-")
    results = [cache_attributes(span) for span in exporter.get_finished_spans()]
    assert results[0]["result"] == "miss" and results[0]["miss_reason"] == "absent"
    assert results[1]["result"] == "hit" and results[1]["served_from"] == "semantic_cache"
    assert 0.9 <= results[1]["similarity"] < 1.0
    assert results[2]["result"] == "miss" and results[2]["miss_reason"] == "below_threshold"
    assert 0 < results[2]["similarity"] < 0.9
    # The same question under another system prompt is another context: nothing to compare with.
    assert results[3]["result"] == "miss" and results[3]["miss_reason"] == "absent"


def test_a_group_that_allows_it_takes_each_requests_own_threshold_and_nothing_else_does():
    provider, exporter = tracing()
    france, paraphrase, germany = ("What is the capital of France?", "what is the capital city of France",
                                   "What is the capital of Germany?")  # cosines to the first: 0.93, 0.81

    async def scenario():
        fixed, plain = await FakeReplica("f").start(), await FakeReplica("p").start()
        async with simulated_replica() as replica:
            routes = (cached([replica.url], semantic=semantic(replica.url, client_threshold=True))
                      + cached([fixed], name="fixed", semantic=semantic(replica.url)) + groups(("plain", 1, [plain])))
            async with gateway(routes, tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
                async def send(text, value, group="baseline", **headers):
                    sent = {"X-Engine-Group": group, **headers}
                    if value is not None:
                        sent["X-Observatory-Cache-Threshold"] = value
                    answer = await ask(session, gw, question(text), sent)
                    await settle(gw)
                    return answer
                await send(france, None)
                answers = [await send(paraphrase, "0.999"),  # would hit at the group's 0.9
                           await send(germany, "0.5"),  # would miss at 0.9
                           await send(france, "0.01", **{"OpenAI-Project": "proj_B"})]  # another namespace
                refused = [await send(paraphrase, value) for value in ("0", "1.5", "nan", "abc", "-0.5", "1e-1", "")]
                async with session.post(gw.url + "/v1/chat/completions", json=question(paraphrase), headers=[
                        ("X-Engine-Group", "baseline"), ("X-Observatory-Cache-Threshold", "0.5"), ("X-Observatory-Cache-Threshold", "0.6")]) as resp:
                    refused.append((resp.status, resp.headers, await resp.read()))
                not_allowed = [await send(paraphrase, "0.9", group) for group in ("fixed", "plain")]
        await fixed.stop()
        await plain.stop()
        return answers, refused, not_allowed

    answers, refused, not_allowed = run(scenario())
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [a[1].get("X-Observatory-Cache") for a in answers] == [None, "semantic_cache", None]
    spans = [cache_attributes(span) for span in exporter.get_finished_spans()]
    strict, loose, other = spans[1:4]
    assert strict["result"] == "miss" and strict["miss_reason"] == "below_threshold" and strict["threshold"] == 0.999
    assert 0.9 <= strict["similarity"] < 0.999
    assert loose["result"] == "hit" and loose["threshold"] == 0.5 and 0.5 <= loose["similarity"] < 0.9
    # A threshold never reaches into another namespace: project B has nothing stored.
    assert other["result"] == "miss" and other["miss_reason"] == "absent" and "similarity" not in other
    assert "threshold" not in spans[0]  # the group's own threshold is not the client's
    for status, _, body in refused:
        error = orjson.loads(body)["error"]
        assert status == 400 and error["code"] == "invalid_cache_threshold", error
        assert "X-Observatory-Cache-Threshold must be one decimal number in (0, 1]" in error["message"]
    assert "got '2 values'" in orjson.loads(refused[-1][2])["error"]["message"]
    for status, _, body in not_allowed:
        error = orjson.loads(body)["error"]
        assert status == 400 and error["code"] == "cache_threshold_not_allowed"
        assert "client_threshold is off" in error["message"]


def test_an_unreachable_embeddings_endpoint_is_a_counted_miss_never_an_error():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        dead = f"http://127.0.0.1:{free_port()}"
        routes = cached([replica], semantic=semantic(dead, timeout_s=0.5))
        async with gateway(routes, tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            statuses = [(await ask(session, gw, chat(**GREEDY)))[0]]
            await settle(gw)
            statuses.append((await ask(session, gw, chat(messages=[{"role": "user", "content": "other"}],
                                                         **GREEDY)))[0])
            counted = metric(gw, "llm_gateway_cache_misses_total", group="baseline", kind="semantic",
                             reason="embeddings_unavailable")
            exact_hit = await ask(session, gw, chat(**GREEDY))  # the exact cache still works without embeddings
        await replica.stop()
        return statuses, counted, exact_hit

    statuses, counted, exact_hit = run(scenario())
    assert statuses == [200, 200] and counted == 2
    assert exact_hit[1]["X-Observatory-Cache"] == "exact_cache"
    first, second, _ = [cache_attributes(span) for span in exporter.get_finished_spans()]
    assert first == {"result": "miss", "miss_reason": "embeddings_unavailable", "key": first["key"],
                     "lookup_ms": first["lookup_ms"]}
    assert second["miss_reason"] == "embeddings_unavailable"


@pytest.fixture
def redis_prefix():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        pytest.skip(f"Redis at {REDIS_URL} is unreachable ({exc}); set GATEWAY_CACHE_TEST_REDIS_URL")
    prefix = f"test-gateway-cache-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_redis_store_is_shared_by_two_gateways(redis_prefix):
    provider, exporter = tracing()

    async def scenario():
        async with simulated_replica() as replica:
            routes = cached([replica.url], store=REDIS_URL, key_prefix=redis_prefix, semantic=semantic(replica.url))
            async with gateway(routes, tracer_provider=provider) as one, gateway(routes, tracer_provider=provider) \
                    as two, aiohttp.ClientSession() as session:
                await ask(session, one, question("What is the capital of France?"))
                await settle(one)
                exact = await ask(session, two, question("What is the capital of France?"))
                semantic_hit = await ask(session, two, question("what is the capital city of France"))
        stored = redis.Redis.from_url(REDIS_URL)
        keys = sorted(key.decode().split(":")[1:3] for key in stored.scan_iter(match=f"{redis_prefix}:*"))
        ttl = min(stored.pttl(key) for key in stored.scan_iter(match=f"{redis_prefix}:*"))
        stored.close()
        return exact, semantic_hit, keys, ttl

    exact, semantic_hit, keys, ttl = run(scenario())
    assert exact[1]["X-Observatory-Cache"] == "exact_cache"
    assert semantic_hit[1]["X-Observatory-Cache"] == "semantic_cache"
    assert keys == [["baseline", "s"], ["baseline", "s"], ["baseline", "x"]]  # entry, vector log, exact entry
    assert ttl > 0  # every key expires
    assert [cache_attributes(s)["result"] for s in exporter.get_finished_spans()] == ["miss", "hit", "hit"]


def test_an_unreachable_redis_makes_lookups_misses_not_failures():
    provider, exporter = tracing()

    async def scenario():
        replica = await FakeReplica("a").start()
        routes = cached([replica], store=f"redis://127.0.0.1:{free_port()}/0", store_timeout_s=0.2)
        async with gateway(routes, tracer_provider=provider) as gw, aiohttp.ClientSession() as session:
            statuses = []
            for _ in range(2):
                statuses.append((await ask(session, gw, chat(**GREEDY)))[0])
                await settle(gw)
            failed = metric(gw, "llm_gateway_cache_stores_total", group="baseline", outcome="store_unavailable")
        await replica.stop()
        return statuses, len(replica.requests), failed

    statuses, forwarded, failed = run(scenario())
    assert statuses == [200, 200] and forwarded == 2 and failed >= 1
    results = [cache_attributes(span) for span in exporter.get_finished_spans()]
    assert [(r["result"], r["miss_reason"]) for r in results] == [("error", "store_unavailable")] * 2


def test_route_updates_turn_a_groups_cache_on_and_off():
    async def scenario():
        replica = await FakeReplica("a").start()
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as session:
            async def put(document):
                async with session.put(gw.url + "/admin/routes", json=document) as resp:
                    return resp.status, await resp.json()
            refused = await put({"groups": [{"name": "baseline", "cache": {"exact": {"ttl_s": -1}}}]})
            await put({"groups": [{"name": "baseline", "cache": {"exact": {"enabled": True}}}]})
            await put({"weights": {"baseline": 2}})  # keeps the cache
            for _ in range(2):
                await ask(session, gw, chat(**GREEDY))
                await settle(gw)
            status, snapshot = await put({"groups": [{"name": "baseline", "cache": None}]})
            await ask(session, gw, chat(**GREEDY))
        await replica.stop()
        return refused, snapshot, len(replica.requests)

    (refused_status, refused), snapshot, forwarded = run(scenario())
    assert refused_status == 400 and "cache.exact.ttl_s" in refused["error"]["message"]
    assert forwarded == 2 and "cache" not in snapshot["groups"][0]


def test_only_complete_answers_are_stored():
    async def scenario():
        replica = await FakeReplica("a", chunks=3).start()
        async with gateway(cached([replica])) as gw, aiohttp.ClientSession() as session:
            replica.status = 500
            for _ in range(2):
                assert (await ask(session, gw, chat(**GREEDY)))[0] == 500
                await settle(gw)
            replica.status, replica.crash = 200, 1  # the stream breaks after its first chunk
            for _ in range(2):
                await ask(session, gw, chat(stream=True, **GREEDY))
                await settle(gw)
            unfinished = metric(gw, "llm_gateway_cache_stores_total", group="baseline", outcome="unfinished")
        await replica.stop()
        return len(replica.requests), unfinished

    assert run(scenario()) == (4, 0)  # errors are not even offered to the cache
