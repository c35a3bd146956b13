"""Engine models: a replica group's simulator constants calibrated from the traffic it served
(engine/sim/traffic_fit.py), versioned per config, and the bound a tuning study holds them to.

    queued ──claim──► fitting ──► fitted (a model: constants, fit and held-out errors)
       │                 └──────► failed (the reason: the traffic could not be fitted, or the fit did not converge)
       └─ cancel ─► cancelled

A calibration is checked before it is queued (``create``): the group in the fleet, enough engine-served requests
with the engine's timings in the window, one config version across it (a change inside the window is a 409, since
constants fitted across two configs belong to neither). Nothing is stored for a refused one. In embedded mode a
command cannot read the trace store (only the platform process opens chdb): it queues the calibration unchecked
and the worker fails it with the same message.

A model's lineage is the config version it was fitted under: ``newest`` returns the group's newest fitted model of
the version the group runs now, so a config change starts afresh and the published constants are the fallback
until a model of the new version exists.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Any

from django.conf import settings
from django.utils import timezone
from fleet.state import FleetUnavailable, UnknownGroup, fleet_group
from jobs import dispatch, leases
from jobs.dispatch import JobKind
from jobs.leases import LeaseLost
from tenancy.models import Project
from traces.store import get_store

from engine.config import ConfigError, EngineConfig
from engine.sim import traffic_fit as F
from engine.sim.profiles import HardwareProfile, UnknownProfileError, hardware_profile

from . import checks, drift, queries
from .models import MODEL_ACTIVE_STATES, EngineModel, ModelState


def cfg(name: str) -> Any:
    return settings.TUNING[name]


log = logging.getLogger(__name__)

MODELS = JobKind(model=EngineModel, what="engine model", task="tuning.calibrate", queued=ModelState.QUEUED,
                 started=ModelState.FITTING, running=(ModelState.FITTING,), cancelled=ModelState.CANCELLED,
                 active=MODEL_ACTIVE_STATES, stale_seconds=lambda: cfg("STALE_SECONDS"),
                 queued_grace_seconds=lambda: cfg("QUEUED_GRACE_SECONDS"))
GATED = ("ttft_ms_p50", "tpot_ms_p50")  # the held-out figures a study's bound is on
# The latest traffic's figures the same bound is on: the prefill time (the engine's TTFT less its queue) in TTFT's
# place. A page comes with traffic the group cannot keep up with; there the queue grows by the minute, a few per
# cent of capacity either way moves the median TTFT several-fold, and the TTFT would judge the queue's growth, not
# the model's costs (traffic_fit.prefill_error).
LIVE_GATED = ("prefill_ms_p50", "tpot_ms_p50")
MAX_WINDOW = dt.timedelta(days=7)


class CalibrationError(ValueError):
    """A calibration refused: ``status`` 400 (bad input, too little traffic), 404 (no such group), 409 (the window
    holds a config change, or the group runs another config than its traffic did)."""

    def __init__(self, message: str, *, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field
        self.problems = [message]


def group_entry(group: str) -> EngineConfig:
    """The group's engine config as the fleet runs it; CalibrationError 404 when the fleet has no such group."""
    try:
        entry, _groups, _live = fleet_group(group)
    except UnknownGroup as exc:
        raise CalibrationError(str(exc), status=404, field="group") from None
    except FleetUnavailable as exc:
        raise CalibrationError(str(exc), status=409, field="group") from None
    try:
        return EngineConfig.from_dict(entry.get("config") or {})
    except ConfigError as exc:
        raise CalibrationError(f"the group's engine config is invalid: {'; '.join(exc.problems)}",
                               field="group") from None


def _window(since: dt.datetime, until: dt.datetime) -> None:
    if until <= since:
        raise CalibrationError("the window must end after it starts", field="since")
    if until - since > MAX_WINDOW:
        raise CalibrationError("a calibration window is at most 7 days", field="since")


def check_traffic(project, group: str, config: EngineConfig, since: dt.datetime, until: dt.datetime) -> str:
    """The config version the window's traffic ran; CalibrationError naming what is missing or conflicting."""
    served, timed, versions = queries.calibration_facts(get_store(), project.id, group=group, since=since,
                                                        until=until)
    need = cfg("CALIBRATION_MIN_REQUESTS")
    if served < need:
        raise CalibrationError(f"too little traffic: {served} engine-served requests of group {group!r} in the "
                               f"window, at least {need} needed", field="since")
    if timed < need:
        raise CalibrationError(
            f"only {timed} of {served} requests of group {group!r} carry the engine's timings (queue, TTFT and TPOT "
            f"from an engine span; rows from client or gateway spans alone cannot be replayed): at least {need} "
            "needed", field="group")
    if len(versions) > 1:
        raise CalibrationError(f"the group's config changed inside the window (versions {', '.join(versions)}): "
                               "calibrate from after the change", status=409, field="since")
    if versions and versions[0] != config.version:
        raise CalibrationError(f"the window's traffic ran config {versions[0]}, the group now runs {config.version}: "
                               "calibrate from traffic of the current config", status=409, field="since")
    return versions[0] if versions else config.version


def create(project, *, group: str, since: dt.datetime, until: dt.datetime | None = None, created_by: str = "",
           read_traces: bool = True, enqueue: bool = True) -> EngineModel:
    """A queued calibration of ``group`` over [since, until), every input checked first (CalibrationError)."""
    until = until or timezone.now()
    _window(since, until)
    config = group_entry(group)
    try:
        hardware_profile(config.gpu_type)
    except UnknownProfileError as exc:
        raise CalibrationError(str(exc), field="group") from None
    version = check_traffic(project, group, config, since, until) if read_traces else config.version
    model = EngineModel.objects.create(project=project, group=group, config_version=version,
                                       config=config.to_dict(), window_start=since, window_end=until,
                                       created_by=created_by)
    if enqueue:
        dispatch.enqueue(MODELS, model.id)  # the broker away: the sweep starts it
    return model


def cancel(model: EngineModel) -> bool:
    return dispatch.cancel(MODELS, model)


def sweep() -> int:
    return dispatch.sweep(MODELS)


def observed_rows(project_id: int, group: str, since: dt.datetime, until: dt.datetime) -> list[F.Observed]:
    """The group's requests in the window as the fit reads them (engine timings in ms; cached tokens 0 when not
    reported)."""
    rows = queries.calibration_rows(get_store(), project_id, group=group, since=since, until=until)
    return [F.Observed(start, int(prompt), int(output), int(cached or 0), ttft_ms=ttft, tpot_ms=tpot, queue_ms=queue)
            for start, prompt, output, cached, ttft, tpot, queue in rows]


def execute(model_id: int) -> str | None:
    """Fit one queued calibration; the state it ended in, None when another worker has it."""
    model = dispatch.claim(MODELS, model_id, log)
    if model is None:
        return None
    try:
        with dispatch.lease(MODELS, model):
            return _execute(model)
    except LeaseLost:
        log.warning("engine model %s: lease lost to another worker", model_id)
        return None
    except Exception as exc:  # noqa: BLE001 - a calibration ends failed, with the reason, rather than hanging
        log.exception("engine model %s failed", model_id)
        EngineModel.objects.filter(id=model.id, lease=model.lease).update(
            state=ModelState.FAILED, reason=f"{exc.__class__.__name__}: {exc}"[:4000], finished_at=timezone.now())
        return ModelState.FAILED


def _fail(model: EngineModel, reason: str) -> str:
    leases.leased_update(model, MODELS.what, state=ModelState.FAILED, reason=reason[:4000],
                         finished_at=timezone.now())
    return ModelState.FAILED


def _execute(model: EngineModel) -> str:
    config = EngineConfig.from_dict(model.config)
    try:
        check_traffic(model.project, model.group, config, model.window_start, model.window_end)
    except CalibrationError as exc:
        return _fail(model, str(exc))
    rows = observed_rows(model.project_id, model.group, model.window_start, model.window_end)
    try:
        fit = F.fit(config, rows, min_requests=cfg("CALIBRATION_MIN_REQUESTS"))
    except F.FitError as exc:
        return _fail(model, str(exc))
    if not math.isfinite(fit.cost) or not fit.held_out_error:
        return _fail(model, f"the fit did not converge (objective {fit.cost}, no held-out figure)")
    if EngineModel.objects.filter(id=model.id, cancel_requested=True).exists():
        # Cancelled while it was fitting: the fit is dropped, not stored as a model a study would use.
        leases.leased_update(model, MODELS.what, state=ModelState.CANCELLED, finished_at=timezone.now())
        return ModelState.CANCELLED
    log.info("engine model %s: group %s fitted in %.1f s, held-out %s", model.id, model.group, fit.seconds,
             fit.held_out_error)
    leases.leased_update(
        model, MODELS.what, state=ModelState.FITTED, base_profile=fit.base_profile, constants=fit.constants,
        start_constants=fit.start_constants, fit_error=fit.fit_error, held_out_error=fit.held_out_error,
        held_out_curves=fit.held_out_curves,
        fit_requests=fit.fit_requests, held_out_requests=fit.held_out_requests, queue_floor_ms=fit.queue_floor_ms,
        fit_seconds=fit.seconds, finished_at=timezone.now())
    return ModelState.FITTED


# ---------------------------------------------------------------------------------------------- use
def worst_of(errors: dict[str, float] | None, figures: tuple[str, ...] = GATED) -> float | None:
    """The largest |error| of ``figures`` (p50 TTFT and TPOT: the held-out figures a study's bound is on); None
    when none was measured."""
    values = [abs(errors[k]) for k in figures if k in (errors or {})]
    return max(values) if values else None


def live_worst(errors: dict[str, float] | None) -> float | None:
    """The larger |error| of p50 prefill time and TPOT on the latest traffic (LIVE_GATED); None when neither."""
    return worst_of(errors, LIVE_GATED)


def held_out_worst(model: EngineModel) -> float | None:
    return worst_of(model.held_out_error)


def unfit_reason(model: EngineModel) -> str | None:
    """Why a study must not trust the model, with the figures: its held-out error (p50 TTFT, TPOT) above the bound,
    or its error on the group's latest traffic (p50 prefill time, TPOT) above it (it drifted since the fit: what
    moved is named); None when it fits."""
    bound = cfg("MODEL_ERROR_BOUND")
    for label, errors, gated in (("held-out error", model.held_out_error, GATED),
                                 ("error on the latest traffic", model.live_error, LIVE_GATED)):
        worst = worst_of(errors, gated)
        if worst is None and label == "held-out error":
            return "no held-out error was measured"
        if worst is not None and worst > bound:
            figures = ", ".join(f"{name} {errors[name]:+.0%}" for name in gated if name in errors)
            why = f": {F.diagnosis(model.live_moved)}" if errors is model.live_error and model.live_moved else ""
            return f"{label} {figures} (worst {worst:.0%}, the bound is {bound:.0%}){why}"
    return None


def reliable(model: EngineModel) -> bool:
    """The model fits: its held-out error, and its error on the latest traffic where measured, within the bound."""
    return unfit_reason(model) is None


def newest(project, group: str, config_version: str) -> EngineModel | None:
    """The group's newest fitted model of this config version (its lineage); None: the published constants."""
    return EngineModel.objects.filter(project=project, group=group, config_version=config_version,
                                      state=ModelState.FITTED).order_by("-created_at", "-id").first()


def profile_of(model: EngineModel) -> HardwareProfile:
    return hardware_profile(model.base_profile).with_constants(**model.constants)


def summary(model: EngineModel) -> dict[str, Any]:
    worst = held_out_worst(model) if model.state == ModelState.FITTED else None
    return {
        "id": model.id, "group": model.group, "config_version": model.config_version, "state": model.state,
        "reason": model.reason, "window": {"since": model.window_start.isoformat(),
                                          "until": model.window_end.isoformat()},
        "base_profile": model.base_profile, "constants": model.constants, "published": model.start_constants,
        "fit_error": model.fit_error, "held_out_error": model.held_out_error, "fit_requests": model.fit_requests,
        "held_out_requests": model.held_out_requests, "fit_seconds": model.fit_seconds,
        "held_out_worst": worst, "error_bound": cfg("MODEL_ERROR_BOUND"),
        "reliable": model.state == ModelState.FITTED and reliable(model),
        "held_out_curves": model.held_out_curves,
        "live": {"error": model.live_error, "requests": model.live_requests,
                 "at": model.live_at.isoformat() if model.live_at else None, "curves": model.live_curves,
                 "moved": model.live_moved, "diagnosis": F.diagnosis(model.live_moved) if model.live_moved else None},
        "created_by": model.created_by, "created_at": model.created_at.isoformat(),
        "finished_at": model.finished_at.isoformat() if model.finished_at else None,
    }


def calibrate_groups(now: dt.datetime | None = None) -> int:
    """The periodic calibration: every (project, group) with enough engine-served traffic in the last window and
    no model newer than the interval gets one queued. The number queued."""
    interval = cfg("CALIBRATION_INTERVAL_SECONDS")
    if interval <= 0:
        return 0
    now = now or timezone.now()
    since = now - dt.timedelta(hours=cfg("CALIBRATION_WINDOW_HOURS"))
    queued = 0
    for project in Project.objects.all():
        for group in queries.groups_with_traffic(get_store(), project.id, since=since, until=now,
                                                 at_least=cfg("CALIBRATION_MIN_REQUESTS")):
            recent = EngineModel.objects.filter(project=project, group=group,
                                                created_at__gt=now - dt.timedelta(seconds=interval)).exists()
            if recent:
                continue
            try:
                create(project, group=group, since=since, until=now, created_by="schedule")
            except CalibrationError as exc:
                log.info("engine model of %s/%s not calibrated: %s", project.name, group, exc)
                continue
            queued += 1
    return queued


def newest_models() -> list[EngineModel]:
    """Each (project, group, config version)'s newest fitted model: the ones whose error on live traffic is kept."""
    seen, out = set(), []
    for model in EngineModel.objects.filter(state=ModelState.FITTED).order_by("-created_at", "-id"):
        key = (model.project_id, model.group, model.config_version)
        if key not in seen:
            seen.add(key)
            out.append(model)
    return out


def newest_per_group(project_id: int) -> list[EngineModel]:
    """The project's newest fitted model of each group (whatever its config version), by group name."""
    out: dict[str, EngineModel] = {}
    for model in EngineModel.objects.filter(project_id=project_id, state=ModelState.FITTED).order_by(
            "group", "-created_at", "-id"):
        out.setdefault(model.group, model)
    return list(out.values())


FIGURE_LABELS = {"ttft_ms": "TTFT (engine core)", "tpot_ms": "TPOT", "queue_ms": "Queue time"}


def page_row(model: EngineModel, current_version: str | None) -> dict[str, Any]:
    """One model as the engine page shows it: its errors, its constants against the published ones, the curves
    (the latest traffic's when measured, else the held-out slice's) and what moved."""
    live = bool(model.live_curves)
    worst = held_out_worst(model)
    return {
        "id": model.id, "group": model.group, "config_version": model.config_version,
        "current": current_version is None or current_version == model.config_version,
        "window_start": model.window_start, "window_end": model.window_end, "created_by": model.created_by,
        "constants": [{"name": name, "value": value, "published": (model.start_constants or {}).get(name),
                       "change": value / model.start_constants[name] - 1
                       if (model.start_constants or {}).get(name) else None}
                      for name, value in sorted((model.constants or {}).items())],
        "held_out_worst": worst, "reliable": reliable(model), "bound": cfg("MODEL_ERROR_BOUND"),
        "live_error": {k: model.live_error.get(k) for k in LIVE_GATED} if model.live_error else None,
        "live_requests": model.live_requests, "live_at": model.live_at,
        "diagnosis": F.diagnosis(model.live_moved) if model.live_moved else None,
        "curves_from": "latest traffic" if live else "held-out slice",
        "figures": [(figure, FIGURE_LABELS[figure]) for figure in F.FIGURES
                    if figure in (model.live_curves if live else model.held_out_curves or {})],
        "curves": model.live_curves if live else (model.held_out_curves or {}),
    }


def refresh_live_error(model: EngineModel, now: dt.datetime | None = None) -> bool:
    """The model's error on its group's latest traffic (the last TUNING_MODEL_LIVE_WINDOW_MINUTES, replayed with
    the model's constants), kept on the model; False (nothing written) when that traffic is too little, or ran
    another config than the model's."""
    now = now or timezone.now()
    since = now - dt.timedelta(minutes=cfg("MODEL_LIVE_WINDOW_MINUTES"))
    served, timed, versions = queries.calibration_facts(get_store(), model.project_id, group=model.group,
                                                        since=since, until=now)
    if timed < cfg("MODEL_LIVE_MIN_REQUESTS") or versions not in ([model.config_version], []):
        return False
    rows = [r for r in observed_rows(model.project_id, model.group, since, now)
            if r.ttft_ms is not None and r.tpot_ms is not None]
    seen = F.compare(EngineConfig.from_dict(model.config), profile_of(model), rows,
                     queue_floor_ms=model.queue_floor_ms)
    errors = {**seen.error, **seen.prefill}
    EngineModel.objects.filter(id=model.id).update(live_error=errors, live_curves=seen.curves,
                                                   live_moved=seen.moved, live_requests=len(rows), live_at=now)
    worst = live_worst(errors)
    checks.record(model, errors, worst, seen.moved, len(rows), now)  # an event of the SLI engine_model_error
    drifting = worst is not None and worst > cfg("MODEL_ERROR_BOUND")
    if drifting:
        log.warning("engine model %s of %s/%s drifts: live error %.0f %% (bound %.0f %%): %s", model.id,
                    model.project_id, model.group, worst * 100, cfg("MODEL_ERROR_BOUND") * 100, seen.diagnosis)
    drift.apply(model, errors, seen.moved, now, drifting=drifting)
    return True


def refresh_live_errors(now: dt.datetime | None = None) -> int:
    """refresh_live_error for every newest model; how many were refreshed."""
    done = 0
    for model in newest_models():
        try:
            done += refresh_live_error(model, now)
        except Exception:  # noqa: BLE001 - one group's trouble (a config the simulator refuses) spares the others
            log.exception("engine model %s: live error not measured", model.id)
    return done
