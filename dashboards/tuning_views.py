"""Tuning pages: studies (progress refreshed while they run) and the form that starts one (operators); a study's
result: workload, SLOs, current against best goodput (on fresh seeds), the knob diff and why the winner wins, the
re-scoring that chose the winner, parameter importances, the Pareto front (goodput against p99 TTFT), the
auto_tune.sh-style grid, the confirmation run, and the proposal as a rollout. The form goes through the API's
type (tuning.api.NewStudy) and the service, so it gives the API's messages."""
from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from fleet.state import group_names
from tenancy.models import Project
from tuning import service
from tuning.api import NewStudy
from tuning.models import ACTIVE_STATES, Objective, TuningStudy

from .access import Viewer, form_post, page
from .inputs import form_number, refusal_errors, validate
from .views import polled_page

log = logging.getLogger(__name__)
STUDY_FIELDS = {"group", "workload", "objective", "trials", "slo", "ttft_ms", "tpot_ms", "e2e_ms", "target",
                "window_hours", "confirm", "space"}
WORKLOADS = ("traffic", "synthetic:chat", "synthetic:rag", "synthetic:code")


def _study(viewer: Viewer, study_id: int) -> TuningStudy:
    study = TuningStudy.objects.select_related("project").filter(id=study_id, project_id=viewer.project_id).first()
    if study is None:
        raise Http404("no such tuning study in this project")
    return study


def _page(request: HttpRequest, viewer: Viewer, **extra) -> HttpResponse:
    studies = [service.summary(s) for s in TuningStudy.objects.filter(project_id=viewer.project_id)
               .select_related("project").order_by("-id")[:50]]
    active = any(s["state"] in ACTIVE_STATES for s in studies)
    context = {"studies": studies, "groups": group_names(), "workloads": WORKLOADS, "objectives": Objective.choices,
               "values": {"workload": "traffic", "objective": "goodput", "trials": 60, "confirm": True}, "errors": {}, **extra}
    return polled_page(request, viewer, "tuning", template="dashboards/tuning.html",
                       partial="dashboards/partials/tuning_studies.html", active=active, **context)


@page()
def studies(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    return _page(request, viewer)


@form_post("operator", "starting a tuning study")
def study_create(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    post = request.POST
    values = {k: post.get(k, "").strip() for k in ("group", "workload", "objective", "trials", "ttft_ms",
                                                   "tpot_ms", "e2e_ms", "target", "window_hours")}
    values["confirm"] = post.get("confirm") == "on"
    data: dict = {"group": values["group"], "workload": values["workload"] or "traffic",
                  "objective": values["objective"] or "goodput", "confirm": values["confirm"]}
    trials = values["trials"]
    data["trials"] = int(trials) if trials.isdigit() else (trials or 60)
    slo = {k: form_number(values[k]) for k in ("ttft_ms", "tpot_ms", "e2e_ms") if values[k]}
    if slo:
        data["slo"] = slo
    for key in ("target", "window_hours"):
        if values[key]:
            data[key] = form_number(values[key])
    parsed, errors = validate(NewStudy, data, STUDY_FIELDS)
    if parsed is None:
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            if "slo" in errors and key in slo:
                errors.setdefault(key, errors["slo"])
        return _page(request, viewer, values=values, errors=errors)
    try:
        study = service.create_study(
            Project.objects.get(id=viewer.project_id), group=parsed.group, workload=parsed.workload,
            objective=parsed.objective, trials=parsed.trials, slo=parsed.slo, target=parsed.target,
            confirm=parsed.confirm, window_hours=float(parsed.window_hours), created_by=viewer.identity.username)
    except service.StudyError as exc:
        # the SLO as a whole has no field of its own on the form
        return _page(request, viewer, values=values, errors=refusal_errors(exc, STUDY_FIELDS - {"slo"}))
    log.info("tuning study %s started from the dashboard by %s", study.id, viewer.identity.username)
    return redirect(reverse("tuning-study", args=[study.id]))


def _pareto_svg(points: list[dict], width: int = 640, height: int = 240) -> dict | None:
    """Screen coordinates of the Pareto front (goodput right, p99 TTFT up) for an inline SVG."""
    usable = [p for p in points if p.get("ttft_p99_ms") is not None and p.get("score") is not None]
    if not usable:
        return None
    pad = 44
    xs = [p["score"] for p in usable]
    ys = [p["ttft_p99_ms"] for p in usable]
    x0, x1 = 0.0, max(xs) * 1.1 or 1.0
    y0, y1 = 0.0, max(ys) * 1.1 or 1.0
    out = []
    for p in sorted(usable, key=lambda p: p["score"]):
        out.append({"x": round(pad + (p["score"] - x0) / (x1 - x0) * (width - 2 * pad), 1),
                    "y": round(height - pad - (p["ttft_p99_ms"] - y0) / (y1 - y0) * (height - 2 * pad), 1),
                    "trial": p["trial"], "score": p["score"], "ttft": p["ttft_p99_ms"]})
    return {"width": width, "height": height, "pad": pad, "points": out, "x_max": x1, "y_max": y1,
            "path": " ".join(f"{'M' if i == 0 else 'L'}{q['x']},{q['y']}" for i, q in enumerate(out))}


@page()
def study_detail(request: HttpRequest, viewer: Viewer, study_id: int) -> HttpResponse:
    study = _study(viewer, study_id)
    data = service.summary(study, detail=True)
    active = study.state in ACTIVE_STATES
    return polled_page(request, viewer, "tuning", template="dashboards/tuning_study.html",
                       partial="dashboards/partials/tuning_progress.html", active=active, study=data,
                       pareto_svg=_pareto_svg(data["pareto"]), importances=sorted((data.get("importances") or {}).items(), key=lambda kv: -kv[1]))


def _operate(viewer: Viewer, study_id: int, what: str, act: Callable[[TuningStudy], object]) -> HttpResponse:
    """``act(study)`` by an operator of the study's project, then back to the study's page; a StudyError answers 409
    with its reason."""
    viewer.require("operator", what)
    study = _study(viewer, study_id)
    try:
        act(study)
    except service.StudyError as exc:
        return HttpResponse(str(exc), status=409, content_type="text/plain; charset=utf-8")
    return redirect(reverse("tuning-study", args=[study.id]))


@require_http_methods(["POST"])
@page()
def study_cancel(request: HttpRequest, viewer: Viewer, study_id: int) -> HttpResponse:
    return _operate(viewer, study_id, "cancelling a study", service.cancel)


@require_http_methods(["POST"])
@page()
def study_propose(request: HttpRequest, viewer: Viewer, study_id: int) -> HttpResponse:
    return _operate(viewer, study_id, "proposing a rollout",
                    lambda study: service.propose(study, by=viewer.identity.username))
