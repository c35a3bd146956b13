"""Gateway resilience: client disconnects, overload shedding, dead replicas, health checks and timeouts."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
from aiohttp import web
from gateway_fakes import (
    FakeReplica,
    chat,
    eventually,
    free_port,
    gateway,
    groups,
    run,
    settings,
    sse_events,
    tracing,
)

from engine.gateway import GATEWAY_KEY, build_gateway_app


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def test_client_hanging_up_mid_stream_closes_the_upstream_request():
    provider, exporter = tracing()

    async def scenario():
        replica = FakeReplica("a", chunks=100, chunk_delay=0.1)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), tracer_provider=provider) as gw:
            async with aiohttp.ClientSession() as client:
                resp = await client.post(gw.url + "/v1/chat/completions", json=chat(stream=True))
                assert resp.status == 200
                await resp.content.readline()
                hung_up = time.monotonic()
                resp.close()  # drops the connection, as a user closing a tab does
            assert await eventually(lambda: replica.cancelled, timeout=3), "upstream request still running"
            assert replica.cancelled[0] - hung_up < 1.0
            assert await eventually(lambda: exporter.get_finished_spans())
            async with aiohttp.ClientSession() as client:
                text = await _metrics(client, gw.url)
            assert 'llm_gateway_requests_total{code="499",group="baseline"} 1.0' in text
            assert gw.gateway.admission.in_flight == 0
        await replica.stop()
        assert replica.completed == 0

    run(scenario())
    (span,) = exporter.get_finished_spans()
    assert span.attributes["error.type"] == "client_disconnected"
    assert span.attributes["http.response.status_code"] == 200  # the stream had started


def test_client_hanging_up_while_waiting_is_noticed_without_handler_cancellation():
    # build_gateway_app under a plain AppRunner (aiohttp does not cancel handlers there): the gateway's own
    # watcher must still close the upstream request of a client that went away before any byte came back.
    async def scenario():
        replica = FakeReplica("a", delay=30)
        await replica.start()
        app = build_gateway_app(settings(groups(("baseline", 1, [replica])), disconnect_poll_s=0.05))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as client:
                try:
                    await client.post(url + "/v1/chat/completions", json=chat())
                except TimeoutError:
                    pass
            assert await eventually(lambda: replica.cancelled, timeout=3), "upstream request still running"
            assert await eventually(lambda: app[GATEWAY_KEY].admission.in_flight == 0)
            assert app[GATEWAY_KEY].table.upstreams()[0].in_flight == 0
        finally:
            await runner.cleanup()
            await replica.stop()

    run(scenario())


def test_overload_is_shed_with_429_and_retry_after():
    async def scenario():
        replica = FakeReplica("a", delay=0.6)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), max_concurrency=2, max_queue=1,
                           max_queue_wait_s=5) as gw, aiohttp.ClientSession() as client:
            async def one():
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()

            results = await asyncio.gather(*(one() for _ in range(5)))
            statuses = sorted(status for status, _, _ in results)
            assert statuses == [200, 200, 200, 429, 429], statuses
            for status, retry_after, document in results:
                if status == 429:
                    assert retry_after is not None and int(retry_after) >= 1
                    assert document["error"]["code"] == "gateway_overloaded"
                    assert document["error"]["type"] == "rate_limit_error" and document["error"]["message"]
            text = await _metrics(client, gw.url)
            assert 'llm_gateway_requests_shed_total{reason="queue_full"} 2.0' in text
        await replica.stop()
        assert len(replica.requests) == 3

    run(scenario())


def test_queue_wait_is_bounded():
    async def scenario():
        replica = FakeReplica("a", delay=2)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), max_concurrency=1, max_queue=10,
                           max_queue_wait_s=0.2) as gw, aiohttp.ClientSession() as client:
            first = asyncio.ensure_future(client.post(gw.url + "/v1/chat/completions", json=chat()))
            await eventually(lambda: replica.requests)
            started = time.monotonic()
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 429 and "Retry-After" in resp.headers
                assert time.monotonic() - started < 1.5
            assert 'reason="queue_timeout"' in await _metrics(client, gw.url)
            assert gw.gateway.admission.queued == 0
            first.cancel()
        await replica.stop()

    run(scenario())


def test_dead_replica_is_routed_around_and_comes_back_after_health_checks():
    async def scenario():
        live = FakeReplica("live")
        await live.start()
        dead_port = free_port()
        dead_url = f"http://127.0.0.1:{dead_port}"
        async with gateway(groups(("baseline", 1, [live, dead_url])), health_interval_s=0.1) as gw, \
                aiohttp.ClientSession() as client:
            for _ in range(10):
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
            assert len(live.requests) == 10
            async with client.get(gw.url + "/admin/routes") as resp:
                upstreams = {u["url"]: u for u in (await resp.json())["groups"][0]["upstreams"]}
            assert upstreams[dead_url]["healthy"] is False and upstreams[dead_url]["last_error"]
            assert upstreams[live.url]["healthy"] is True

            revived = FakeReplica("revived")
            await revived.start(port=dead_port)
            dead = next(u for u in gw.gateway.table.upstreams() if u.url == dead_url)
            assert await eventually(lambda: dead.healthy, timeout=3), "probe never brought the replica back"
            for _ in range(10):
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
            assert len(revived.requests) > 0
            await revived.stop()
        await live.stop()

    run(scenario())


def test_a_restarted_replica_serves_the_next_request_without_waiting_for_the_next_probe_round():
    async def scenario():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # Probe rounds 30 s apart: only the recheck a request triggers can see the replica come back.
        async with gateway(groups(("baseline", 1, [url])), health_interval_s=30) as gw, \
                aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"  # worth retrying soon: a request triggers a probe
            (upstream,) = gw.gateway.table.upstreams()
            assert upstream.healthy is False
            restarted = FakeReplica("restarted")
            await restarted.start(port=port)
            await asyncio.sleep(0.6)  # a restart takes longer than the least gap between recheck rounds (0.5 s)
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200, await resp.text()
            assert len(restarted.requests) == 1 and upstream.healthy is True
            await restarted.stop()

    run(scenario())


def test_requests_finding_no_replica_in_rotation_share_one_recheck_round():
    async def scenario():
        sick = FakeReplica("sick")
        sick.health_status = 500
        await sick.start()
        # One failed probe takes it out: the gateway's first round (at start) does.
        async with gateway(groups(("baseline", 1, [sick])), health_interval_s=30, unhealthy_after=1) as gw, \
                aiohttp.ClientSession() as client:
            (upstream,) = gw.gateway.table.upstreams()
            assert await eventually(lambda: not upstream.healthy)
            before = sick.health_checks

            async def call() -> tuple[int, str]:
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    return resp.status, (await resp.json())["error"]["code"]

            started = time.monotonic()
            answers = await asyncio.gather(*(call() for _ in range(40)))
            answers += [await call() for _ in range(10)]  # and one after the other
            assert answers == [(503, "no_healthy_upstream")] * 50
            assert sick.requests == []
            # 50 requests, but one round at a time and at most one per 0.5 s: few probes.
            rounds = sick.health_checks - before
            assert 1 <= rounds <= 2 + int((time.monotonic() - started) / 0.5)
            assert f'llm_gateway_recheck_rounds_total{{outcome="down"}} {float(rounds)}' in await _metrics(client, gw.url)
            sick.health_status = 200
            await asyncio.sleep(0.6)  # past the least gap between rounds
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
            assert len(sick.requests) == 1
            assert 'llm_gateway_recheck_rounds_total{outcome="back"} 1.0' in await _metrics(client, gw.url)
        await sick.stop()

    run(scenario())


def test_failover_crosses_groups_and_all_dead_gives_503():
    provider, exporter = tracing()

    async def scenario():
        canary = FakeReplica("canary")
        await canary.start()
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        # A long probe interval: only the requests themselves find out that baseline is dead.
        async with gateway(groups(("baseline", 1000, dead), ("canary", 1, [canary])), health_interval_s=30,
                           tracer_provider=provider) as gw, aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
            assert len(canary.requests) == 1
            await canary.stop()
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
                document = await resp.json()
            assert document["error"]["code"] == "upstream_unavailable"
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_healthy_upstream"
            async with client.get(gw.url + "/health") as resp:
                assert resp.status == 503
            text = await _metrics(client, gw.url)
            assert 'kind="unreachable"' in text

    run(scenario())
    served = exporter.get_finished_spans()[0]
    assert served.attributes["llm_observatory.replica_group"] == "canary"


def test_failing_health_probes_take_a_replica_out_and_back_in():
    async def scenario():
        a, b = FakeReplica("a"), FakeReplica("b")
        await a.start()
        await b.start()
        async with gateway(groups(("baseline", 1, [a, b])), health_interval_s=0.05, unhealthy_after=2) as gw, \
                aiohttp.ClientSession() as client:
            upstream_a = next(u for u in gw.gateway.table.upstreams() if u.url == a.url)
            a.health_status = 503
            assert await eventually(lambda: not upstream_a.healthy)
            before = len(a.requests)
            for _ in range(8):
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
            assert len(a.requests) == before
            a.health_status = 200
            assert await eventually(lambda: upstream_a.healthy)
        await a.stop()
        await b.stop()

    run(scenario())


def test_first_byte_timeout_gives_504_and_closes_the_upstream_request():
    async def scenario():
        replica = FakeReplica("a", delay=10)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), first_byte_timeout_s=0.3) as gw, \
                aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 504
                assert (await resp.json())["error"]["code"] == "upstream_timeout"
            # A stream whose first chunk never comes is a 504 too: nothing had been sent yet.
            async with client.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                assert resp.status == 504
            assert await eventually(lambda: len(replica.cancelled) == 2)
            assert 'kind="timeout"' in await _metrics(client, gw.url)
            # A slow replica is not a dead one.
            assert all(u.healthy for u in gw.gateway.table.upstreams())
        await replica.stop()

    run(scenario())


def test_idle_and_total_timeouts_end_a_started_stream_with_an_error_event():
    provider, exporter = tracing()

    async def scenario():
        replica = FakeReplica("a", chunks=3, chunk_delay=10)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), idle_timeout_s=0.3,
                           tracer_provider=provider) as gw, aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                assert resp.status == 200
                idle_events = sse_events(await resp.read())
        replica.chunk_delay = 0.2
        replica.chunks = 50
        async with gateway(groups(("baseline", 1, [replica])), total_timeout_s=0.7,
                           tracer_provider=provider) as gw, aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                total_events = sse_events(await resp.read())
        await replica.stop()
        return idle_events, total_events

    idle_events, total_events = run(scenario())
    assert len(idle_events) == 2
    assert orjson.loads(idle_events[-1])["error"]["code"] == "upstream_timeout"
    assert 2 <= len(total_events) < 10
    assert "longer than 0.7 s" in orjson.loads(total_events[-1])["error"]["message"]
    for span in exporter.get_finished_spans():
        assert span.attributes["error.type"] == "upstream_timeout"


def test_replica_dying_before_answering_fails_over_and_mid_stream_ends_with_an_error_event():
    provider, exporter = tracing()

    async def scenario():
        crashing, healthy = FakeReplica("crashing"), FakeReplica("healthy")
        await crashing.start()
        await healthy.start()
        crashing.crash = "before_answer"
        async with gateway(groups(("baseline", 1, [crashing]), ("canary", 1, [healthy])),
                           tracer_provider=provider, health_interval_s=30) as gw, aiohttp.ClientSession() as client:
            for _ in range(6):
                async with client.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["choices"][0]["message"]["content"] == "healthy"
            assert crashing.requests, "the crashing replica was never tried"
            # A hang-up is not proof of death (a stale pooled connection looks the same): still in rotation.
            assert all(u.healthy for u in gw.gateway.table.upstreams())

            exporter.clear()
            crashing.crash = 1
            async with client.put(gw.url + "/admin/routes", json={"weights": {"canary": 0}}) as resp:
                assert resp.status == 200
            async with client.post(gw.url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                assert resp.status == 200
                events = sse_events(await resp.read())
        await crashing.stop()
        await healthy.stop()
        return events

    events = run(scenario())
    assert len(events) == 2 and orjson.loads(events[0])["choices"][0]["delta"]["content"] == "t0"
    assert orjson.loads(events[1])["error"]["code"] == "upstream_disconnected"
    (span,) = exporter.get_finished_spans()
    assert span.attributes["error.type"] == "upstream_disconnected"
    assert span.attributes["llm_observatory.replica_group"] == "baseline"
