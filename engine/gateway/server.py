"""Running the gateway: inside another program (``start_gateway``/``serve_gateway``) or as ``python -m engine.gateway``.

    python -m engine.gateway --bind 127.0.0.1:8100 --routes routes.json [--admin-token-file FILE]

Spans go to ``--otlp-endpoint`` (or the standard OTEL_EXPORTER_OTLP_* environment);
without either they are dropped. The admin token may come from ``--admin-token``,
``--admin-token-file`` or the ``LLM_GATEWAY_ADMIN_TOKEN`` environment variable (a file
or the environment keep it out of ``ps``). SIGINT/SIGTERM stop the server gracefully.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import prometheus_client
from aiohttp import web

from engine.addresses import host_port, parse_bind
from engine.cli_args import integer, non_negative_int, positive_float, positive_int
from engine.gateway.app import GATEWAY_KEY, Gateway, build_gateway_app
from engine.gateway.settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_SERVICE_NAME,
    GatewaySettings,
    RoutesError,
    load_routes,
)
from engine.telemetry import build_tracer_provider

log = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "LLM_GATEWAY_ADMIN_TOKEN"
_SHUTDOWN_TIMEOUT_S = 10.0


@dataclasses.dataclass
class RunningGateway:
    """A gateway listening on a socket; ``close()`` stops it (in-flight requests get a short grace period)."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY_KEY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_gateway(settings: GatewaySettings, *, tracer_provider=None) -> RunningGateway:
    """Build the app and listen on ``settings.host:settings.port`` (port 0 picks a free port)."""
    app = build_gateway_app(settings, tracer_provider=tracer_provider)
    # handler_cancellation: a client that hangs up cancels its handler at once, closing the upstream request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    return RunningGateway(app=app, runner=runner, host=host, port=port)


async def serve_gateway(settings: GatewaySettings, *, tracer_provider=None, stop: asyncio.Event | None = None,
                        on_ready=None) -> None:
    """Run the gateway until ``stop`` is set (or the task is cancelled); ``on_ready(RunningGateway)`` once listening."""
    running = await start_gateway(settings, tracer_provider=tracer_provider)
    try:
        if on_ready is not None:
            on_ready(running)
        await (stop or asyncio.Event()).wait()
    finally:
        await running.close()


def _parser() -> argparse.ArgumentParser:
    # Defaults come from GatewaySettings, so the CLI and embedded use cannot drift apart.
    d = {field.name: field.default for field in dataclasses.fields(GatewaySettings) if field.name != "groups"}
    parser = argparse.ArgumentParser(prog="python -m engine.gateway",
                                     description="OpenAI-compatible gateway in front of vLLM or simulator replicas.")
    parser.add_argument("--bind", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}", help="HOST:PORT (default %(default)s)")
    parser.add_argument("--routes", required=True, type=Path, help="JSON file of replica groups")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--admin-token", help=f"bearer token for /admin (or set {ADMIN_TOKEN_ENV})")
    token.add_argument("--admin-token-file", type=Path, help="file holding the admin token")
    parser.add_argument("--max-concurrency", type=positive_int, default=d["max_concurrency"],
                        help="requests in flight upstream (default %(default)s)")
    parser.add_argument("--max-queue", type=non_negative_int, default=d["max_queue"],
                        help="requests waiting for a slot before 429 (default %(default)s)")
    parser.add_argument("--max-queue-wait", type=positive_float, default=d["max_queue_wait_s"],
                        help="seconds a request may wait for a slot (default %(default)s)")
    parser.add_argument("--connect-timeout", type=positive_float, default=d["connect_timeout_s"])
    parser.add_argument("--first-byte-timeout", type=positive_float, default=d["first_byte_timeout_s"])
    parser.add_argument("--idle-timeout", type=positive_float, default=d["idle_timeout_s"])
    parser.add_argument("--total-timeout", type=positive_float, default=d["total_timeout_s"])
    parser.add_argument("--max-body-bytes", type=positive_int, default=d["max_body_bytes"])
    parser.add_argument("--health-interval", type=positive_float, default=d["health_interval_s"])
    parser.add_argument("--health-timeout", type=positive_float, default=d["health_timeout_s"])
    parser.add_argument("--service-name", default=DEFAULT_SERVICE_NAME, help="OTel service.name")
    parser.add_argument("--otlp-endpoint", help="OTLP traces endpoint (default: OTEL_EXPORTER_OTLP_* environment)")
    parser.add_argument("--otlp-protocol", choices=("grpc", "http/protobuf"), help="OTLP protocol (default grpc)")
    parser.add_argument("--seed", type=integer, help="seed the routing RNG (reproducible splits)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def _admin_token(args) -> str | None:
    if args.admin_token_file is not None:
        try:
            token = args.admin_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read admin token file {args.admin_token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ValueError(f"admin token file {args.admin_token_file} is empty")
        return token
    return args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None


def settings_from_args(args) -> GatewaySettings:
    host, port = parse_bind(args.bind, lowest_port=0)
    return GatewaySettings(
        groups=load_routes(args.routes),
        host=host,
        port=port,
        admin_token=_admin_token(args),
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_queue_wait_s=args.max_queue_wait,
        connect_timeout_s=args.connect_timeout,
        first_byte_timeout_s=args.first_byte_timeout,
        idle_timeout_s=args.idle_timeout,
        total_timeout_s=args.total_timeout,
        max_body_bytes=args.max_body_bytes,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        service_name=args.service_name,
        rng_seed=args.seed,
    )


async def _run(settings: GatewaySettings, tracer_provider) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def ready(running: RunningGateway) -> None:
        groups = ", ".join(f"{g.name}={g.weight:g} ({len(g.upstreams)} upstreams)" for g in settings.groups)
        print(f"llm-gateway listening on {running.url}/v1 — {groups}", flush=True)

    await serve_gateway(settings, tracer_provider=tracer_provider, stop=stop, on_ready=ready)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # As vLLM's API server does: no `*_created` series next to every counter and histogram.
    prometheus_client.disable_created_metrics()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        tracer_provider = build_tracer_provider(settings.service_name, endpoint=args.otlp_endpoint,
                                                protocol=args.otlp_protocol)
    except (RoutesError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(settings, tracer_provider))
    except OSError as exc:
        print(f"error: cannot listen on {args.bind}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        tracer_provider.shutdown()
    return 0
