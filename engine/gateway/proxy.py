"""One inference request through the gateway: validate, admit, route, forward, relay, trace.

The request's SERVER span starts on arrival and ends after the last byte is sent. Its own
context goes upstream as ``traceparent`` (there is no separate client span), so the
engine's ``llm_request`` span is its direct child. Span attributes follow the OTel GenAI
conventions; ``server.address``/``server.port`` name the replica that served the request.

Failures before anything reached the client are answered with an OpenAI-style error:
413/400/404 for bad input, 429 when shed, 503 when no replica can be reached (each
unreachable replica is tried in turn first), 504 on an upstream timeout, 502 on a broken
upstream answer. Once a stream has started, a failure ends it with an SSE ``error`` event.
A client that hangs up has its upstream request closed, which makes vLLM abort it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.gateway.admission import Overloaded
from engine.gateway.cache_answers import hit_document, render_stream
from engine.gateway.cache_keys import BODY_FLAG, HEADER, read_directives, read_threshold
from engine.gateway.errors import GatewayError, error_body, error_response
from engine.gateway.health import describe_failure
from engine.gateway.metrics import NO_GROUP
from engine.gateway.routing import Upstream
from engine.gateway.sse import SseRelay
from engine.telemetry import CACHE_READ_ATTRIBUTE, REPLICA_GROUP_ATTRIBUTE, extract_context, inject_context

log = logging.getLogger(__name__)

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
PROVIDER = "vllm"
# Client headers worth passing on: the engine's API key, the caller's request id (vLLM can adopt it), Accept.
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "Accept")
# Correlation ids a caller sends, recorded on the span as OTel's `http.request.header.<name>` (a list of strings):
# the caller's request id and LiteLLM's call id, so a trace that lost its traceparent upstream can still be told.
_RECORDED_HEADERS = ("x-request-id", "x-litellm-call-id")
_MAX_RECORDED_HEADER = 256
_PASSED_BACK_HEADERS = ("Retry-After", "X-Request-Id")
# Sends a request to one replica group, whatever its weight (0 included) and without falling back to another:
# how a regression run or a rollout's pre-traffic gate replays a dataset against one group of the fleet.
GROUP_HEADER = "X-Engine-Group"
_MAX_MODEL_NAME = 512
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics and spans
_MAX_CACHED_TOKENS = 2**31 - 1  # more than any context holds: a bound for an answer that gives no prompt count


async def read_bounded(request: web.BaseRequest, limit: int, timeout_s: float) -> bytes:
    """The request body; 413 as soon as it is known to exceed ``limit`` bytes, 408 if it takes over ``timeout_s``."""
    if request.content_length is not None and request.content_length > limit:
        raise GatewayError(413, f"request body is larger than {limit} bytes", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise GatewayError(413, f"request body is larger than {limit} bytes", "request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s", "request_timeout") \
            from None
    except HttpProcessingError as exc:
        raise GatewayError(400, f"malformed request body: {exc.message}", "invalid_body") from None
    return b"".join(chunks)


def recorded_headers(headers) -> dict[str, list[str]]:
    """The correlation headers of a request as span attributes; values longer than `_MAX_RECORDED_HEADER`
    characters or holding anything but printable ASCII are left out (they are the caller's, unchecked)."""
    out = {}
    for name in _RECORDED_HEADERS:
        values = [v for v in headers.getall(name, ()) if 0 < len(v) <= _MAX_RECORDED_HEADER and v.isprintable()
                  and v.isascii()]
        if values:
            out[f"http.request.header.{name}"] = values[:4]
    return out


class _ClientGone(Exception):
    """Writing to the client failed: it hung up."""


class _AttemptFailed(Exception):
    """An upstream attempt failed before anything reached the client; another replica may be tried."""

    def __init__(self, kind: str, reason: str, mark_down: bool):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.mark_down = mark_down


class _Watchdog:
    """One timer per request enforcing the first-byte, idle and total deadlines.

    A timeout context around every upstream read would arm and cancel a timer per token;
    this timer instead wakes up about once per idle period, looks at when the current wait
    began, and either re-arms itself or cancels the request's task (``fired``). Waiting
    on the client (a slow reader) is bounded by the total deadline only.
    """

    __slots__ = ("exchange", "loop", "fired", "waiting_since", "_handle")

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.loop = exchange.loop
        self.fired = False
        self.waiting_since: float | None = None  # set while waiting on the upstream
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = self.loop.call_at(self._due(), self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _due(self) -> float:
        exchange = self.exchange
        settings = exchange.settings
        if self.waiting_since is None:
            # Check in at least as often as the shortest timeout, so a wait that starts meanwhile is caught on time.
            period = min(settings.idle_timeout_s, settings.first_byte_timeout_s)
            return min(exchange.deadline, self.loop.time() + period)
        if exchange.first_bytes_at is None:
            return min(exchange.deadline, exchange.dispatched_at + settings.first_byte_timeout_s)
        return min(exchange.deadline, self.waiting_since + settings.idle_timeout_s)

    def _check(self) -> None:
        due = self._due()
        if self.loop.time() >= due and (self.waiting_since is not None or due >= self.exchange.deadline):
            self._handle = None
            self.fired = True
            self.exchange.task.cancel("upstream timeout")
        else:
            self._handle = self.loop.call_at(due, self._check)


class Exchange:
    """The life of one inference request; ``handle()`` returns the (already sent) response."""

    def __init__(self, gateway, request: web.Request, operation: str):
        self.gateway = gateway
        self.settings = gateway.settings
        self.request = request
        self.operation = operation
        self.loop = asyncio.get_running_loop()
        self.arrival = self.loop.time()
        self.deadline = self.arrival + self.settings.total_timeout_s
        self.task = asyncio.current_task()
        self.span = gateway.tracer.start_span(
            operation,
            context=extract_context(request.headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER,
                "http.request.method": request.method,
                "url.path": request.path,
                **recorded_headers(request.headers),
            },
        )
        self.span_context = trace.set_span_in_context(self.span)
        self.group = NO_GROUP
        self.upstream: Upstream | None = None
        self.model: str | None = None
        self.stream = False
        self.status: int | None = None  # what the client was sent
        self.error_type: str | None = None
        self.error_message: str | None = None
        self.response: web.StreamResponse | None = None
        self.client_gone = False
        self.cancel_requested = False  # set by the disconnect watcher when it cancels this task
        self.queue_wait = 0.0
        self.dispatched_at: float | None = None
        self.first_bytes_at: float | None = None
        self.upstream_done_at: float | None = None
        self.first_chunk_at: float | None = None
        self.keep_usage_chunk = True
        self.sse: SseRelay | None = None
        self.watchdog = _Watchdog(self)
        # The response cache of the request's group, if it has one (cache.py): the lookup, and the answer to store.
        self.cache = None
        self.cache_lookup = None
        self.capture = None
        self.answer_body: bytes | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def handle(self) -> web.StreamResponse:
        self.gateway.watch(self)
        try:
            return await self._serve()
        except asyncio.CancelledError:
            self.gateway.unwatch(self)
            if self.cancel_requested and self.task.uncancel() == 0:
                self._note_client_gone()
                return web.Response(status=CLIENT_CLOSED)  # nobody is listening any more
            if self.client_disconnected():
                self._note_client_gone()  # the server cancels handlers of vanished clients
            else:
                self._fail("cancelled", "the gateway is shutting down")
            raise
        except Exception as exc:  # a bug, not a client's doing: answer 500 and keep serving
            log.exception("inference request failed")
            self._fail(type(exc).__name__, "internal gateway error")
            if self.response is None:
                return error_response(500, "internal gateway error", "internal_error")
            return self.response
        finally:
            self.gateway.unwatch(self)
            self._finish()

    async def _serve(self) -> web.StreamResponse:
        try:
            try:
                await self._admit_and_forward()
            except GatewayError as exc:
                self._fail(exc.code, exc.message)
                if self.response is not None:
                    await self._end_stream_with_error(exc.status, exc.message, exc.code)
                else:
                    await self._send(exc.response())
        except _ClientGone:
            self._note_client_gone()
        return self.response if self.response is not None else web.Response(status=CLIENT_CLOSED)

    async def _admit_and_forward(self) -> None:
        body = await read_bounded(self.request, self.settings.max_body_bytes, self.settings.client_body_timeout_s)
        payload = self._parse(body)
        await self._check_model()
        preferred, pinned = self._route()
        body, payload = await self._consult_cache(body, payload, preferred)
        if self.cache_lookup is not None and self.cache_lookup.answer is not None:
            await self._serve_cached(preferred, payload)
            return
        try:
            self.queue_wait = await self.gateway.admission.acquire()
        except Overloaded as exc:
            self.gateway.metrics.shed.labels(exc.reason).inc()
            raise GatewayError(429, f"{exc} — retry later", "gateway_overloaded",
                               retry_after=self.settings.retry_after_s) from None
        try:
            self.gateway.metrics.queue_wait.observe(self.queue_wait)
            upstream_body, headers = self._upstream_request(body, payload)
            await self._forward(upstream_body, headers, preferred, pinned)
        finally:
            self.gateway.admission.release()
        self._store_answer(preferred)

    def _route(self) -> tuple[str, bool]:
        """The group the request goes to first, and whether ``X-Engine-Group`` pinned it there."""
        table = self.gateway.table
        pinned = self.request.headers.get(GROUP_HEADER)
        if pinned is None:
            return table.choose_group().name, False
        if table.group(pinned) is None:
            raise GatewayError(400, f"{GROUP_HEADER}: no replica group named {pinned[:100]!r} "
                                    f"(groups: {', '.join(g.name for g in table.groups)})", "unknown_group")
        return pinned, True

    # --- response cache (cache.py): looked up before admission, stored after a complete answer ------------

    async def _consult_cache(self, body: bytes, payload: dict, group: str) -> tuple[bytes, dict]:
        directives = read_directives(self.request.headers, payload)
        if BODY_FLAG in payload:  # the gateway's own flag never goes upstream
            payload = {key: value for key, value in payload.items() if key != BODY_FLAG}
            body = orjson.dumps(payload)
        cache = self.gateway.caches.get(group)
        threshold = read_threshold(self.request.headers, cache is not None and cache.client_threshold)
        if cache is not None:
            self.cache = cache
            lookup = self.cache_lookup = await cache.lookup(self.request.headers, payload, self.operation, directives,
                                                            threshold)
            self.span.set_attributes(lookup.attributes())
            if lookup.pending is not None and self.stream:
                self.capture = cache.capture()
        return body, payload

    async def _serve_cached(self, group: str, payload: dict) -> None:
        self.group = group
        document = hit_document(self.cache_lookup.answer, self.operation)
        self._note_document(document)
        if not self.stream:
            await self._send(web.Response(status=200, body=orjson.dumps(document), headers={
                "Content-Type": "application/json", HEADER: self._served_from()}))
            return
        include_usage = (payload.get("stream_options") or {}).get("include_usage") is True
        await self._write_stream(render_stream(document, self.operation, include_usage), "text/event-stream")
        await self._finish_stream()

    def _served_from(self) -> str | None:
        """The cache that answered (``exact_cache``/``semantic_cache``, the response's cache header); None when none
        did."""
        return self.cache_lookup.served_from if self.cache_lookup is not None else None

    def _store_answer(self, group: str) -> None:
        lookup = self.cache_lookup
        if lookup is None or lookup.pending is None or self.status != 200 or self.error_type is not None:
            return
        if self.group != group:
            self.cache.skip_store("failover")
        elif self.answer_body is not None:
            self.cache.store_later(lookup.pending, self.operation, body=self.answer_body)
        elif self.capture is not None and self.sse is not None and self.sse.done:
            self.cache.store_later(lookup.pending, self.operation, capture=self.capture)
        else:
            self.cache.skip_store("unfinished")

    # --- request -------------------------------------------------------------------------------------------

    def _parse(self, body: bytes) -> dict:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(payload, dict):
            raise GatewayError(400, "request body must be a JSON object", "invalid_json")
        model = payload.get("model")
        if model is None:
            raise GatewayError(400, "'model' is required", "missing_required_parameter", param="model")
        if not isinstance(model, str) or not model.strip() or len(model) > _MAX_MODEL_NAME:
            raise GatewayError(400, f"'model' must be a non-empty string of at most {_MAX_MODEL_NAME} characters",
                               "invalid_type", param="model")
        stream = payload.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise GatewayError(400, "'stream' must be a boolean", "invalid_type", param="stream")
        options = payload.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise GatewayError(400, "'stream_options' must be an object", "invalid_type", param="stream_options")
        self.model = model
        self.stream = stream
        self.span.update_name(f"{self.operation} {model}")
        attributes = {"gen_ai.request.model": model, "gen_ai.request.stream": stream}
        max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            attributes["gen_ai.request.max_tokens"] = max_tokens
        for key, attribute in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p")):
            value = payload.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                attributes[attribute] = float(value)
        self.span.set_attributes(attributes)
        return payload

    async def _check_model(self) -> None:
        table = self.gateway.table
        known = table.known_models()
        if known is None or self.model in known:
            return
        # Lists may be a few seconds old: look again (at most once a second) before calling a model unknown.
        await self.gateway.monitor.refresh_models(max_age_s=1.0)
        known = table.known_models()
        if known is not None and self.model not in known:
            raise GatewayError(404, f"the model '{self.model}' does not exist on this gateway's replicas",
                               "model_not_found", param="model")

    def _upstream_request(self, body: bytes, payload: dict) -> tuple[bytes, dict[str, str]]:
        self.keep_usage_chunk = True
        if self.stream:
            options = payload.get("stream_options") or {}
            if options.get("include_usage") is not True:
                # Ask for the usage chunk (the span needs the token counts) and hide it from the client later.
                self.keep_usage_chunk = False
                payload = dict(payload, stream_options=dict(options, include_usage=True))
                body = orjson.dumps(payload)
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        for name in _FORWARDED_HEADERS:
            value = self.request.headers.get(name)
            if value is not None:
                headers[name] = value
        inject_context(headers, context=self.span_context)
        return body, headers

    # --- upstream ------------------------------------------------------------------------------------------

    async def _forward(self, body: bytes, headers: dict[str, str], preferred: str, pinned: bool) -> None:
        table = self.gateway.table
        metrics = self.gateway.metrics
        tried: list[Upstream] = []
        last_failure: _AttemptFailed | None = None
        rechecked = False
        self.watchdog.start()
        try:
            while True:
                upstream = table.pick(self.model, preferred, tried, pinned=pinned)
                if upstream is None:
                    # None in rotation: one out of it may be back since its last probe (a restarted replica).
                    if rechecked or not await self.gateway.monitor.recheck(self.model, exclude=tried):
                        break
                    rechecked = True
                    continue
                if tried:
                    metrics.failovers.inc()
                tried.append(upstream)
                self.upstream = upstream
                self.group = upstream.group
                upstream.in_flight += 1
                try:
                    response = await self._open(upstream, body, headers)
                except _AttemptFailed as failure:
                    upstream.in_flight -= 1
                    metrics.upstream_errors.labels(upstream.group, upstream.url, failure.kind).inc()
                    if failure.mark_down:
                        upstream.mark_down(failure.reason)
                    log.info("upstream %s failed (%s), trying another replica", upstream.url, failure.reason)
                    last_failure = failure
                    continue
                except BaseException:
                    upstream.in_flight -= 1
                    raise
                try:
                    await self._relay(response)
                except BaseException as exc:
                    response.close()  # drop the connection: vLLM aborts a request whose client went away
                    if isinstance(exc, asyncio.CancelledError) and self._timed_out():
                        self._count_upstream_error(upstream, "timeout")
                        raise GatewayError(504, self._timeout_message(), "upstream_timeout") from None
                    raise
                else:
                    response.release()  # fully read: the connection goes back to the pool
                finally:
                    upstream.in_flight -= 1
                return
        finally:
            self.watchdog.stop()
        # Not the probe interval: the next request has the replicas out of rotation probed again (``recheck``).
        retry_after = self.settings.retry_after_s
        if last_failure is None:
            raise GatewayError(503, f"no healthy replica serves the model '{self.model}'", "no_healthy_upstream",
                               retry_after=retry_after)
        raise GatewayError(503, f"no replica could be reached (last: {last_failure.reason})",
                           "upstream_unavailable", retry_after=retry_after)

    def _timed_out(self) -> bool:
        """Whether a CancelledError being handled is the watchdog's (and only the watchdog's) doing."""
        if not self.watchdog.fired:
            return False
        self.watchdog.fired = False
        return self.task.uncancel() == 0

    async def _open(self, upstream: Upstream, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send the request and wait for the response headers (the watchdog bounds the wait)."""
        self.dispatched_at = self.watchdog.waiting_since = self.loop.time()
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.settings.connect_timeout_s,
                                        sock_read=None)
        try:
            return await self.gateway.session.post(upstream.url + self.request.path, data=body, headers=headers,
                                                   timeout=timeout, allow_redirects=False)
        except asyncio.CancelledError:
            if self._timed_out():
                self._count_upstream_error(upstream, "timeout")
                raise GatewayError(504, self._timeout_message(), "upstream_timeout") from None
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise _AttemptFailed("unreachable", describe_failure(exc), mark_down=True) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # The replica (or a stale pooled connection) hung up before answering: the request can go elsewhere.
            raise _AttemptFailed("disconnected", describe_failure(exc), mark_down=False) from None
        except aiohttp.ClientError as exc:
            self._count_upstream_error(upstream, "bad_response")
            raise GatewayError(502, f"bad answer from the replica: {describe_failure(exc)}", "bad_upstream_response") \
                from None
        finally:
            self.watchdog.waiting_since = None

    def _timeout_message(self) -> str:
        now = self.loop.time()
        if now >= self.deadline - 0.001:
            return f"the request took longer than {self.settings.total_timeout_s:g} s"
        if self.first_bytes_at is None:
            return f"the replica sent nothing within {self.settings.first_byte_timeout_s:g} s"
        return f"the replica sent nothing for {self.settings.idle_timeout_s:g} s"

    def _count_upstream_error(self, upstream: Upstream, kind: str) -> None:
        self.gateway.metrics.upstream_errors.labels(upstream.group, upstream.url, kind).inc()

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The next bytes of the upstream body (b"" at its end); the watchdog enforces the deadlines."""
        self.watchdog.waiting_since = self.loop.time()
        try:
            chunk = await response.content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            self._count_upstream_error(self.upstream, "disconnected")
            raise GatewayError(502, f"the replica broke off its answer: {describe_failure(exc)}",
                               "upstream_disconnected") from None
        finally:
            self.watchdog.waiting_since = None
        if chunk and self.first_bytes_at is None:
            self.first_bytes_at = self.loop.time()
        return chunk

    # --- relay ---------------------------------------------------------------------------------------------

    async def _relay(self, response: aiohttp.ClientResponse) -> None:
        content_type = response.headers.get("Content-Type", "")
        try:
            if self.stream and response.status == 200 and content_type.startswith("text/event-stream"):
                await self._relay_stream(response, content_type)
            else:
                await self._relay_body(response, content_type)
        finally:
            if self.upstream_done_at is None:
                self.upstream_done_at = self.loop.time()
            self.gateway.unwatch(self)  # nothing upstream left to cancel; a vanished client shows when writing
            if self.sse is not None:
                self._note_response(self.sse.response_id, self.sse.model, self.sse.usage, self.sse.finish_reasons)

    async def _relay_body(self, response: aiohttp.ClientResponse, content_type: str) -> None:
        limit = self.settings.max_upstream_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await self._read(response)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                self._count_upstream_error(self.upstream, "bad_response")
                raise GatewayError(502, f"the replica's answer is larger than {limit} bytes", "bad_upstream_response")
            chunks.append(chunk)
        self.upstream_done_at = self.loop.time()
        self.gateway.unwatch(self)
        body = b"".join(chunks)
        if response.status == 200 and "json" in content_type:
            self._note_completion(body)
            if self.cache_lookup is not None:
                self.answer_body = body
        elif response.status >= 400:
            self._fail(str(response.status), _upstream_error_message(body, response.status))
        headers = {"Content-Type": content_type or "application/octet-stream"}
        for name in _PASSED_BACK_HEADERS:
            if name in response.headers:
                headers[name] = response.headers[name]
        await self._send(web.Response(status=response.status, body=body, headers=headers))

    def _note_completion(self, body: bytes) -> None:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(document, dict):
            self._note_document(document)

    def _note_document(self, document: dict) -> None:
        finish_reasons = {}
        choices = document.get("choices")
        if isinstance(choices, list):
            for position, choice in enumerate(choices):
                if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                    index = choice.get("index")
                    finish_reasons[index if isinstance(index, int) else position] = choice["finish_reason"]
        self._note_response(document.get("id"), document.get("model"), document.get("usage"), finish_reasons)

    def _note_response(self, response_id, model, usage, finish_reasons: dict[int, str]) -> None:
        attributes = {}
        if isinstance(response_id, str):
            attributes["gen_ai.response.id"] = response_id
        if isinstance(model, str):
            attributes["gen_ai.response.model"] = model
        if isinstance(usage, dict):
            for source, attribute in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                                      ("completion_tokens", "gen_ai.usage.output_tokens")):
                value = usage.get(source)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    attributes[attribute] = value
            # vLLM's prefix-cache hits (--enable-prompt-tokens-details); left out when the engine did not say or
            # said something that is no count of the prompt's tokens.
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            bound = min(attributes.get("gen_ai.usage.input_tokens", _MAX_CACHED_TOKENS), _MAX_CACHED_TOKENS)
            if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= bound:
                attributes[CACHE_READ_ATTRIBUTE] = cached
        if finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = [finish_reasons[k] for k in sorted(finish_reasons)]
        self.span.set_attributes(attributes)

    async def _relay_stream(self, response: aiohttp.ClientResponse, content_type: str) -> None:
        relay = self.sse = SseRelay(keep_usage_chunk=self.keep_usage_chunk)
        while True:
            chunk = await self._read(response)
            if not chunk:
                break
            if self.capture is not None:
                self.capture.add(chunk)
            data = relay.feed(chunk)
            if data:
                await self._write_stream(data, content_type)
        tail = relay.flush()
        if tail:
            await self._write_stream(tail, content_type)
        self.upstream_done_at = self.loop.time()
        self.gateway.unwatch(self)
        if relay.error is not None:
            self._fail("upstream_error", _error_text(relay.error))
        if self.response is None:  # an empty stream: still a valid (empty) answer
            await self._start_stream(content_type)
        await self._finish_stream()

    async def _start_stream(self, content_type: str) -> None:
        headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        served_from = self._served_from()
        if served_from is not None:
            headers[HEADER] = served_from
        response = web.StreamResponse(status=200, headers=headers)
        self.response = response
        self.status = 200
        try:
            await response.prepare(self.request)
        except ConnectionError:
            raise _ClientGone() from None

    async def _write_stream(self, data: bytes, content_type: str) -> None:
        if self.response is None:
            await self._start_stream(content_type)
            self.first_chunk_at = self.loop.time()
            self.span.set_attribute("gen_ai.response.time_to_first_chunk", self.first_chunk_at - self.arrival)
        try:
            await self.response.write(data)
        except ConnectionError:
            raise _ClientGone() from None

    async def _finish_stream(self) -> None:
        try:
            await self.response.write_eof()
        except ConnectionError:
            raise _ClientGone() from None

    async def _end_stream_with_error(self, status: int, message: str, code: str) -> None:
        """A failure after the stream started: tell the client in-band, as vLLM does, and end the stream."""
        try:
            await self.response.write(b"data: " + error_body(status, message, code) + b"\n\n")
            await self.response.write_eof()
        except ConnectionError:
            raise _ClientGone() from None

    async def _send(self, response: web.StreamResponse) -> None:
        """Send a whole response now, so the span can end after its last byte."""
        self.response = response
        self.status = response.status
        try:
            await response.prepare(self.request)
            await response.write_eof()
        except ConnectionError:
            raise _ClientGone() from None

    # --- outcome -------------------------------------------------------------------------------------------

    def _fail(self, error_type: str, message: str) -> None:
        if self.error_type is None:
            self.error_type = error_type
            self.error_message = message

    def client_disconnected(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def _note_client_gone(self) -> None:
        self.client_gone = True
        self.error_type = "client_disconnected"
        self.error_message = "the client closed the connection"

    def _finish(self) -> None:
        """End the span and record the request's metrics (exactly once)."""
        now = self.loop.time()
        metrics = self.gateway.metrics
        status = self.status if self.status is not None else (CLIENT_CLOSED if self.client_gone else 500)
        code = CLIENT_CLOSED if self.client_gone else status
        attributes = {"http.response.status_code": status}
        if self.group != NO_GROUP:
            attributes[REPLICA_GROUP_ATTRIBUTE] = self.group
        if self.upstream is not None:
            attributes["server.address"] = self.upstream.host
            attributes["server.port"] = self.upstream.port
        self.span.set_attributes(attributes)
        if self.error_type is not None:
            self.span.set_attribute("error.type", self.error_type)
            self.span.set_status(Status(StatusCode.ERROR, self.error_message))
        self.span.end(end_time=time.time_ns())
        metrics.requests.labels(self.group, str(code)).inc()
        metrics.duration.labels(self.group).observe(now - self.arrival)
        if self.dispatched_at is not None and self.upstream_done_at is not None:
            before = self.dispatched_at - self.arrival - self.queue_wait
            metrics.overhead.observe(max(0.0, before) + max(0.0, now - self.upstream_done_at))


def _error_text(error: object) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:500]
    return str(error)[:500]


def _upstream_error_message(body: bytes, status: int) -> str:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"the replica answered {status}"
    if isinstance(document, dict) and "error" in document:
        return _error_text(document["error"])
    if isinstance(document, dict) and isinstance(document.get("message"), str):
        return document["message"][:500]
    return f"the replica answered {status}"
