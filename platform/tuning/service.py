"""Tuning studies: create (checked), execute under a lease, resume after a crash, confirm, propose.

A study runs in Celery (queue ``tuning``) as one execution holding the study's lease (a
random token every write is conditional on, kept fresh by a heartbeat thread). Phases:

1. ``searching``: Optuna ask-and-tell (``search.search``) in the study ``tuning-<id>`` of the
   platform's database. A worker that dies leaves its trial RUNNING; whoever resumes the
   study (the sweep, every 15 s, takes studies whose heartbeat stopped) fails it and
   enqueues its point again (``search.recover``).
2. ``rescoring``: the top candidates and the current config over several seeds.
3. ``confirming``: a paired regression run of the winner against the current config, both
   started for the run on the group's backend (``target_config``/``baseline_config``: real-time
   simulated replicas, or real `vllm serve` processes replayed in turn for a real-vLLM group), on
   items with the workload's lengths at the winner's predicted goodput (capped by
   ``CONFIRM_MAX_RATE``); SLO attainment is measured per arm from the decomposed rows. Where the
   winner misses the SLOs there, it alone is replayed at lower rates (``CONFIRM_RATE_STEPS``) until
   it meets them: the confirmed goodput is the highest rate at which it did.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
import uuid
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone
from observatory import leases
from observatory.leases import SHUTTING_DOWN, LeaseLost

from engine.config import ConfigError, EngineConfig

from . import search as S
from .goodput import THRESHOLD_METRICS, Slo, goodput
from .models import ACTIVE_STATES, Objective, StudyState, TrialLease, TuningStudy
from .space import SpaceError, parse_space
from .workload import SYNTHETIC, Workload, WorkloadError, from_pairs, from_traffic, prefix_hit_rate_of, synthetic

log = logging.getLogger(__name__)

DEFAULT_SLO = {"ttft_ms": 500.0, "tpot_ms": 50.0}
DEFAULT_TARGET = 0.95


class StudyError(ValueError):
    def __init__(self, message: str, *, field: str | None = None, problems: list[str] | None = None):
        super().__init__(message)
        self.field = field
        self.problems = problems or [message]


def cfg(name: str) -> Any:
    return settings.TUNING[name]


# ---------------------------------------------------------------------------------------------- Optuna storage
_storages: dict[str, Any] = {}
_storage_lock = threading.Lock()


def storage_url() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = quote(db.get("USER") or "", safe="")
    password = quote(db.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = db.get("HOST") or "localhost"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"postgresql+psycopg://{auth}{host}{port}/{quote(db['NAME'], safe='')}"


def storage():
    """Optuna's RDB storage in the platform's database (one engine per process)."""
    import optuna

    url = storage_url()
    with _storage_lock:
        if url not in _storages:
            kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
            _storages[url] = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        return _storages[url]


def optuna_study(study: TuningStudy, *, create: bool = False):
    import optuna

    if create:
        return optuna.create_study(study_name=study.optuna_name, storage=storage(),
                                   directions=S.directions(study.objective),
                                   sampler=S.sampler(study.objective, study.seed), load_if_exists=True)
    return optuna.load_study(study_name=study.optuna_name, storage=storage(),
                             sampler=S.sampler(study.objective, study.seed))


# ---------------------------------------------------------------------------------------------- inputs
def _fleet_group(group: str) -> tuple[dict | None, bool, list[dict]]:
    """(the group's entry or None, whether a controller answered, every group) from the managed fleet; raises
    FleetUnavailable when the fleet file cannot be read."""
    from observatory.engine_link import fleet_groups

    groups, live = fleet_groups()
    entry = next((g for g in groups if g.get("name") == group and not g.get("dynamic")), None)
    return entry, live, groups


def group_config(group: str) -> tuple[EngineConfig, list[str]]:
    """The group's engine config as the managed fleet runs it (the fleet file when no controller answers),
    and its replicas' URLs."""
    from observatory.engine_link import FleetUnavailable

    try:
        entry, live, groups = _fleet_group(group)
    except FleetUnavailable as exc:
        raise StudyError(str(exc), field="group") from None
    if entry is None:
        names = ", ".join(g.get("name", "?") for g in groups if not g.get("dynamic"))
        raise StudyError(f"the fleet has no replica group {group!r} (groups: {names or 'none'})", field="group")
    urls = [url for url in entry.get("upstreams") or [] if isinstance(url, str)] if live else []
    return EngineConfig.from_dict(entry.get("config") or {}), urls


def group_backend(group: str) -> dict:
    """{"backend", "served_model_name"?} of the group in the fleet (simulator when it cannot be told)."""
    from observatory.engine_link import FleetUnavailable

    try:
        entry, _live, _groups = _fleet_group(group)
    except FleetUnavailable:
        entry = None
    out = {"backend": (entry or {}).get("backend") or "simulator"}
    if entry and entry.get("served_model_name"):
        out["served_model_name"] = entry["served_model_name"]
    return out


def project_slo(project, group: str, overrides: dict | None = None, target: float | None = None) -> Slo:
    """Latency thresholds of the project's enabled SLOs that apply to ``group``; the target share is the
    strictest objective. Overrides (``{"ttft_ms": 300}``) win; with neither, DEFAULT_SLO and a note."""
    from slo.models import SLO

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
        from traces.store import get_store

        until = timezone.now()
        since = until - dt.timedelta(hours=window_hours)
        hit = prefix_hit_rate_of(replica_urls or []) if replica_urls else None
        try:
            return from_traffic(get_store(), project.id, group=group, since=since, until=until, seed=seed,
                                prefix_hit_rate=hit)
        except WorkloadError as exc:
            raise StudyError(str(exc), field="workload") from None
    if spec.startswith("synthetic:"):
        kind = spec.split(":", 1)[1]
        if kind not in SYNTHETIC:
            raise StudyError(f"unknown synthetic workload {kind!r}: use synthetic:chat, synthetic:rag or "
                             "synthetic:code", field="workload")
        return synthetic(kind, seed=seed)
    if spec.startswith("dataset:"):
        from regressions.datasets import resolve_version

        from engine.tokens import count_tokens

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


def create_study(project, *, group: str, workload: str = "traffic", objective: str = "goodput",
                 space: Any = None, trials: int = 60, slo: dict | None = None, target: float | None = None,
                 seed: int = 0, confirm: bool = True, window_hours: float = 24.0, created_by: str = "",
                 enqueue: bool = True, read_traces: bool = True) -> TuningStudy:
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
        confirm=confirm, created_by=created_by)
    optuna_study(study, create=True)
    if enqueue:
        enqueue_study(study.id)
    return study


def enqueue_study(study_id: int) -> None:
    from .tasks import execute

    try:
        execute.delay(study_id)
    except Exception:  # broker away: the sweep starts queued studies too
        log.warning("could not enqueue tuning study %s; the sweep will start it", study_id, exc_info=True)


def cancel(study: TuningStudy) -> bool:
    now = timezone.now()
    if TuningStudy.objects.filter(id=study.id, state=StudyState.QUEUED).update(
            state=StudyState.CANCELLED, finished_at=now, cancel_requested=True):
        return True
    return bool(TuningStudy.objects.filter(id=study.id, state__in=ACTIVE_STATES).update(cancel_requested=True))


# ---------------------------------------------------------------------------------------------- execution
def claim(study_id: int) -> TuningStudy | None:
    return leases.claim(TuningStudy, study_id, queued=StudyState.QUEUED, started=StudyState.SEARCHING,
                        running=(StudyState.SEARCHING, StudyState.RESCORING, StudyState.CONFIRMING),
                        stale_seconds=cfg("STALE_SECONDS"))


def Lease(study: TuningStudy) -> leases.Lease:  # noqa: N802 (used as the class it returns)
    return leases.Lease(study, "tuning study", cfg("STALE_SECONDS"))


def _update(study: TuningStudy, **fields) -> None:
    leases.leased_update(study, "tuning study", **fields)


def problem_of(study: TuningStudy) -> S.Problem:
    current = EngineConfig.from_dict(study.current_config)
    return S.Problem(current=current, space=parse_space(study.space, current), workload=Workload.from_dict(
        study.workload), slo=Slo(**study.slo), objective=study.objective, seed=study.seed,
        count=cfg("SIM_REQUESTS"))


def execute(study_id: int) -> str | None:
    study = claim(study_id)
    if study is None:
        return None
    log.info("tuning study %s: %s (attempt %s)", study.id, "resuming" if study.attempts > 1 else "starting",
             study.attempts)
    try:
        with Lease(study) as lease:
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
                          precision=problem.precision)
            result["current"] = {"config": study.current_config, "goodput": cur.goodput,
                                 "score": problem.score(cur, problem.current),
                                 "best_attainment": cur.best_attainment, "at": cur.at.to_dict() if cur.at else None}
            _update(study, result=result)
        S.seed_start(problem, ostudy)
        _resync_slots(study, ostudy)
        helpers = max(0, parallel_trials() - 1)
        for _ in range(helpers):
            enqueue_trials(study.id)
        idle_since = None  # since when slots are all taken but no trial is leased (a slot leaked by a dead worker)
        while True:
            trial_loop(study, problem, ostudy, lease.stop_now)
            if lease.stop_now():
                return _stopped(study, lease)
            if len(S.valid_trials(ostudy)) >= study.trials and not _fresh_leases(study).exists():
                break
            # Slots are all taken: helpers are running the last trials (or died: their leases go stale; or died
            # between taking a slot and leasing its trial, which leaves a slot without a lease).
            leased = _fresh_leases(study).exists()
            idle_since = None if leased else (idle_since or time.monotonic())
            if recover_stale(study, ostudy) or (
                    idle_since is not None and time.monotonic() - idle_since > cfg("STALE_SECONDS")):
                _resync_slots(study, ostudy)
                idle_since = None
            _update(study, phase=f"waiting for {_fresh_leases(study).count()} trial(s) of other workers")
            time.sleep(0.5)
        _progress(study, ostudy)
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
        outcome = _confirm(study, problem, result, lease)
        if outcome is not None:
            return outcome
        _update(study, state=StudyState.DONE, result=result, finished_at=timezone.now(), phase="done")
        return StudyState.DONE
    return state


# ---------------------------------------------------------------------------------------------- parallel trials
def parallel_trials() -> int:
    """Workers that run a study's trials at once (the study's own execution included)."""
    return max(1, int(cfg("PARALLEL_TRIALS")))


def enqueue_trials(study_id: int) -> None:
    from .tasks import trials

    try:
        trials.delay(study_id)
    except Exception:  # broker away: the study's own execution runs every trial then
        log.warning("could not enqueue a trial worker for tuning study %s", study_id, exc_info=True)


def _fresh_leases(study: TuningStudy):
    stale = timezone.now() - dt.timedelta(seconds=cfg("STALE_SECONDS"))
    return TrialLease.objects.filter(study_id=study.id, heartbeat_at__gte=stale)


def _resync_slots(study: TuningStudy, ostudy) -> None:
    """Slots taken = valid trials done + trials running under a fresh lease (after a crash lost some)."""
    done = len(S.valid_trials(ostudy))
    TuningStudy.objects.filter(id=study.id).update(slots_taken=done + _fresh_leases(study).count())


def recover_stale(study: TuningStudy, ostudy, *, unleased: bool = False) -> int:
    """Fail and enqueue again the trials whose worker died; free their slots. Returns how many."""
    import optuna

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


def _progress(study: TuningStudy, ostudy) -> None:
    valid = S.valid_trials(ostudy)
    invalid = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.user_attrs.get("valid") is False)
    best = max((t.user_attrs["score"] for t in valid), default=None)
    TuningStudy.objects.filter(id=study.id).update(
        trials_done=len(valid), invalid_trials=invalid, best_score=best,
        phase=f"trial {len(valid)}/{study.trials}")


class _TrialBeat:
    """Keeps this worker's trial leases fresh from a thread of its own while it simulates."""

    def __init__(self, worker: str):
        self.worker = worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"tuning-trial-{worker[:8]}", daemon=True)

    def __enter__(self) -> _TrialBeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _keep(self) -> None:
        from django.db import connection

        try:
            while not self._stop.wait(max(0.2, cfg("STALE_SECONDS") / 4.0)):
                TrialLease.objects.filter(worker=self.worker).update(heartbeat_at=timezone.now())
        finally:
            connection.close()


def trial_loop(study: TuningStudy, problem: S.Problem, ostudy, should_stop) -> int:
    """Run valid trials while slots are free: reserve a slot, ask (refused points cost no slot), lease the trial,
    simulate, tell. Returns how many this worker completed."""
    worker = uuid.uuid4().hex
    completed = 0
    with _TrialBeat(worker):
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
                _progress(study, ostudy)  # before the lease goes: the study moves on only when no lease is left
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
    rescored = S.robust(problem, candidates + [{"trial": None, "config": current["config"],
                                                "score": current["score"], "goodput": current["goodput"],
                                                "params": {}, "is_current": True}], seeds=cfg("RESCORE_SEEDS"))
    current_r = next(c for c in rescored if c.get("is_current"))
    winner = S.choose([c for c in rescored if not c.get("is_current")])
    if winner["robust_score"] <= current_r["robust_score"]:
        winner = current_r
    winner_config = EngineConfig.from_dict(winner["config"])
    explanation = S.explain(problem, problem.current, winner_config, current["goodput"] or problem.workload.rate)
    out.update(
        candidates=[{k: v for k, v in c.items() if k != "config"} | {"config": c["config"]} for c in rescored],
        best={"config": winner["config"], "goodput": winner["goodput"], "score": winner["score"],
              "robust_score": winner["robust_score"], "trial": winner.get("trial"),
              "is_current": bool(winner.get("is_current"))},
        current_robust_score=current_r["robust_score"],
        predicted_gain=(winner["robust_score"] / current_r["robust_score"]
                        if current_r["robust_score"] > 0 else None),
        explanation=explanation,
        grid_baseline=S.grid_against(S.grid_baseline(problem, study.trials), winner["score"],
                                     max(c["score"] for c in candidates),
                                     "req/s per GPU" if problem.objective == "goodput_per_gpu" else "req/s",
                                     problem.precision),
        replicas_for_peak=(math.ceil(problem.workload.peak_rate / winner["goodput"]) if winner["goodput"] > 0
                           else None),
    )
    return out


def _slo_words(slo: Slo) -> str:
    return ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in slo.thresholds.items())


def local_tokenizer(model: str):
    """The model's own tokenizer when it is a local directory with a tokenizer.json (a tiny model, a mounted
    checkpoint), else None."""
    from pathlib import Path

    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # a file it cannot read: fall back to the estimate
        log.warning("cannot read the tokenizer of %s; prompts are sized by the estimate", model, exc_info=True)
        return None


def prompt_text(tokens: int, rng, tokenizer=None) -> str:
    """Synthetic text of about ``tokens`` prompt tokens: by the platform's estimate, or, given the model's own
    tokenizer (a real vLLM counts with it), shrunk until that tokenizer counts no more than asked (a prompt
    longer than planned would push prompt + output past max_model_len and vLLM would refuse it)."""
    from engine.tokens import synthetic_text

    words = tokens
    text = synthetic_text(words, rng)
    if tokenizer is None:
        return text
    for _ in range(8):
        counted = len(tokenizer.encode(text, add_special_tokens=False).ids)
        if counted <= tokens or words <= 1:
            break
        words = max(1, min(words - 1, int(words * tokens / counted)))
        text = synthetic_text(words, rng)
    return text


def confirmation_rates(predicted: float) -> list[float]:
    """The rates the confirmation replays the winner at, in turn, until it meets the SLOs: ``CONFIRM_RATE_STEPS``
    times its predicted goodput (by default 1, 0.8, 0.6), each capped at ``CONFIRM_MAX_RATE``; a rate no lower
    than the one before is dropped."""
    rates: list[float] = []
    for factor in cfg("CONFIRM_RATE_STEPS"):
        rate = round(min(max(predicted * factor, 0.1), cfg("CONFIRM_MAX_RATE")), 4)
        if not rates or rate < rates[-1]:
            rates.append(rate)
    return rates


def _confirm(study: TuningStudy, problem: S.Problem, result: dict, lease: Lease) -> str | None:
    """Replay winner and current as a paired regression run and measure both: on real-time simulated replicas, or
    on real `vllm serve` processes when the study's group runs real vLLM. Where the winner misses the SLOs at its
    predicted goodput, it alone is replayed again at the lower rates of ``confirmation_rates`` until it meets them
    (or none is left): the confirmed goodput is the highest rate at which it did. Each finished step is kept in
    the result, so a resumed study goes on with the next one."""
    from regressions.models import RegressionRun, RunState

    best = result.get("best") or {}
    if best.get("is_current"):
        result["confirmation"] = {"skipped": "the current config is the best found: nothing to confirm"}
        return None
    rates = confirmation_rates(best["goodput"])
    confirmation = result.setdefault("confirmation", {})
    steps = confirmation.setdefault("steps", [])
    while True:
        run_id = TuningStudy.objects.filter(id=study.id).values_list("confirmation_run_id", flat=True).first()
        if run_id is None or (steps and steps[-1]["run_id"] == run_id):  # this step's run is not started yet
            if steps and (steps[-1]["attainment"] is None or steps[-1]["met"] or len(steps) >= len(rates)):
                break
            run_id = _start_confirmation_run(study, problem, result, best, rates[len(steps)], paired=not steps)
            if run_id is None:
                break
        while True:
            run = RegressionRun.objects.get(id=run_id)
            if run.state in (RunState.DONE, RunState.ERROR, RunState.CANCELLED):
                break
            if lease.stop_now():
                return _stopped(study, lease)
            time.sleep(1.0)
        figures = confirmation_figures(run, problem, run.options["rate"])
        if not steps:  # the paired run's figures are the confirmation's own
            confirmation.update(figures)
        attainment = figures["best"]
        steps.append({"run_id": run.id, "rate": figures["rate"], "state": run.state, "attainment": attainment,
                      "predicted_attainment": figures["predicted_attainment"].get("best"),
                      "requests": figures["measured"]["best"]["requests"],
                      "met": attainment is not None and attainment >= problem.slo.target})
        _update(study, result=result, phase=f"confirming on replicas: {len(steps)} of at most {len(rates)} rates")
    met = [step["rate"] for step in steps if step["met"]]
    confirmation["confirmed_goodput"] = max(met) if met else None
    if met and best.get("goodput"):
        confirmation["confirmed_share"] = round(max(met) / best["goodput"], 4)  # of the predicted goodput
    if study.objective != Objective.PARETO and confirmation.get("best") is not None:
        result["confirmed_goodput"] = confirmation["confirmed_goodput"]
    return None


def _start_confirmation_run(study: TuningStudy, problem: S.Problem, result: dict, best: dict, rate: float,
                            paired: bool) -> int | None:
    """The confirmation's next regression run: the winner against the current config (paired) at the first rate,
    the winner alone at the lower ones. None (and the reason in the result) when it cannot start."""
    import random

    from regressions.datasets import clean_items, write_version
    from regressions.service import RunError, create_run

    name = f"tuning-study-{study.id}"
    if paired:
        rng = random.Random(study.seed)
        items = []
        tokenizer = local_tokenizer(problem.current.model)
        max_len = problem.current.resolved().max_model_len
        for index in range(cfg("CONFIRM_ITEMS")):
            prompt, output = problem.workload.samples[rng.randrange(len(problem.workload.samples))]
            if max_len is not None and prompt + output > max_len:  # as the simulation fits them (Workload.requests)
                prompt = max(1, min(prompt, max_len - output))
                output = max(1, min(output, max_len - prompt))
            items.append({"id": f"w{index + 1}", "prompt": prompt_text(max(1, min(prompt, 8000)), rng, tokenizer),
                          "params": {"max_tokens": max(1, output), "ignore_eos": True, "temperature": 0}})
        items = clean_items((f"item {i + 1}", item, item["id"]) for i, item in enumerate(items))
        write_version(study.project, name, items, source="tuning", replace=True, created_by=study.created_by,
                      note=f"lengths of tuning study {study.id}'s workload")
    backend = group_backend(study.group)
    real = backend["backend"] == "vllm"
    options = {"rate": rate, "arrival": "poisson", "seed": study.seed, "burstiness": problem.workload.burstiness}
    if paired:
        options["arms"] = "in_turn" if real else "together"  # two real vLLM servers on this host's cores would
        # slow each other
    try:
        # On the group's own backend: real `vllm serve` processes for a group of real vLLM replicas.
        run = create_run(study.project, dataset=name, target_config=best["config"],
                         baseline_config=study.current_config if paired else None,
                         created_by=study.created_by or "tuning", options=options,
                         config_backend=backend if real else None)
    except RunError as exc:
        what = "the confirmation run" if paired else f"the confirmation's replay at {rate:g} req/s"
        result["confirmation"]["error"] = f"{what} could not start: {exc}"
        return None
    _update(study, confirmation_run=run, result=result)
    return run.id


def confirmation_figures(run, problem: S.Problem, rate: float) -> dict:
    """Measured SLO attainment per arm of the confirmation run, beside the simulator's prediction at that rate."""
    from regressions.models import Arm

    from .goodput import measure

    limits = problem.slo.thresholds
    arms: dict[str, dict] = {}
    replayed = 0
    for arm, label in ((Arm.CANDIDATE, "best"), (Arm.BASELINE, "current")):
        results = list(run.results.filter(arm=arm, warmup=False))
        replayed = max(replayed, len(results))
        results = results[int(len(results) * 0.1):]  # as in the simulation: the first 10% warm the engine up
        good = 0
        for r in results:
            m = r.metrics or {}
            ok = r.success and all(m.get(k) is not None and m[k] <= v for k, v in limits.items()
                                   if not (k == "tpot_ms" and (r.completion_tokens or 0) <= 1))
            good += ok
        arms[label] = {"requests": len(results), "attainment": good / len(results) if results else None}
    predicted = {}
    # As many requests as were replayed: beyond its goodput a short replay queues less than a long one, so a
    # prediction of the study's length would not be the same experiment.
    count = replayed or cfg("CONFIRM_ITEMS")
    for label, config in (("best", run.target.get("config")), ("current", (run.baseline_target or {}).get("config"))):
        if config:
            m = measure(EngineConfig.from_dict(config), problem.workload, problem.slo, rate, count=count,
                        seed=problem.seed)
            predicted[label] = m.attainment
    real = (run.target or {}).get("backend") == "vllm"
    out = {"run_id": run.id, "state": run.state, "verdict": run.verdict, "rate": round(rate, 4), "requests": count,
           "target": problem.slo.target, "measured": arms, "predicted_attainment": predicted,
           "backend": "vllm" if real else "simulator", "note": (
               "replayed on real vLLM: a `vllm serve` per config, started for the run with the launcher's command; "
               "the current config's replay, then the winner's (in turn: two servers would split this host's cores)"
               if real else "replayed on real-time simulated replicas (this host has no GPU): the engine simulator "
               "in real time, with HTTP, tokenisation and tracing on the path")}
    best = arms.get("best", {}).get("attainment")
    out["best"] = best
    if "best" in predicted and best is not None:
        out["gap_best"] = round(predicted["best"] - best, 4)
    current = arms.get("current", {}).get("attainment")
    if "current" in predicted and current is not None:
        out["gap_current"] = round(predicted["current"] - current, 4)
    return out


# ---------------------------------------------------------------------------------------------- sweep, proposal
def sweep() -> int:
    now = timezone.now()
    stale = now - dt.timedelta(seconds=cfg("STALE_SECONDS"))
    queued_for = now - dt.timedelta(seconds=cfg("QUEUED_GRACE_SECONDS"))
    running = (StudyState.SEARCHING, StudyState.RESCORING, StudyState.CONFIRMING)
    ids = list(TuningStudy.objects.filter(
        Q(state=StudyState.QUEUED, created_at__lt=queued_for) | Q(state__in=running, heartbeat_at__lt=stale),
        cancel_requested=False).values_list("id", flat=True)[:20])
    TuningStudy.objects.filter(state__in=running, heartbeat_at__lt=stale, cancel_requested=True).update(
        state=StudyState.CANCELLED, finished_at=now)
    for study_id in ids:
        enqueue_study(study_id)
    return len(ids)


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


def summary(study: TuningStudy, *, detail: bool = False) -> dict:
    """The study as the API and `manage.py tune --json` show it (goodput in requests/s)."""
    result = study.result or {}
    current = result.get("current") or {}
    best = result.get("best") or {}
    workload = dict(study.workload)
    workload.pop("samples", None)
    workload.pop("sample_buckets", None)
    out = {
        "study_id": study.id, "id": study.id, "project": study.project.name, "group": study.group,
        "state": study.state, "phase": study.phase, "objective": study.objective, "workload": workload,
        "slo": study.slo, "space": study.space, "trials_budget": study.trials,
        "trials": study.trials_done, "invalid_trials": study.invalid_trials,
        "retried_trials": study.retried_trials, "attempts": study.attempts,
        "current": {"config": study.current_config, "goodput": current.get("goodput")},
        "best": ({"config": best.get("config"), "goodput": best.get("goodput"),
                  "robust_score": best.get("robust_score"), "confirmed_goodput": result.get("confirmed_goodput")}
                 if best else None),
        "predicted_gain": result.get("predicted_gain"),
        "pareto": result.get("pareto", []),
        "message": result.get("message"), "error": study.error or None,
        "confirmation_run_id": study.confirmation_run_id, "proposal": study.proposal,
        "created_at": study.created_at.isoformat(), "created_by": study.created_by,
        "started_at": study.started_at.isoformat() if study.started_at else None,
        "finished_at": study.finished_at.isoformat() if study.finished_at else None,
        "simulated": True,
    }
    if detail:
        out.update({k: result.get(k) for k in ("explanation", "importances", "candidates", "grid_baseline",
                                               "confirmation", "replicas_for_peak")})
    return out
