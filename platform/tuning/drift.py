"""An engine model's drift as an alert: when the newest model of a group misses its latest traffic by more than the
bound (TUNING_MODEL_ERROR_BOUND, on p50 prefill time or TPOT: calibration.LIVE_GATED, the figures a study refuses
the model on), the group's hardware or software no longer behaves as the model says (a driver update, a noisy
neighbour, a degraded GPU). The alert goes through the alerts' lifecycle like
any other (pending for its severity's period, then firing to the project's channels, silences and repeats
included) and resolves when the error is back under the bound, or when a newer model fits the traffic again.

Its diagnosis is known when it is raised: which per-step cost moved at the same batch sizes
(engine/sim/traffic_fit.attribute), the largest first ("decode step time +35 % at the same batch sizes").

One alert per (project, group, severity): the key is the group, whatever model or config version measured it.
"""
from __future__ import annotations

import datetime as dt

from alerts.lifecycle import MODEL_DRIFT_ALERTNAME, AlertSpec, drive
from alerts.model_check_diagnosis import moved_most, suggestion
from alerts.models import AlertKind, AlertTransition
from django.conf import settings
from tenancy.models import Project

from engine.sim import traffic_fit as F

from .models import EngineModel

FIGURE_NAMES = {"prefill_ms_p50": "p50 prefill time", "tpot_ms_p50": "p50 TPOT"}  # calibration.LIVE_GATED


def _severity() -> str:
    return settings.TUNING["MODEL_DRIFT_SEVERITY"]


def drift_spec(model: EngineModel, errors: dict[str, float], moved: dict[str, float], *, bound: float,
               project_name: str) -> AlertSpec:
    """The alert that ``errors`` (the model's live relative errors) and ``moved`` describe for the model's group."""
    gated = {k: errors[k] for k in FIGURE_NAMES if errors.get(k) is not None}
    worst_figure = max(gated, key=lambda k: abs(gated[k])) if gated else None
    worst = gated.get(worst_figure) if worst_figure else None
    cost = moved_most(moved)
    why = F.diagnosis(moved)
    figure = (f"live {FIGURE_NAMES[worst_figure]} {abs(worst):.0%} {'under' if worst < 0 else 'over'} what was "
              f"served (bound {bound:.0%})" if worst_figure else "no live error")
    title = f"Engine model of {model.group} drifts: {figure}"
    summary = (f"The engine model {model.id} of group {model.group} (config {model.config_version}) predicts its "
               f"latest traffic off the bound, {figure}: {why}. Tuning studies on {model.group} refuse this model until it is "
               f"calibrated again.")
    diagnosis = {
        "summary": why, "dominant_component": cost,
        "dominant_reason": f"{F.COSTS[cost]} {moved[cost] * 100:+.0f} % at the same batch sizes" if cost else None,
        "moved": dict(moved or {}), "live_error": dict(errors), "bound": bound, "engine_model": model.id,
        "group": model.group, "config_version": model.config_version,
        "suggestion": suggestion(moved or {}, project=project_name, group=model.group),
    }
    severity = _severity()
    labels = {"alertname": MODEL_DRIFT_ALERTNAME, "project": project_name, "severity": severity,
              "group": model.group, **({"cost": cost} if cost else {})}
    return AlertSpec(
        project_id=model.project_id, project_name=project_name, kind=AlertKind.ENGINE_MODEL_DRIFT, key=model.group,
        severity=severity, labels=labels, annotations={"title": title, "summary": summary},
        values={"live_error": dict(errors), "moved": dict(moved or {}), "engine_model": model.id, "bound": bound},
        context={"kind": AlertKind.ENGINE_MODEL_DRIFT, "group": model.group, "engine_model": model.id,
                 "diagnosis": diagnosis},
        title=title, summary=summary, reason=f"{figure}; {why}"[:300],
        resolved_title=f"Resolved: the engine model of {model.group} fits its traffic again")


def apply(model: EngineModel, errors: dict[str, float], moved: dict[str, float], at: dt.datetime,
          *, drifting: bool) -> list[AlertTransition]:
    """Drive the group's drift alert with this measurement (``drifting``: the live error is above the bound)."""
    project_name = Project.objects.filter(id=model.project_id).values_list("name", flat=True).first() or ""
    spec = drift_spec(model, errors, moved, bound=settings.TUNING["MODEL_ERROR_BOUND"], project_name=project_name)
    return drive(spec, drifting, at)
