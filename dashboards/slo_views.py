"""SLO pages: the list (state, budget remaining, burn rates), one SLO with its burn-rate and budget charts, and the
create/edit form, validated by the API's own types and checks (operators; viewers see no edit controls and get 403
when posting anyway)."""
from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods
from slo import definitions, queries, services
from slo.api import NewSlo, SloReplacement
from slo.models import LATENCY_SLIS, SLO, NoDataPolicy, Sli
from traces.store import get_store

from .access import Viewer, page
from .inputs import problems_by_field, validate
from .views import _base

log = logging.getLogger(__name__)
WINDOWS = {"6h": dt.timedelta(hours=6), "24h": dt.timedelta(hours=24), "7d": dt.timedelta(days=7),
           "30d": dt.timedelta(days=30)}
FILTERS = ("service", "model", "prompt_bucket", "engine_config", "replica_group")
FIELDS = {"name", "description", "sli", "threshold_ms", "threshold", "objective", "period", "min_requests", "min_bad",
          "no_data", "repeat_interval", "enabled", "include_cached", *FILTERS}
SLIS = [str(s) for s in LATENCY_SLIS] + [str(Sli.ERROR_RATIO), str(Sli.ENGINE_MODEL_ERROR)]


def _window_order(window: str) -> dt.timedelta:
    try:
        return definitions.parse_duration(window, "window")
    except ValueError:
        return dt.timedelta.max


def _slo(viewer: Viewer, name: str) -> SLO:
    slo = SLO.objects.filter(project_id=viewer.project_id, name=name).first()
    if slo is None:
        raise Http404("no such SLO in this project")
    return slo


@page()
def slo_list(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    slos = [services.describe(s, viewer.project) for s in SLO.objects.filter(project_id=viewer.project_id)
            .order_by("name")]
    windows = sorted({w for s in slos for w in s["status"]["burn_rates"]}, key=_window_order) \
        if slos else []
    return render(request, "dashboards/slos.html", _base(request, viewer, "slos", slos=slos, windows=windows))


@page()
def slo_detail(request: HttpRequest, viewer: Viewer, name: str) -> HttpResponse:
    slo = _slo(viewer, name)
    body = services.describe(slo, viewer.project)
    label = request.GET.get("window") if request.GET.get("window") in WINDOWS else "24h"
    until = dt.datetime.now(dt.timezone.utc)
    points = queries.status_series(get_store(), viewer.project_id, slo.id, until - WINDOWS[label], until, 10_000)
    windows = sorted({w for p in points for w in p["burn_rates"]} | set(body["status"]["burn_rates"]),
                     key=_window_order)
    series = {
        "t": [int(dt.datetime.fromisoformat(p["at"].replace("Z", "+00:00")).timestamp()) for p in points],
        "windows": windows,
        "burn": [[p["burn_rates"].get(w) for p in points] for w in windows],
        "budget": [p["budget_remaining"] for p in points],
        "thresholds": sorted({t["factor"] for t in body["tiers"]}, reverse=True),
        "since": int((until - WINDOWS[label]).timestamp()), "until": int(until.timestamp()),
    }
    return render(request, "dashboards/slo.html", _base(request, viewer, "slos", slo=body, series=series,
                                                        window=label, windows=list(WINDOWS), state_points=len(points)))


def _form_data(post) -> dict:
    """The posted fields in the API's JSON shape (numbers as numbers where they read as numbers)."""
    data: dict = {}
    for field in ("name", "description", "sli", "period", "no_data", "repeat_interval"):
        value = post.get(field, "")
        if value != "" or field == "description":
            data[field] = value
    objective = post.get("objective", "").strip()
    if objective:
        try:
            data["objective"] = float(objective)
        except ValueError:
            data["objective"] = objective
    for field, kind in (("threshold_ms", float), ("threshold", float), ("min_requests", int), ("min_bad", int)):
        value = post.get(field, "").strip()
        if value:
            try:
                data[field] = kind(value)
            except ValueError:
                data[field] = value
    filters = {}
    for field in FILTERS:
        values = [v.strip() for v in post.get(field, "").split(",") if v.strip()]
        if values:
            filters[field] = values if len(values) > 1 else values[0]
    if filters:
        data["filters"] = filters
    data["enabled"] = post.get("enabled") == "on"
    data["include_cached"] = post.get("include_cached") == "on"
    # Each SLI reads its own threshold field (the form shows both): the other one is not sent.
    if data.get("sli") != Sli.ENGINE_MODEL_ERROR:
        data.pop("threshold", None)
    if data.get("sli") not in LATENCY_SLIS:
        data.pop("threshold_ms", None)
    return data


def _initial(body: dict | None) -> dict:
    if body is None:
        return {"sli": "ttft_ms", "objective": "99%", "period": "30d", "no_data": "ok", "repeat_interval": "4h",
                "min_requests": 20, "min_bad": 3, "enabled": True, "include_cached": False}
    values = {k: body.get(k) for k in ("name", "description", "sli", "threshold_ms", "threshold", "period", "no_data",
                                       "repeat_interval", "min_requests", "min_bad", "enabled", "include_cached")}
    values["objective"] = body["objective_percent"]
    for field in FILTERS:
        values[field] = ", ".join(body["filters"].get(field, []))
    return values


@require_http_methods(["GET", "POST"])
@page()
def slo_form(request: HttpRequest, viewer: Viewer, name: str | None = None) -> HttpResponse:
    existing = _slo(viewer, name) if name else None
    viewer.require("operator", "editing SLOs")
    errors: dict[str, list[str]] = {}
    values = _initial(services.describe(existing, viewer.project) if existing else None)
    status = 200
    if request.method == "POST":
        data = _form_data(request.POST)
        values = {**{k: request.POST.get(k, "") for k in FIELDS}, "enabled": data["enabled"],
                  "include_cached": data["include_cached"]}
        if existing is not None:
            data.pop("name", None)
        parsed, errors = validate(SloReplacement if existing else NewSlo, data, FIELDS)
        if not errors:
            definition = parsed.definition()
            try:
                with transaction.atomic():
                    if existing is None:
                        slo = services.create(viewer.project_id, definition)
                    else:
                        definition.setdefault("name", existing.name)
                        slo, _ = services.replace(existing, definition)
            except definitions.DefinitionError as exc:
                errors = problems_by_field(exc.problems, FIELDS)
            except services.SloExists as exc:
                errors = {"name": [str(exc)]}
            else:
                log.info("SLO %s/%s %s by %s in the dashboard", viewer.project, slo.name,
                         "created" if existing is None else "replaced", viewer.identity.username)
                return redirect(reverse("slo", args=[slo.name]))
        status = 400
    context = _base(request, viewer, "slos", values=values, errors=errors, existing=existing, slis=SLIS,
                    no_data_choices=list(NoDataPolicy.values), prompt_buckets=definitions.PROMPT_BUCKETS)
    return render(request, "dashboards/slo_form.html", context, status=status)


@require_http_methods(["POST"])
@page()
def slo_delete(request: HttpRequest, viewer: Viewer, name: str) -> HttpResponse:
    slo = _slo(viewer, name)
    viewer.require("operator", "deleting SLOs")
    slo.delete()
    log.info("SLO %s/%s deleted by %s in the dashboard", viewer.project, name, viewer.identity.username)
    return redirect(reverse("slos"))
