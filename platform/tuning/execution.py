"""A tuning study's execution by the worker that claimed it, under the study's lease (a random token every write is
conditional on, kept fresh by a heartbeat thread). Phases, each resumed where it stopped by whoever takes the study
over (the sweep, every 15 s, hands on studies whose heartbeat stopped):

1. ``searching``: Optuna ask-and-tell in the study ``tuning-<id>`` of the platform's database, by this worker and
   the helper workers it enqueues (tuning.trials); trials of workers that died are failed and their points
   enqueued again.
2. ``rescoring``: the top candidates and the current config over the selection seeds, where the winner is chosen;
   then the winner, the current config and the auto_tune.sh-style grid's best on fresh seeds, the figures the study
   reports (``search.settle``).
3. ``confirming``: the winner replayed against the current config on replicas (tuning.confirmation).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

from django.utils import timezone
from jobs import dispatch, leases
from jobs.leases import Lease, LeaseLost

from engine.config import EngineConfig

from . import search as S
from .confirmation import confirm
from .goodput import Slo, goodput
from .models import StudyState, TuningStudy
from .service import STUDIES, StudyError, build_workload, cfg, problem_of
from .storage import optuna_study
from .trials import enqueue_trials, fresh_leases, parallel_trials, progress, recover_stale, resync_slots, trial_loop

log = logging.getLogger(__name__)


def _update(study: TuningStudy, **fields) -> None:
    """A write of the execution holding the lease; LeaseLost when another worker has the study now."""
    leases.leased_update(study, STUDIES.what, **fields)


def execute(study_id: int) -> str | None:
    """Run (or resume) a study to its end; the state it ended in, None when not claimed (or taken over)."""
    study = dispatch.claim(STUDIES, study_id, log)
    if study is None:
        return None
    try:
        with dispatch.lease(STUDIES, study) as lease:
            return _execute(study, lease)
    except LeaseLost:
        log.warning("tuning study %s: lease lost to another worker", study_id)
        return None
    except Exception as exc:  # noqa: BLE001 - a study ends failed, with the reason, rather than hanging
        log.exception("tuning study %s failed", study_id)
        TuningStudy.objects.filter(id=study.id, lease=study.lease).update(
            state=StudyState.FAILED, error=f"{exc.__class__.__name__}: {exc}"[:4000], finished_at=timezone.now())
        return StudyState.FAILED


def _stopped(study: TuningStudy, lease: Lease) -> str | None:
    """Ends the execution when cancelled; leaves the study for the next worker when shutting down."""
    if lease.lost:
        raise LeaseLost(f"tuning study {study.id} was taken over")
    if lease.cancel_asked:
        _update(study, state=StudyState.CANCELLED, finished_at=timezone.now(), phase="cancelled")
        return StudyState.CANCELLED
    return "interrupted"


def _execute(study: TuningStudy, lease: Lease) -> str:
    if study.workload.get("pending"):
        _update(study, phase="reading the workload from the project's traffic")
        try:
            wl = build_workload(study.project, study.group, study.workload["pending"],
                                window_hours=study.workload.get("window_hours", 24.0), seed=study.seed,
                                replica_urls=study.workload.get("replica_urls"))
        except StudyError as exc:
            _update(study, state=StudyState.FAILED, error=str(exc), finished_at=timezone.now(), phase="no workload")
            return StudyState.FAILED
        study.workload = wl.to_dict()
        _update(study, workload=study.workload)
    problem = problem_of(study)
    ostudy = optuna_study(study, create=True)
    state = TuningStudy.objects.get(id=study.id).state
    result = dict(study.result or {})
    if state == StudyState.SEARCHING:
        # Trials of workers that died: those with a stale lease, and (on a resumed study) RUNNING trials older than
        # the stale time that never got a lease (the worker died between asking and leasing).
        recover_stale(study, ostudy, unleased=study.attempts > 1)
        if "current" not in result:
            _update(study, phase="scoring the current config")
            cur = goodput(problem.current, problem.workload, problem.slo, seed=problem.seed, count=problem.count,
                          precision=problem.precision, hardware=problem.hardware)
            result["current"] = {"config": study.current_config, "goodput": cur.goodput,
                                 "score": problem.score(cur, problem.current),
                                 "best_attainment": cur.best_attainment, "at": cur.at.to_dict() if cur.at else None}
            _update(study, result=result)
        S.seed_start(problem, ostudy)
        resync_slots(study, ostudy)
        helpers = max(0, parallel_trials() - 1)
        for _ in range(helpers):
            enqueue_trials(study.id)
        idle_since = None  # since when slots are all taken but no trial is leased (a slot leaked by a dead worker)
        while True:
            trial_loop(study, problem, ostudy, lease.stop_now)
            if lease.stop_now():
                return _stopped(study, lease)
            if len(S.valid_trials(ostudy)) >= study.trials and not fresh_leases(study).exists():
                break
            # Slots are all taken: helpers are running the last trials (or died: their leases go stale; or died
            # between taking a slot and leasing its trial, which leaves a slot without a lease).
            leased = fresh_leases(study).exists()
            idle_since = None if leased else (idle_since or time.monotonic())
            if recover_stale(study, ostudy) or (
                    idle_since is not None and time.monotonic() - idle_since > cfg("STALE_SECONDS")):
                resync_slots(study, ostudy)
                idle_since = None
            _update(study, phase=f"waiting for {fresh_leases(study).count()} trial(s) of other workers")
            time.sleep(0.5)
        progress(study, ostudy)
        _update(study, state=StudyState.RESCORING, phase="re-scoring the best candidates over seeds")
        state = StudyState.RESCORING
    if state == StudyState.RESCORING:
        result.update(_rescore(study, problem, ostudy, result))
        if result.get("infeasible"):
            _update(study, state=StudyState.DONE, result=result, finished_at=timezone.now(),
                    phase="no config meets the SLOs")
            return StudyState.DONE
        if study.confirm:
            _update(study, state=StudyState.CONFIRMING, result=result, phase="confirming on replicas")
            state = StudyState.CONFIRMING
        else:
            _update(study, state=StudyState.DONE, result=result, finished_at=timezone.now(), phase="done")
            return StudyState.DONE
    if state == StudyState.CONFIRMING:
        if not confirm(study, problem, result, lease):
            return _stopped(study, lease)
        _update(study, state=StudyState.DONE, result=result, finished_at=timezone.now(), phase="done")
        return StudyState.DONE
    return state


def _rescore(study: TuningStudy, problem: S.Problem, ostudy, result: dict) -> dict:
    trials = S.valid_trials(ostudy)
    out: dict[str, Any] = {"importances": S.importances(ostudy), "pareto": S.pareto(ostudy, problem)}
    current = result["current"]
    ranked = sorted(trials, key=lambda t: -t.user_attrs["score"])
    seen, candidates = set(), []
    for t in ranked:
        key = repr(sorted(t.params.items()))
        if key in seen:
            continue
        seen.add(key)
        candidates.append({"trial": t.number, "config": t.user_attrs["config"], "score": t.user_attrs["score"],
                           "goodput": t.user_attrs["goodput"], "params": t.params})
        if len(candidates) >= cfg("RESCORE_CANDIDATES"):
            break
    if not candidates or max(c["goodput"] for c in candidates) <= 0:
        best_attainment = max([t.user_attrs.get("best_attainment", 0.0) for t in trials]
                              + [current.get("best_attainment") or 0.0])
        # What the closest config still misses nearly idle: the threshold no batching can buy back.
        closest = max(trials, key=lambda t: t.user_attrs.get("best_attainment", 0.0), default=None)
        config = EngineConfig.from_dict(closest.user_attrs["config"]) if closest else problem.current
        rate, misses = S.idle_misses(problem, config)
        which = f"trial {closest.number}" if closest else "the current config"
        idle = f"; nearly idle ({rate:.3g} req/s) the closest config ({which}) still has {', '.join(misses)}" \
            if misses else ""
        out.update(infeasible=True, best=None, message=(
            f"no configuration meets the SLOs ({_slo_words(problem.slo)}) for {problem.slo.target:.1%} of requests "
            f"at any rate: the best attainment reached was {best_attainment:.1%}{idle}. Relax the thresholds or the "
            "target share, or change hardware/model"))
        return out
    settled = S.settle(problem, candidates, current, seeds=cfg("RESCORE_SEEDS"),
                       grid=S.grid_baseline(problem, study.trials))
    best = settled["best"]
    # On the search's seed, at the current config's goodput there: where its attainment meets the target.
    settled["explanation"] = S.explain(problem, problem.current, EngineConfig.from_dict(best["config"]),
                                       current["goodput"] or problem.workload.rate)
    settled["replicas_for_peak"] = (math.ceil(problem.workload.peak_rate / best["goodput"]) if best["goodput"] > 0
                                    else None)
    out.update(settled)
    return out


def _slo_words(slo: Slo) -> str:
    return ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in slo.thresholds.items())
