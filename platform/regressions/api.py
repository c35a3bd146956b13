"""JSON API of golden datasets and regression runs (router of apikit.api): viewers read; operators create
datasets, versions and runs, and cancel runs.

    GET  /datasets                              the project's datasets
    POST /datasets                              a new dataset with its first version
    GET  /datasets/{name}                       a dataset, its versions, and a page of one version's items
    POST /datasets/{name}/versions              a new version: items upserted (or replacing), ids deleted, or
                                                synthetic items shaped like the project's traffic
    GET  /regression-runs                       runs, newest first
    POST /regression-runs                       start a run (the targets must answer)
    GET  /regression-runs/{id}                  state, progress, summary, verdict
    POST /regression-runs/{id}/cancel           ask it to stop
    GET  /regression-runs/{id}/comparison       gates, per-metric and per-bucket tests, quality (409 until done)
    GET  /regression-runs/{id}/results          per request: output, scores, figures, trace id, what served it
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Annotated, Any, Literal, Optional, Union

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, acting_in, declared, project_object, refused, require
from apikit.inputs import Matching, ProjectName, QueryInt, Slug, Text, Time, iso
from django.http import HttpRequest
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from traces.store import get_store

from . import service
from .datasets import DatasetError, clean_items, resolve_version, traffic_items, write_version
from .models import Dataset, RegressionRun, RunState, target_label

log = logging.getLogger(__name__)
router = ApiRouter(tags=["regressions"])
MAX_LIMIT = 1000


# -- inputs --------------------------------------------------------------------------------------------------
class Message(Schema):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text(65536, multiline=True)
    name: Optional[Text(64, min_length=1)] = None


class Params(Schema):
    """Request parameters sent with the item (the runner sets model, stream and n)."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=1_000_000, description="default 256")
    temperature: Optional[StrictFloat | StrictInt] = Field(None, ge=0, le=100, description="default 0 (greedy)")
    top_p: Optional[StrictFloat | StrictInt] = Field(None, ge=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=1_000_000)
    min_tokens: Optional[StrictInt] = Field(None, ge=0, le=1_000_000)
    stop: Optional[list[Text(200, min_length=1, multiline=True)]] = Field(None, max_length=16)
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: Optional[StrictBool] = None
    presence_penalty: Optional[StrictFloat | StrictInt] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[StrictFloat | StrictInt] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[StrictFloat | StrictInt] = Field(None, gt=0, le=10)
    response_format: Optional[dict[str, Any]] = None


EvaluatorName = Optional[Text(64, min_length=1)]


class ExactEvaluator(Schema):
    model_config = ConfigDict(extra="forbid")
    type: Literal["exact"]
    name: EvaluatorName = None


class ContainsEvaluator(Schema):
    model_config = ConfigDict(extra="forbid")
    type: Literal["contains"]
    value: Text(1000, min_length=1, multiline=True)
    case_sensitive: StrictBool = True
    name: EvaluatorName = None


class RegexEvaluator(Schema):
    model_config = ConfigDict(extra="forbid")
    type: Literal["regex"]
    pattern: Text(500, min_length=1, multiline=True, description="a Python regular expression (re.search)")
    name: EvaluatorName = None


class JsonEvaluator(Schema):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json"]
    name: EvaluatorName = None


class JsonSchemaEvaluator(Schema):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema", description="a JSON Schema (Draft 2020-12)")
    name: EvaluatorName = None


class SimilarityEvaluator(Schema):
    model_config = ConfigDict(extra="forbid")
    type: Literal["similarity", "consistency"]
    threshold: Optional[StrictFloat | StrictInt] = Field(None, ge=0, le=1, description="default 0.8 (similarity), "
                                                                                    "1.0 (consistency)")
    name: EvaluatorName = None


Evaluator = Annotated[Union[ExactEvaluator, ContainsEvaluator, RegexEvaluator, JsonEvaluator, JsonSchemaEvaluator,
                            SimilarityEvaluator], Field(discriminator="type")]
ItemId = Matching(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$", "1-200 characters: letters, digits and ._:/@+- "
                  "(starting with a letter or digit)", min_length=1, max_length=200)


class _ItemFields(Schema):
    model_config = ConfigDict(extra="forbid")
    id: Optional[ItemId] = Field(None, description="the upsert key; default item-<position>")
    params: Params = Field(default_factory=Params)
    expected: Optional[Text(65536, multiline=True)] = None
    evaluators: list[Evaluator] = Field(default_factory=list, max_length=20)
    tags: list[Text(100, min_length=1)] = Field(default_factory=list, max_length=50)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ChatItem(_ItemFields):
    """A dataset item sent to /chat/completions."""

    messages: list[Message] = Field(..., min_length=1, max_length=1000)


class PromptItem(_ItemFields):
    """A dataset item sent to /completions."""

    prompt: Text(65536, min_length=1, multiline=True)


Item = Union[ChatItem, PromptItem]


class FromTraffic(Schema):
    model_config = ConfigDict(extra="forbid")
    since: Optional[Time] = Field(None, description="default: until − 24 hours")
    until: Optional[Time] = Field(None, description="default: now")
    size: StrictInt = Field(100, ge=1, le=10_000, description="items in the version")
    seed: StrictInt = Field(0, ge=0, le=2**31 - 1)


class NewDataset(Schema):
    model_config = ConfigDict(extra="forbid")
    name: Slug
    description: Text(1000, multiline=True) = ""
    items: list[Item] = Field(..., min_length=1, max_length=10_000)
    note: Text(500) = ""


class NewVersion(Schema):
    # What the handler checks, stated in the document too: items, ids to delete, or from_traffic alone.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["items"], "properties": {"items": {"minItems": 1}, "from_traffic": {"type": "null"}}},
        {"required": ["delete"], "properties": {"delete": {"minItems": 1}, "from_traffic": {"type": "null"}}},
        {"required": ["from_traffic"], "properties": {"from_traffic": {"type": "object"}, "items": {"maxItems": 0},
                                                      "delete": {"maxItems": 0}}},
    ]})
    items: list[Item] = Field(default_factory=list, max_length=10_000,
                              description="upserted by id into the latest version's items")
    delete: list[Text(200, min_length=1)] = Field(default_factory=list, max_length=10_000,
                                                 description="ids removed from the latest version")
    replace: StrictBool = Field(False, description="the version holds only `items`")
    from_traffic: Optional[FromTraffic] = Field(None, description="instead of items: synthetic items with the "
                                                                  "prompt/output lengths of the project's traffic")
    note: Text(500) = ""


class CacheSweep(Schema):
    """Measure the gateway's semantic-cache threshold (docs/regressions.md, "Measuring the semantic cache's
    threshold"): after the replay with the cache bypassed, a pass per threshold with the semantic cache on."""

    model_config = ConfigDict(extra="forbid")
    thresholds: list[Annotated[StrictFloat | StrictInt, Field(gt=0, le=1)]] = Field(
        ..., min_length=1, max_length=20, description="similarity thresholds in (0, 1], at most 4 decimals each")
    max_false_hit_rate: StrictFloat | StrictInt = Field(
        1.0, ge=0, le=100, description="percent: the recommended threshold is the lowest whose false-hit rate is "
                                       "within it")


class Options(Schema):
    model_config = ConfigDict(extra="forbid")
    rate: Optional[StrictFloat | StrictInt | Literal["inf"]] = Field(
        "inf", description="requests per second (Poisson, or constant), or \"inf\": all at once")
    arrival: Literal["poisson", "constant"] = "poisson"
    burstiness: StrictFloat | StrictInt = Field(1.0, gt=0, le=100, description="gamma shape (1 = Poisson)")
    max_concurrency: Optional[StrictInt] = Field(None, ge=1, le=10_000)
    repetitions: StrictInt = Field(1, ge=1, le=100)
    warmup: StrictInt = Field(0, ge=0, le=1000)
    time_limit_s: Optional[StrictFloat | StrictInt] = Field(None, gt=0, le=7 * 86400)
    timeout_s: StrictFloat | StrictInt = Field(600.0, gt=0, le=3600)
    seed: StrictInt = Field(0, ge=0, le=2**31 - 1)
    reset_prefix_cache: StrictBool = False
    arms: Literal["together", "in_turn"] = Field(
        "together", description="paired runs: both arms of an item sent at once (together), or the baseline's "
                                "whole replay and then the candidate's (in_turn; for targets sharing one machine)")
    cache_sweep: Optional[CacheSweep] = Field(
        None, description="measure the target gateway's semantic-cache threshold; the report is the run's "
                          "summary.cache_sweep")


class NewRun(Schema):
    model_config = ConfigDict(extra="forbid")
    dataset: Slug
    version: Optional[StrictInt] = Field(None, ge=1, le=2**31 - 1, description="default: the latest")
    target: Optional[Text(500, min_length=1)] = Field(
        None, description="group:NAME of the managed fleet, or an OpenAI base URL (or give target_config)")
    target_config: Optional[dict[str, Any]] = Field(
        None, description="an engine config (vLLM knob names) started for the run as a simulated replica")
    baseline: Optional[Text(500, min_length=1)] = Field(
        None, description="a run id to compare with, or a group/URL replayed alongside (paired mode); "
                          "default: the last passing run of this dataset and target")
    baseline_config: Optional[dict[str, Any]] = Field(
        None, description="an engine config started for the run and replayed alongside (paired mode)")
    options: Options = Field(default_factory=Options)
    gates: Optional[dict[str, Any]] = Field(None, description="gates document (docs/regressions.md); default gates "
                                                              "when left out")


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class DatasetQuery(ProjectQuery):
    version: Optional[QueryInt(1, 2**31 - 1, "default: the latest")] = None
    offset: QueryInt(0, 10_000_000, "items skipped") = 0
    limit: QueryInt(0, MAX_LIMIT, "items returned") = 100


class RunsQuery(ProjectQuery):
    dataset: Optional[Slug] = None
    state: Optional[Literal["queued", "running", "analysing", "done", "error", "cancelled"]] = None
    limit: QueryInt(1, 200, "runs returned") = 50


class ResultsQuery(ProjectQuery):
    arm: Optional[Matching(r"^(candidate|baseline|t[0-9.]{1,6})$", "candidate, baseline, or a cache sweep's pass "
                           "(t0.85)", min_length=1, max_length=10)] = None
    offset: QueryInt(0, 10_000_000, "results skipped") = 0
    limit: QueryInt(1, MAX_LIMIT, "results returned") = 100


class DatasetPath(Schema):
    name: Slug


class RunPath(Schema):
    run_id: QueryInt(1, 2**63 - 1, "run id")


# -- outputs -------------------------------------------------------------------------------------------------
class VersionOut(Schema):
    number: int
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    created_by: str
    source: str
    note: str
    item_count: int


class DatasetOut(Schema):
    project: str
    name: str
    description: str
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    latest_version: Optional[int]
    item_count: int


class DatasetList(Schema):
    project: str
    datasets: list[DatasetOut]


class DatasetDetail(DatasetOut):
    versions: list[VersionOut]
    version: int
    items: list[dict[str, Any]]
    offset: int
    total_items: int


class RunOut(Schema):
    id: int
    project: str
    dataset: str
    dataset_version: int
    target: dict[str, Any]
    target_label: str
    baseline_target: Optional[dict[str, Any]]
    baseline_label: Optional[str]
    baseline_run: Optional[int]
    options: dict[str, Any]
    gates: dict[str, Any]
    state: str
    verdict: Optional[str]
    error: Optional[str]
    progress: dict[str, int]
    cancel_requested: bool
    synthetic: bool
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    created_by: str
    started_at: Optional[str]
    finished_at: Optional[str]
    requests_ended_at: Optional[str]
    attempts: int
    summary: dict[str, Any]


class RunList(Schema):
    project: str
    runs: list[RunOut]


class Comparison(Schema):
    run_id: int
    verdict: str
    comparison: dict[str, Any]


class ResultOut(Schema):
    arm: str
    item_id: str
    repetition: int
    trace_id: str
    success: bool
    status: Optional[int]
    error: Optional[str]
    output: str
    finish_reason: Optional[str]
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    prompt_bucket: Optional[str]
    metrics: dict[str, Any]
    scores: dict[str, Any]
    passed: Optional[bool]
    row_found: bool
    sent_at: Optional[dt.datetime] = Field(None, description="when the request was sent")
    served_from: Optional[str] = Field(None, description="engine, exact_cache or semantic_cache (the gateway's "
                                                         "X-Observatory-Cache header)")
    similarity: Optional[float] = Field(None, description="a cache sweep's pass: the best similarity the "
                                                          "gateway's semantic lookup found")


class Results(Schema):
    run_id: int
    total: int
    offset: int
    results: list[ResultOut]


# -- views ---------------------------------------------------------------------------------------------------
def dataset_json(dataset: Dataset, project: str) -> dict:
    latest = dataset.latest()
    return {"project": project, "name": dataset.name, "description": dataset.description,
            "created_at": iso(dataset.created_at), "latest_version": latest.number if latest else None,
            "item_count": latest.item_count if latest else 0}


def version_json(version) -> dict:
    return {"number": version.number, "created_at": iso(version.created_at), "created_by": version.created_by,
            "source": version.source, "note": version.note, "item_count": version.item_count}


def run_json(run: RegressionRun) -> dict:
    return {
        "id": run.id, "project": run.project.name, "dataset": run.dataset_version.dataset.name,
        "dataset_version": run.dataset_version.number, "target": run.target, "target_label": run.label,
        "baseline_target": run.baseline_target, "baseline_label": target_label(run.baseline_target) or None,
        "baseline_run": run.baseline_run_id, "options": run.options,
        "gates": run.gates, "state": run.state, "verdict": run.verdict or None, "error": run.error or None,
        "progress": {"done": run.progress_done, "total": run.progress_total},
        "cancel_requested": run.cancel_requested, "synthetic": run.synthetic, "created_at": iso(run.created_at),
        "created_by": run.created_by, "started_at": iso(run.started_at), "finished_at": iso(run.finished_at),
        "requests_ended_at": iso(run.requests_ended_at), "attempts": run.attempts, "summary": run.summary or {},
    }


def _dataset_problems(exc: DatasetError, prefix: str = "items") -> ApiError:
    problems = []
    for text in exc.problems:
        where, sep, reason = text.partition(": ")
        field = f"{prefix}[{int(where.split()[-1]) - 1}]" if sep and where.startswith("item ") else prefix
        problems.append({"field": field, "location": "body", "reason": reason if sep else text})
    return ApiError(400, f"invalid items: {'; '.join(exc.problems)}", problems=problems)


def _items(items: list[Item]) -> list[dict]:
    entries = []
    for index, item in enumerate(items):
        data = item.model_dump(exclude_none=True, by_alias=True)
        entries.append((f"item {index + 1}", data, f"item-{index + 1}"))
    return clean_items(entries)


def _dataset(project, name: str) -> Dataset:
    dataset = Dataset.objects.filter(project=project, name=name).first()
    if dataset is None:
        raise ApiError(404, f"no dataset named {name!r} in this project")
    return dataset


def _run(identity, run_id: int) -> RegressionRun:
    run = RegressionRun.objects.select_related("project", "dataset_version__dataset").filter(
        id=run_id, project_id__in=list(identity.projects)).first()
    if run is None:
        raise ApiError(404, f"no regression run {run_id} for this token")
    return run


_DATASET_LINKS = {"GetDataset": {"operationId": "regressions_api_read_dataset",
                                 "parameters": {"name": "$response.body#/name"}}}
_RUN_LINKS = {"GetRun": {"operationId": "regressions_api_read_run", "parameters": {"run_id": "$response.body#/id"}}}


@router.get("/datasets", response=declared(ok={200: DatasetList}), summary="The project's golden datasets")
def list_datasets(request: HttpRequest, query: Query[ProjectQuery]):
    project = project_object(request.auth, query.project)
    return {"project": project.name,
            "datasets": [dataset_json(d, project.name) for d in Dataset.objects.filter(project=project).order_by("name")]}


@router.post("/datasets", response=declared(409, 413, ok={201: DatasetOut}),
             summary="Create a dataset with its first version (operators)",
             openapi_extra={"responses": {201: {"description": "the dataset", "links": _DATASET_LINKS}}})
def create_dataset(request: HttpRequest, body: NewDataset, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "operator", "creating a dataset")
    if Dataset.objects.filter(project=project, name=body.name).exists():
        raise ApiError(409, f"a dataset named {body.name!r} exists: add a version to it "
                            f"(POST /api/v1/datasets/{body.name}/versions)")
    try:
        items = _items(body.items)
        write_version(project, body.name, items, source="api", created_by=identity.username, note=body.note,
                      description=body.description)
    except DatasetError as exc:
        raise _dataset_problems(exc) from None
    log.info("dataset %s/%s created by %s", project.name, body.name, identity.username)
    return Status(201, dataset_json(_dataset(project, body.name), project.name))


@router.get("/datasets/{name}", response=declared(ok={200: DatasetDetail}),
            summary="A dataset, its versions and a page of one version's items")
def read_dataset(request: HttpRequest, path: Path[DatasetPath], query: Query[DatasetQuery]):
    project = project_object(request.auth, query.project)
    dataset = _dataset(project, path.name)
    try:
        version = resolve_version(project, path.name, query.version)
    except LookupError as exc:
        raise ApiError(404, str(exc)) from None
    items = version.items.order_by("position")[query.offset: query.offset + query.limit]
    return {**dataset_json(dataset, project.name),
            "versions": [version_json(v) for v in dataset.versions.order_by("number")],
            "version": version.number, "items": [item.as_dict() for item in items], "offset": query.offset,
            "total_items": version.item_count}


@router.post("/datasets/{name}/versions", response=declared(413, ok={201: VersionOut}),
             summary="A new version of a dataset (operators): items upserted by id, ids deleted, or items shaped "
                     "like the project's traffic")
def create_version(request: HttpRequest, path: Path[DatasetPath], body: NewVersion, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "operator", "changing a dataset")
    _dataset(project, path.name)
    try:
        if body.from_traffic is not None:
            if body.items or body.delete:
                raise ApiError(400, "from_traffic makes the whole version: leave items and delete out")
            until = body.from_traffic.until or dt.datetime.now(dt.timezone.utc)
            since = body.from_traffic.since or until - dt.timedelta(hours=24)
            if since >= until:
                raise ApiError(400, "from_traffic.since must be before until")
            items = traffic_items(get_store(), project.id, since=since, until=until, size=body.from_traffic.size,
                                  seed=body.from_traffic.seed)
            version = write_version(project, path.name, items, source="traffic", created_by=identity.username,
                                    note=body.note, replace=True)
        else:
            if not body.items and not body.delete:
                raise ApiError(400, "a new version needs items, delete or from_traffic")
            items = _items(body.items) if body.items else []
            version = write_version(project, path.name, items, source="api", created_by=identity.username,
                                    note=body.note, replace=body.replace, delete=body.delete)
    except DatasetError as exc:
        raise _dataset_problems(exc) from None
    return Status(201, version_json(version))


@router.get("/regression-runs", response=declared(ok={200: RunList}), summary="Regression runs, newest first")
def list_runs(request: HttpRequest, query: Query[RunsQuery]):
    project = project_object(request.auth, query.project)
    runs = RegressionRun.objects.filter(project=project).select_related("project", "dataset_version__dataset")
    if query.dataset:
        runs = runs.filter(dataset_version__dataset__name=query.dataset)
    if query.state:
        runs = runs.filter(state=query.state)
    return {"project": project.name, "runs": [run_json(r) for r in runs.order_by("-id")[: query.limit]]}


@router.post("/regression-runs", response=declared(413, ok={201: RunOut}),
             summary="Start a regression run (operators); the target (and a baseline target) must answer",
             openapi_extra={"responses": {201: {"description": "the run, queued", "links": _RUN_LINKS}}})
def create_run(request: HttpRequest, body: NewRun, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "operator", "starting a regression run")
    options = body.options.model_dump()
    try:
        run = service.create_run(project, dataset=body.dataset, version=body.version, target=body.target,
                                 baseline=body.baseline, options=options, gates=body.gates,
                                 created_by=identity.username, target_config=body.target_config,
                                 baseline_config=body.baseline_config)
    except service.RunError as exc:
        raise refused(exc) from None
    log.info("regression run %s (%s/%s → %s) started by %s", run.id, project.name, body.dataset, run.label,
             identity.username)
    return Status(201, run_json(_run(identity, run.id)))


@router.get("/regression-runs/{run_id}", response=declared(ok={200: RunOut}),
            summary="A run: state, progress, summary and verdict")
def read_run(request: HttpRequest, path: Path[RunPath]):
    return run_json(_run(request.auth, path.run_id))


@router.post("/regression-runs/{run_id}/cancel", response=declared(409, ok={202: RunOut}),
             summary="Ask a run to stop (operators); a queued run is cancelled at once")
def cancel_run(request: HttpRequest, path: Path[RunPath]):
    identity = request.auth
    run = _run(identity, path.run_id)
    require(identity, run.project_id, "operator", "cancelling a run")
    if not service.cancel(run):
        raise ApiError(409, f"run {run.id} has already ended ({run.state})")
    return Status(202, run_json(_run(identity, run.id)))


@router.get("/regression-runs/{run_id}/comparison", response=declared(409, ok={200: Comparison}),
            summary="The comparison with the baseline: gates, per-metric and per-bucket tests, quality")
def read_comparison(request: HttpRequest, path: Path[RunPath]):
    run = _run(request.auth, path.run_id)
    if run.state != RunState.DONE:
        raise ApiError(409, f"run {run.id} is {run.state}: the comparison is made when it is done")
    return {"run_id": run.id, "verdict": run.verdict, "comparison": run.comparison}


@router.get("/regression-runs/{run_id}/results", response=declared(ok={200: Results}),
            summary="Per request: output, scores, latency figures and the trace id")
def read_results(request: HttpRequest, path: Path[RunPath], query: Query[ResultsQuery]):
    run = _run(request.auth, path.run_id)
    results = run.results.filter(warmup=False)
    if query.arm:
        results = results.filter(arm=query.arm)
    total = results.count()
    page = results.order_by("id")[query.offset: query.offset + query.limit]
    return {"run_id": run.id, "total": total, "offset": query.offset, "results": [{
        "arm": r.arm, "item_id": r.item_id, "repetition": r.repetition, "trace_id": r.trace_id,
        "success": r.success, "status": r.status, "error": r.error or None, "output": r.output,
        "finish_reason": r.finish_reason or None, "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens, "prompt_bucket": r.prompt_bucket or None, "metrics": r.metrics,
        "scores": r.scores, "passed": r.passed, "row_found": r.row_found, "sent_at": r.sent_at,
        "served_from": r.served_from or None, "similarity": r.similarity} for r in page]}
