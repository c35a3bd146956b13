"""Rollout pages: the rollouts of the project (state refreshed while one runs) and the form that starts one
(admins); a rollout: its steps, the canary's current analysis drawn as both sides' latency distributions per
metric, every verdict with its values, the audit of its transitions, and the controls (operators pause; admins
resume, approve, promote, abort, retry). The form goes through the API's type (rollouts.api.NewRollout) and the
service, so it gives the API's messages."""
from __future__ import annotations

import logging

import yaml
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from fleet.state import group_names
from rollouts import controls, service
from rollouts.api import NewRollout
from rollouts.models import ACTIVE_STATES, Rollout, RolloutAnalysis
from rollouts.plan import METRIC_LABELS
from rollouts.transitions import Conflict
from tenancy.models import Project
from tuning.models import StudyState, TuningStudy

from .access import Viewer, form_post, page
from .inputs import refusal_errors, validate
from .views import polled_page

log = logging.getLogger(__name__)
FIELDS = {"group", "config", "from_study", "plan"}
CONTROLS = {
    "pause": ("operator", controls.manual_pause),
    "resume": ("admin", controls.resume),
    "approve": ("admin", controls.approve),
    "promote": ("admin", controls.promote_now),
    "abort": ("admin", controls.abort),
    "retry": ("admin", controls.retry),
}


def _rollout(viewer: Viewer, rollout_id: int) -> Rollout:
    rollout = Rollout.objects.select_related("project").filter(id=rollout_id, project_id=viewer.project_id).first()
    if rollout is None:
        raise Http404("no such rollout in this project")
    return rollout


def _proposals(viewer: Viewer) -> list[dict]:
    return [{"id": s.id, "group": s.group, "version": (s.proposal or {}).get("config_version")}
            for s in TuningStudy.objects.filter(project_id=viewer.project_id, state=StudyState.DONE,
                                                proposal__isnull=False).order_by("-id")[:20]]


def _page(request: HttpRequest, viewer: Viewer, **extra) -> HttpResponse:
    rollouts = [service.summary(r) for r in Rollout.objects.filter(project_id=viewer.project_id)
                .select_related("project").order_by("-id")[:50]]
    active = any(r["state"] in ACTIVE_STATES for r in rollouts)
    context = {"rollouts": rollouts, "groups": group_names(), "proposals": _proposals(viewer), "values": {},
               "errors": {}, **extra}
    return polled_page(request, viewer, "rollouts", template="dashboards/rollouts.html",
                       partial="dashboards/partials/rollout_list.html", active=active, reload_when_done=False,
                       **context)


@page()
def rollouts(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    # "Start its rollout" from a tuning study's page comes with the study and its group chosen.
    values = {k: request.GET.get(k, "")[:100] for k in ("from_study", "group") if request.GET.get(k)}
    return _page(request, viewer, values=values)


def _yaml(text: str, field: str, errors: dict) -> object:
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        errors[field] = [f"not YAML or JSON: {str(exc).splitlines()[0]}"]
        return None
    if not isinstance(value, dict):
        errors[field] = ["a mapping (knob: value, ...)" if field == "config" else "a mapping (steps, analysis)"]
        return None
    return value


@form_post("admin", "starting a rollout")
def rollout_create(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    post = request.POST
    values = {k: post.get(k, "").strip() for k in ("group", "config", "from_study", "plan")}
    errors: dict[str, list[str]] = {}
    data: dict = {"group": values["group"]}
    config = _yaml(values["config"], "config", errors)
    if config is not None:
        data["config"] = config
    if values["from_study"]:
        data["from_study"] = int(values["from_study"]) if values["from_study"].isdigit() else values["from_study"]
    plan = _yaml(values["plan"], "plan", errors)
    if plan is not None:
        data["plan"] = plan
    if errors:
        return _page(request, viewer, values=values, errors=errors)
    parsed, errors = validate(NewRollout, data, FIELDS)
    if parsed is None:
        return _page(request, viewer, values=values, errors=errors)
    try:
        rollout = service.create_rollout(Project.objects.get(id=viewer.project_id), group=parsed.group,
                                         config=parsed.config, from_study=parsed.from_study, plan=parsed.plan,
                                         created_by=viewer.identity.username, source="dashboard")
    except service.RolloutError as exc:
        return _page(request, viewer, values=values, errors=refusal_errors(exc, FIELDS))
    log.info("rollout %s started from the dashboard by %s", rollout.id, viewer.identity.username)
    return redirect(reverse("rollout", args=[rollout.id]))


def distribution_svg(metric: dict, width: int = 300, height: int = 150) -> dict | None:
    """Both sides' quantile curves of one metric (percentile right, milliseconds up) for an inline SVG."""
    q = metric.get("quantiles") or {}
    base, can = q.get("baseline") or [], q.get("canary") or []
    values = [v for v in base + can if v is not None]
    if not values:
        return None
    pad_l, pad_r, pad_t, pad_b = 40, 8, 10, 22
    top = max(values) * 1.1 or 1.0
    xs = q.get("q") or []

    def path(series):
        points = [(pad_l + x * (width - pad_l - pad_r), height - pad_b - (v / top) * (height - pad_t - pad_b))
                  for x, v in zip(xs, series) if v is not None]
        return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(points))

    return {"width": width, "height": height, "pad_l": pad_l, "pad_b": pad_b, "top": top,
            "baseline": path(base), "canary": path(can), "label": METRIC_LABELS.get(metric["metric"], metric["metric"]),
            "x_end": width - pad_r, "y_axis": height - pad_b}


def _latest_analysis(rollout: Rollout) -> RolloutAnalysis | None:
    return rollout.analyses.order_by("-at", "-id").first()


@page()
def rollout_detail(request: HttpRequest, viewer: Viewer, rollout_id: int) -> HttpResponse:
    rollout = _rollout(viewer, rollout_id)
    data = service.summary(rollout, detail=True)
    latest = _latest_analysis(rollout)
    charts = []
    if latest is not None:
        for metric in latest.figures.get("metrics", []):
            svg = distribution_svg(metric)
            if svg:
                charts.append({"metric": metric, "svg": svg})
    return polled_page(request, viewer, "rollouts", template="dashboards/rollout.html",
                       partial="dashboards/partials/rollout_progress.html", active=rollout.state in ACTIVE_STATES,
                       reload_when_done=False, rollout=data, latest=latest, charts=charts,
                       loop=rollout.loops.values("id", "state").first(),
                       analyses=list(rollout.analyses.order_by("-at", "-id")[:30]))


@require_http_methods(["POST"])
@page()
def rollout_control(request: HttpRequest, viewer: Viewer, rollout_id: int, action: str) -> HttpResponse:
    if action not in CONTROLS:
        raise Http404("no such control")
    role, do = CONTROLS[action]
    viewer.require(role, action)
    rollout = _rollout(viewer, rollout_id)
    try:
        do(rollout, f"user:{viewer.identity.username}")
    except (service.RolloutError, Conflict) as exc:
        return HttpResponse(str(exc), status=409, content_type="text/plain; charset=utf-8")
    log.info("rollout %s: %s from the dashboard by %s", rollout.id, action, viewer.identity.username)
    return redirect(reverse("rollout", args=[rollout.id]))
