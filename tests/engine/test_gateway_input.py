"""Gateway input handling: hostile bodies, OpenAI error shape everywhere, admin auth and validation, the CLI."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from gateway_fakes import MODEL, FakeReplica, chat, gateway, groups, run

from engine.addresses import parse_bind
from engine.gateway import GatewaySettings, RoutesError, main, parse_routes

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "s3cret-admin-token"


def _assert_openai_error(document: dict, code: str | None = None) -> None:
    error = document["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error
    if code is not None:
        assert error["code"] == code, error


def test_bad_requests_get_the_right_status_and_the_gateway_keeps_serving():
    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), max_body_bytes=4096) as gw, \
                aiohttp.ClientSession() as client:
            url = gw.url + "/v1/chat/completions"

            async def post(data=None, json_body=None, headers=None):
                async with client.post(url, data=data, json=json_body, headers=headers) as resp:
                    return resp.status, await resp.json(content_type=None)

            async def chunked():
                for _ in range(10):
                    yield b" " * 1000

            cases = [
                (await post(data=b"x" * 5000), 413, "request_too_large"),
                (await post(data=chunked()), 413, "request_too_large"),  # no Content-Length: counted while read
                (await post(data=b"{not json"), 400, "invalid_json"),
                (await post(data=b"\xff\xfe\x00garbage"), 400, "invalid_json"),
                (await post(data=b"[1, 2, 3]"), 400, "invalid_json"),
                (await post(data=b"null"), 400, "invalid_json"),
                (await post(data=b"[" * 2000 + b"]" * 2000), 400, "invalid_json"),
                (await post(data=b""), 400, "invalid_json"),
                (await post(json_body={"messages": []}), 400, "missing_required_parameter"),
                (await post(json_body={"model": 42, "messages": []}), 400, "invalid_type"),
                (await post(json_body={"model": "", "messages": []}), 400, "invalid_type"),
                (await post(json_body={"model": "m" * 600, "messages": []}), 400, "invalid_type"),
                (await post(json_body=chat(stream="yes")), 400, "invalid_type"),
                (await post(json_body=chat(stream=True, stream_options=[1])), 400, "invalid_type"),
            ]
            for (status, document), expected_status, expected_code in cases:
                assert status == expected_status, (document, expected_code)
                _assert_openai_error(document, expected_code)

            # A body trickling in slower than the body timeout allows.
            async def trickle():
                yield b'{"model": '
                await asyncio.sleep(1)
                yield b'"m"}'

            async with gateway(groups(("baseline", 1, [replica])), client_body_timeout_s=0.2) as slow_gw:
                async with client.post(slow_gw.url + "/v1/chat/completions", data=trickle()) as resp:
                    assert resp.status == 408
                    _assert_openai_error(await resp.json(), "request_timeout")

            # Unknown model once the replicas' model lists are known.
            async with client.get(gw.url + "/v1/models") as resp:
                assert resp.status == 200
                assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
            status, document = await post(json_body=chat(model="no-such-model"))
            assert status == 404
            _assert_openai_error(document, "model_not_found")
            assert document["error"]["param"] == "model"

            # Wrong method and unknown paths answer in the same error shape.
            async with client.get(url) as resp:
                assert resp.status == 405
                _assert_openai_error(await resp.json())
            async with client.get(gw.url + "/v2/nothing") as resp:
                assert resp.status == 404
                _assert_openai_error(await resp.json())

            # None of the above reached a replica, and the gateway still serves.
            assert replica.requests == []
            status, document = await post(json_body=chat())
            assert status == 200 and document["choices"]
        await replica.stop()

    run(scenario())


def test_admin_api_requires_the_token_when_one_is_set():
    async def scenario():
        replica = FakeReplica("a")
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica])), admin_token=ADMIN_TOKEN) as gw, \
                aiohttp.ClientSession() as client:
            url = gw.url + "/admin/routes"
            for headers in ({}, {"Authorization": "Bearer wrong-token-here"}, {"Authorization": ADMIN_TOKEN},
                            {"Authorization": f"Basic {ADMIN_TOKEN}"}):
                async with client.get(url, headers=headers) as resp:
                    assert resp.status == 401
                    _assert_openai_error(await resp.json(), "invalid_admin_token")
                async with client.put(url, json={"weights": {"baseline": 5}}, headers=headers) as resp:
                    assert resp.status == 401
            good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with client.get(url, headers=good) as resp:
                assert resp.status == 200
                document = await resp.json()
            (group,) = document["groups"]
            assert group["name"] == "baseline" and group["weight"] == 1
            assert group["upstreams"][0]["url"] == replica.url and group["upstreams"][0]["in_flight"] == 0
            assert gw.gateway.table.groups[0].weight == 1

            invalid_updates = [
                {"weights": {"baseline": -1}},
                {"weights": {"baseline": 0}},
                {"weights": {"nope": 1}},
                {"weights": {"baseline": True}},
                {"groups": [{"name": "baseline", "weight": 1, "upstreams": ["ftp://x"]}]},
                {"groups": [{"name": "baseline", "weight": 1, "upstreams": ["http://u:p@host"]}]},
                {"groups": [{"name": "baseline", "weight": 1, "upstreams": []}]},
                {"groups": [{"name": "new", "weight": 1}]},
                {"groups": [{"name": "bad name!", "weight": 1, "upstreams": [replica.url]}]},
                {"groups": [{"name": "a", "weight": 1, "upstreams": [replica.url]},
                            {"name": "b", "weight": 1, "upstreams": [replica.url]}]},
                {"groups": []},
                {"weights": {"baseline": 1}, "groups": []},
                [1, 2],
            ]
            for update in invalid_updates:
                async with client.put(url, json=update, headers=good) as resp:
                    assert resp.status == 400, update
                    _assert_openai_error(await resp.json(), "invalid_routes" if update != [1, 2] else None)
            async with client.put(url, data=b"{oops", headers=good) as resp:
                assert resp.status == 400
            assert gw.gateway.table.groups[0].weight == 1  # nothing half-applied
            async with client.put(url, json={"weights": {"baseline": 3}}, headers=good) as resp:
                assert resp.status == 200
            assert gw.gateway.table.groups[0].weight == 3
        await replica.stop()

    run(scenario())


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.254.254.254", 9))  # no packet is sent: this only picks the outgoing interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_admin_api_without_token_answers_only_loopback_peers():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")

    async def scenario():
        routes = groups(("baseline", 1, ["http://127.0.0.1:9"]))
        async with gateway(routes, host="0.0.0.0") as gw, aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{gw.port}/admin/routes") as resp:
                assert resp.status == 200
            async with client.get(f"http://{address}:{gw.port}/admin/routes") as resp:
                assert resp.status == 403
                _assert_openai_error(await resp.json(), "forbidden")
            async with client.put(f"http://{address}:{gw.port}/admin/routes", json={"weights": {"baseline": 2}},
                                  headers={"X-Forwarded-For": "127.0.0.1"}) as resp:
                assert resp.status == 403
        async with gateway(routes, host="0.0.0.0", admin_token=ADMIN_TOKEN) as gw, aiohttp.ClientSession() as client:
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with client.get(f"http://{address}:{gw.port}/admin/routes", headers=headers) as resp:
                assert resp.status == 200

    run(scenario())


def test_routes_and_settings_are_validated():
    good = [{"name": "baseline", "weight": 90, "upstreams": ["http://127.0.0.1:8101/", "https://h.example:9"]},
            {"name": "canary", "weight": 10, "upstreams": ["http://127.0.0.1:8103"]}]
    specs = parse_routes({"groups": good})
    assert specs[0].upstreams == ("http://127.0.0.1:8101", "https://h.example:9")
    assert parse_routes(good) == specs
    for bad in ([], {"groups": good, "extra": 1}, [dict(good[0], weight=float("inf"))],
                [dict(good[0], upstreams=["http://h:99999"])], [dict(good[0], upstreams=["http://h/?q=1"])],
                [dict(good[0], colour="red")], [good[0], good[0]], "routes"):
        with pytest.raises(RoutesError):
            parse_routes(bad)
    assert parse_bind("127.0.0.1:8100") == ("127.0.0.1", 8100)
    assert parse_bind("[::1]:0", lowest_port=0) == ("::1", 0)
    with pytest.raises(ValueError):
        parse_bind("[::1]:0")
    for bad in ("8100", "host:", "::1:8100", "h:70000", ":80"):
        with pytest.raises(ValueError):
            parse_bind(bad)
    with pytest.raises(ValueError):
        GatewaySettings(groups=good, max_concurrency=0)
    with pytest.raises(ValueError):
        GatewaySettings(groups=good, idle_timeout_s=float("nan"))
    with pytest.raises(ValueError):
        GatewaySettings(groups=good, admin_token="short")


def test_cli_refuses_bad_configuration(tmp_path, capsys):
    assert main(["--routes", str(tmp_path / "missing.json")]) == 2
    assert "cannot read routes file" in capsys.readouterr().err
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps([{"name": "g", "weight": 0, "upstreams": ["http://127.0.0.1:9"]}]))
    assert main(["--routes", str(routes)]) == 2
    assert "weight above 0" in capsys.readouterr().err
    routes.write_text(json.dumps([{"name": "g", "weight": 1, "upstreams": ["http://127.0.0.1:9"]}]))
    assert main(["--routes", str(routes), "--bind", "nowhere"]) == 2
    with pytest.raises(SystemExit):
        main(["--routes", str(routes), "--max-concurrency", "-3"])


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"groups": [{"name": "g", "weight": 1, "upstreams": ["http://127.0.0.1:9"]}]}))
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.gateway", "--bind", "127.0.0.1:0", "--routes", str(routes),
         "--admin-token-file", str(token_file), "--health-interval", "0.2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, process.stderr.read() if process.poll() else "")
        base = line.split("listening on ", 1)[1].split()[0].removesuffix("/v1")

        async def probe():
            async with aiohttp.ClientSession() as client:
                async with client.get(base + "/admin/routes") as resp:
                    assert resp.status == 401
                async with client.get(base + "/admin/routes",
                                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                    assert resp.status == 200
                async with client.get(base + "/metrics") as resp:
                    assert resp.status == 200 and "llm_gateway_requests_in_flight" in await resp.text()

        run(probe())
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()  # reap it and close its pipes


def _mutations(seed: int, count: int):
    """Seeded hostile variants of a valid request: byte flips, cuts, splices, and wrong-typed fields."""
    import random

    rng = random.Random(seed)
    valid = json.dumps(chat(stream=True, stream_options={"include_usage": True})).encode()
    odd_values = [None, True, -1, 1e308, "", "x" * 10_000, [], {}, [[[]]], {"a": {"b": None}}, "\u0000", 2**70]
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            data = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)
        elif kind == 1:
            yield valid[: rng.randrange(len(valid))]
        elif kind == 2:
            cut = rng.randrange(len(valid))
            yield valid[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 20))) + valid[cut:]
        else:
            body = chat(stream=rng.choice([True, False]))
            body[rng.choice(["model", "stream", "stream_options", "max_tokens", "messages"])] = rng.choice(odd_values)
            yield json.dumps(body).encode()


def test_mutated_requests_never_crash_the_gateway():
    async def scenario():
        replica = FakeReplica("a", chunks=2)
        await replica.start()
        async with gateway(groups(("baseline", 1, [replica]))) as gw, aiohttp.ClientSession() as client:
            statuses = set()
            for body in _mutations(seed=2024, count=150):
                async with client.post(gw.url + "/v1/chat/completions", data=body,
                                       headers={"Content-Type": "application/json"}) as resp:
                    statuses.add(resp.status)
                    raw = await resp.read()
                    assert resp.status in (200, 400, 404), (resp.status, body[:200], raw[:200])
                    if resp.status != 200:
                        _assert_openai_error(json.loads(raw))
            async with client.get(gw.url + "/health") as resp:
                assert resp.status == 200
        await replica.stop()
        return statuses

    statuses = run(scenario())
    assert 400 in statuses and 200 in statuses
