"""Test support for the gateway tests: a small vLLM look-alike replica on a real socket, and a gateway starter.

No tests live here; the ``test_gateway_*`` files import it (pytest puts this folder on
``sys.path``, there being no ``__init__.py``).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time

import orjson
from aiohttp import web
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.gateway import GatewaySettings, start_gateway

MODEL = "test-model"


def run(coroutine):
    """Run one async scenario (the test suite has no asyncio plugin)."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout=60))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "llm-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class FakeReplica:
    """Speaks the part of vLLM's OpenAI API the gateway uses; every knob is a plain attribute tests may change.

    Streams send their headers at once and their chunks as they are produced, as vLLM does.
    Records each request (path, headers, JSON body) and when a handler was cancelled
    because its client (the gateway) went away.
    """

    _ids = itertools.count(1)

    def __init__(self, name: str = "replica", *, model: str = MODEL, chunks: int = 3, chunk_delay: float = 0.0,
                 delay: float = 0.0, status: int = 200):
        self.name = name
        self.model = model
        self.chunks = chunks
        self.chunk_delay = chunk_delay
        self.delay = delay  # before the answer (non-streaming) or before the first chunk (streaming)
        self.status = status
        self.health_status = 200
        self.health_checks = 0  # /health requests answered
        # When set, each chunk after the first waits for an item here: tests step a stream by hand.
        self.steps: asyncio.Queue | None = None
        # Simulated crash: "before_answer" drops the connection without a response; an int N drops it after N chunks.
        self.crash: str | int | None = None
        # When not None, sent as usage.prompt_tokens_details (vLLM's prefix-cache hits: {"cached_tokens": N}).
        self.prompt_tokens_details: object = None
        self.requests: list[dict] = []
        self.cancelled: list[float] = []
        self.completed = 0
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeReplica:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port or self.port or 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                               "owned_by": "vllm", "replica": self.name}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        number = next(self._ids)
        if self.crash == "before_answer":
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        try:
            if self.status != 200:
                await asyncio.sleep(self.delay)
                return web.json_response({"error": {"message": f"{self.name} refuses", "type": "BadRequestError",
                                                    "param": None, "code": self.status}}, status=self.status)
            if body.get("stream"):
                return await self._stream(request, body, number)
            await asyncio.sleep(self.delay)
            self.completed += 1
            return web.json_response({
                "id": f"cmpl-{self.name}-{number}", "object": "chat.completion", "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.name},
                             "finish_reason": "stop"}],
                "usage": self._usage(),
            })
        except asyncio.CancelledError:
            self.cancelled.append(time.monotonic())
            raise

    def _usage(self) -> dict:
        usage = {"prompt_tokens": 7, "completion_tokens": self.chunks, "total_tokens": 7 + self.chunks}
        if self.prompt_tokens_details is not None:
            usage["prompt_tokens_details"] = self.prompt_tokens_details
        return usage

    async def _stream(self, request: web.Request, body: dict, number: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.delay)
        base = {"id": f"chatcmpl-{self.name}-{number}", "object": "chat.completion.chunk", "model": self.model}
        for index in range(self.chunks):
            if index == self.crash:
                request.transport.close()
                return response
            if index:
                await asyncio.sleep(self.chunk_delay)
                if self.steps is not None:
                    await self.steps.get()
            chunk = dict(base, choices=[{"index": 0, "delta": {"content": f"t{index}"},
                                         "finish_reason": "stop" if index == self.chunks - 1 else None}])
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = dict(base, choices=[], usage=self._usage())
            await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.completed += 1
        return response


def groups(*pairs) -> list[dict]:
    """``groups(("baseline", 90, [r1, r2]), ("canary", 10, [r3]))`` → routes for GatewaySettings."""
    return [{"name": name, "weight": weight, "upstreams": [u if isinstance(u, str) else u.url for u in members]}
            for name, weight, members in pairs]


def settings(routes: list[dict], **overrides) -> GatewaySettings:
    values = dict(groups=routes, port=0, health_interval_s=0.2, health_timeout_s=0.5, rng_seed=1234)
    values.update(overrides)
    return GatewaySettings(**values)


@contextlib.asynccontextmanager
async def gateway(routes: list[dict], tracer_provider=None, **overrides):
    running = await start_gateway(settings(routes, **overrides), tracer_provider=tracer_provider)
    try:
        yield running
    finally:
        await running.close()


def chat(stream: bool = False, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream, "max_tokens": 16}
    body.update(extra)
    return body


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body."""
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def eventually(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
