"""A small OpenAI-compatible server with a known pace, used by the load generator's tests (and checked here).

``FakeOpenAI`` runs aiohttp in a thread of its own (its own event loop, so the client's
timing is not disturbed by the server's work). Streams send the first token ``ttft``
seconds after the request arrived and then one chunk every ``itl`` seconds, on an
absolute schedule (no drift). Prompt markers change the behaviour of one request:
``[fail:CODE]`` answers CODE with an OpenAI error body, ``[stream-error]`` sends an
error chunk after the first token. ``POST /v1/traces`` keeps OTLP/HTTP exports. Every request is recorded with its headers, body
and wall-clock arrival/finish times.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import threading
import time

import aiohttp
from aiohttp import web

_FAIL = re.compile(r"\[fail:(\d{3})\]")


@dataclasses.dataclass
class ReceivedRequest:
    path: str
    headers: dict[str, str]
    body: dict
    arrived_ns: int
    finished_ns: int | None = None
    # Wall-clock ns taken right before each text chunk / the end of the body was written: nothing the
    # client measures can come earlier.
    chunk_ns: list[int] = dataclasses.field(default_factory=list)
    eof_ns: int | None = None

    @property
    def text(self) -> str:
        if "prompt" in self.body:
            return str(self.body["prompt"])
        return " ".join(m.get("content", "") for m in self.body.get("messages", []))


class FakeOpenAI:
    def __init__(
        self,
        *,
        ttft: float = 0.05,
        itl: float = 0.01,
        tokens_per_chunk: int = 1,
        usage: bool = True,
        model: str = "fake-model",
        role_chunk_first: bool = True,
    ):
        self.ttft = ttft
        self.itl = itl
        self.tokens_per_chunk = tokens_per_chunk
        self.usage = usage
        self.model = model
        self.role_chunk_first = role_chunk_first
        self.received: list[ReceivedRequest] = []
        self.otlp_exports: list[tuple[dict[str, str], bytes]] = []  # (headers, body) of POST /v1/traces
        self.in_flight = 0
        self.peak_in_flight = 0
        self._counter = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> FakeOpenAI:
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._setup())
            except BaseException as exc:  # reported to the starting thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _setup(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/traces", self._otlp)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- handlers -------------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _otlp(self, request: web.Request) -> web.Response:
        """An OTLP/HTTP sink, so tests can see what the load generator's own exporter sends."""
        self.otlp_exports.append((dict(request.headers), await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        received = ReceivedRequest(request.path, dict(request.headers), await request.json(), time.time_ns())
        self.received.append(received)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request, received, arrived)
        finally:
            self.in_flight -= 1
            received.finished_ns = time.time_ns()

    async def _answer(self, request: web.Request, received: ReceivedRequest, arrived: float) -> web.StreamResponse:
        body = received.body
        failure = _FAIL.search(received.text)
        if failure:
            status = int(failure.group(1))
            return web.json_response(
                {"error": {"message": f"injected failure {status}", "type": "InternalServerError", "code": status}},
                status=status,
            )
        self._counter += 1
        response_id = f"cmpl-fake-{self._counter}"
        chat = request.path.endswith("/chat/completions")
        n = int(body["max_tokens"])
        chunks = [min(self.tokens_per_chunk, n - i) for i in range(0, n, self.tokens_per_chunk)]
        if not body.get("stream"):
            await asyncio.sleep(max(0.0, arrived + self.ttft + (len(chunks) - 1) * self.itl - time.monotonic()))
            text = " ".join(["word"] * n)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({
                "id": response_id, "object": "chat.completion" if chat else "text_completion", "model": self.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
            })
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion", "model": self.model}

        async def send(payload: dict) -> None:
            await response.write(b"data: " + json.dumps({**base, **payload}).encode() + b"\n\n")

        if chat and self.role_chunk_first:
            # vLLM sends the role first; it carries no text and must not count as the first token.
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await response.write(b": keep-alive comment\n\n")
        for i, size in enumerate(chunks):
            await asyncio.sleep(max(0.0, arrived + self.ttft + i * self.itl - time.monotonic()))
            text = "".join(" word" for _ in range(size))
            last = i == len(chunks) - 1
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            received.chunk_ns.append(time.time_ns())
            await send({"choices": [choice]})
            if i == 0 and "[stream-error]" in received.text:
                await send({"error": {"message": "engine died", "code": 500}})
                await response.write_eof()
                return response
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}})
        await response.write(b"data: [DONE]\n\n")
        received.eof_ns = time.time_ns()
        await response.write_eof()
        return response


def free_port() -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _stream_chunk_times(url: str, body: dict) -> tuple[list[float], list[bytes]]:
    times, lines = [], []
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        async with session.post(url, json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {") and b'"text": " word' in line:
                    times.append(time.perf_counter() - start)
                lines.append(line)
    return times, lines


def test_fake_server_streams_at_its_pace():
    with FakeOpenAI(ttft=0.05, itl=0.01) as server:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        times, lines = asyncio.run(_stream_chunk_times(server.base_url + "/completions", body))
    assert len(times) == 5
    # Lower bounds are the server's pacing; upper bounds only catch a server that ignores it (a loaded CI
    # machine delays the client by tens of milliseconds).
    assert 0.049 <= times[0] <= 0.5
    assert 0.089 <= times[-1] <= 0.6  # the fifth chunk is due 50 + 4 × 10 ms after the request
    assert lines[-2].strip() == b"data: [DONE]" or lines[-1].strip() == b"data: [DONE]"
    assert any(b'"usage"' in line for line in lines)
