"""JSON API of tuning studies (router of apikit.api): viewers read; operators create, cancel and propose.

    GET  /tuning-studies                   studies, newest first
    POST /tuning-studies                   a new study (checked: group, space, workload, SLO)
    GET  /tuning-studies/{id}              state, progress, result (goodputs on fresh seeds beside the search's,
                                           explanation, importances, Pareto front, the re-scoring that chose
                                           the winner, grid baseline, confirmation)
    GET  /tuning-studies/{id}/trials       every trial: params, valid or why not, goodput
    POST /tuning-studies/{id}/cancel       ask it to stop
    POST /tuning-studies/{id}/propose      hand the winner to a rollout of the group
    GET  /engine-models                    a group's calibrated engine models, newest first
    POST /engine-models                    calibrate a group's engine model from its traffic (checked: the group,
                                           enough requests with engine timings, one config in the window)
    GET  /engine-models/{id}               one model: constants, fit and held-out errors, whether a study trusts it
    POST /engine-models/{id}/cancel        stop a calibration that is queued or fitting
    POST /engine-models/{id}/evaluate      a fitted model against any window of its group's traffic (its errors,
                                           curves, what moved, observed and predicted quantiles; nothing stored)
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Literal, Optional

from apikit.api import PROJECT_DESCRIPTION, ApiError, ApiRouter, acting_in, declared, project_object, refused, require
from apikit.inputs import ProjectName, QueryInt, Text, Time
from django.http import HttpRequest
from ninja import Path, Query, Schema
from ninja.responses import Status
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from tenancy.keys import ApiIdentity

from . import calibration, evaluation, service
from .models import EngineModel, TuningStudy
from .storage import optuna_study

log = logging.getLogger(__name__)
router = ApiRouter(tags=["tuning"])


class NewStudy(Schema):
    model_config = ConfigDict(extra="forbid")
    group: Text(100, min_length=1) = Field(..., description="the replica group of the managed fleet to tune")
    workload: Text(120, min_length=1) = Field(
        "traffic", description="traffic (the group's recent requests), dataset:NAME or synthetic:chat|rag|code")
    window_hours: StrictFloat | StrictInt = Field(24, gt=0, le=744, description="traffic window")
    objective: Literal["goodput", "goodput_per_gpu", "pareto"] = "goodput"
    space: Optional[dict[str, Any]] = Field(
        None, description="knob → list of values or {low, high[, log]}; default: docs/tuning.md")
    trials: StrictInt = Field(60, ge=1, le=1000, description="valid trials (refused configs are not counted)")
    slo: Optional[dict[str, StrictFloat | StrictInt]] = Field(
        None, description="thresholds in ms (ttft_ms, tpot_ms, e2e_ms); default: the project's SLOs")
    target: Optional[StrictFloat] = Field(None, ge=0.5, lt=1, description="share of requests that must meet them")
    seed: StrictInt = Field(0, ge=0, le=2**31 - 1)
    confirm: StrictBool = Field(True, description="replay winner and current config on real-time replicas")
    allow_unreliable: StrictBool = Field(False, description="run with the group's engine model although its held-out "
                                         "error is above the bound (the study is marked unreliable); else 409")


class ProjectQuery(Schema):
    project: Optional[ProjectName] = Field(None, description=PROJECT_DESCRIPTION)


class StudiesQuery(ProjectQuery):
    state: Optional[Literal["queued", "searching", "rescoring", "confirming", "done", "failed", "cancelled"]] = None
    limit: QueryInt(1, 200, "studies returned") = 50


class StudyPath(Schema):
    study_id: QueryInt(1, 2**63 - 1, "study id")


class StudyOut(Schema):
    model_config = ConfigDict(extra="allow")
    study_id: int
    id: int
    project: str
    group: str
    state: str
    objective: str
    workload: dict[str, Any]
    slo: dict[str, Any]
    trials: int
    current: dict[str, Any]
    best: Optional[dict[str, Any]] = None
    no_gain: Optional[str] = Field(None, description="why the winner is not proposed: on the fresh seeds it does not "
                                   "beat the current config by more than the goodput search's precision")
    pareto: list[dict[str, Any]]


class StudyList(Schema):
    project: str
    studies: list[StudyOut]


class TrialOut(Schema):
    number: int
    state: str
    valid: Optional[bool] = None
    params: dict[str, Any]
    goodput: Optional[float] = None
    score: Optional[float] = None
    problems: list[str] = []
    started_at: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    completed_at: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})


class TrialList(Schema):
    study_id: int
    trials: list[TrialOut]


class ProposalOut(Schema):
    model_config = ConfigDict(extra="allow")
    study_id: int
    group: str
    config: dict[str, Any]
    config_version: str


def _study(identity: ApiIdentity, study_id: int) -> TuningStudy:
    study = TuningStudy.objects.select_related("project").filter(
        id=study_id, project_id__in=list(identity.projects)).first()
    if study is None:
        raise ApiError(404, f"no tuning study {study_id} for this token")
    return study


def _operated(request: HttpRequest, study_id: int, what: str) -> tuple[ApiIdentity, TuningStudy]:
    """The token's identity and its study ``study_id``, which it may operate on (``what`` names the act in a 403)."""
    identity = request.auth
    study = _study(identity, study_id)
    require(identity, study.project_id, "operator", what)
    return identity, study


def _iso(value) -> str | None:
    """Optuna keeps naive local times: as UTC ISO 8601."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.astimezone()
    return value.astimezone(dt.timezone.utc).isoformat()


_LINKS = {"GetStudy": {"operationId": "tuning_api_read_study", "parameters": {"study_id": "$response.body#/id"}}}


@router.get("/tuning-studies", response=declared(ok={200: StudyList}), summary="Tuning studies, newest first")
def list_studies(request: HttpRequest, query: Query[StudiesQuery]):
    project = project_object(request.auth, query.project)
    studies = TuningStudy.objects.filter(project=project).select_related("project")
    if query.state:
        studies = studies.filter(state=query.state)
    return {"project": project.name, "studies": [service.summary(s) for s in studies.order_by("-id")[: query.limit]]}


@router.post("/tuning-studies", response=declared(409, 413, ok={201: StudyOut}),
             summary="Start a tuning study of a replica group (operators)",
             openapi_extra={"responses": {201: {"description": "the study, queued", "links": _LINKS}}})
def create_study(request: HttpRequest, body: NewStudy, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "operator", "starting a tuning study")
    try:
        study = service.create_study(
            project, group=body.group, workload=body.workload, objective=body.objective, space=body.space,
            trials=body.trials, slo=body.slo, target=body.target, seed=body.seed, confirm=body.confirm,
            window_hours=float(body.window_hours), created_by=identity.username,
            allow_unreliable=body.allow_unreliable)
    except service.StudyError as exc:
        raise refused(exc) from None
    log.info("tuning study %s of %s/%s started by %s", study.id, project.name, body.group, identity.username)
    return Status(201, service.summary(_study(identity, study.id)))


@router.get("/tuning-studies/{study_id}", response=declared(ok={200: StudyOut}),
            summary="A study: progress and result (explanation, importances, Pareto front, confirmation)")
def read_study(request: HttpRequest, path: Path[StudyPath]):
    return service.summary(_study(request.auth, path.study_id), detail=True)


@router.get("/tuning-studies/{study_id}/trials", response=declared(ok={200: TrialList}),
            summary="The study's trials: parameters, whether vLLM would accept them, goodput")
def list_trials(request: HttpRequest, path: Path[StudyPath]):
    study = _study(request.auth, path.study_id)
    try:
        ostudy = optuna_study(study)
    except KeyError:
        return {"study_id": study.id, "trials": []}
    out = []
    for t in ostudy.get_trials(deepcopy=False):
        out.append({"number": t.number, "state": t.state.name.lower(), "valid": t.user_attrs.get("valid"),
                    "params": t.params, "goodput": t.user_attrs.get("goodput"), "score": t.user_attrs.get("score"),
                    "problems": t.user_attrs.get("problems") or [],
                    "started_at": _iso(t.datetime_start), "completed_at": _iso(t.datetime_complete)})
    return {"study_id": study.id, "trials": out}


@router.post("/tuning-studies/{study_id}/cancel", response=declared(409, ok={202: StudyOut}),
             summary="Ask a study to stop (operators)")
def cancel_study(request: HttpRequest, path: Path[StudyPath]):
    identity, study = _operated(request, path.study_id, "cancelling a tuning study")
    if not service.cancel(study):
        raise ApiError(409, f"study {study.id} has already ended ({study.state})")
    return Status(202, service.summary(_study(identity, study.id)))


@router.post("/tuning-studies/{study_id}/propose", response=declared(409, ok={201: ProposalOut}),
             summary="Propose the study's winner as a rollout of its group (operators)")
def propose(request: HttpRequest, path: Path[StudyPath]):
    identity, study = _operated(request, path.study_id, "proposing a rollout")
    try:
        proposal = service.propose(study, by=identity.username)
    except service.StudyError as exc:
        raise ApiError(409, str(exc)) from None
    return Status(201, proposal)


# ---------------------------------------------------------------------------------------------- engine models
class NewModel(Schema):
    model_config = ConfigDict(extra="forbid")
    group: Text(100, min_length=1) = Field(..., description="the replica group of the managed fleet")
    window_hours: StrictFloat | StrictInt = Field(1, gt=0, le=168, description="the traffic window, ending now")


class ModelsQuery(ProjectQuery):
    group: Optional[Text(100, min_length=1)] = None
    state: Optional[Literal["queued", "fitting", "fitted", "failed", "cancelled"]] = None
    limit: QueryInt(1, 200, "models returned") = 50


class ModelPath(Schema):
    model_id: QueryInt(1, 2**63 - 1, "engine model id")


class ModelOut(Schema):
    model_config = ConfigDict(extra="allow")
    id: int
    group: str
    config_version: str
    state: str
    reason: str
    constants: dict[str, float]
    held_out_error: dict[str, float]
    reliable: bool


class ModelList(Schema):
    project: str
    models: list[ModelOut]


def _model(identity: ApiIdentity, model_id: int) -> EngineModel:
    model = EngineModel.objects.filter(id=model_id, project_id__in=list(identity.projects)).first()
    if model is None:
        raise ApiError(404, f"no engine model {model_id} for this token")
    return model


_MODEL_LINKS = {"GetModel": {"operationId": "tuning_api_read_model", "parameters": {"model_id": "$response.body#/id"}}}


@router.get("/engine-models", response=declared(ok={200: ModelList}),
            summary="Calibrated engine models, newest first")
def list_models(request: HttpRequest, query: Query[ModelsQuery]):
    project = project_object(request.auth, query.project)
    models = EngineModel.objects.filter(project=project)
    if query.group:
        models = models.filter(group=query.group)
    if query.state:
        models = models.filter(state=query.state)
    return {"project": project.name, "models": [calibration.summary(m) for m in models[: query.limit]]}


@router.post("/engine-models", response=declared(409, ok={202: ModelOut}),
             summary="Calibrate a group's engine model from the traffic it served (operators)",
             openapi_extra={"responses": {202: {"description": "the calibration, queued", "links": _MODEL_LINKS}}})
def create_model(request: HttpRequest, body: NewModel, query: Query[ProjectQuery]):
    identity, project = acting_in(request, query.project, "operator", "calibrating an engine model")
    until = dt.datetime.now(dt.timezone.utc)
    try:
        model = calibration.create(project, group=body.group, since=until - dt.timedelta(hours=float(body.window_hours)),
                                   until=until, created_by=identity.username)
    except calibration.CalibrationError as exc:
        raise refused(exc) from None
    log.info("engine model %s of %s/%s queued by %s", model.id, project.name, body.group, identity.username)
    return Status(202, calibration.summary(model))


@router.get("/engine-models/{model_id}", response=declared(ok={200: ModelOut}),
            summary="An engine model: its constants, fit and held-out errors, whether a study trusts it")
def read_model(request: HttpRequest, path: Path[ModelPath]):
    return calibration.summary(_model(request.auth, path.model_id))



@router.post("/engine-models/{model_id}/cancel", response=declared(409, ok={202: ModelOut}),
             summary="Stop a calibration that is queued or fitting (operators)")
def cancel_model(request: HttpRequest, path: Path[ModelPath]):
    identity = request.auth
    model = _model(identity, path.model_id)
    require(identity, model.project_id, "operator", "cancelling a calibration")
    if not calibration.cancel(model):
        raise ApiError(409, f"engine model {model.id} has already ended ({model.state})")
    model.refresh_from_db()
    return Status(202, calibration.summary(model))


class ModelEvaluation(Schema):
    model_config = ConfigDict(extra="forbid")
    since: Optional[Time] = Field(None, description="the window's start; leave it out for window_hours, or for the "
                                  "latest traffic (TUNING_MODEL_LIVE_WINDOW_MINUTES)")
    until: Optional[Time] = Field(None, description="the window's end (default: now)")
    window_hours: Optional[StrictFloat | StrictInt] = Field(None, gt=0, le=168,
                                                            description="the window ending at until, instead of since")
    constants: Literal["model", "published"] = Field(
        "model", description="replay with the model's fitted constants, or with the published ones it started from")


class EvaluationOut(Schema):
    model_config = ConfigDict(extra="allow")
    model_id: int
    group: str
    constants: str
    requests: int
    error: dict[str, float]
    observed: dict[str, float]
    predicted: dict[str, float]
    diagnosis: str


@router.post("/engine-models/{model_id}/evaluate", response=declared(409, ok={200: EvaluationOut}),
             summary="A fitted engine model against a window of its group's traffic (errors, curves, what moved)")
def evaluate_model(request: HttpRequest, path: Path[ModelPath], body: ModelEvaluation):
    model = _model(request.auth, path.model_id)
    try:
        since, until = evaluation.window(since=body.since, until=body.until, hours=body.window_hours,
                                         now=dt.datetime.now(dt.timezone.utc))
        return evaluation.evaluate(model, since=since, until=until, constants=body.constants)
    except evaluation.EvaluationError as exc:
        raise refused(exc) from None
