"""Engine page: the managed fleet's groups (weights, config versions, models), replicas (state, restarts), the
engine knobs that differ between groups, and small live charts of each replica's vLLM metrics (running and
waiting requests, KV cache usage, speculative decoding acceptance), read from the replicas' own /metrics; and the
project's engine models (tuning.calibration): per group, the newest calibration's constants, its error and a
predicted-vs-observed chart per figure.

The knob values are the fleet's internals: project admins see them (as GET /api/v1/engine's `detail: full`)."""
from __future__ import annotations

import time

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from fleet import replica_metrics
from fleet.state import fleet_state, summary_of
from tuning import calibration

from .access import Viewer, page
from .views import _base


def knob_diff(groups: list[dict]) -> tuple[list[dict], list[dict]]:
    """(knobs whose values differ between the groups, knobs all groups share), each {knob, values by group}."""
    names = [g.get("name") for g in groups]
    configs = [g.get("config") or {} for g in groups]
    knobs = sorted({k for config in configs for k in config})
    differ, same = [], []
    for knob in knobs:
        values = [config.get(knob) for config in configs]
        row = {"knob": knob, "values": [(name, value) for name, value in zip(names, values)]}
        (differ if len({repr(v) for v in values}) > 1 else same).append(row)
    return differ, same


@page()
def engine(request: HttpRequest, viewer: Viewer) -> HttpResponse:
    state = fleet_state()
    fleet = state.get("fleet") or state.get("last_state")
    admin = viewer.can("admin")
    summary = summary_of(fleet)
    differ, same = knob_diff((fleet or {}).get("groups") or []) if admin else ([], [])
    upstreams = {}
    for name, verdict in ((fleet or {}).get("gateway_upstreams") or {}).items() if isinstance(
            (fleet or {}).get("gateway_upstreams"), dict) else []:
        upstreams[name] = verdict
    versions = {g.get("name"): g.get("config_version") for g in (summary or {}).get("groups") or []}
    models = [calibration.page_row(m, versions.get(m.group)) for m in calibration.newest_per_group(viewer.project_id)]
    context = _base(request, viewer, "engine", running=state.get("running", False), summary=summary,
                    error=state.get("error"), differ=differ, same=same, admin=admin, upstreams=upstreams,
                    models=models, model_curves={str(m["id"]): m["curves"] for m in models},
                    min_requests=calibration.cfg("CALIBRATION_MIN_REQUESTS"),
                    periodic=calibration.cfg("CALIBRATION_INTERVAL_SECONDS") > 0,
                    live_min=calibration.cfg("MODEL_LIVE_MIN_REQUESTS"),
                    check_minutes=round(calibration.cfg("CALIBRATION_CHECK_SECONDS") / 60))
    return render(request, "dashboards/engine.html", context)


@page()
def engine_metrics(request: HttpRequest, viewer: Viewer) -> JsonResponse:
    """The replicas' current vLLM figures, for the page's live charts (polled every few seconds)."""
    state = fleet_state()
    replicas = [(r.get("name"), r.get("url")) for r in ((state.get("fleet") or {}).get("replicas") or [])
                if r.get("url") and r.get("state") in ("healthy", "unhealthy", "draining")]
    return JsonResponse({"t": time.time(), "running": bool(state.get("running")),
                         "replicas": replica_metrics.live_figures_of(replicas)})
