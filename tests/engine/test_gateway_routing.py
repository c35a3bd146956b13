"""Gateway routing: weighted group split, least-loaded replica inside a group, runtime route changes."""
from __future__ import annotations

import asyncio
import math
import random

import aiohttp
from gateway_fakes import FakeReplica, chat, gateway, groups, run

from engine.gateway.routing import RouteTable
from engine.gateway.settings import GroupSpec


def _within_five_sigma(observed: int, n: int, p: float) -> bool:
    return abs(observed - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def test_weighted_split_holds_over_real_requests():
    n = 2000

    async def scenario():
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        for replica in (a, b, c):
            await replica.start()
        async with gateway(groups(("baseline", 90, [a, b]), ("canary", 10, [c]))) as gw:
            async with aiohttp.ClientSession() as session:
                limit = asyncio.Semaphore(24)

                async def one():
                    async with limit, session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()

                await asyncio.gather(*(one() for _ in range(n)))
        for replica in (a, b, c):
            await replica.stop()
        return len(a.requests), len(b.requests), len(c.requests)

    a, b, c = run(scenario())
    assert a + b + c == n
    assert _within_five_sigma(c, n, 0.10), (a, b, c)
    # Inside the baseline group the least-loaded pick spreads requests over both replicas.
    assert a > 0.3 * (a + b) and b > 0.3 * (a + b), (a, b)


def test_route_table_draws_groups_by_weight_and_never_weight_zero():
    table = RouteTable([GroupSpec("baseline", 70, ("http://a",)), GroupSpec("canary", 30, ("http://c",)),
                        GroupSpec("drained", 0, ("http://d",))], random.Random(7))
    draws = 20000
    counts = {"baseline": 0, "canary": 0, "drained": 0}
    for _ in range(draws):
        counts[table.choose_group().name] += 1
    assert counts["drained"] == 0
    assert _within_five_sigma(counts["canary"], draws, 0.30), counts


def test_pick_prefers_least_in_flight_healthy_replica_then_other_groups():
    table = RouteTable([GroupSpec("baseline", 1, ("http://a", "http://b", "http://c")),
                        GroupSpec("canary", 1, ("http://d",)), GroupSpec("drained", 0, ("http://e",))],
                       random.Random(1))
    a, b, c = table.groups[0].upstreams
    d = table.groups[1].upstreams[0]
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert table.pick("m", "baseline") is b
    b.mark_down("test")
    assert table.pick("m", "baseline") is c
    assert table.pick("m", "baseline", tried=[c]) is a
    # Nothing left in the group: another weighted group, never the drained one.
    assert table.pick("m", "baseline", tried=[a, c]) is d
    assert table.pick("m", "baseline", tried=[a, c, d]) is None
    # A replica known not to serve the model is skipped.
    a.models = frozenset({"other"})
    c.models = frozenset({"m"})
    assert table.pick("m", "baseline") is c
    assert table.pick("other", "baseline", tried=[]) is a


def test_concurrent_requests_spread_to_the_least_loaded_replica():
    async def scenario():
        a, b = FakeReplica("a", delay=0.3), FakeReplica("b", delay=0.3)
        await a.start()
        await b.start()
        async with gateway(groups(("baseline", 1, [a, b]))) as gw, aiohttp.ClientSession() as session:
            async def one():
                async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200

            await asyncio.gather(*(one() for _ in range(6)))
        await a.stop()
        await b.stop()
        return len(a.requests), len(b.requests)

    assert run(scenario()) == (3, 3)


def test_weights_and_upstreams_change_at_run_time():
    async def scenario():
        a, c, new = FakeReplica("a"), FakeReplica("c"), FakeReplica("new")
        for replica in (a, c, new):
            await replica.start()
        async with gateway(groups(("baseline", 100, [a]), ("canary", 0, [c]))) as gw, \
                aiohttp.ClientSession() as session:
            async def send(count):
                for _ in range(count):
                    async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                        assert resp.status == 200

            await send(20)
            assert (len(a.requests), len(c.requests)) == (20, 0)

            async with session.put(gw.url + "/admin/routes", json={"weights": {"baseline": 0, "canary": 5}}) as resp:
                assert resp.status == 200, await resp.text()
                document = await resp.json()
            assert [(g["name"], g["weight"]) for g in document["groups"]] == [("baseline", 0), ("canary", 5)]
            await send(20)
            assert (len(a.requests), len(c.requests)) == (20, 20)

            # Full table: canary moves to a new replica, baseline keeps its replicas (upstreams omitted).
            update = {"groups": [{"name": "baseline", "weight": 1},
                                 {"name": "canary", "weight": 1, "upstreams": [new.url]}]}
            async with session.put(gw.url + "/admin/routes", json=update) as resp:
                assert resp.status == 200, await resp.text()
            async with session.get(gw.url + "/admin/routes") as resp:
                document = await resp.json()
            assert [[u["url"] for u in g["upstreams"]] for g in document["groups"]] == [[a.url], [new.url]]
            await send(40)
            assert len(c.requests) == 20 and len(new.requests) > 0 and len(a.requests) > 20
        for replica in (a, c, new):
            await replica.stop()

    run(scenario())


def test_x_engine_group_pins_a_group_even_at_weight_zero_and_never_falls_back():
    async def scenario():
        a, drained = FakeReplica("a"), FakeReplica("d")
        for replica in (a, drained):
            await replica.start()
        async with gateway(groups(("baseline", 100, [a]), ("canary", 0, [drained]))) as gw:
            async with aiohttp.ClientSession() as session:
                for _ in range(10):
                    async with session.post(gw.url + "/v1/chat/completions", json=chat(),
                                            headers={"X-Engine-Group": "canary"}) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                async with session.post(gw.url + "/v1/chat/completions", json=chat(),
                                        headers={"X-Engine-Group": "nope"}) as resp:
                    unknown = resp.status, await resp.json()
                await drained.stop()
                async with session.post(gw.url + "/v1/chat/completions", json=chat(),
                                        headers={"X-Engine-Group": "canary"}) as resp:
                    down = resp.status
        await a.stop()
        return len(a.requests), len(drained.requests), unknown, down

    to_a, to_drained, unknown, down = run(scenario())
    assert (to_a, to_drained) == (0, 10)
    assert unknown[0] == 400 and unknown[1]["error"]["code"] == "unknown_group" and "canary" in unknown[1]["error"]["message"]
    assert down == 503  # the pinned group is down: no fallback to the baseline group
    table = RouteTable([GroupSpec("baseline", 1, ("http://a",)), GroupSpec("drained", 0, ("http://e",))])
    assert table.pick("m", "drained", pinned=True).url == "http://e"
    assert table.pick("m", "missing", pinned=True) is None
