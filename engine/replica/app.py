"""The simulated replica's HTTP server: vLLM's OpenAI-compatible API on top of the simulated engine core.

Endpoints as ``vllm serve`` exposes them: ``GET /health``, ``GET|POST /ping``,
``GET /version``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE streaming) and ``GET /metrics``; also
``POST /v1/embeddings`` from a stand-in embedding model (``embeddings.py``: a hashed bag of
words, not the simulated LLM), so the gateway's semantic cache has an endpoint to call.

Timeline of one request, on the replica's monotonic clock:

    arrival        the handler starts (the HTTP request has been received)
    queued         after input processing (parsing, tokenisation, chat template): the
                   request enters the engine core; the processing time is modelled by
                   SimOptions.api_time_before (half the fixed API cost + tokenisation per
                   prompt token), or the real time it took if that was longer
    scheduled      the core first schedules it            (core timestamps)
    first token    end of the step that produced it       (core timestamps)
    first output   the first token chunk is written to the client (non-streaming: handed
                   to the handler) -> gen_ai.latency.time_to_first_token
    last token     end of the step that produced the last token
    finished       the last byte of the response is written -> gen_ai.latency.e2e; the final
                   output waits at least SimOptions.api_time_after (the other half of the
                   fixed cost + detokenisation per output token) after the last token

so vLLM's overhead (e2e − queue − prefill − decode) is the input processing plus the
output processing and the writes, never negative.

Without ``ignore_eos`` a request stops when its "natural" length is reached: a length
drawn from a seeded log-normal (median ``OUTPUT_LENGTH_MEDIAN`` tokens), capped at
``max_tokens`` (``finish_reason`` "stop" when shorter, "length" when capped). Requests with
``temperature: 0`` draw from their prompt (same prompt, same length), and a request
``seed`` makes the draw reproducible.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.config import EngineConfig
from engine.replica.driver import (
    ABORT_CLIENT,
    ABORT_ERROR,
    ABORT_REJECTED,
    ABORT_SHUTDOWN,
    RealTimeDriver,
    TrackedRequest,
)
from engine.replica.embeddings import DEFAULT_DIMENSION as DEFAULT_EMBEDDING_DIMENSION
from engine.replica.embeddings import MAX_DIMENSION as MAX_EMBEDDING_DIMENSION
from engine.replica.embeddings import embeddings_response
from engine.replica.metrics import ReplicaMetrics
from engine.replica.openai_api import (
    CHAT,
    COMPLETION,
    ApiError,
    GenerationRequest,
    error_body,
    full_response,
    new_request_id,
    parse_generation_request,
    prompt_fingerprint,
    stream_chunk,
    usage_body,
    usage_chunk,
)
from engine.replica.spans import RequestTimings, build_replica_tracer_provider, emit_request_span
from engine.sim.core import EngineCore
from engine.sim.options import SimOptions
from engine.sim.profiles import HardwareProfile, hardware_profile
from engine.sim.request import SimRequest
from engine.tokens import synthetic_text, token_ends

log = logging.getLogger(__name__)

# The vLLM release whose API and telemetry the replica reproduces (reported by GET /version).
VLLM_VERSION = "0.11.0"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Natural output lengths (tokens) when the client does not force them: log-normal, ShareGPT-like.
OUTPUT_LENGTH_MEDIAN = 180.0
OUTPUT_LENGTH_SIGMA = 0.9
# Context length assumed when the config names a model whose context length is unknown.
FALLBACK_MAX_MODEL_LEN = 32768

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


HARDWARE_ENV = "ENGINE_SIM_HARDWARE"
_OVERRIDABLE = ("mfu", "bandwidth_efficiency", "serial_fraction", "step_overhead", "layer_overhead",
                "sequence_overhead", "api_overhead")


# vLLM's VLLM_SERVER_DEV_MODE opens endpoints a production server must not have; this one opens the simulator's
# fault injection: POST /sim/hardware changes the simulated GPU's constants while the replica serves.
DEV_MODE_ENV = "ENGINE_SIM_DEV_MODE"


def hardware_override(config: EngineConfig) -> HardwareProfile | None:
    """The config's GPU profile with constants replaced by ENGINE_SIM_HARDWARE (a JSON object, e.g.
    ``{"mfu": 0.5, "step_overhead": 0.002}``): a GPU that runs slower or faster than the published figures, for
    what-if runs and for tests that need a group whose true constants only they know. None when unset; ValueError
    naming the problem when it is not such an object."""
    text = os.environ.get(HARDWARE_ENV)
    if not text:
        return None
    try:
        values = json.loads(text)
    except ValueError:
        raise ValueError(f"{HARDWARE_ENV} is not JSON: {text[:100]!r}") from None
    return hardware_with(config, values, HARDWARE_ENV)


def hardware_with(config: EngineConfig, values: Any, source: str) -> HardwareProfile:
    """The config's published GPU profile with ``values`` (constant → non-negative number) in place; ValueError
    naming ``source`` and the problem otherwise."""
    if not isinstance(values, dict):
        raise ValueError(f"{source} must be a JSON object of constants ({', '.join(_OVERRIDABLE)})")
    for name, value in values.items():
        if name not in _OVERRIDABLE:
            raise ValueError(f"{source}: {name!r} is not a constant one may set ({', '.join(_OVERRIDABLE)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{source}: {name} must be a non-negative number, not {value!r}")
    return hardware_profile(config.gpu_type).with_constants(**{k: float(v) for k, v in values.items()})


class ReplicaState:
    """Everything one replica app owns: config, engine core, driver, metrics, tracer."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        group: str,
        served_model_name: str | None,
        tracer_provider: TracerProvider | None,
        options: SimOptions | None,
        seed: int,
        enable_prompt_tokens_details: bool = False,
    ):
        self.config = config
        # vLLM's --enable-prompt-tokens-details: usage says how many prompt tokens the prefix cache served.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.resolved = config.resolved()
        self.group = group
        self.served_model_name = served_model_name or config.model
        self.max_model_len = self.resolved.max_model_len or FALLBACK_MAX_MODEL_LEN
        self.options = options or SimOptions()
        self.seed = seed
        self.rng = random.Random(seed)
        self.owns_provider = tracer_provider is None
        self.tracer_provider = tracer_provider or build_replica_tracer_provider(
            config, group, served_model_name=self.served_model_name)
        self.tracer = self.tracer_provider.get_tracer("vllm.llm_engine")
        # Build the core now so a config the simulator cannot run fails at start-up, not on the first request.
        self.core = EngineCore(config, hardware=hardware_override(config), options=self.options, seed=seed)
        self.options = self.core.options  # with the hardware profile's API overhead filled in
        self.api_free_at = 0.0  # when the (one-process) API server is done with the requests admitted so far
        self.metrics = ReplicaMetrics(
            config, model_name=self.served_model_name, num_gpu_blocks=getattr(self.core, "num_blocks_total", None)
        )
        self.driver: RealTimeDriver | None = None
        self.draining = False
        self.started_at = time.time()
        # Monotonic seconds -> epoch nanoseconds, anchored once so every span uses the same mapping.
        self._anchor_mono = time.monotonic()
        self._anchor_wall_ns = time.time_ns()

    def wall_ns(self, monotonic_seconds: float) -> int:
        return self._anchor_wall_ns + round((monotonic_seconds - self._anchor_mono) * 1e9)

    @property
    def ready(self) -> bool:
        return self.driver is not None and self.driver.alive and not self.draining

    async def start(self) -> None:
        if self.driver is None:
            self.driver = RealTimeDriver(
                self.core,
                metrics=self.metrics,
                detokenize_seconds_per_token=self.options.detokenize_seconds_per_token,
            )
            self.driver.start()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, wait up to ``timeout`` s for in-flight ones, then abort the rest."""
        self.draining = True
        driver = self.driver
        if driver is None:
            return
        deadline = time.monotonic() + max(0.0, timeout)
        while driver.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if driver.num_in_flight:
            log.warning("aborting %d requests still in flight at shutdown", driver.num_in_flight)
            driver.abort_all(ABORT_SHUTDOWN)
            # Let the handlers write their error events before connections are closed.
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.driver is not None:
            await self.driver.stop()
        try:
            self.tracer_provider.force_flush()
        except Exception:  # flushing must never block a shutdown
            log.exception("flushing spans failed")
        if self.owns_provider:
            self.tracer_provider.shutdown()


REPLICA_KEY = web.AppKey("replica", ReplicaState)
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
EMBEDDING_DIMENSION_KEY = web.AppKey("embedding_dimension", int)


# ---------------------------------------------------------------------------------------------- helpers
def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int, err_type: str) -> web.Response:
    return _json(error_body(message, status, err_type), status)


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _natural_output_length(rng: random.Random) -> int:
    return max(1, int(round(rng.lognormvariate(math.log(OUTPUT_LENGTH_MEDIAN), OUTPUT_LENGTH_SIGMA))))


def choose_output_length(state: ReplicaState, request: GenerationRequest) -> tuple[int, str]:
    """How many tokens the request will generate and why it stops ("length" or "stop")."""
    if request.ignore_eos:
        return request.max_tokens, "length"
    if request.seed is not None:
        rng = random.Random(request.seed)
    elif request.temperature == 0:
        rng = random.Random(state.seed * 1_000_003 + prompt_fingerprint(request.prompt_token_ids))
    else:
        rng = state.rng
    natural = max(_natural_output_length(rng), request.min_tokens)
    if natural >= request.max_tokens:
        return request.max_tokens, "length"
    return natural, "stop"


async def _read_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(
            f"request body too large: the limit is {request.app[MAX_BODY_KEY]} bytes",
            status=413,
            err_type="RequestEntityTooLargeError",
        ) from exc
    if not raw:
        raise ApiError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None


# ---------------------------------------------------------------------------------------------- middleware
@web.middleware
async def _errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every failure leaves as a vLLM-style JSON error; nothing reaches the client as a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Unknown routes and methods answer like vLLM's FastAPI app.
        return _json({"detail": exc.reason}, exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error("internal error in the simulated replica", 500, "InternalServerError")


# ---------------------------------------------------------------------------------------------- simple endpoints
async def _health(request: web.Request) -> web.Response:
    state = request.app[REPLICA_KEY]
    if state.ready:
        return web.Response(status=200)
    reason = "shutting down" if state.draining else "engine core not running"
    return _error(f"the replica is not ready: {reason}", 503, "ServiceUnavailableError")


async def _version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION})


async def _models(request: web.Request) -> web.Response:
    state = request.app[REPLICA_KEY]
    created = int(state.started_at)
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": state.config.model,
                    "parent": None,
                    "max_model_len": state.max_model_len,
                    "permission": [
                        {
                            "id": "modelperm-" + state.config.version,
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def _embeddings(request: web.Request) -> web.Response:
    """The stand-in embedding model (engine/replica/embeddings.py): not the simulated LLM, no span, no metrics."""
    state = request.app[REPLICA_KEY]
    if not state.ready:
        return _error("the replica cannot take requests: it is shutting down", 503, "ServiceUnavailableError")
    body = await _read_body(request)
    return _json(embeddings_response(body, served_model_name=state.served_model_name,
                                     dimension=request.app[EMBEDDING_DIMENSION_KEY]))


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[REPLICA_KEY]
    response = web.Response(body=generate_latest(state.metrics.registry))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


# ---------------------------------------------------------------------------------------------- generation
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETION)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def _generate(http_request: web.Request, kind: str) -> web.StreamResponse:
    state = http_request.app[REPLICA_KEY]
    arrival = time.monotonic()
    if not state.ready:
        reason = "it is shutting down" if state.draining else "its engine core is not running"
        return _error(f"the replica cannot take requests: {reason}", 503, "ServiceUnavailableError")
    body = await _read_body(http_request)
    request = parse_generation_request(
        body,
        kind=kind,
        served_model_name=state.served_model_name,
        max_model_len=state.max_model_len,
        priority_scheduling=state.resolved.scheduling_policy == "priority",
    )
    request_id = new_request_id(kind)
    created = int(time.time())
    output_tokens, finish_reason = choose_output_length(state, request)
    sim = SimRequest(
        request_id=request_id,
        prompt_tokens=request.prompt_tokens,
        output_tokens=output_tokens,
        arrival_time=arrival,
        prompt_token_ids=request.prompt_token_ids,
        priority=request.priority,
    )
    # vLLM's input processing (chat template, tokenisation) before the engine core sees the request; one API
    # server process admits one request at a time (SimOptions.api_server_serial, as in virtual time).
    api_time = state.options.api_time_before(request.prompt_tokens)
    if state.options.api_server_serial:
        state.api_free_at = max(state.api_free_at, arrival) + api_time
        remaining = state.api_free_at - time.monotonic()
    else:
        remaining = api_time - (time.monotonic() - arrival)
    if remaining > 0:
        await asyncio.sleep(remaining)
    driver = state.driver
    if driver is None or not state.ready:
        return _error("the replica cannot take requests: it is shutting down", 503, "ServiceUnavailableError")
    tracked = driver.submit(sim, http_request=http_request)
    generation = _Generation(state, http_request, request, tracked, request_id, created, finish_reason,
                             output_tokens)
    try:
        if request.stream:
            return await _stream(generation)
        return await _respond(generation)
    finally:
        if tracked.done:
            driver.finish(request_id)
        else:
            driver.abort(request_id, tracked.aborted or ABORT_CLIENT)


async def _finishing_time(state: ReplicaState, tracked: TrackedRequest) -> None:
    """Hold the final output until the modelled response assembly after the last token is over.

    ``SimOptions.api_time_after`` (half the fixed API cost plus detokenisation per output
    token) is what virtual time adds after the last token, so both modes decompose alike.
    """
    last_token = tracked.sim.last_token_time
    if last_token is None:
        return
    remaining = last_token + state.options.api_time_after(tracked.released) - time.monotonic()
    if remaining > 0:
        await asyncio.sleep(remaining)


def _abort_message(tracked: TrackedRequest) -> tuple[str, int, str]:
    reason = tracked.aborted
    if reason == ABORT_REJECTED:
        return tracked.error or "the engine refused the request", 400, "BadRequestError"
    if reason == ABORT_SHUTDOWN:
        return "the replica is shutting down; the request was aborted", 503, "ServiceUnavailableError"
    if reason == ABORT_ERROR:
        return "the simulated engine core failed; the request was aborted", 500, "InternalServerError"
    return "the request was aborted", 499, "ClientClosedRequest"


class _TextWriter:
    """Synthetic output text of `total` tokens, made whole up front and handed out piecewise, so the pieces'
    concatenation is the same text whatever the chunking (a greedy request answers the same text each time, as
    greedy decoding does on vLLM)."""

    def __init__(self, seed: int, total: int):
        self.text = synthetic_text(max(total, 0), random.Random(seed))
        self.ends = token_ends(self.text)
        self.sent = 0
        self.position = 0

    def take(self, count: int) -> str:
        if count <= 0:
            return ""
        self.sent += count
        if self.sent <= len(self.ends):
            end = self.ends[self.sent - 1]
        else:  # more than planned (cannot happen: released ≤ the planned output); pad with words
            extra = synthetic_text(self.sent - len(self.ends), random.Random(self.sent))
            self.text += (" " if self.text else "") + extra
            self.ends = token_ends(self.text)
            end = self.ends[self.sent - 1]
        piece, self.position = self.text[self.position:end], end
        return piece


def text_seed(state: ReplicaState, request: GenerationRequest) -> int:
    """The output text's seed: the request's `seed`, else for greedy sampling one fixed by the prompt (the same
    prompt gets the same text, as from a deterministic model), else a random one."""
    if request.seed is not None:
        return request.seed
    if request.temperature == 0:
        return state.seed * 1_000_033 + prompt_fingerprint(request.prompt_token_ids) + 7
    return state.rng.getrandbits(32)


@dataclass(frozen=True)
class _Generation:
    """One accepted request on its way to a response: what answering and recording it need."""

    state: ReplicaState
    http_request: web.Request
    request: GenerationRequest
    tracked: TrackedRequest
    request_id: str
    created: int
    finish_reason: str
    output_tokens: int

    @property
    def reported_cached_tokens(self) -> int | None:
        """The prompt tokens the prefix cache served (vLLM's ``num_cached_tokens``: whole blocks, fixed when the
        request is first scheduled) as the usage reports them: only with prompt-token details on."""
        return self.tracked.sim.num_cached_tokens if self.state.enable_prompt_tokens_details else None


async def _stream(generation: _Generation) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        await response.prepare(generation.http_request)
        await _stream_body(generation, response)
    except ConnectionResetError:
        # The client went away mid-stream; the caller aborts the request in the core.
        log.info("client of %s disconnected during the stream", generation.request_id)
    return response


async def _stream_body(generation: _Generation, response: web.StreamResponse) -> None:
    state, request, tracked = generation.state, generation.request, generation.tracked
    request_id, created, finish_reason = generation.request_id, generation.created, generation.finish_reason
    writer = _TextWriter(text_seed(state, request), generation.output_tokens)
    sent = 0
    first_output: float | None = None
    while True:
        await tracked.wait_update()
        if tracked.aborted:
            if tracked.aborted != ABORT_CLIENT:
                message, status, err_type = _abort_message(tracked)
                await response.write(_sse({"error": error_body(message, status, err_type)}) + SSE_DONE)
            return
        count = tracked.released - sent
        done = tracked.done
        if count <= 0 and not done:
            continue
        if done:
            await _finishing_time(state, tracked)
        pieces: list[bytes] = []
        if sent == 0 and request.kind == CHAT:
            # vLLM opens a chat stream with a role-only delta when the first output arrives.
            pieces.append(_sse(stream_chunk(request, request_id, created, text="", finish_reason=None, role=True)))
        sent += count
        usage = usage_body(request.prompt_tokens, sent) if request.continuous_usage_stats else None
        pieces.append(
            _sse(
                stream_chunk(
                    request,
                    request_id,
                    created,
                    text=writer.take(count),
                    finish_reason=finish_reason if done else None,
                    usage=usage,
                )
            )
        )
        if done:
            if request.include_usage:
                pieces.append(_sse(usage_chunk(request, request_id, created, sent,
                                               generation.reported_cached_tokens)))
            pieces.append(SSE_DONE)
        # Stamped when the output is handed to the HTTP layer, as vLLM's output processor stamps it before
        # the API server writes: stamped after the write, a busy machine could delay the stamp past the
        # moment the client (and the gateway) already had the bytes, and the engine's e2e would exceed theirs.
        handed = time.monotonic()
        await response.write(b"".join(pieces))
        if first_output is None:
            first_output = handed
            state.metrics.time_to_first_token.observe(handed - tracked.sim.arrival_time)
        if done:
            await response.write_eof()
            _record_finished(generation, first_output, handed)
            return


async def _respond(generation: _Generation) -> web.StreamResponse:
    state, request, tracked = generation.state, generation.request, generation.tracked
    observed_first = False
    while not tracked.done:
        await tracked.wait_update()
        if tracked.aborted:
            message, status, err_type = _abort_message(tracked)
            return _error(message, status, err_type)
        if not observed_first and tracked.first_release is not None:
            observed_first = True
            state.metrics.time_to_first_token.observe(tracked.first_release - tracked.sim.arrival_time)
    await _finishing_time(state, tracked)
    text = _TextWriter(text_seed(state, request), generation.output_tokens).take(tracked.released)
    body = orjson.dumps(full_response(request, generation.request_id, generation.created, text,
                                      generation.finish_reason, tracked.released, generation.reported_cached_tokens))
    response = web.Response(body=body, status=200, content_type="application/json")
    handed = time.monotonic()  # before the write (see _stream_body)
    await response.prepare(generation.http_request)
    await response.write_eof()
    first_output = tracked.first_release if tracked.first_release is not None else handed
    _record_finished(generation, first_output, handed)
    return response


def _record_finished(generation: _Generation, first_output: float, finished: float) -> None:
    """The request's span and per-request metrics, once its last byte is written."""
    state, request, tracked, request_id = generation.state, generation.request, generation.tracked, generation.request_id
    sim = tracked.sim
    queued = sim.queued_time if sim.queued_time is not None else sim.arrival_time
    scheduled = sim.scheduled_time if sim.scheduled_time is not None else queued
    first_token = sim.first_token_time if sim.first_token_time is not None else scheduled
    last_token = sim.last_token_time if sim.last_token_time is not None else first_token
    timings = RequestTimings(
        arrival=sim.arrival_time,
        queued=queued,
        scheduled=scheduled,
        first_token=first_token,
        last_token=last_token,
        first_output=first_output,
        finished=finished,
        prompt_tokens=request.prompt_tokens,
        completion_tokens=tracked.released,
        cached_prompt_tokens=sim.num_cached_tokens,
    )
    try:
        emit_request_span(
            state.tracer,
            headers=generation.http_request.headers,
            timings=timings,
            wall_ns_at=state.wall_ns,
            request_id=request_id,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            n=request.n,
        )
    except Exception:  # telemetry must never fail a request that was served
        log.exception("emitting the llm_request span of %s failed", request_id)
    metrics = state.metrics
    metrics.request_success[generation.finish_reason].inc()
    metrics.e2e_request_latency.observe(timings.e2e)
    metrics.request_queue_time.observe(timings.time_in_queue)
    metrics.request_prefill_time.observe(timings.prefill)
    metrics.request_decode_time.observe(timings.decode)
    metrics.request_inference_time.observe(timings.inference)
    metrics.request_time_per_output_token.observe(
        timings.decode / (timings.completion_tokens - 1) if timings.completion_tokens > 1 else 0.0
    )
    metrics.request_prompt_tokens.observe(timings.prompt_tokens)
    metrics.request_generation_tokens.observe(timings.completion_tokens)
    metrics.request_params_max_tokens.observe(request.max_tokens)
    metrics.request_max_num_generation_tokens.observe(request.max_tokens)
    metrics.request_params_n.observe(request.n)


async def _sim_hardware(request: web.Request) -> web.Response:
    """GET: the simulated GPU's constants now. POST {constant: value, ...}: from the next engine step on, the
    config's published profile with these in place (as ENGINE_SIM_HARDWARE at start), e.g. a decode slowed by a
    lower ``bandwidth_efficiency``. Only with ENGINE_SIM_DEV_MODE=1."""
    state = request.app[REPLICA_KEY]
    if request.method == "POST":
        try:
            values = orjson.loads(await request.read())
            profile = hardware_with(state.config, values, "the body")
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _error(str(exc), 400, "BadRequestError")
        state.core.set_hardware(profile)
        log.warning("simulated GPU constants changed: %s", values)
    hardware = state.core.hardware
    return web.json_response({"gpu_type": state.config.gpu_type,
                              "constants": {name: getattr(hardware, name) for name in _OVERRIDABLE}})


# ---------------------------------------------------------------------------------------------- the app
def build_replica_app(
    config: EngineConfig,
    *,
    group: str = "default",
    served_model_name: str | None = None,
    tracer_provider: TracerProvider | None = None,
    options: SimOptions | None = None,
    seed: int = 0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    enable_prompt_tokens_details: bool = False,
    embedding_dimension: int = DEFAULT_EMBEDDING_DIMENSION,
) -> web.Application:
    """An aiohttp app serving vLLM's OpenAI-compatible API from a simulated engine core.

    Without ``tracer_provider`` the replica builds its own from the OTel environment
    (gRPC by default, like vLLM) and shuts it down on cleanup; a provider passed in is
    flushed but left open for its owner. ``enable_prompt_tokens_details``: as vLLM's
    ``--enable-prompt-tokens-details``, every usage (final chunk or body) carries
    ``prompt_tokens_details.cached_tokens``.
    """
    if not isinstance(group, str) or not group.strip():
        raise ValueError("group must be a non-empty string")
    if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name.strip()):
        raise ValueError("served_model_name must be a non-empty string")
    state = ReplicaState(
        config.validate(),
        group=group,
        served_model_name=served_model_name,
        tracer_provider=tracer_provider,
        options=options,
        seed=seed,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors_middleware])
    app[REPLICA_KEY] = state
    app[MAX_BODY_KEY] = max_body_bytes
    if isinstance(embedding_dimension, bool) or not isinstance(embedding_dimension, int) \
            or not 1 <= embedding_dimension <= MAX_EMBEDDING_DIMENSION:
        raise ValueError(f"embedding_dimension must be an integer in 1..{MAX_EMBEDDING_DIMENSION}")
    app[EMBEDDING_DIMENSION_KEY] = embedding_dimension
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    if os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true", "yes"):
        app.router.add_get("/sim/hardware", _sim_hardware)
        app.router.add_post("/sim/hardware", _sim_hardware)

    async def on_startup(app: web.Application) -> None:
        await app[REPLICA_KEY].start()

    async def on_cleanup(app: web.Application) -> None:
        await app[REPLICA_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def replica_state(app: web.Application) -> ReplicaState:
    """The state of an app built by ``build_replica_app`` (for runners and tests)."""
    return app[REPLICA_KEY]
