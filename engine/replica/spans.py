"""The ``llm_request`` span exactly as vLLM V1 emits it, plus the replica's tracer provider and resource.

vLLM (``OutputProcessor.do_tracing`` in ``vllm/v1/engine/output_processor.py``, names from
``vllm/tracing/utils.py``) emits one span per finished request: name ``llm_request``, kind
SERVER, parented on the incoming W3C ``traceparent``, starting at the request's arrival and
ending when the frontend has processed its last output. Its attributes are float seconds:

    gen_ai.latency.time_to_first_token     first output handed to the client - arrival
    gen_ai.latency.e2e                     finish - arrival
    gen_ai.latency.time_in_queue           scheduled_ts - queued_ts        (engine-core clock)
    gen_ai.latency.time_in_model_prefill   first_token_ts - scheduled_ts
    gen_ai.latency.time_in_model_decode    last_token_ts - first_token_ts
    gen_ai.latency.time_in_model_inference last_token_ts - scheduled_ts

with ``gen_ai.usage.{prompt_tokens,completion_tokens}``, ``gen_ai.request.id`` (the
response id) and ``gen_ai.request.{top_p,max_tokens,temperature,n}`` each set only when
truthy (vLLM's ``if req_state.temperature:``, so a greedy ``temperature: 0`` request has no
temperature attribute). No ``gen_ai.response.model``: a real vLLM 0.32 run showed V1 leaves
it out (the constant exists, nothing sets it), so the simulator leaves it out too and names
the served model on its resource (``llm_observatory.model``), as the launcher does for real
vLLM replicas through ``OTEL_RESOURCE_ATTRIBUTES``.

One addition to vLLM's attributes: ``gen_ai.usage.cache_read.input_tokens`` (int, 0 on a
miss), the prompt tokens served from the prefix cache (vLLM's ``num_cached_tokens``, whole
blocks). vLLM 0.32 reports that count only in its API answer
(``usage.prompt_tokens_details.cached_tokens``), where a gateway in front picks it up.

Aborted requests: vLLM's V1 ``OutputProcessor.abort_requests`` does not trace, so a request
aborted by a client disconnect (or a shutdown) has no ``llm_request`` span and is not
counted in the per-request histograms or ``vllm:request_success_total``; tracing aborted
requests is proposed in the open PR vllm-project/vllm#32162. The replica does the same.

Resource: ``service.name`` (``OTEL_SERVICE_NAME`` or ``vllm``), vLLM's
``vllm.instrumenting_module_name`` and ``vllm.process_id``, and the simulator's labels
``llm_observatory.simulated=true``, ``llm_observatory.engine_config`` (the config version)
``llm_observatory.replica_group`` and ``llm_observatory.model``.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Tracer

from engine.config import EngineConfig
from engine.telemetry import (
    CACHE_READ_ATTRIBUTE,
    ENGINE_CONFIG_ATTRIBUTE,
    MODEL_ATTRIBUTE,
    REPLICA_GROUP_ATTRIBUTE,
    SIMULATED_ATTRIBUTE,
    build_tracer_provider,
    extract_context,
)

SPAN_NAME = "llm_request"
INSTRUMENTING_MODULE = "vllm.llm_engine"  # what vLLM's AsyncLLM passes to init_tracer


def replica_resource_attributes(config: EngineConfig, group: str, model: str | None = None) -> dict[str, object]:
    """Resource attributes of a simulated replica (``service.name`` aside); ``model`` is the served model name."""
    return {
        MODEL_ATTRIBUTE: model or config.model,
        "vllm.instrumenting_module_name": INSTRUMENTING_MODULE,
        "vllm.process_id": str(os.getpid()),
        SIMULATED_ATTRIBUTE: True,
        ENGINE_CONFIG_ATTRIBUTE: config.version,
        REPLICA_GROUP_ATTRIBUTE: group,
    }


def build_replica_tracer_provider(
    config: EngineConfig,
    group: str,
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    headers: Mapping[str, str] | None = None,
    served_model_name: str | None = None,
) -> TracerProvider:
    """A provider with the replica's resource, exporting like vLLM (gRPC unless the env says http/protobuf).

    Without ``endpoint`` the OTel environment decides; with neither, spans are dropped
    (tests add their own span processor to the returned provider).
    """
    service_name = os.environ.get("OTEL_SERVICE_NAME") or "vllm"
    return build_tracer_provider(
        service_name,
        endpoint=endpoint,
        protocol=protocol,
        headers=headers,
        resource_attributes=replica_resource_attributes(config, group, served_model_name),
    )


@dataclasses.dataclass
class RequestTimings:
    """One finished request's timestamps (seconds on the replica's monotonic clock) and counts."""

    arrival: float
    queued: float
    scheduled: float
    first_token: float  # engine core: end of the step that produced the first token
    last_token: float  # engine core: end of the step that produced the last token
    first_output: float  # frontend: when the first token was handed to the client
    finished: float  # frontend: when the last output was handed to the client
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's num_cached_tokens)

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def time_to_first_token(self) -> float:
        return self.first_output - self.arrival

    @property
    def time_in_queue(self) -> float:
        return self.scheduled - self.queued

    @property
    def prefill(self) -> float:
        return self.first_token - self.scheduled

    @property
    def decode(self) -> float:
        return self.last_token - self.first_token

    @property
    def inference(self) -> float:
        return self.last_token - self.scheduled


def emit_request_span(
    tracer: Tracer,
    *,
    headers: Mapping[str, str],
    timings: RequestTimings,
    wall_ns_at,
    request_id: str,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    n: int | None,
) -> None:
    """Record the ``llm_request`` span of one finished request (``wall_ns_at`` maps monotonic s → epoch ns)."""
    attributes: dict[str, object] = {
        "gen_ai.latency.time_to_first_token": timings.time_to_first_token,
        "gen_ai.latency.e2e": timings.e2e,
        "gen_ai.latency.time_in_queue": timings.time_in_queue,
        "gen_ai.usage.prompt_tokens": timings.prompt_tokens,
        "gen_ai.usage.completion_tokens": timings.completion_tokens,
        CACHE_READ_ATTRIBUTE: timings.cached_prompt_tokens,
        "gen_ai.latency.time_in_model_prefill": timings.prefill,
        "gen_ai.latency.time_in_model_decode": timings.decode,
        "gen_ai.latency.time_in_model_inference": timings.inference,
        "gen_ai.request.id": request_id,
    }
    if top_p:
        attributes["gen_ai.request.top_p"] = top_p
    if max_tokens:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if temperature:
        attributes["gen_ai.request.temperature"] = temperature
    if n:
        attributes["gen_ai.request.n"] = n
    span = tracer.start_span(
        SPAN_NAME,
        context=extract_context(headers),
        kind=SpanKind.SERVER,
        attributes=attributes,
        start_time=wall_ns_at(timings.arrival),
    )
    span.end(end_time=wall_ns_at(timings.finished))
