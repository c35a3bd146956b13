"""JSON API v1: requests of a trace and latency summaries (router of apikit.api)."""
from __future__ import annotations

import datetime as dt
from typing import Literal, Optional

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, declared, project_for, project_name
from apikit.inputs import (
    EARLIEST,
    Duration,
    Flag,
    Matching,
    OptionalTime,
    ProjectName,
    Text,
    TraceId,
    format_duration,
)
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from ninja import Query, Schema
from pydantic import Field, field_validator

from collectors.base import SERVED_FROM

from . import cache_queries, queries
from .store import get_store

router = ApiRouter(tags=["requests"])
MAX_RANGE = dt.timedelta(days=400)
MAX_BUCKETS = 2_000
ServedFrom = Literal[SERVED_FROM]
PromptBucket = Literal["<256", "<1k", "<4k", "<16k", ">=16k", "unknown"]
# The group_by value: a comma-separated subset of the dimensions (repeats are taken once), or empty for one group.
_DIMENSION = "(" + "|".join(queries.GROUP_DIMENSIONS) + ")"
GROUP_BY_PATTERN = f"^({_DIMENSION}(,{_DIMENSION}){{0,{len(queries.GROUP_DIMENSIONS) - 1}}})?$"
Label = Text(256, description="exact match")
GroupBy = Matching(GROUP_BY_PATTERN, "group_by takes a comma-separated subset of " + ", ".join(queries.GROUP_DIMENSIONS)
                   + " (empty: one group over everything)", max_length=80)


@csrf_exempt
def not_found_view(request: HttpRequest, *args, **kwargs) -> JsonResponse:
    """Unknown paths under /api/ answer in JSON like the rest of the API."""
    return JsonResponse({"error": f"no API endpoint at {request.path}"}, status=404)


# -- schemas of the answers ------------------------------------------------------------------------------------
class Hop(Schema):
    role: Literal["client", "gateway", "engine"]
    span_id: str
    service: str
    convention: str
    name: str
    start_ns: int
    duration_ms: float
    ttft_ms: Optional[float]
    network_ms: Optional[float] = Field(None, description="network from the hop above into this one: below a "
                                        "client, or below a gateway that shows its call to this hop as a span")
    unattributed_ms: Optional[float] = Field(None, description="the hop above's own processing and the network "
                                             "into this hop together, where the gateway above shows no call span")
    processing_ms: Optional[float] = Field(None, description="a gateway's own time: its span minus its call to "
                                           "the next hop")
    trace_id: Optional[str] = Field(None, description="the hop's own trace, on the hops of a row joined across "
                                    "traces (null otherwise)")


class NetworkPerHop(Schema):
    client_gateway: Optional[float] = Field(description="client e2e − gateway e2e (both hops present)")
    gateway_engine: Optional[float] = Field(description="gateway e2e − engine e2e (both hops present)")


class Request(Schema):
    project: str = Field(description="the project the row belongs to")
    trace_id: str
    request_key: str = Field(description="span id of the call that anchors the request (engine, else gateway, else "
                                          "client)")
    request_id: str
    start_time: str = Field(json_schema_extra={"format": "date-time"})
    service: str
    model: str
    engine_config: str
    replica_group: str = Field(description="'' when the engine did not say")
    gateway: str = Field(description="the gateways' services, outermost first, joined by ' > ' (e.g. "
                                     "'litellm-proxy > llm-gateway'); '' when the request passed none")
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    prompt_bucket: str
    e2e_ms: Optional[float]
    ttft_ms: Optional[float]
    engine_ttft_ms: Optional[float]
    tpot_ms: Optional[float]
    network_ms: Optional[float]
    gateway_ms: Optional[float] = Field(description="Σ the gateways' own processing where a gateway shows its call "
                                        "to the next hop; e2e = network + gateway + lookup + overhead + queue + "
                                        "prefill + decode (NULL: counted in network_ms)")
    overhead_ms: Optional[float]
    queue_ms: Optional[float]
    prefill_ms: Optional[float]
    decode_ms: Optional[float]
    hops: list[Hop]
    status: Literal["ok", "error"]
    joined_by: Literal["", "response_id"] = Field(description="'response_id' when the hops came from several traces "
                                                  "(a hop that did not propagate traceparent), joined by the "
                                                  "response id both sides recorded; '' for a row of one trace")
    linked_trace_ids: list[str] = Field(description="the other traces holding hops of a joined row")
    network_ms_per_hop: NetworkPerHop
    cached_prompt_tokens: Optional[int] = Field(description="prompt tokens read from the engine's prefix cache (the "
                                                "engine's report, else the nearest gateway's, else the client's); "
                                                "null when no hop said, and on requests served from a cache")
    served_from: ServedFrom = Field(description="what answered: the engine, or the gateway's response cache (then "
                                    "queue, prefill and decode are 0 and the gateway's lookup and own time split "
                                    "its span)")
    lookup_ms: Optional[float] = Field(description="the gateway's response-cache lookup, on requests served from a "
                                       "cache (null otherwise: a miss's lookup is in the gateway's own time)")


class Requests(Schema):
    requests: list[Request]


class Tail(Schema):
    p50: Optional[float]
    p95: Optional[float]
    p99: Optional[float]


class Component(Schema):
    p50: Optional[float]
    p95: Optional[float]


class SummaryGroup(Schema):
    key: dict[str, str]
    count: int
    errors: int
    e2e_ms: Tail
    ttft_ms: Tail
    tpot_ms: Tail
    network_ms: Component
    overhead_ms: Component
    queue_ms: Component
    prefill_ms: Component
    decode_ms: Component


class Quantiles(Schema):
    method: Literal["exact", "t-digest"]
    error: str


class Summary(Schema):
    since: str = Field(json_schema_extra={"format": "date-time"})
    until: str = Field(json_schema_extra={"format": "date-time"})
    group_by: list[str]
    filters: dict[str, str] = Field(description="the filters applied")
    quantiles: Quantiles
    groups: list[SummaryGroup]


class EngineFigures(Schema):
    requests: int = Field(description="requests an engine served")
    e2e_ms_p50: Optional[float]


class CacheClass(Schema):
    requests: int
    share: Optional[float] = Field(description="of all the group's requests in the bucket")
    e2e_ms_p50: Optional[float]
    latency_saved_ms: Optional[float] = Field(description="the engine-served requests' p50 e2e (same bucket and "
                                              "group) minus this class's p50 e2e; null when either has no request")


class ResponseCache(Schema):
    exact_cache: CacheClass
    semantic_cache: CacheClass


class CacheGroup(Schema):
    key: dict[str, str] = Field(description="{by: value}; {} when not grouped")
    requests: int
    prompt_tokens: int = Field(description="Σ prompt tokens of all the requests")
    reported_prompt_tokens: int = Field(description="Σ prompt tokens of the requests reporting cached tokens")
    cached_prompt_tokens: int = Field(description="Σ prompt tokens read from the engines' prefix caches")
    token_hit_ratio: Optional[float] = Field(description="cached_prompt_tokens / reported_prompt_tokens")
    requests_reporting_cached: int
    requests_with_hit: int = Field(description="requests with cached prompt tokens > 0")
    request_hit_ratio: Optional[float] = Field(description="requests_with_hit / requests_reporting_cached")
    prefill_ms_per_uncached_token: Optional[float] = Field(
        description="Σ prefill / Σ (prompt − cached tokens) over engine-served requests knowing all three")
    engine: EngineFigures
    response_cache: ResponseCache


class CacheBucket(Schema):
    t: str = Field(json_schema_extra={"format": "date-time"}, description="the bucket's start")
    groups: list[CacheGroup]


class Caches(Schema):
    since: str = Field(json_schema_extra={"format": "date-time"})
    until: str = Field(json_schema_extra={"format": "date-time"})
    step: str
    by: Optional[str]
    filters: dict[str, str] = Field(description="the filters applied")
    buckets: list[CacheBucket]


# -- inputs ----------------------------------------------------------------------------------------------------
class RequestsQuery(Schema):
    trace_id: TraceId
    project: Optional[ProjectName] = Field(None, description="Project name. A token that reads several projects "
                                           "may leave it out: the trace is then searched in all of them. A project "
                                           "the token does not read is 404.")


class SummaryQuery(Schema):
    since: Optional[OptionalTime] = Field(None, description="default (or empty): until − 1 hour")
    until: Optional[OptionalTime] = Field(None, description="default (or empty): now")
    group_by: GroupBy = "model"
    model: Optional[Label] = None
    service: Optional[Label] = None
    engine_config: Optional[Label] = None
    prompt_bucket: Optional[PromptBucket] = None
    replica_group: Optional[Label] = None
    gateway: Optional[Text(256, description="exact match: the gateways' services, outermost first, joined by ' > ' "
                                            "('' for requests through no gateway)", min_length=0)] = None
    served_from: Optional[ServedFrom] = Field(None, description="'engine' for the engine's own latency, leaving out "
                                              "the requests a gateway answered from its response cache")
    exact: Flag = Field(False, description="exact percentiles (quantilesExact over the raw rows) instead of t-digest")
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)

    @field_validator("group_by")
    @classmethod
    def _once_each(cls, value: str) -> str:
        return ",".join(dict.fromkeys(part for part in value.split(",") if part))


class CachesQuery(Schema):
    since: Optional[OptionalTime] = Field(None, description="default (or empty): until − 24 hours")
    until: Optional[OptionalTime] = Field(None, description="default (or empty): now")
    step: Duration(dt.timedelta(minutes=1), dt.timedelta(days=30),
                   "the buckets' width, such as 5m, 1h or 1d (whole hours read the rollups)") = dt.timedelta(hours=1)
    by: Optional[Literal[cache_queries.GROUPS]] = Field(None, description="one group per value of this dimension "
                                                        "(default: one group)")
    model: Optional[Label] = None
    service: Optional[Label] = None
    engine_config: Optional[Label] = None
    prompt_bucket: Optional[PromptBucket] = None
    replica_group: Optional[Label] = None
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


def _time_range(query, default: dt.timedelta) -> tuple[dt.datetime, dt.datetime]:
    """The query's [since, until): until defaults to now and since to until − `default`; 400 when empty or longer
    than MAX_RANGE."""
    until = query.until or dt.datetime.now(dt.timezone.utc)
    since = query.since or max(until - default, EARLIEST)
    if since >= until:
        raise ApiError(400, "since must be before until")
    if until - since > MAX_RANGE:
        raise ApiError(400, f"the time range is limited to {MAX_RANGE.days} days")
    return since, until


def _iso(value: dt.datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


@router.get("/requests", response=declared(ok={200: Requests}), summary="LLM requests of one trace, with their "
            "latency decomposition", description="Ordered by start time. Requests appear once their spans are "
            "stored and the trace decomposed (see /readyz decomposition_pending).")
def requests_view(request: HttpRequest, query: Query[RequestsQuery]):
    identity = request.auth
    if query.project is None and len(identity.projects) > 1:
        # A trace id names one trace whatever the project: a token that reads several searches them all.
        found = []
        for name, project_id in sorted(identity.project_names.items()):
            for item in queries.requests_for_trace(get_store(), project_id, query.trace_id.lower()):
                item["project"] = name
                found.append(item)
        found.sort(key=lambda item: (item["start_time"], item["request_key"]))
        return {"requests": found}
    project_id = project_for(identity, query.project)
    items = queries.requests_for_trace(get_store(), project_id, query.trace_id.lower())
    name = project_name(identity, project_id)
    for item in items:
        item["project"] = name
    return {"requests": items}


@router.get("/latency/summary", response=declared(ok={200: Summary}),
            summary="Latency percentiles per group over a time range",
            description="Requests are selected by start time (the outermost hop's). The range is at most "
                        f"{MAX_RANGE.days} days. Per group: count, errors, p50/p95/p99 of e2e, TTFT and TPOT, p50/p95 "
                        "of each component (NULLs left out).")
def latency_summary_view(request: HttpRequest, query: Query[SummaryQuery]):
    project_id = project_for(request.auth, query.project)
    since, until = _time_range(query, dt.timedelta(hours=1))
    group_by = [g for g in query.group_by.split(",") if g]
    filters = {name: getattr(query, name) for name in queries.FILTER_DIMENSIONS if getattr(query, name) is not None}
    groups = queries.latency_summary(
        get_store(), project_id, since=since, until=until, group_by=group_by, filters=filters, exact=query.exact
    )
    return {
        "since": _iso(since),
        "until": _iso(until),
        "group_by": group_by,
        "filters": filters,
        "quantiles": {
            "method": "exact" if query.exact else "t-digest",
            "error": "exact" if query.exact else queries.TDIGEST_ERROR_NOTE,
        },
        "groups": groups,
    }


@router.get("/caches", response=declared(ok={200: Caches}),
            summary="Prefix-cache and response-cache figures per time bucket and group",
            description="Requests are selected by start time, in buckets of `step` from the one holding `since` "
                        f"(at most {MAX_BUCKETS} buckets, {MAX_RANGE.days} days). Per bucket and group: prompt and "
                        "cached prompt tokens and their ratio, requests with a prefix-cache hit and their ratio, "
                        "prefill time per uncached prompt token, and the requests the gateway answered from its "
                        "response cache (exact, semantic): their share, p50 e2e and the latency they saved "
                        "(docs/api.md).")
def caches_view(request: HttpRequest, query: Query[CachesQuery]):
    project_id = project_for(request.auth, query.project)
    since, until = _time_range(query, dt.timedelta(hours=24))
    step = int(query.step.total_seconds())
    if (until.timestamp() - int(since.timestamp()) // step * step) / step > MAX_BUCKETS:
        raise ApiError(400, f"at most {MAX_BUCKETS} buckets: a longer step, or a shorter range")
    filters = {name: getattr(query, name) for name in cache_queries.FILTERS if getattr(query, name) is not None}
    buckets = cache_queries.cache_series(get_store(), project_id, since=since, until=until, step=step, by=query.by,
                                        filters=filters)
    return {"since": _iso(since), "until": _iso(until), "step": format_duration(query.step), "by": query.by,
            "filters": filters, "buckets": buckets}
