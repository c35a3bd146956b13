"""Sends one OpenAI-compatible request, measures it the way vLLM's benchmark does, and records its CLIENT span.

Measurement (``vllm/benchmarks/lib/endpoint_request_func.py``, the code behind
``benchmark_serving.py`` and ``vllm bench serve``), all from ``perf_counter`` taken
right before the request is sent:

* TTFT: arrival of the first SSE chunk that carries generated text (``text``, or the
  chat delta's ``content``/``reasoning_content``/``tool_calls``). vLLM counts the first
  chunk with any choice; the chat role-only chunk vLLM sends carries no text and comes
  with the first token anyway, so the figures agree.
* ITL: gaps between successive text-carrying chunks (a chunk holding several tokens,
  e.g. after speculative decoding, is one gap, as in vLLM).
* TPOT = (e2e − TTFT) / (n − 1), n = ``usage.completion_tokens`` (requested with
  ``stream_options.include_usage``), else the tokens counted in the received text;
  undefined when n <= 1.
* e2e: until the last byte of the response. vLLM stops its clock at the last data
  chunk; the only difference is the ``[DONE]`` trailer written right after it. Taking
  the last byte makes e2e exactly the CLIENT span's duration, the figure the platform
  decomposes.

The span starts immediately before the request is sent (its ``traceparent`` is in the
request) and ends after the last byte; its start is the wall clock read together with
the start ``perf_counter`` and its end is start + measured e2e, so its duration is the
measured e2e to the nanosecond.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.loadgen.workload import RequestContent
from engine.telemetry import inject_context
from engine.tokens import count_tokens

PROVIDER_NAME = "openai"
# An error message from a server is kept to this length (bodies can be whole HTML pages).
MAX_ERROR_CHARS = 500
MAX_HEADER_CHARS = 40
CACHE_HEADER = "X-Observatory-Cache"  # engine.gateway.cache_keys.HEADER (the gateway package is not imported here)


@dataclasses.dataclass
class RequestRecord:
    """Everything measured about one request. Times in milliseconds; None where not measured."""

    index: int
    scheduled_ms: float  # planned send time, from the start of the run
    sent_ms: float | None = None  # actual send time, from the start of the run
    success: bool = False
    e2e_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = dataclasses.field(default_factory=list)
    last_chunk_ms: float | None = None  # arrival of the last text-carrying chunk (vLLM's "latency")
    prompt_tokens: int | None = None  # usage.prompt_tokens, else the local count of what was sent
    completion_tokens: int | None = None  # usage.completion_tokens, else counted in the received text
    usage_reported: bool = False
    max_tokens: int | None = None
    status: int | None = None  # HTTP status, None when no response arrived
    error: str | None = None
    error_type: str | None = None  # as the span's error.type: HTTP status code, exception class, or a reason
    response_id: str | None = None
    response_model: str | None = None
    finish_reason: str | None = None
    trace_id: str | None = None  # hex, to find the request in the platform (GET /api/v1/requests?trace_id=)
    span_id: str | None = None
    output: str | None = None  # the generated text, kept only when the sender is asked to (keep_output)
    # The response's X-Observatory-Cache header: the platform gateway's response cache answered (exact_cache,
    # semantic_cache); None when it did not say so (an engine's answer, or a server without that cache).
    served_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class ResponseError(Exception):
    """A response that is not a valid OpenAI-compatible answer; ``error_type`` goes to the span."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.error_type = error_type


def _qualified_name(exc: BaseException) -> str:
    """``error.type`` for an exception: its fully qualified class name (builtins unqualified), per OTel."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _error_message(body: bytes, reason: str | None) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message"}}`` or ``{"message"}``), else the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            text = inner["message"]
        elif isinstance(inner, str):
            text = inner
        elif isinstance(data.get("message"), str):
            text = data["message"]
        elif isinstance(data.get("detail"), str):
            text = data["detail"]
    text = text or reason or ""
    return text[:MAX_ERROR_CHARS]


def _choice_text(choice: Any) -> str:
    """Generated text a stream choice carries (completions ``text``, chat ``delta``), '' when none."""
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
    joined = "".join(p for p in parts if isinstance(p, str))
    if not joined and delta.get("tool_calls"):
        # Tool-call arguments are generated tokens too.
        calls = delta["tool_calls"]
        joined = json.dumps(calls) if isinstance(calls, list) else ""
    return joined


def _message_text(choice: Any) -> str:
    """Generated text of a non-streaming choice."""
    if not isinstance(choice, dict):
        return ""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    message = choice.get("message")
    if isinstance(message, dict):
        parts = [message.get("content"), message.get("reasoning_content"), message.get("reasoning")]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def _usage_counts(usage: Any) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None

    def count(key):
        value = usage.get(key)
        return value if value.__class__ is int and value >= 0 else None

    return count("prompt_tokens"), count("completion_tokens")


class RequestSender:
    """Sends requests of one run over one aiohttp session, with one tracer."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_url: str,
        model: str,
        endpoint: str,
        stream: bool,
        tracer: trace.Tracer,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        keep_output: bool = False,
    ):
        self.session = session
        self.api_url = api_url
        self.model = model
        self.endpoint = endpoint
        self.stream = stream
        self.tracer = tracer
        self.operation = "chat" if endpoint == "chat" else "text_completion"
        self.span_name = f"{self.operation} {model}"
        parsed = urlsplit(api_url)
        self.server_address = parsed.hostname or ""
        self.server_port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.base_headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else
                             "application/json"}
        if api_key:
            self.base_headers["Authorization"] = f"Bearer {api_key}"
        self.base_headers.update(headers or {})
        self.extra_body = dict(extra_body or {})
        self.keep_output = keep_output

    def body(self, content: RequestContent) -> dict[str, Any]:
        """The request body: vLLM benchmark defaults (greedy, ``ignore_eos``: the output length is as asked)."""
        body: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            body["messages"] = [dict(m) for m in content.messages or ()]
        else:
            body["prompt"] = content.prompt
        body["temperature"] = 0.0
        body["ignore_eos"] = True
        # Extra keys may change sampling; the keys that define the measurement are set after them.
        body.update(self.extra_body)
        body.update({"max_tokens": content.max_tokens, "stream": self.stream})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def send(self, record: RequestRecord, content: RequestContent, run_start: float,
                   attributes: dict[str, Any] | None = None) -> RequestRecord:
        """Send one request and fill ``record`` in; never raises for a failed request (the record says why).
        ``attributes`` are added to the CLIENT span (e.g. the regression run and item it belongs to)."""
        content = content.for_endpoint(self.endpoint)
        body = self.body(content)
        payload = json.dumps(body).encode()
        headers = dict(self.base_headers)
        record.max_tokens = content.max_tokens
        attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": content.max_tokens,
            "gen_ai.request.stream": self.stream,
            "server.address": self.server_address,
            "server.port": self.server_port,
            **(attributes or {}),
        }
        for key in ("temperature", "top_p"):  # as sent (--extra-body may change them)
            value = body.get(key)
            if isinstance(value, (int, float)) and value.__class__ is not bool:
                attributes[f"gen_ai.request.{key}"] = value
        start_wall_ns = time.time_ns()
        start = time.perf_counter()
        span = self.tracer.start_span(self.span_name, kind=SpanKind.CLIENT, attributes=attributes,
                                      start_time=start_wall_ns)
        inject_context(headers, trace.set_span_in_context(span))
        record.sent_ms = (start - run_start) * 1000.0
        context = span.get_span_context()
        record.trace_id = format(context.trace_id, "032x")
        record.span_id = format(context.span_id, "016x")
        text = ""
        end = start
        try:
            async with self.session.post(self.api_url, data=payload, headers=headers) as response:
                record.status = response.status
                cache = response.headers.get(CACHE_HEADER)
                record.served_from = cache[:MAX_HEADER_CHARS] if cache is not None else None
                if response.status != 200:
                    error_body = await response.read()
                    end = time.perf_counter()
                    raise ResponseError(_error_message(error_body, response.reason), str(response.status))
                if self.stream:
                    text, end = await self._read_stream(response, record, start)
                else:
                    text, end = await self._read_json(response, record)
            record.success = True
        except ResponseError as exc:
            end = end if end > start else time.perf_counter()
            record.error, record.error_type = str(exc), exc.error_type
        except Exception as exc:  # aiohttp.ClientError, asyncio.TimeoutError, OSError ...
            end = time.perf_counter()
            record.error = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:MAX_ERROR_CHARS]
            record.error_type = _qualified_name(exc)
        except BaseException:  # cancelled: the span still ends, marked as such, and the cancel goes on
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
            span.set_attribute("error.type", "cancelled")
            span.end(end_time=start_wall_ns + round((time.perf_counter() - start) * 1e9))
            raise
        elapsed = end - start
        record.e2e_ms = elapsed * 1000.0
        if record.success:
            self._finish_counts(record, content, text, elapsed)
            if self.keep_output:
                record.output = text
        self._end_span(span, record, start_wall_ns, elapsed)
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord, start: float):
        """Read the SSE stream to its last byte; (generated text, perf time of the last byte)."""
        pieces: list[str] = []
        first: float | None = None
        previous: float | None = None
        async for raw in response.content:
            now = time.perf_counter()
            line = raw.strip()
            # SSE comments (":" — keep-alive pings), event/id fields and blank separators carry no data.
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                raise ResponseError(f"invalid JSON in the stream: {data[:200]!r}", "invalid_response") from None
            if not isinstance(chunk, dict):
                raise ResponseError("a stream chunk is not a JSON object", "invalid_response")
            if chunk.get("error") is not None:
                # vLLM reports failures after the 200 header as an error chunk.
                raise ResponseError(_error_message(json.dumps(chunk).encode(), None), "stream_error")
            self._note_identity(record, chunk)
            choices = chunk.get("choices")
            if isinstance(choices, list) and choices:
                choice = choices[0]
                piece = _choice_text(choice)
                if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                    record.finish_reason = choice["finish_reason"]
                if piece:
                    if first is None:
                        first = now
                        record.ttft_ms = (now - start) * 1000.0
                    else:
                        record.itl_ms.append((now - previous) * 1000.0)
                    previous = now
                    pieces.append(piece)
            if chunk.get("usage") is not None:
                prompt_tokens, completion_tokens = _usage_counts(chunk["usage"])
                if completion_tokens is not None:
                    record.usage_reported = True
                    record.completion_tokens = completion_tokens
                if prompt_tokens is not None:
                    record.prompt_tokens = prompt_tokens
        end = time.perf_counter()
        if first is None:
            raise ResponseError("the stream ended without any generated text", "no_content")
        record.last_chunk_ms = (previous - start) * 1000.0
        return "".join(pieces), end

    async def _read_json(self, response: aiohttp.ClientResponse, record: RequestRecord):
        body = await response.read()
        end = time.perf_counter()
        try:
            data = json.loads(body)
        except ValueError:
            raise ResponseError(f"the response is not JSON: {body[:200]!r}", "invalid_response") from None
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
            raise ResponseError("the response has no choices", "invalid_response")
        self._note_identity(record, data)
        choice = data["choices"][0]
        if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
            record.finish_reason = choice["finish_reason"]
        prompt_tokens, completion_tokens = _usage_counts(data.get("usage"))
        if completion_tokens is not None:
            record.usage_reported = True
            record.completion_tokens = completion_tokens
        if prompt_tokens is not None:
            record.prompt_tokens = prompt_tokens
        return _message_text(choice), end

    @staticmethod
    def _note_identity(record: RequestRecord, chunk: dict) -> None:
        if record.response_id is None and isinstance(chunk.get("id"), str) and chunk["id"]:
            record.response_id = chunk["id"]
        if record.response_model is None and isinstance(chunk.get("model"), str) and chunk["model"]:
            record.response_model = chunk["model"]

    @staticmethod
    def _finish_counts(record: RequestRecord, content: RequestContent, text: str, elapsed: float) -> None:
        if record.completion_tokens is None:
            record.completion_tokens = count_tokens(text)
        if record.prompt_tokens is None:
            record.prompt_tokens = content.input_tokens
        if record.ttft_ms is not None and record.completion_tokens > 1:
            record.tpot_ms = (elapsed * 1000.0 - record.ttft_ms) / (record.completion_tokens - 1)

    def _end_span(self, span: trace.Span, record: RequestRecord, start_wall_ns: int, elapsed: float) -> None:
        if record.response_model:
            span.set_attribute("gen_ai.response.model", record.response_model)
        if record.response_id:
            span.set_attribute("gen_ai.response.id", record.response_id)
        if record.status is not None:
            span.set_attribute("http.response.status_code", record.status)
        if record.success:
            span.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
            if record.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [record.finish_reason])
            if record.ttft_ms is not None:
                span.set_attribute("gen_ai.response.time_to_first_chunk", record.ttft_ms / 1000.0)
        else:
            span.set_attribute("error.type", record.error_type or "_OTHER")
            span.set_status(Status(StatusCode.ERROR, record.error or record.error_type))
        span.end(end_time=start_wall_ns + round(elapsed * 1e9))
