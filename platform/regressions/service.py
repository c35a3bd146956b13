"""A regression run's creation (checked: dataset version, targets, options, gates), its cancel, and the app's kind
of job: runs live in the database, a worker claims one with a conditional update (so two workers never run one
run), and the sweep enqueues queued runs nobody took and resumes runs whose worker died (regressions.execution
runs them).

    queued ──claim──► running ──► analysing ──► done (verdict pass | fail | inconclusive)
       │                 │  └─ cancel ─► cancelled          ▲
       └─ cancel ────────┴──── error (target gone, ...) ────┘ (an error names its reason)
"""
from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from jobs import dispatch
from jobs.dispatch import JobKind

from . import cache_sweep, runner
from . import gates as gates_module
from .datasets import resolve_version
from .models import ACTIVE_STATES, RegressionRun, RunState

ARRIVALS = ("poisson", "constant")
ARMS_ORDERS = ("together", "in_turn")
OPTION_LIMITS = {"repetitions": (1, 100), "warmup": (0, 1000), "max_concurrency": (1, 10_000)}


class RunError(ValueError):
    """A run that cannot be created: `problems` names each reason; `status` is the API's answer."""

    def __init__(self, message: str, status: int = 400, problems: list[str] | None = None, field: str = ""):
        super().__init__(message)
        self.status = status
        self.field = field
        self.problems = problems or [message]


def cfg(name: str) -> Any:
    return settings.REGRESSIONS[name]


RUNS = JobKind(model=RegressionRun, what="regression run", task="regressions.execute", queued=RunState.QUEUED,
               started=RunState.RUNNING, running=(RunState.RUNNING, RunState.ANALYSING),
               cancelled=RunState.CANCELLED, active=ACTIVE_STATES, stale_seconds=lambda: cfg("STALE_SECONDS"),
               queued_grace_seconds=lambda: cfg("QUEUED_GRACE_SECONDS"))


def clean_options(options: dict | None) -> dict:
    """Load options checked and completed; raises RunError naming each problem."""
    options = dict(options or {})
    problems = []
    known = {"rate", "arrival", "burstiness", "max_concurrency", "repetitions", "warmup", "time_limit_s",
             "timeout_s", "seed", "reset_prefix_cache", "arms", "cache_sweep"}
    unknown = set(options) - known
    if unknown:
        problems.append(f"unknown options {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
    out: dict[str, Any] = {}
    rate = options.get("rate", "inf")
    if rate in ("inf", None) or (isinstance(rate, float) and math.isinf(rate) and rate > 0):
        out["rate"] = "inf"
    elif isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= 10_000):
        problems.append("rate must be a number of requests per second in (0, 10000], or \"inf\" (all at once)")
    else:
        out["rate"] = float(rate)
    arrival = options.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        problems.append(f"arrival must be one of {', '.join(ARRIVALS)}")
    out["arrival"] = arrival
    burstiness = options.get("burstiness", 1.0)
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) or not 0 < burstiness <= 100:
        problems.append("burstiness (gamma shape; 1 = Poisson) must be a number in (0, 100]")
    out["burstiness"] = burstiness
    for key, (low, high) in OPTION_LIMITS.items():
        default = None if key == "max_concurrency" else (1 if key == "repetitions" else 0)
        value = options.get(key, default)
        if value is None:
            out[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            problems.append(f"{key} must be a whole number between {low} and {high}")
        out[key] = value
    for key, default, high in (("time_limit_s", None, 7 * 86400), ("timeout_s", 600.0, 3600)):
        value = options.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= high):
            problems.append(f"{key} must be a number of seconds in (0, {high}]")
        out[key] = value
    seed = options.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        problems.append("seed must be a whole number in [0, 2^31)")
    out["seed"] = seed
    arms = options.get("arms", "together")
    if arms not in ARMS_ORDERS:
        problems.append("arms must be together (a paired run sends both arms of an item at once) or in_turn "
                        "(the baseline's whole replay, then the candidate's)")
    out["arms"] = arms
    reset = options.get("reset_prefix_cache", False)
    if not isinstance(reset, bool):
        problems.append("reset_prefix_cache must be true or false")
    out["reset_prefix_cache"] = reset
    sweep, sweep_problems = cache_sweep.clean(options.get("cache_sweep"))
    problems.extend(sweep_problems)
    if sweep is not None:
        out["cache_sweep"] = sweep
    if problems:
        raise RunError("; ".join(problems), problems=problems, field="options")
    return out


def _baseline_run(project, baseline: str) -> RegressionRun:
    text = baseline.strip().removeprefix("run:")
    if not text.isdigit():
        raise RunError(f"no run {baseline!r}", field="baseline")
    found = RegressionRun.objects.filter(project=project, id=int(text)).first()
    if found is None:
        raise RunError(f"no run {text} in project {project.name}", field="baseline")
    if found.state != RunState.DONE:
        raise RunError(f"run {text} is {found.state}: a baseline must be a finished run", field="baseline")
    return found


def create_run(project, *, dataset: str, target: str | None = None, version: int | None = None,
               baseline: str | None = None, options: dict | None = None, gates: Any = None, created_by: str = "",
               check: bool = True, enqueue: bool = True, target_config: dict | None = None,
               baseline_config: dict | None = None, config_backend: dict | None = None) -> RegressionRun:
    """A new queued run, checked: the dataset version exists, the targets answer, options and gates are valid.
    `baseline`: a run id (`run:ID` or ID) to compare with, or a target (group:NAME / URL) replayed alongside
    (paired mode); None compares with the last passing run of the same dataset and target. `config_backend`
    ({"backend": "vllm", "served_model_name": ...}): config targets run on real `vllm serve` processes instead of
    simulated replicas (a study confirming on a group of real vLLM replicas)."""
    try:
        dataset_version = resolve_version(project, dataset, version)
    except LookupError as exc:
        raise RunError(str(exc), field="version" if version else "dataset") from None
    if (target is None) == (target_config is None):
        raise RunError("give a target (group:NAME or a URL) or a target config (vLLM knobs), one of them",
                       field="target")
    try:
        target_spec = runner.parse_target(target) if target is not None else runner.config_target(target_config)
    except runner.TargetError as exc:
        raise RunError(str(exc), field="target" if target is not None else "target_config") from None
    backend = {}
    if config_backend:
        try:
            backend = runner.backend_of(config_backend)
        except runner.TargetError as exc:
            raise RunError(str(exc), field="config_backend") from None
    if target_spec["kind"] == "config":
        target_spec.update(backend)
    baseline_target = baseline_run = None
    if baseline and baseline_config is not None:
        raise RunError("give a baseline or a baseline config, not both", field="baseline")
    if baseline_config is not None:
        try:
            baseline_target = runner.config_target(baseline_config)
        except runner.TargetError as exc:
            raise RunError(f"baseline: {exc}", field="baseline_config") from None
        baseline_target.update(backend)
    elif baseline:
        if baseline.strip().removeprefix("run:").isdigit():
            baseline_run = _baseline_run(project, baseline)
            if baseline_run.dataset_version.dataset_id != dataset_version.dataset_id:
                raise RunError(f"run {baseline_run.id} replayed another dataset", field="baseline")
        else:
            try:
                baseline_target = runner.parse_target(baseline)
            except runner.TargetError as exc:
                raise RunError(f"baseline: {exc}", field="baseline") from None
    clean = clean_options(options)
    sweep = clean.get("cache_sweep")
    if sweep is not None and (baseline_target is not None or target_spec["kind"] == "config"):
        raise RunError("a cache sweep replays one target through the gateway whose cache it measures (group:NAME "
                       "or the gateway's URL): no paired baseline, no engine config started for the run",
                       field="options")
    try:
        gate_config = gates_module.parse_gates(gates)
    except gates_module.GateError as exc:
        raise RunError(f"gates: {exc}", problems=exc.problems, field="gates") from None
    arms = 2 if baseline_target else 1
    total = dataset_version.item_count * clean["repetitions"] * arms
    if sweep is not None:  # each item once per threshold
        total += dataset_version.item_count * len(sweep["thresholds"])
    if total > cfg("MAX_REQUESTS"):
        raise RunError(f"the run would send {total} requests; the limit is {cfg('MAX_REQUESTS')}")
    if check:
        for field, spec in (("target", target_spec), ("baseline", baseline_target)):
            if spec is not None:
                try:
                    runner.check_target(spec)
                except runner.TargetError as exc:
                    raise RunError(str(exc), field=field) from None
    run = RegressionRun.objects.create(
        project=project, dataset_version=dataset_version, target=target_spec, baseline_target=baseline_target,
        baseline_run=baseline_run, options=clean, gates=gate_config, created_by=created_by[:150],
        progress_total=total + clean["warmup"] * arms)
    if enqueue:
        dispatch.enqueue_on_commit(RUNS, run.id)
    return run


def cancel(run: RegressionRun) -> bool:
    """Ask a run to stop; a queued run is cancelled at once. False when it has already ended."""
    return dispatch.cancel(RUNS, run)


def sweep() -> int:
    """Start queued runs nobody took and resume runs whose worker stopped beating; the number enqueued."""
    return dispatch.sweep(RUNS)
