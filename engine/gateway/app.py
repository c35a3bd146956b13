"""The gateway's aiohttp application: inference proxy, model list, health, metrics and the route admin API.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (proxied, see
``proxy.py``), ``GET /v1/models`` (merged from the replicas, cached), ``GET /health``
(200 while some replica is healthy, else 503), ``GET /metrics`` (Prometheus) and
``GET``/``PUT /admin/routes``. The admin API needs ``Authorization: Bearer <token>``
when a token is configured; without one it only answers loopback peers (the socket's
peer address; forwarding headers are not trusted). Every error is OpenAI-shaped.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import random

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.gateway.admission import AdmissionController
from engine.gateway.cache import CacheRegistry
from engine.gateway.errors import GatewayError, error_response
from engine.gateway.health import UpstreamMonitor
from engine.gateway.metrics import GatewayMetrics
from engine.gateway.proxy import OPERATIONS, Exchange, read_bounded
from engine.gateway.routing import RouteTable
from engine.gateway.settings import GatewaySettings, RoutesError, parse_route_update
from engine.telemetry import build_tracer_provider

log = logging.getLogger(__name__)

TRACER_NAME = "llm_observatory.gateway"
_MAX_ADMIN_BODY = 1024 * 1024
# Below uvicorn's 5 s keep-alive (vLLM's server), so the gateway never reuses a connection vLLM is closing.
_UPSTREAM_KEEPALIVE_S = 4.0


class Gateway:
    """The state one gateway app shares between requests: routes, admission, metrics, tracer, upstream session."""

    def __init__(self, settings: GatewaySettings, tracer_provider=None):
        self.settings = settings
        self.table = RouteTable(settings.groups, random.Random(settings.rng_seed))
        self.admission = AdmissionController(settings.max_concurrency, settings.max_queue, settings.max_queue_wait_s)
        self.metrics = GatewayMetrics(self.table, self.admission)
        self.session: aiohttp.ClientSession | None = None
        self.caches = CacheRegistry(self.metrics, lambda: self.session)
        self.caches.update(self.table.specs())
        self.metrics.watch_caches(self.caches)
        self._owned_provider = None
        if tracer_provider is None:
            tracer_provider = self._owned_provider = build_tracer_provider(settings.service_name)
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer(TRACER_NAME)
        self.monitor = UpstreamMonitor(self.table, settings, rechecks=self.metrics.rechecks)
        self._watched: set[Exchange] = set()

    # Exchanges waiting on an upstream are watched so a vanished client gets its upstream request closed even
    # when the server does not cancel handlers itself (aiohttp's default).
    def watch(self, exchange: Exchange) -> None:
        self._watched.add(exchange)

    def unwatch(self, exchange: Exchange) -> None:
        self._watched.discard(exchange)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(self.settings.disconnect_poll_s)
            for exchange in list(self._watched):
                if not exchange.cancel_requested and exchange.client_disconnected():
                    exchange.cancel_requested = True
                    self._watched.discard(exchange)
                    exchange.task.cancel("client disconnected")

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup context: the upstream session and background tasks live as long as the app."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S, ttl_dns_cache=30)
        self.session = aiohttp.ClientSession(connector=connector, trust_env=False)
        self.monitor.session = self.session
        tasks = [asyncio.create_task(self.monitor.run(), name="gateway-health"),
                 asyncio.create_task(self._watch_disconnects(), name="gateway-disconnects")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.caches.close()
            await self.session.close()
            if self._owned_provider is not None:
                self._owned_provider.shutdown()

    # --- handlers ------------------------------------------------------------------------------------------

    async def inference(self, request: web.Request) -> web.StreamResponse:
        return await Exchange(self, request, OPERATIONS[request.path]).handle()

    async def models(self, request: web.Request) -> web.Response:
        await self.monitor.refresh_models(self.settings.models_cache_ttl_s)
        document = self.monitor.models_document()
        if document is None:
            return error_response(503, "no replica answered /v1/models", "upstream_unavailable",
                                  retry_after=self.settings.health_interval_s)
        return _json(document)

    async def health(self, request: web.Request) -> web.Response:
        upstreams = self.table.upstreams()
        healthy = sum(1 for upstream in upstreams if upstream.healthy)
        document = {"status": "ok" if healthy else "unavailable", "healthy_upstreams": healthy,
                    "upstreams": len(upstreams)}
        return _json(document, status=200 if healthy else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_routes(self, request: web.Request) -> web.Response:
        self._authorise_admin(request)
        return _json(self.table.snapshot())

    async def put_routes(self, request: web.Request) -> web.Response:
        self._authorise_admin(request)
        body = await read_bounded(request, _MAX_ADMIN_BODY, self.settings.client_body_timeout_s)
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, f"body is not valid JSON: {exc}", "invalid_json") from None
        try:
            self.table.replace(parse_route_update(document, self.table.specs()))
        except RoutesError as exc:
            raise GatewayError(400, str(exc), "invalid_routes") from None
        self.caches.update(self.table.specs())
        log.info("routes changed by %s: %s", request.remote,
                 ", ".join(f"{g.name}={g.weight:g}×{len(g.upstreams)}" for g in self.table.groups))
        self.monitor.wake()  # probe new replicas now rather than at the next interval
        return _json(self.table.snapshot())

    def _authorise_admin(self, request: web.Request) -> None:
        token = self.settings.admin_token
        if token is None:
            if not _is_loopback(request.remote):
                raise GatewayError(403, "the admin API only answers local clients when no admin token is set",
                                   "forbidden")
            return
        header = request.headers.get("Authorization", "")
        scheme, _, offered = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(offered.strip().encode(), token.encode()):
            raise GatewayError(401, "a valid 'Authorization: Bearer <admin token>' header is required",
                               "invalid_admin_token")


def _is_loopback(remote: str | None) -> bool:
    try:
        address = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _json(document: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(document), headers={"Content-Type": "application/json"})


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Answer every failure in the OpenAI error shape: routing misses, our own errors, and bugs (500)."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
        return error_response(exc.status, exc.reason or "error", code, headers=headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal gateway error", "internal_error")


GATEWAY_KEY = web.AppKey("gateway", Gateway)


def build_gateway_app(settings: GatewaySettings, *, tracer_provider=None) -> web.Application:
    """The gateway as an aiohttp application; the app's ``GATEWAY_KEY`` holds its state (routes, metrics)."""
    gateway = Gateway(settings, tracer_provider)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[openai_errors])
    app[GATEWAY_KEY] = gateway
    app.cleanup_ctx.append(gateway.lifespan)
    for path in OPERATIONS:
        app.router.add_post(path, gateway.inference)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.prometheus)
    app.router.add_get("/admin/routes", gateway.get_routes)
    app.router.add_put("/admin/routes", gateway.put_routes)
    return app
