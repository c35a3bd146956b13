"""A searching study's trials, run by several workers at once on the shared Optuna storage: the study's own
execution and the helper tasks it enqueues (``tuning.trials``). Each worker reserves a slot (a conditional update:
never more valid trials than the budget between them), asks Optuna for a point (refused points are told at once and
take no slot), leases the trial (a row whose heartbeat a thread of the worker keeps going), simulates and tells.
Optuna's heartbeat does not cover ask-and-tell, so a worker that dies leaves its trial RUNNING: once its lease is
stale, ``recover_stale`` fails the trial, enqueues its point again and frees the slot."""
from __future__ import annotations

import datetime as dt
import logging
import uuid

import optuna
from django.db import IntegrityError, transaction
from django.db.models import F, QuerySet
from django.utils import timezone
from jobs import dispatch
from jobs.leases import SHUTTING_DOWN, Heartbeat

from . import search as S
from .models import StudyState, TrialLease, TuningStudy
from .service import cfg, problem_of
from .storage import optuna_study

log = logging.getLogger(__name__)


def parallel_trials() -> int:
    """Workers that run a study's trials at once (the study's own execution included)."""
    return max(1, int(cfg("PARALLEL_TRIALS")))


def enqueue_trials(study_id: int) -> None:
    """One helper worker for the study's trials; the broker away, the study's own execution runs every trial."""
    dispatch.send("tuning.trials", study_id, what="trial worker of tuning study")


def fresh_leases(study: TuningStudy) -> QuerySet:
    """The study's trial leases whose worker still beats."""
    stale = timezone.now() - dt.timedelta(seconds=cfg("STALE_SECONDS"))
    return TrialLease.objects.filter(study_id=study.id, heartbeat_at__gte=stale)


def resync_slots(study: TuningStudy, ostudy) -> None:
    """Slots taken = valid trials done + trials running under a fresh lease (after a crash lost some)."""
    done = len(S.valid_trials(ostudy))
    TuningStudy.objects.filter(id=study.id).update(slots_taken=done + fresh_leases(study).count())


def recover_stale(study: TuningStudy, ostudy, *, unleased: bool = False) -> int:
    """Fail and enqueue again the trials whose worker died; free their slots. Returns how many."""
    stale_at = timezone.now() - dt.timedelta(seconds=cfg("STALE_SECONDS"))
    stale = list(TrialLease.objects.filter(study_id=study.id, heartbeat_at__lt=stale_at))
    ids = {lease.trial_id for lease in stale}
    if unleased:
        leased = set(TrialLease.objects.filter(study_id=study.id).values_list("trial_id", flat=True))
        for trial in ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            started = trial.datetime_start
            if trial._trial_id not in leased and started is not None and \
                    started.timestamp() < stale_at.timestamp():
                ids.add(trial._trial_id)
    if not ids:
        return 0
    retried = S.recover(ostudy, trial_ids=ids)
    TrialLease.objects.filter(id__in=[lease.id for lease in stale]).delete()
    if retried:
        log.warning("tuning study %s: %s trial(s) of a stopped worker failed and enqueued again", study.id, retried)
        TuningStudy.objects.filter(id=study.id).update(retried_trials=F("retried_trials") + retried)
    return retried


def _reserve_slot(study: TuningStudy) -> bool:
    return bool(TuningStudy.objects.filter(
        id=study.id, state=StudyState.SEARCHING, cancel_requested=False, slots_taken__lt=F("trials")).update(
        slots_taken=F("slots_taken") + 1))


def _release_slot(study: TuningStudy) -> None:
    TuningStudy.objects.filter(id=study.id, slots_taken__gt=0).update(slots_taken=F("slots_taken") - 1)


def progress(study: TuningStudy, ostudy) -> None:
    """The study's counts of valid and refused trials and its best score so far, from the Optuna study."""
    valid = S.valid_trials(ostudy)
    invalid = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.user_attrs.get("valid") is False)
    best = max((t.user_attrs["score"] for t in valid), default=None)
    TuningStudy.objects.filter(id=study.id).update(
        trials_done=len(valid), invalid_trials=invalid, best_score=best,
        phase=f"trial {len(valid)}/{study.trials}")


def trial_loop(study: TuningStudy, problem: S.Problem, ostudy, should_stop) -> int:
    """Run valid trials while slots are free: reserve a slot, ask (refused points cost no slot), lease the trial,
    simulate, tell. Returns how many this worker completed."""
    worker = uuid.uuid4().hex
    completed = 0
    # This worker's trial leases (one at a time) stay fresh while it simulates.
    with Heartbeat(TrialLease.objects.filter(worker=worker), f"tuning-trial-{worker[:8]}", cfg("STALE_SECONDS")):
        while not should_stop():
            if not _reserve_slot(study):
                return completed
            best = TuningStudy.objects.filter(id=study.id).values_list("best_score", flat=True).first()

            def lease(trial) -> bool:
                try:
                    with transaction.atomic():
                        TrialLease.objects.create(study_id=study.id, trial_id=trial._trial_id,
                                                  number=trial.number, worker=worker)
                except IntegrityError:
                    return False  # two workers took the same enqueued trial (SQLite cannot lock its row)
                return True

            try:
                outcome = S.run_one(problem, ostudy, best=best, on_start=lease, should_stop=should_stop,
                                    max_invalid=S.MAX_INVALID_PER_TRIAL * study.trials)
            except BaseException:
                _release_slot(study)
                TrialLease.objects.filter(worker=worker).delete()
                raise
            if outcome.result is not None:
                completed += 1
                progress(study, ostudy)  # before the lease goes: the study moves on only when no lease is left
            TrialLease.objects.filter(worker=worker).delete()
            if outcome.result is None:
                _release_slot(study)
                return completed
    return completed


def run_trials(study_id: int) -> int:
    """A helper worker of a searching study: runs its trials while slots are free (Celery task `tuning.trials`)."""
    study = TuningStudy.objects.filter(id=study_id, state=StudyState.SEARCHING).first()
    if study is None or study.workload.get("pending"):
        return 0
    problem = problem_of(study)
    ostudy = optuna_study(study)

    def should_stop() -> bool:
        return SHUTTING_DOWN.is_set() or not TuningStudy.objects.filter(
            id=study_id, state=StudyState.SEARCHING, cancel_requested=False).exists()

    return trial_loop(study, problem, ostudy, should_stop)
