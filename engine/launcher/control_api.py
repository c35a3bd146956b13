"""The fleet controller's control API: JSON over HTTP on loopback, behind a bearer token.

The token is kept in ``<run_dir>/control.token`` (mode 0600). The API is what
``python -m engine status|down`` and the platform's rollouts use:

``GET /fleet``
    The whole state: fleet state (``starting``, ``running``, ``degraded``, ``stopping``),
    the gateway, each group (weight, replicas, backend, config version and knobs, the
    replacement under way or the last one), and every process (group, config version,
    port, pid, state, restarts, last exit code, since, log path).
``PUT /fleet/groups/{name}/config`` with ``{"config": {<engine config>}}``
    Validates the config (400 with every problem), answers 200 ``unchanged`` when its
    version is the running one, 409 while that group is already being replaced, else 202
    and replaces the group in the background: new replicas on new ports, the gateway moved
    to them once healthy, the old ones drained then stopped. Progress is in ``GET /fleet``
    (``groups[].transition``).
``PUT /fleet/groups/{name}`` with ``{"base": "<group>", "config": {<engine config>}}``
    (optionally ``"replicas"``, default 1, and ``"weight"``, default 0)
    Adds a run-time group (a rollout's canary) with ``base``'s backend and model: 201 while
    it starts, 200 when the same group is already there, 409 when the name is taken, 404
    when ``base`` is not a group of the fleet file.
``DELETE /fleet/groups/{name}``
    202; takes a run-time group out of the gateway's table, then drains and stops its
    replicas (200 when there is no such group, 409 for a group of the fleet file).
``PUT /fleet/weights`` with ``{"weights": {"baseline": 90, "canary": 10}}``
    Changes traffic weights (≥ 0, at least one group above 0); 200 once the gateway has them.
``POST /fleet/stop``
    202; stops the gateway, then the replicas, then the controller.

Errors are ``{"error": "..."}`` (plus ``"problems": [...]`` for invalid configs) with 400,
401, 404, 409, 413 or 502.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
from typing import Any

from aiohttp import web

from engine.config import ConfigError, EngineConfig
from engine.launcher.fleet_controller import FleetController
from engine.launcher.fleet_spec import MAX_REPLICAS_PER_GROUP
from engine.launcher.run_dir import CONTROL_TOKEN_FILE

_MAX_BODY = 64 * 1024


def _json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def build_control_app(controller: FleetController) -> web.Application:
    """The control API's aiohttp application (bearer-token auth, JSON in and out)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        supplied = request.headers.get("Authorization", "")
        scheme, _, token = supplied.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 controller.control_token.encode()):
            token_file = controller.run_dir / CONTROL_TOKEN_FILE
            response = _json_error(401, f"missing or wrong bearer token (see {token_file})")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _json_error(413, f"request body larger than {_MAX_BODY} bytes")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _json_error(exc.status, exc.reason)
            raise

    async def read_json(request: web.Request) -> tuple[Any, web.Response | None]:
        if request.content_length is not None and request.content_length > _MAX_BODY:
            return None, _json_error(413, f"request body larger than {_MAX_BODY} bytes")
        raw = await request.read()
        try:
            return json.loads(raw or b"null"), None
        except (ValueError, UnicodeDecodeError) as exc:
            return None, _json_error(400, f"body is not valid JSON: {exc}")

    async def get_fleet(request: web.Request) -> web.Response:
        return web.json_response(controller.snapshot())

    async def put_group_config(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body, error = await read_json(request)
        if error is not None:
            return error
        if not isinstance(body, dict) or "config" not in body or set(body) - {"config", "drain_timeout"}:
            return _json_error(400, 'body must be {"config": {<engine config>}} (optionally with "drain_timeout")')
        drain_timeout = body.get("drain_timeout")
        if drain_timeout is not None and (isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float))
                                          or not math.isfinite(drain_timeout) or not 0 < drain_timeout <= 3600):
            return _json_error(400, "drain_timeout must be a number of seconds in (0, 3600]")
        try:
            config = EngineConfig.from_dict(body["config"])
        except ConfigError as exc:
            return _json_error(400, "invalid engine config", problems=exc.problems)
        status, payload = await controller.set_group_config(name, config, drain_timeout=drain_timeout)
        return web.json_response(payload, status=status)

    async def put_weights(request: web.Request) -> web.Response:
        body, error = await read_json(request)
        if error is not None:
            return error
        weights = body.get("weights") if isinstance(body, dict) and set(body) == {"weights"} else None
        if not isinstance(weights, dict) or not weights:
            return _json_error(400, 'body must be {"weights": {"<group>": <weight>, ...}}')
        unknown = sorted(str(name) for name in weights if name not in controller.groups)
        if unknown:
            return _json_error(404, f"no such group(s): {', '.join(unknown)}")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or not 0 <= weight <= 1_000_000:
                return _json_error(400, f"weight of {name!r} must be a number in 0..1000000, not {weight!r}")
        status, payload = await controller.set_weights(weights)
        return web.json_response(payload, status=status)

    async def put_group(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body, error = await read_json(request)
        if error is not None:
            return error
        if not isinstance(body, dict) or not {"base", "config"} <= set(body) \
                or set(body) - {"base", "config", "replicas", "weight"}:
            return _json_error(400, 'body must be {"base": "<group>", "config": {<engine config>}} (optionally '
                                    'with "replicas" and "weight")')
        replicas = body.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS_PER_GROUP:
            return _json_error(400, f"replicas must be an integer in 1..{MAX_REPLICAS_PER_GROUP}")
        weight = body.get("weight", 0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 <= weight <= 1_000_000:
            return _json_error(400, "weight must be a number in 0..1000000")
        if not isinstance(body["base"], str):
            return _json_error(400, "base must be the name of a group of the fleet file")
        try:
            config = EngineConfig.from_dict(body["config"])
        except ConfigError as exc:
            return _json_error(400, "invalid engine config", problems=exc.problems)
        status, payload = await controller.add_group(name, base=body["base"], config=config, replicas=replicas,
                                                     weight=weight)
        return web.json_response(payload, status=status)

    async def delete_group(request: web.Request) -> web.Response:
        status, payload = await controller.remove_group(request.match_info["name"])
        return web.json_response(payload, status=status)

    async def post_stop(request: web.Request) -> web.Response:
        # Answer first, then stop: the caller learns the stop was accepted before the API goes away.
        asyncio.get_running_loop().call_later(0.05, controller.request_stop)
        return web.json_response({"status": "stopping"}, status=202)

    app = web.Application(middlewares=[guard], client_max_size=_MAX_BODY)
    app.router.add_get("/fleet", get_fleet)
    app.router.add_put("/fleet/groups/{name}/config", put_group_config)
    app.router.add_put("/fleet/groups/{name}", put_group)
    app.router.add_delete("/fleet/groups/{name}", delete_group)
    app.router.add_put("/fleet/weights", put_weights)
    app.router.add_post("/fleet/stop", post_stop)
    return app
