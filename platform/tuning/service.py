"""Tuning studies: their creation (every input checked: the group in the fleet, the space, the SLOs, the
workload), cancel, proposal and what the API shows of them, and the app's kind of job. A study runs in Celery (queue
``tuning``, task ``tuning.execute``; tuning.execution) under the study's lease; the sweep enqueues queued studies
nobody took and resumes studies whose worker stopped beating.

    queued ──claim──► searching ──► rescoring ──► confirming ──► done (proposable unless nothing beat the current)
       │                  └──────────┴──── cancel ────┴──► cancelled; an error ─► failed (its reason kept)
       └─ cancel ─► cancelled
"""
from __future__ import annotations

import datetime as dt
import functools
import math
from typing import Any

from django.conf import settings
from django.utils import timezone
from fleet.state import FleetUnavailable, UnknownGroup, fleet_group
from jobs import dispatch
from jobs.dispatch import JobKind
from regressions.datasets import resolve_version
from slo.models import SLO
from traces.store import get_store

from engine.config import ConfigError, EngineConfig
from engine.tokens import count_tokens

from . import calibration
from . import search as S
from .goodput import THRESHOLD_METRICS, Slo
from .models import ACTIVE_STATES, Objective, StudyState, TuningStudy
from .space import SpaceError, parse_space
from .storage import optuna_study
from .workload import SYNTHETIC, Workload, WorkloadError, from_pairs, from_traffic, prefix_hit_rate_of, synthetic

DEFAULT_SLO = {"ttft_ms": 500.0, "tpot_ms": 50.0}
DEFAULT_TARGET = 0.95


class StudyError(ValueError):
    def __init__(self, message: str, *, field: str | None = None, problems: list[str] | None = None,
                 status: int = 400):
        super().__init__(message)
        self.field = field
        self.problems = problems or [message]
        self.status = status


def cfg(name: str) -> Any:
    return settings.TUNING[name]


STUDIES = JobKind(model=TuningStudy, what="tuning study", task="tuning.execute", queued=StudyState.QUEUED,
                  started=StudyState.SEARCHING,
                  running=(StudyState.SEARCHING, StudyState.RESCORING, StudyState.CONFIRMING),
                  cancelled=StudyState.CANCELLED, active=ACTIVE_STATES, stale_seconds=lambda: cfg("STALE_SECONDS"),
                  queued_grace_seconds=lambda: cfg("QUEUED_GRACE_SECONDS"))


# ---------------------------------------------------------------------------------------------- inputs
def group_config(group: str) -> tuple[EngineConfig, list[str]]:
    """The group's engine config as the managed fleet runs it (the fleet file when no controller answers),
    and its replicas' URLs."""
    try:
        entry, _groups, live = fleet_group(group)
    except (UnknownGroup, FleetUnavailable) as exc:
        raise StudyError(str(exc), field="group") from None
    urls = [url for url in entry.get("upstreams") or [] if isinstance(url, str)] if live else []
    return EngineConfig.from_dict(entry.get("config") or {}), urls


def group_backend(group: str) -> dict:
    """{"backend", "served_model_name"?} of the group in the fleet (simulator when it cannot be told)."""
    try:
        entry, _groups, _live = fleet_group(group)
    except (UnknownGroup, FleetUnavailable):
        entry = None
    out = {"backend": (entry or {}).get("backend") or "simulator"}
    if entry and entry.get("served_model_name"):
        out["served_model_name"] = entry["served_model_name"]
    return out


def project_slo(project, group: str, overrides: dict | None = None, target: float | None = None) -> Slo:
    """Latency thresholds of the project's enabled SLOs that apply to ``group``; the target share is the
    strictest objective. Overrides (``{"ttft_ms": 300}``) win; with neither, DEFAULT_SLO and a note."""
    thresholds: dict[str, float] = {}
    names, objectives = [], []
    for slo in SLO.objects.filter(project=project, enabled=True, sli__in=THRESHOLD_METRICS):
        group_filter = (slo.filters or {}).get("replica_group")
        if group_filter and group_filter != group:
            continue
        if slo.threshold_ms is None:
            continue
        thresholds[slo.sli] = min(thresholds.get(slo.sli, math.inf), float(slo.threshold_ms))
        names.append(slo.name)
        objectives.append(slo.objective)
    source = "SLOs " + ", ".join(sorted(names)) if names else ""
    for key, value in (overrides or {}).items():
        if key not in THRESHOLD_METRICS:
            raise StudyError(f"unknown SLO threshold {key!r} (use {', '.join(THRESHOLD_METRICS)})", field="slo")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise StudyError(f"SLO threshold {key} must be a positive number of milliseconds, not {value!r}",
                             field="slo")
        thresholds[key] = float(value)
        source = (source + "; " if source else "") + f"{key} ≤ {value:g} ms given"
    if not thresholds:
        thresholds = dict(DEFAULT_SLO)
        source = "no latency SLO for this group: default TTFT ≤ 500 ms, TPOT ≤ 50 ms"
    share = target if target is not None else (max(objectives) if objectives else DEFAULT_TARGET)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.5 <= share < 1:
        raise StudyError(f"the SLO target share must be in [0.5, 1), not {share!r}", field="slo")
    return Slo(thresholds=thresholds, target=float(share), source=source)


def build_workload(project, group: str, spec: str, *, window_hours: float = 24.0, seed: int = 0,
                   replica_urls: list[str] | None = None) -> Workload:
    spec = (spec or "traffic").strip()
    if spec == "traffic":
        until = timezone.now()
        since = until - dt.timedelta(hours=window_hours)
        # The replicas' own counters only when no request of the window reported cached prompt tokens.
        replicas = functools.partial(prefix_hit_rate_of, replica_urls) if replica_urls else None
        try:
            return from_traffic(get_store(), project.id, group=group, since=since, until=until, seed=seed,
                                replica_hit_rate=replicas)
        except WorkloadError as exc:
            raise StudyError(str(exc), field="workload") from None
    if spec.startswith("synthetic:"):
        kind = spec.split(":", 1)[1]
        if kind not in SYNTHETIC:
            raise StudyError(f"unknown synthetic workload {kind!r}: use synthetic:chat, synthetic:rag or "
                             "synthetic:code", field="workload")
        return synthetic(kind, seed=seed)
    if spec.startswith("dataset:"):
        name = spec.split(":", 1)[1]
        try:
            version = resolve_version(project, name)
        except LookupError as exc:
            raise StudyError(str(exc), field="workload") from None
        pairs = []
        for item in version.items.all():
            text = item.prompt or " ".join(m.get("content", "") for m in (item.messages or []))
            output = (item.params or {}).get("max_tokens") or 128
            pairs.append((max(1, count_tokens(text)), int(output)))
        try:
            return from_pairs(f"dataset:{name}", pairs, rate=1.0, seed=seed,
                              notes=[f"dataset {name} v{version.number}: its prompts' lengths and max_tokens, "
                                     "Poisson arrivals"])
        except WorkloadError as exc:
            raise StudyError(str(exc), field="workload") from None
    raise StudyError(f"unknown workload {spec!r}: use traffic, dataset:NAME or synthetic:chat|rag|code",
                     field="workload")


def problem_of(study: TuningStudy) -> S.Problem:
    """What the study's trials score: its current config, space, workload, SLO and objective, simulated with the
    group's calibrated engine model when the study took one."""
    current = EngineConfig.from_dict(study.current_config)
    hardware = calibration.profile_of(study.engine_model) if study.engine_model_id else None
    return S.Problem(current=current, space=parse_space(study.space, current), workload=Workload.from_dict(
        study.workload), slo=Slo(**study.slo), objective=study.objective, seed=study.seed,
        count=cfg("SIM_REQUESTS"), hardware=hardware)


def engine_model_for(project, group: str, current: EngineConfig, allow_unreliable: bool):
    """(the group's newest calibrated model of its current config or None, whether it is used although its
    held-out error, or its error on the latest traffic, is above the bound). StudyError 409 with the figures when
    it is and that was not asked for."""
    model = calibration.newest(project, group, current.version)
    reason = calibration.unfit_reason(model) if model is not None else None
    if reason is None:
        return model, False
    if not allow_unreliable:
        raise StudyError(
            f"the group's engine model {model.id} does not fit its traffic: {reason}; calibrate it again, or start "
            "the study with allow_unreliable to run it marked unreliable", field="engine_model", status=409)
    return model, True


def create_study(project, *, group: str, workload: str = "traffic", objective: str = "goodput",
                 space: Any = None, trials: int = 60, slo: dict | None = None, target: float | None = None,
                 seed: int = 0, confirm: bool = True, window_hours: float = 24.0, created_by: str = "",
                 enqueue: bool = True, read_traces: bool = True, allow_unreliable: bool = False) -> TuningStudy:
    """A new queued study, every input checked (raises StudyError naming the problem). ``read_traces=False``
    (a command in embedded mode, where only the platform process opens the trace store) leaves a traffic
    workload to the worker, which fails the study with the same message when the window has no traffic."""
    if objective not in Objective.values:
        raise StudyError(f"unknown objective {objective!r} (use {', '.join(Objective.values)})", field="objective")
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= cfg("MAX_TRIALS"):
        raise StudyError(f"trials must be an integer in 1..{cfg('MAX_TRIALS')}, not {trials!r}", field="trials")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise StudyError("seed must be an integer in 0..2³¹−1", field="seed")
    if not isinstance(window_hours, (int, float)) or not 0 < window_hours <= 24 * 31:
        raise StudyError("window_hours must be in (0, 744]", field="window_hours")
    current, urls = group_config(group)
    engine_model, unreliable = engine_model_for(project, group, current, allow_unreliable)
    try:
        parsed = parse_space(space, current, per_gpu=objective == Objective.GOODPUT_PER_GPU)
    except SpaceError as exc:
        raise StudyError("; ".join(exc.problems), field="space", problems=exc.problems) from None
    slo_spec = project_slo(project, group, slo, target)
    if (workload or "traffic").strip() == "traffic" and not read_traces:
        workload_data = {"pending": "traffic", "window_hours": window_hours, "replica_urls": urls}
    else:
        workload_data = build_workload(project, group, workload, window_hours=window_hours, seed=seed,
                                       replica_urls=urls).to_dict()
    study = TuningStudy.objects.create(
        project=project, group=group, objective=objective, current_config=current.to_dict(),
        workload=workload_data, slo=slo_spec.to_dict(), space=parsed.to_dict(), trials=trials, seed=seed,
        confirm=confirm, created_by=created_by, engine_model=engine_model, unreliable_model=unreliable)
    optuna_study(study, create=True)
    if enqueue:
        dispatch.enqueue(STUDIES, study.id)  # the broker away: the sweep starts queued studies too
    return study


def cancel(study: TuningStudy) -> bool:
    """Ask a study to stop; a queued study is cancelled at once. False when it has already ended."""
    return dispatch.cancel(STUDIES, study)


def sweep() -> int:
    """Start queued studies nobody took and resume studies whose worker stopped beating; the number enqueued."""
    return dispatch.sweep(STUDIES)


# ---------------------------------------------------------------------------------------------- proposal, reads
def propose(study: TuningStudy, by: str = "") -> dict:
    """Hand the winner to a rollout: the proposal (config, group, predicted and confirmed gains) is kept on the
    study for the rollout to take."""
    if study.state != StudyState.DONE:
        raise StudyError(f"study {study.id} is {study.state}: only a finished study can be proposed",
                         field="state")
    best = (study.result or {}).get("best")
    if not best or best.get("is_current"):
        raise StudyError("the study found nothing better than the current config: nothing to propose",
                         field="best")
    if study.result.get("no_gain"):
        raise StudyError(f"{study.result['no_gain']}: nothing to propose", field="best")
    try:
        config = EngineConfig.from_dict(best["config"])
    except ConfigError as exc:
        raise StudyError(f"the best config is no longer valid: {exc}") from None
    proposal = {"study_id": study.id, "group": study.group, "config": config.to_dict(),
                "config_version": config.version,
                "from_version": EngineConfig.from_dict(study.current_config).version,
                "diff": {k: {"current": v[1], "proposed": v[0]} for k, v in config.diff(
                    EngineConfig.from_dict(study.current_config)).items()},
                "predicted_gain": study.result.get("predicted_gain"),
                "confirmed_goodput": study.result.get("confirmed_goodput"),
                "proposed_by": by, "proposed_at": timezone.now().isoformat()}
    TuningStudy.objects.filter(id=study.id).update(proposal=proposal)
    return proposal


def _model_summary(study: TuningStudy) -> dict[str, Any]:
    if not study.engine_model_id:
        return {"id": None, "source": "published constants (no calibrated model of the group's current config)",
                "unreliable": False}
    model = study.engine_model
    return {"id": model.id, "source": "calibrated from the group's traffic", "constants": model.constants,
            "window": {"since": model.window_start.isoformat(), "until": model.window_end.isoformat()},
            "held_out_error": model.held_out_error, "unreliable": study.unreliable_model}


def summary(study: TuningStudy, *, detail: bool = False) -> dict:
    """The study as the API and `manage.py tune --json` show it (goodput in requests/s)."""
    result = study.result or {}
    current = result.get("current") or {}
    best = result.get("best") or {}
    fresh = result.get("current_fresh") or {}
    workload = dict(study.workload)
    workload.pop("samples", None)
    workload.pop("sample_buckets", None)
    out = {
        "study_id": study.id, "id": study.id, "project": study.project.name, "group": study.group,
        "state": study.state, "phase": study.phase, "objective": study.objective, "workload": workload,
        "slo": study.slo, "space": study.space, "trials_budget": study.trials,
        "trials": study.trials_done, "invalid_trials": study.invalid_trials,
        "retried_trials": study.retried_trials, "attempts": study.attempts,
        # goodput: on the fresh seeds once the study has re-scored (until then, and when no config meets the
        # SLOs, the search's figure); search_goodput: on the search's seed (docs/tuning.md, the API's figures).
        "current": {"config": study.current_config, "goodput": fresh.get("goodput", current.get("goodput")),
                    "search_goodput": current.get("goodput"), "robust_goodput": fresh.get("robust_goodput"),
                    "robust_score": fresh.get("robust_score"), "seed_goodputs": fresh.get("seed_goodputs")},
        "best": ({"config": best.get("config"), "goodput": best.get("goodput"),
                  "robust_score": best.get("robust_score"), "robust_goodput": best.get("robust_goodput"),
                  "search_goodput": best.get("search_goodput"), "selection_score": best.get("selection_score"),
                  "seed_goodputs": best.get("seed_goodputs"), "is_current": bool(best.get("is_current")),
                  "confirmed_goodput": result.get("confirmed_goodput")}
                 if best else None),
        "predicted_gain": result.get("predicted_gain"), "no_gain": result.get("no_gain"),
        "seeds": result.get("seeds"), "figures": result.get("figures"),
        "pareto": result.get("pareto", []),
        "message": result.get("message"), "error": study.error or None,
        "confirmation_run_id": study.confirmation_run_id, "proposal": study.proposal,
        "created_at": study.created_at.isoformat(), "created_by": study.created_by,
        "started_at": study.started_at.isoformat() if study.started_at else None,
        "finished_at": study.finished_at.isoformat() if study.finished_at else None,
        "simulated": True,
        # The constants the trials simulated with: the group's calibrated model (its window and held-out error), or
        # the published profile when the group has none for its current config.
        "engine_model": _model_summary(study),
    }
    if detail:
        out.update({k: result.get(k) for k in ("explanation", "importances", "candidates", "grid_baseline",
                                               "confirmation", "replicas_for_peak")})
    return out
