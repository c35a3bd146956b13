"""An engine model against any window of its group's traffic, on demand: the window's requests replayed with the
model's constants (or the published ones it started from) and compared with what they were served
(engine/sim/traffic_fit.compare), with the observed and predicted quantiles beside the errors. Nothing is stored.

The window is checked first, each refusal naming what is missing or conflicting (EvaluationError): its ends (at most
7 days apart, as a calibration's), enough requests of the group with the engine's timings, not more than one
synchronous replay should hold, and one config version, the model's (constants fitted under one config say nothing
of another's traffic).
"""
from __future__ import annotations

import datetime as dt
import time
from typing import Any, Literal

from django.conf import settings
from traces.store import get_store

from engine.config import EngineConfig
from engine.sim import traffic_fit as F
from engine.sim.profiles import UnknownProfileError, hardware_profile

from . import calibration, queries
from .models import EngineModel, ModelState

# The most requests one evaluation replays: it runs in the API call (about 0.2 ms a request at light load on the
# CPU build's profile, so ~4 s), and a week of a busy group is millions.
MAX_REQUESTS = 20_000
Constants = Literal["model", "published"]


class EvaluationError(ValueError):
    """An evaluation refused: ``status`` 400 (bad window, too little or too much traffic), 409 (the model is not
    fitted, or the window's traffic ran another config than the model's)."""

    def __init__(self, message: str, *, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field
        self.problems = [message]


def window(*, since: dt.datetime | None, until: dt.datetime | None, hours: float | None,
           now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """[since, until) from what was given: ``since`` (and ``until``, default now), or ``hours`` ending at ``until``
    (default now), or neither: the latest traffic, as the live error reads it (TUNING_MODEL_LIVE_WINDOW_MINUTES)."""
    if since is not None and hours is not None:
        raise EvaluationError("give since (and until) or window_hours, not both", field="window_hours")
    until = until or now
    if since is None:
        length = dt.timedelta(hours=hours) if hours is not None else dt.timedelta(
            minutes=settings.TUNING["MODEL_LIVE_WINDOW_MINUTES"])
        since = until - length
    _check_window(since, until)
    return since, until


def _check_window(since: dt.datetime, until: dt.datetime) -> None:
    if until <= since:
        raise EvaluationError(f"the window must end after it starts (since {since.isoformat()}, until "
                              f"{until.isoformat()})", field="until")
    if until - since > calibration.MAX_WINDOW:
        raise EvaluationError(f"an evaluation window is at most 7 days; this one is {until - since}", field="since")


def _check_traffic(model: EngineModel, since: dt.datetime, until: dt.datetime) -> int:
    """How many of the window's requests the replay will compare; EvaluationError naming what is wrong."""
    served, timed, versions = queries.calibration_facts(get_store(), model.project_id, group=model.group,
                                                        since=since, until=until)
    need = settings.TUNING["MODEL_LIVE_MIN_REQUESTS"]
    if timed < need:
        raise EvaluationError(
            f"too little traffic: {served} engine-served requests of group {model.group!r} in the window, {timed} of "
            f"them with the engine's timings (queue, TTFT and TPOT from an engine span); at least {need} needed",
            field="since")
    if timed > MAX_REQUESTS:
        raise EvaluationError(f"the window holds {timed} requests of group {model.group!r}; an evaluation replays at "
                              f"most {MAX_REQUESTS}: narrow the window", field="since")
    if len(versions) > 1:
        raise EvaluationError(f"the window's traffic ran several configs (versions {', '.join(versions)}): the model "
                              f"is of {model.config_version}; evaluate a window of that config alone", status=409,
                              field="since")
    if versions and versions[0] != model.config_version:
        raise EvaluationError(f"the window's traffic ran config {versions[0]}, the model was fitted under "
                              f"{model.config_version}: evaluate it on traffic of its own config", status=409,
                              field="since")
    return timed


def _quantiles(curves: dict[str, dict[str, list[float]]], side: str) -> dict[str, float]:
    """{"ttft_ms_p50": ms, ...}: the ``side`` ("observed" or "predicted") of each curve at traffic_fit.QUANTILES."""
    out = {}
    for figure, curve in curves.items():
        for q in F.QUANTILES:
            out[f"{figure}_p{q}"] = curve[side][curve["q"].index(q)]
    return out


def evaluate(model: EngineModel, *, since: dt.datetime, until: dt.datetime,
             constants: Constants = "model") -> dict[str, Any]:
    """The model (``constants`` "model": its fitted constants; "published": the profile it started from) against
    its group's traffic in [since, until): errors per figure and quantile ((predicted − observed) / observed, the
    queue's over max(observed, the model's floor)), how many are within the bound, the curves, what moved, and the
    observed and predicted quantiles in ms."""
    if model.state != ModelState.FITTED:
        raise EvaluationError(f"engine model {model.id} is {model.state}: only a fitted model can be evaluated",
                              status=409, field="model_id")
    _check_window(since, until)
    _check_traffic(model, since, until)
    started = time.monotonic()
    rows = [r for r in calibration.observed_rows(model.project_id, model.group, since, until)
            if r.ttft_ms is not None and r.tpot_ms is not None]
    try:
        profile = calibration.profile_of(model) if constants == "model" else hardware_profile(model.base_profile)
        seen = F.compare(EngineConfig.from_dict(model.config), profile, rows, queue_floor_ms=model.queue_floor_ms)
    except (ValueError, UnknownProfileError) as exc:  # a config or profile this simulator refuses (a newer version's)
        raise EvaluationError(f"engine model {model.id} cannot be replayed here: {exc}", status=409,
                              field="model_id") from None
    bound = settings.TUNING["MODEL_ERROR_BOUND"]
    within = sum(1 for value in seen.error.values() if abs(value) <= bound)
    return {
        "model_id": model.id, "group": model.group, "config_version": model.config_version, "constants": constants,
        "profile": {name: getattr(profile, name) for name in sorted(model.constants or {})},
        "window": {"since": since.isoformat(), "until": until.isoformat()},
        "requests": seen.requests, "error": seen.error, "bound": bound,
        "within_bound": {"count": within, "of": len(seen.error)},
        "observed": _quantiles(seen.curves, "observed"), "predicted": _quantiles(seen.curves, "predicted"),
        "curves": seen.curves, "moved": seen.moved, "diagnosis": seen.diagnosis,
        "queue_floor_ms": model.queue_floor_ms, "seconds": round(time.monotonic() - started, 3),
    }
