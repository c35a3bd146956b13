"""JSON API of SLOs (router of apikit.api): /slos (list, create), /slos/{name} (read, replace, delete),
/slos/{name}/history.

Viewers read; operators (and admins) create, replace and delete. A body is first parsed by its declared type
(NewSlo, SloReplacement: one form per kind of SLI, every field's shape and bounds, as in the OpenAPI
document), then checked like the YAML
(definitions.validate: what one field cannot say alone, e.g. a tier that can never fire for the objective).
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Annotated, Any, Literal, Optional, Union

from apikit.api import (
    PROJECT_DESCRIPTION,
    ApiError,
    ApiRouter,
    declared,
    project_for,
    project_name,
    require,
    union_tags,
)
from apikit.inputs import Duration, DurationOrSeconds, Matching, ProjectName, QueryInt, Slug, Text, Time
from django.http import HttpRequest
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator
from traces.store import get_store

from . import definitions, queries, services
from .models import LATENCY_SLIS as LATENCY_SLI_CHOICES
from .models import SLO, NoDataPolicy, Sli

log = logging.getLogger(__name__)
router = ApiRouter(tags=["slos"])
MAX_SERIES_POINTS = 10_000
MAX_SERIES_RANGE = dt.timedelta(days=90)
# Fields of the answer that are not part of a definition: a body read with GET can be sent back with PUT.
READ_ONLY = ("project", "objective_percent", "period_days", "repeat_interval_seconds", "default_tiers", "error_budget",
             "created_at", "updated_at", "status", "series")

Window = Duration(dt.timedelta(minutes=1), dt.timedelta(days=30), "a window such as 5m, 1h, 6h or 3d (at most 30d)")
FilterValue = Text(256, min_length=1)
Filter = Union[FilterValue, Annotated[list[FilterValue], Field(min_length=1, max_length=definitions.MAX_FILTER_VALUES)]]
# Not alertname, slo, project, severity, sli or tier (definitions.validate says so): a pattern cannot, portably.
LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]{0,63}$"
Description = Text(2000, multiline=True)
NoData = Literal[tuple(NoDataPolicy.values)]  # type: ignore[valid-type]
Labels = Annotated[dict[Matching(LABEL_NAME, "a label name such as team ([a-zA-Z_][a-zA-Z0-9_]*, at most 64)"), Text(200)],
                   Field(max_length=20)]
RepeatInterval = DurationOrSeconds(dt.timedelta(minutes=1), dt.timedelta(days=7), "between 1m and 7d, e.g. 4h, or "
                                   "whole seconds", whole_seconds=True)
SeriesWindow = Duration(dt.timedelta(minutes=1), MAX_SERIES_RANGE,
                        "the status series of this window up to now, e.g. 6h (at most 90d)")


def _boolean(value):
    # A Literal[False] alone takes 0 (and 0.0) for false: the document says a boolean, so only one is taken.
    if not isinstance(value, bool):
        raise ValueError("a boolean: false")
    return value


class Tier(Schema):
    model_config = ConfigDict(extra="forbid")
    name: Matching(r"^[a-z0-9][a-z0-9_-]{0,99}$", "a slug such as page-1h (not no_data)")
    severity: Literal["page", "ticket"]
    long_window: Window
    short_window: Window = Field(description="shorter than long_window (typically 1/12 of it)")
    factor: Annotated[float, Field(gt=0, le=1000, strict=True, description="burn rate, e.g. 14.4")]


class Filters(Schema):
    model_config = ConfigDict(extra="forbid")
    service: Optional[Filter] = None
    model: Optional[Filter] = None
    prompt_bucket: Optional[Union[Literal[definitions.PROMPT_BUCKETS], Annotated[  # type: ignore[valid-type]
        list[Literal[definitions.PROMPT_BUCKETS]], Field(min_length=1, max_length=6)]]] = None  # type: ignore[valid-type]
    engine_config: Optional[Filter] = None
    replica_group: Optional[Filter] = None


class ModelCheckFilters(Schema):
    """engine_model_error counts live checks of a replica group's engine model: only replica_group selects them."""

    model_config = ConfigDict(extra="forbid")
    replica_group: Optional[Filter] = None

    @model_validator(mode="before")
    @classmethod
    def _only_the_group(cls, value):
        others = sorted(str(k) for k in value if k != "replica_group") if isinstance(value, dict) else []
        if others:
            raise ValueError(f"engine_model_error counts live checks of a replica group's engine model, which only "
                             f"replica_group selects; remove {', '.join(others)}")
        return value


# A percentage above 0% and at most 99.9999% ("0%", "0.0%" do not match); spaces around it are allowed.
PERCENT = r"^ *([1-9][0-9]?(\.[0-9]{1,4})?|0\.([1-9][0-9]{0,3}|0[1-9][0-9]{0,2}|00[1-9][0-9]?|000[1-9])) *% *$"
Objective = Union[
    Annotated[StrictFloat, Field(gt=0, le=0.999999, description="a fraction, e.g. 0.999")],
    Matching(PERCENT, "a percentage above 0% and at most 99.9999%, such as '99.9%' (or a fraction such as 0.999)"),
]
Threshold = Annotated[float, Field(gt=0, le=3_600_000, strict=True)]
LATENCY_SLIS = tuple(str(sli) for sli in LATENCY_SLI_CHOICES)
# Examples of a replacement (PUT: the path names the SLO); a creation's add a name.
EXAMPLE = {"description": "first token within 500 ms", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%",
           "period": "30d", "filters": {"service": "chat"}}
ERRORS_EXAMPLE = {"sli": "error_ratio", "objective": "99.5%", "filters": {"service": "chat"}}
MODEL_ERROR_EXAMPLE = {"sli": "engine_model_error", "threshold": 0.2, "objective": "90%",
                       "filters": {"replica_group": "chat"},
                       "tiers": [{"name": "page-6h", "severity": "page", "long_window": "6h", "short_window": "30m",
                                  "factor": 6},
                                 {"name": "ticket-3d", "severity": "ticket", "long_window": "3d", "short_window": "6h",
                                  "factor": 1}]}


def _examples(*examples: dict) -> dict:
    return {"examples": list(examples), **DEFAULT_TIERS_OBJECTIVE}


# With the default tiers (tiers left out or "default"), the fastest one (14.4×) must be able to fire:
# 14.4 × (1 − objective) ≤ 1, so the objective is at least 93.0556%. The document says so with if/then (the
# bounds below are a little inside: 93.06%); definitions.validate checks every tier, the user's too.
DEFAULT_TIERS_OBJECTIVE = {
    "if": {"properties": {"tiers": {"const": "default"}}},
    "then": {"properties": {"objective": {"anyOf": [
        {"type": "number", "minimum": 0.9306, "maximum": 0.999999},
        {"type": "string", "pattern": r"^ *(9[4-9](\.[0-9]{1,4})?|93\.(0[6-9][0-9]{0,2}|[1-9][0-9]{0,3})) *% *$"},
    ]}}},
}


class _Definition(Schema):
    """The same fields as one item of `slos:` in the YAML format (docs/slo.md)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_examples(EXAMPLE))
    name: Optional[Slug] = Field(None, description="a replacement takes the path's name")
    description: Description = ""
    objective: Objective = Field(description="above 0% and at most 99.9999%; each tier must be able to fire: "
                                             "factor × (1 − objective) ≤ 1 (the default tiers need at least 93.06%)",
                                 examples=["99%", 0.999])
    period: Union[Literal["28d", "30d"], Literal[28, 30]] = "30d"
    filters: Optional[Filters] = None
    include_cached: StrictBool = Field(False, description="also count requests the gateway answered from its response "
                                                          "cache (served_from exact_cache | semantic_cache); false: "
                                                          "engine-served requests only")
    tiers: Union[Literal["default"], Annotated[list[Tier], Field(min_length=1, max_length=definitions.MAX_TIERS)]] = \
        Field("default", description="'default' (the SRE Workbook's four tiers) or your own; tier names are unique")
    min_requests: Annotated[StrictInt, Field(ge=0, le=10_000_000)] = 20
    min_bad: Annotated[StrictInt, Field(ge=0, le=10_000_000)] = 3
    no_data: NoData = "ok"
    repeat_interval: RepeatInterval = "4h"
    labels: Optional[Labels] = None
    enabled: StrictBool = True
    # Read-only fields of an answer, ignored: what GET returns can be sent back with PUT. The project is
    # ?project= (or the token's only project), never the body's.
    project: Optional[Any] = Field(None, description="read-only, ignored: the project is ?project=")
    objective_percent: Optional[Any] = Field(None, description="read-only, ignored")
    period_days: Optional[Any] = Field(None, description="read-only, ignored")
    repeat_interval_seconds: Optional[Any] = Field(None, description="read-only, ignored")
    default_tiers: Optional[Any] = Field(None, description="read-only, ignored")
    error_budget: Optional[Any] = Field(None, description="read-only, ignored")
    created_at: Optional[Any] = Field(None, description="read-only, ignored")
    updated_at: Optional[Any] = Field(None, description="read-only, ignored")
    status: Optional[Any] = Field(None, description="read-only, ignored")
    series: Optional[Any] = Field(None, description="read-only, ignored")

    def definition(self) -> dict:
        """The fields given, in the YAML form definitions.validate takes."""
        data = self.model_dump(mode="json", exclude_unset=True, exclude={*READ_ONLY})
        data["sli"] = self.sli  # the discriminator: given, even where pydantic counts it as unset
        if data.get("name") is None:  # a replacement's null name (the document allows it): the path's
            data.pop("name", None)
        if data.get("filters") is None:
            data.pop("filters", None)
        else:  # a dimension given as null (the document allows it) does not filter, like one left out
            data["filters"] = {key: value for key, value in data["filters"].items() if value is not None}
        if data.get("labels") is None:
            data.pop("labels", None)
        for key in ("threshold_ms", "threshold"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class LatencySlo(_Definition):
    """A latency SLO: a request is good when its SLI is at or under threshold_ms."""

    sli: Literal[LATENCY_SLIS]  # type: ignore[valid-type]
    threshold_ms: Threshold = Field(description="a request is good at or under it", examples=[500])
    threshold: None = Field(None, description="none: only engine_model_error takes a ratio threshold")


class ErrorRatioSlo(_Definition):
    """An availability SLO: a request is good when it did not fail. It has no threshold."""

    model_config = ConfigDict(json_schema_extra=_examples(ERRORS_EXAMPLE))
    sli: Literal["error_ratio"]
    threshold_ms: None = Field(None, description="none: an error_ratio SLO has no threshold")
    threshold: None = Field(None, description="none: an error_ratio SLO has no threshold")


class EngineModelErrorSlo(_Definition):
    """An SLO on the engine model of a replica group: each live check of the group's newest model (every
    TUNING_CALIBRATION_CHECK_SECONDS) is an event, good when its worst |error| on p50 prefill time and p50 TPOT is at
    or under threshold."""

    model_config = ConfigDict(json_schema_extra=_examples(MODEL_ERROR_EXAMPLE))
    sli: Literal["engine_model_error"]
    threshold: Annotated[float, Field(gt=0, le=1, strict=True)] = Field(
        description="the largest |relative error| of a good check, a fraction (0.2 = 20%)", examples=[0.2])
    threshold_ms: None = Field(None, description="none: the threshold is a ratio (threshold)")
    filters: Optional[ModelCheckFilters] = None
    include_cached: Annotated[Literal[False], BeforeValidator(_boolean)] = Field(
        False, description="false: checks are not requests")


class NewLatencySlo(LatencySlo):
    model_config = ConfigDict(json_schema_extra=_examples({"name": "chat-ttft", **EXAMPLE}))
    name: Slug = Field(description="unique in the project")


class NewErrorRatioSlo(ErrorRatioSlo):
    model_config = ConfigDict(json_schema_extra=_examples({"name": "chat-errors", **ERRORS_EXAMPLE}))
    name: Slug = Field(description="unique in the project")


class NewEngineModelErrorSlo(EngineModelErrorSlo):
    model_config = ConfigDict(json_schema_extra=_examples({"name": "chat-model", **MODEL_ERROR_EXAMPLE}))
    name: Slug = Field(description="unique in the project")


# The SLI decides which fields apply: one form per kind, chosen by "sli" (a discriminator in the document).
NewSlo = Annotated[Union[NewLatencySlo, NewErrorRatioSlo, NewEngineModelErrorSlo], Field(discriminator="sli")]
SloReplacement = Annotated[Union[LatencySlo, ErrorRatioSlo, EngineModelErrorSlo], Field(discriminator="sli")]
union_tags.update(Sli.values)


class SloTierStatus(Schema):
    name: Optional[str] = None
    severity: Optional[str] = None
    long_window: Optional[str] = None
    short_window: Optional[str] = None
    factor: Optional[float] = None
    long_burn: Optional[float] = None
    short_burn: Optional[float] = None
    burning: Optional[bool] = None
    suppressed: Optional[bool] = None
    reason: Optional[str] = None


class SloStatus(Schema):
    state: Literal["pending", "ok", "burning", "no_data", "low_traffic"]
    last_evaluated_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    firing: Optional[SloTierStatus]
    burn_rates: dict[str, Optional[float]] = Field(description="window (5m, 30m, 1h, … the period) → burn rate")
    budget_remaining: Optional[float] = Field(description="over the period: 1 untouched, 0 spent, < 0 overspent")
    counts: dict[str, dict[str, int]]
    tiers: list[SloTierStatus]


class SloStatusPoint(Schema):
    at: str = Field(json_schema_extra={"format": "date-time"})
    state: str
    firing_tier: Optional[str]
    severity: Optional[str]
    budget_remaining: Optional[float]
    burn_rates: dict[str, float]
    counts: dict[str, Any]


class TierOut(Schema):
    name: str
    severity: str
    long_window: str
    short_window: str
    factor: float


class Slo(Schema):
    project: str
    name: str
    description: str
    sli: str
    threshold_ms: Optional[float] = None
    threshold: Optional[float] = Field(None, description="engine_model_error: the largest |relative error| of a good "
                                                         "check")
    objective: float
    objective_percent: str
    period: str
    period_days: int
    filters: dict[str, list[str]]
    include_cached: bool = Field(description="false: only engine-served requests count; true: response-cache hits too")
    tiers: list[TierOut]
    default_tiers: bool
    error_budget: float
    min_requests: int
    min_bad: int
    no_data: str
    repeat_interval: Union[str, int]
    repeat_interval_seconds: int
    labels: dict[str, str]
    enabled: bool
    created_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    updated_at: Optional[str] = Field(json_schema_extra={"format": "date-time"})
    status: SloStatus
    series: Optional[list[SloStatusPoint]] = Field(None, description="only with ?series=WINDOW")


class SloList(Schema):
    project: str
    slos: list[Slo]


class Deleted(Schema):
    deleted: str
    project: str


class History(Schema):
    project: str
    slo: str
    since: str = Field(json_schema_extra={"format": "date-time"})
    until: str = Field(json_schema_extra={"format": "date-time"})
    points: list[SloStatusPoint]


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class ReadQuery(ProjectQuery):
    series: Optional[SeriesWindow] = None


class HistoryQuery(ProjectQuery):
    since: Optional[Time] = Field(None, description="default: until − 24 hours")
    until: Optional[Time] = Field(None, description="default: now")
    limit: QueryInt(1, MAX_SERIES_POINTS, "points at most (evenly thinned beyond it)") = 1440


class SloPath(Schema):
    name: Slug


def _definition_error(exc: definitions.DefinitionError) -> ApiError:
    problems = []
    for text in exc.problems:
        field, sep, reason = text.partition(": ")
        problems.append({"field": field if sep else "", "location": "body", "reason": reason if sep else text})
    return ApiError(400, f"invalid SLO: {'; '.join(exc.problems)}", problems=problems)


def _project(identity, query_project: str | None) -> tuple[int, str]:
    """The project from ?project=, or the token's only project."""
    project_id = project_for(identity, query_project)
    return project_id, project_name(identity, project_id)


def _slo(project_id: int, name: str) -> SLO:
    slo = SLO.objects.filter(project_id=project_id, name=name).first()
    if slo is None:
        raise ApiError(404, f"no SLO named {name!r} in this project")
    return slo


_LINKS = {
    "GetSlo": {"operationId": "slo_api_read_slo", "parameters": {"name": "$response.body#/name"}},
    "ReplaceSlo": {"operationId": "slo_api_replace_slo", "parameters": {"name": "$response.body#/name"}},
    "DeleteSlo": {"operationId": "slo_api_delete_slo", "parameters": {"name": "$response.body#/name"}},
    "SloHistory": {"operationId": "slo_api_slo_history", "parameters": {"name": "$response.body#/name"}},
}


@router.get("/slos", response=declared(ok={200: SloList}),
            summary="The project's SLOs with their latest evaluation (burn rate per window, budget remaining, state)")
def list_slos(request: HttpRequest, query: Query[ProjectQuery]):
    project_id, name = _project(request.auth, query.project)
    slos = SLO.objects.filter(project_id=project_id).order_by("name")
    return {"project": name, "slos": [services.describe(s, name) for s in slos]}


@router.post("/slos", response=declared(409, 413, ok={201: Slo}), summary="Create an SLO (operators)",
             openapi_extra={"responses": {201: {"description": "the SLO", "links": _LINKS}}})
def create_slo(request: HttpRequest, body: NewSlo, query: Query[ProjectQuery]):
    identity = request.auth
    project_id, project = _project(identity, query.project)
    require(identity, project_id, "operator", "creating an SLO")
    data = body.definition()
    try:
        slo = services.create(project_id, data)
    except definitions.DefinitionError as exc:
        raise _definition_error(exc) from None
    except services.SloExists as exc:
        raise ApiError(409, str(exc)) from None
    log.info("SLO %s/%s created by %s", project, slo.name, identity.username)
    return Status(201, services.describe(slo, project))


@router.get("/slos/{name}", response=declared(ok={200: Slo}), summary="One SLO, optionally with its status series")
def read_slo(request: HttpRequest, path: Path[SloPath], query: Query[ReadQuery]):
    project_id, project = _project(request.auth, query.project)
    slo = _slo(project_id, path.name)
    body = services.describe(slo, project)
    if query.series is not None:
        until = dt.datetime.now(dt.timezone.utc)
        body["series"] = queries.status_series(get_store(), project_id, slo.id, until - query.series, until,
                                               MAX_SERIES_POINTS)
    return body


@router.put("/slos/{name}", response=declared(409, 413, ok={200: Slo}),
            summary="Replace an SLO's definition (operators); its evaluation state is kept")
def replace_slo(request: HttpRequest, path: Path[SloPath], body: SloReplacement, query: Query[ProjectQuery]):
    identity = request.auth
    project_id, project = _project(identity, query.project)
    require(identity, project_id, "operator", "replacing an SLO")
    slo = _slo(project_id, path.name)
    data = body.definition()
    data.setdefault("name", path.name)
    try:
        slo, changed = services.replace(slo, data)
    except definitions.DefinitionError as exc:
        raise _definition_error(exc) from None
    except services.SloExists as exc:
        raise ApiError(409, str(exc)) from None
    log.info("SLO %s/%s replaced by %s (%s)", project, path.name, identity.username, ", ".join(changed) or "no change")
    return services.describe(slo, project)


@router.delete("/slos/{name}", response=declared(ok={200: Deleted}), summary="Delete an SLO (operators)")
def delete_slo(request: HttpRequest, path: Path[SloPath], query: Query[ProjectQuery]):
    identity = request.auth
    project_id, project = _project(identity, query.project)
    slo = _slo(project_id, path.name)
    require(identity, project_id, "operator", "deleting an SLO")
    slo.delete()
    log.info("SLO %s/%s deleted by %s", project, path.name, identity.username)
    return {"deleted": path.name, "project": project}


@router.get("/slos/{name}/history", response=declared(ok={200: History}),
            summary="The SLO's evaluations over a time range (at most 90 days)")
def slo_history(request: HttpRequest, path: Path[SloPath], query: Query[HistoryQuery]):
    project_id, project = _project(request.auth, query.project)
    slo = _slo(project_id, path.name)
    until = query.until or dt.datetime.now(dt.timezone.utc)
    since = query.since or until - dt.timedelta(hours=24)
    if since >= until:
        raise ApiError(400, "since must be before until")
    if until - since > MAX_SERIES_RANGE:
        raise ApiError(400, f"the time range is limited to {MAX_SERIES_RANGE.days} days")
    points = queries.status_series(get_store(), project_id, slo.id, since, until, query.limit)
    return {
        "project": project, "slo": slo.name,
        "since": since.isoformat().replace("+00:00", "Z"), "until": until.isoformat().replace("+00:00", "Z"),
        "points": points,
    }

