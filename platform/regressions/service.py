"""A regression run's life: created (checked), claimed by a worker, replayed, analysed, done; or cancelled, or
ended in error. State lives in the database and moves by conditional updates (claims), so two workers never run
one run, and a run whose worker died (platform restart) is taken up again by the sweep: it resumes where its
results stop (finished requests are kept, the rest is sent), or analyses again.

    queued ──claim──► running ──► analysing ──► done (verdict pass | fail | inconclusive)
       │                 │  └─ cancel ─► cancelled          ▲
       └─ cancel ────────┴──── error (target gone, ...) ────┘ (an error names its reason)
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import statistics as pystats
import time
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from observatory import leases
from observatory.leases import SHUTTING_DOWN, LeaseLost

from . import gates as gates_module
from .datasets import resolve_version
from .evaluators import evaluators_for, score_output
from .models import ACTIVE_STATES, Arm, RegressionRun, RunResult, RunState, Verdict

log = logging.getLogger(__name__)


class _LazyRunner:
    """regressions.runner on first use (it imports aiohttp and the load generator's client): the API's module
    imports this one, and every process that loads the URLs (each `manage.py` command) need not pay for it."""

    def __getattr__(self, name):
        from . import runner as module

        return getattr(module, name)


runner = _LazyRunner()

ARRIVALS = ("poisson", "constant")
PREFETCH_SECONDS = 2.0  # while a run goes, the rows of requests finished this long ago are fetched every as often
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


def clean_options(options: dict | None) -> dict:
    """Load options checked and completed; raises RunError naming each problem."""
    options = dict(options or {})
    problems = []
    known = {"rate", "arrival", "burstiness", "max_concurrency", "repetitions", "warmup", "time_limit_s",
             "timeout_s", "seed", "reset_prefix_cache", "arms"}
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
    try:
        gate_config = gates_module.parse_gates(gates)
    except gates_module.GateError as exc:
        raise RunError(f"gates: {exc}", problems=exc.problems, field="gates") from None
    arms = 2 if baseline_target else 1
    total = dataset_version.item_count * clean["repetitions"] * arms
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
        transaction.on_commit(lambda: enqueue_run(run.id))
    return run


def enqueue_run(run_id: int) -> None:
    from .tasks import execute

    try:
        execute.delay(run_id)
    except Exception:  # broker away: the sweep starts queued runs too
        log.warning("could not enqueue regression run %s; the sweep will start it", run_id, exc_info=True)


def cancel(run: RegressionRun) -> bool:
    """Ask a run to stop; a queued run is cancelled at once. False when it has already ended."""
    now = timezone.now()
    if RegressionRun.objects.filter(id=run.id, state=RunState.QUEUED).update(
            state=RunState.CANCELLED, cancel_requested=True, finished_at=now):
        return True
    return bool(RegressionRun.objects.filter(id=run.id, state__in=ACTIVE_STATES).update(cancel_requested=True))


# -- execution -----------------------------------------------------------------------------------------------
def claim(run_id: int) -> RegressionRun | None:
    """Take a queued run, or one whose worker stopped beating (resume); None when another worker has it."""
    return leases.claim(RegressionRun, run_id, queued=RunState.QUEUED, started=RunState.RUNNING,
                        running=(RunState.RUNNING, RunState.ANALYSING), stale_seconds=cfg("STALE_SECONDS"))


class Interrupted(RuntimeError):
    pass


def Lease(run: RegressionRun) -> leases.Lease:  # noqa: N802 (used as the class it returns)
    return leases.Lease(run, "regression run", cfg("STALE_SECONDS"))


def _update(run: RegressionRun, **fields) -> None:
    """A write of the execution holding the lease; LeaseLost when another worker has the run now."""
    leases.leased_update(run, "regression run", **fields)


def _finish(run: RegressionRun, state: str, **fields) -> None:
    _update(run, state=state, finished_at=timezone.now(), heartbeat_at=timezone.now(), **fields)


def execute(run_id: int) -> str | None:
    """Run (or resume) a run to its end; returns the final state, None when not claimed (or taken over)."""
    run = claim(run_id)
    if run is None:
        return None
    log.info("regression run %s: %s (attempt %s)", run.id, "resuming" if run.attempts > 1 else "starting",
             run.attempts)
    try:
        rows: dict[str, dict] = {}  # decomposed rows fetched while the run goes, so few are left to wait for
        with Lease(run) as lease:
            if run.state == RunState.RUNNING:
                if not replay(run, lease, rows):
                    _finish(run, RunState.CANCELLED)
                    return RunState.CANCELLED
                _update(run, state=RunState.ANALYSING)
            analyse(run, lease, rows)
        return RunState.DONE
    except LeaseLost:
        log.warning("regression run %s: another worker took it over; this one stops", run.id)
        return None
    except Interrupted:
        log.info("regression run %s: interrupted by the worker's shutdown; it resumes after a restart", run.id)
        return None
    except runner.TargetError as exc:
        if SHUTTING_DOWN.is_set():
            return None
        _finish(run, RunState.ERROR, error=str(exc)[:2000])
        return RunState.ERROR
    except Exception as exc:
        if SHUTTING_DOWN.is_set():  # the store or the database went away under it: not the run's fault
            log.info("regression run %s: stopped by the shutdown (%s); it resumes after a restart", run.id, exc)
            return None
        log.exception("regression run %s failed", run.id)
        _finish(run, RunState.ERROR, error=f"{type(exc).__name__}: {exc}"[:2000])
        return RunState.ERROR


def _tracer_provider(project_name: str):
    from observatory.engine_link import engine_ingest_key, platform_traces_url

    from engine.telemetry import build_tracer_provider

    return build_tracer_provider(runner.SERVICE_NAME, endpoint=cfg("OTLP_ENDPOINT") or platform_traces_url(),
                                 protocol="http/protobuf",
                                 headers={"authorization": f"Bearer {engine_ingest_key(project_name)}"},
                                 schedule_delay_ms=200)


def _result(run: RegressionRun, slot: runner.Slot, record, started: float) -> RunResult:
    metrics = {"ttft_ms": record.ttft_ms, "tpot_ms": record.tpot_ms, "e2e_ms": record.e2e_ms,
               "itl_ms": pystats.fmean(record.itl_ms) if record.itl_ms else None}
    return RunResult(
        run=run, arm=slot.arm, item_id=slot.item["id"], repetition=slot.repetition, warmup=slot.warmup,
        trace_id=record.trace_id or "", success=record.success, status=record.status,
        error=(record.error or "")[:2000], output=record.output or "", finish_reason=record.finish_reason or "",
        prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
        metrics={k: v for k, v in metrics.items() if v is not None},
        sent_at=dt.datetime.fromtimestamp(started, tz=dt.timezone.utc))


def _wait_for_target(base_url: str, headers: dict[str, str], lease: Lease, wait: float | None = None) -> str:
    """The target's model, waiting up to TARGET_WAIT_SECONDS (or ``wait``) for it to answer (a resumed run may
    start before the fleet the restarted platform brings up is ready); TargetError after that."""
    wait = cfg("TARGET_WAIT_SECONDS") if wait is None else wait
    deadline = time.monotonic() + wait
    while True:
        try:
            return asyncio.run(runner._probe(base_url, headers, runner.PROBE_TIMEOUT))
        except runner.TargetError:
            if time.monotonic() >= deadline:
                raise
        lease.check()
        if SHUTTING_DOWN.is_set():
            raise Interrupted()
        time.sleep(1.0)


def _complete(row: dict | None) -> bool:
    return row is not None and row.get("service") == runner.SERVICE_NAME and (
        row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None)


def replay(run: RegressionRun, lease: Lease, rows: dict[str, dict] | None = None) -> bool:
    """Send what is left of the run; False when it was cancelled."""
    items = [item.as_dict() for item in run.dataset_version.items.order_by("position")]
    paired = run.baseline_target is not None
    slots = runner.plan(items, run.options, paired=paired)
    done = set(run.results.values_list("arm", "item_id", "repetition", "warmup"))
    remaining = [s for s in slots if (s.arm, s.item["id"], s.repetition, s.warmup) not in done]
    if not remaining:
        if run.requests_ended_at is None:
            _update(run, requests_ended_at=timezone.now())
        return True
    remaining = runner.rebase(remaining)
    targets = {Arm.CANDIDATE.value: dict(run.target)}
    if paired:
        targets[Arm.BASELINE.value] = dict(run.baseline_target)
    endpoints = {}
    notes = []
    replicas = _start_config_replicas(run, targets)
    try:
        return _replay(run, lease, rows, remaining, targets, endpoints, notes, done)
    finally:
        for replica in replicas:
            replica.stop()


def _start_config_replicas(run: RegressionRun, targets: dict[str, dict]) -> list:
    """Start the replica of each config target (simulated, or real vLLM when the target says so; its URL put in the
    target); the started ones."""
    from django.conf import settings as django_settings
    from observatory.engine_link import engine_ingest_key, platform_grpc_endpoint, platform_traces_url

    started = []
    for arm, target in targets.items():
        if target["kind"] != "config":
            continue
        traces_url = cfg("OTLP_ENDPOINT") or platform_traces_url()
        if target.get("backend") == "vllm":
            traces_url = cfg("OTLP_GRPC_ENDPOINT") or platform_grpc_endpoint()  # vLLM exports over gRPC only
        replica = runner.ConfigReplica(
            target, run_id=run.id, arm=arm, directory=django_settings.DATA_DIR / "regressions" / f"run-{run.id}",
            traces_url=traces_url, ingest_key=engine_ingest_key(run.project.name),
            seed=int(run.options.get("seed", 0)))
        try:
            target["url"] = replica.start()
        except Exception:
            for other in started:
                other.stop()
            raise
        started.append(replica)
    return started


def _replay(run, lease, rows, remaining, targets, endpoints, notes, done) -> bool:
    for arm, target in targets.items():
        base_url, headers = runner.endpoint_of(target)
        # A real vLLM started for the run needs its start-up (~20-60 s on CPU) on top of the usual wait.
        model = _wait_for_target(base_url, headers, lease,
                                 cfg("TARGET_WAIT_SECONDS") + (runner.VLLM_START_SECONDS
                                                               if target.get("backend") == "vllm" else 0.0))
        endpoints[arm] = runner.Endpoint(base_url, headers, model)
        if run.options.get("reset_prefix_cache") and run.attempts == 1:
            notes.append(f"{arm}: " + asyncio.run(runner.reset_prefix_cache(base_url, headers)))
    if notes:
        _update(run, summary={"notes": notes})
    provider = _tracer_provider(run.project.name)
    replay_ = runner.Replay(remaining, endpoints, run_id=run.id, tracer_provider=provider,
                            max_concurrency=run.options.get("max_concurrency"),
                            timeout=float(run.options.get("timeout_s") or 600.0),
                            time_limit=run.options.get("time_limit_s"))
    replay_.start()
    written = len(done)
    cancelled = False
    finished_at: list[tuple[float, str]] = []  # (monotonic time, trace id) of the requests finished so far
    next_fetch = time.monotonic() + PREFETCH_SECONDS
    try:
        while True:
            finished = replay_.done.wait(0.5)
            batch = []
            while True:
                try:
                    slot, record, started = replay_.finished.get_nowait()
                except Exception:  # queue.Empty
                    break
                batch.append(_result(run, slot, record, started))
                if record.success and record.trace_id and not slot.warmup:
                    finished_at.append((time.monotonic(), record.trace_id))
            if rows is not None and time.monotonic() >= next_fetch:
                next_fetch = time.monotonic() + PREFETCH_SECONDS
                settled = time.monotonic() - PREFETCH_SECONDS
                wanted = [t for at, t in finished_at if at <= settled and not _complete(rows.get(t))]
                if wanted:
                    from traces.store import get_store

                    rows.update(fetch_rows(get_store(), run.project_id, wanted[:5000]))
            if lease.lost or SHUTTING_DOWN.is_set():
                replay_.cancel()
                replay_.join(30)
                lease.check()
                raise Interrupted()
            if batch:
                RunResult.objects.bulk_create(batch, ignore_conflicts=True)
                written += len(batch)
                _update(run, progress_done=written)
            if lease.cancel_asked and not cancelled:
                cancelled = True
                replay_.cancel()
            if finished and replay_.finished.empty():
                break
        replay_.join()
    finally:
        provider.force_flush()
        provider.shutdown()
    if replay_.error is not None:
        raise replay_.error
    if cancelled:
        return False
    fields = {"requests_ended_at": timezone.now()}
    if replay_.stopped_early:
        fields["summary"] = {**(RegressionRun.objects.get(id=run.id).summary or {}),
                             "time_limit_reached": True}
    _update(run, **fields)
    return True


# -- analysis ------------------------------------------------------------------------------------------------
ROW_COLUMNS = ("trace_id", "e2e_ms", "ttft_ms", "tpot_ms", "engine_ttft_ms", "network_ms", "gateway_ms",
               "overhead_ms", "queue_ms", "prefill_ms", "decode_ms", "prompt_bucket", "prompt_tokens",
               "completion_tokens", "service")


def fetch_rows(store, project_id: int, trace_ids: list[str]) -> dict[str, dict]:
    """The decomposed request row of each trace (the one with the longest e2e if a trace has several)."""
    from traces.store import string_set

    out: dict[str, dict] = {}
    for start in range(0, len(trace_ids), 5000):
        chunk = trace_ids[start:start + 5000]
        ids_sql, ids = string_set("ids", chunk)
        rows = store.query(
            f"SELECT {', '.join(ROW_COLUMNS)} FROM {store.table('llm_requests')} FINAL "
            f"WHERE project_id = {{project_id:UInt32}} AND trace_id IN {ids_sql}",
            project_id=project_id, parameters={"ids": ids})
        for row in rows:
            data = dict(zip(ROW_COLUMNS, row))
            previous = out.get(data["trace_id"])
            if previous is None or (data["e2e_ms"] or 0) > (previous["e2e_ms"] or 0):
                out[data["trace_id"]] = data
    return out


def simulated(store, project_id: int, trace_ids: list[str]) -> bool:
    """Whether the engine spans of these traces came from the simulator (resource llm_observatory.simulated)."""
    from traces.store import string_set

    if not trace_ids:
        return False
    ids_sql, ids = string_set("ids", trace_ids[:200])
    rows = store.query(
        f"SELECT count() FROM {store.table('spans')} AS s "
        f"LEFT JOIN {store.table('span_resources')} AS r FINAL "
        "ON r.project_id = s.project_id AND r.resource_id = s.resource_id AND r.day = toDate(s.start_time) "
        f"WHERE s.project_id = {{project_id:UInt32}} AND s.trace_id IN {ids_sql} "
        "AND if(s.resource_id = 0, s.resource_attributes, r.attributes)['llm_observatory.simulated'] = 'true'",
        project_id=project_id, parameters={"ids": ids})
    return bool(rows and rows[0][0])


def _wait_for_rows(store, run: RegressionRun, trace_ids: list[str], lease: Lease,
                   rows: dict[str, dict] | None = None) -> dict[str, dict]:
    """The rows of the run's traces, once each is complete: its outermost hop is the run's own client span and it
    has the engine's figures (the spans of one request come from three exporters and are decomposed as they
    arrive; the row is rebuilt when the rest comes). A target that sends no engine spans (an untraced URL) is
    recognised when, UNTRACED_GRACE_SECONDS into the wait, no row has engine figures. After ROW_WAIT_SECONDS,
    what there is."""
    started = time.monotonic()
    deadline = started + cfg("ROW_WAIT_SECONDS")
    rows = {t: rows[t] for t in trace_ids if t in rows} if rows else {}

    def engine_seen() -> bool:
        return any(row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None for row in rows.values())

    def complete(trace_id: str, untraced: bool) -> bool:
        row = rows.get(trace_id)
        if row is None or row.get("service") != runner.SERVICE_NAME:
            return False
        return untraced or row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None

    while True:
        untraced = time.monotonic() - started >= cfg("UNTRACED_GRACE_SECONDS") and not engine_seen()
        missing = [t for t in trace_ids if not complete(t, untraced)]
        if missing:
            rows.update(fetch_rows(store, run.project_id, missing))
            missing = [t for t in missing if not complete(t, untraced)]
        if not missing or time.monotonic() >= deadline:
            return rows
        lease.check()
        if SHUTTING_DOWN.is_set():
            raise Interrupted()
        time.sleep(0.25)


def _as_dict(result: RunResult, has_evaluators: bool) -> dict:
    return {"item_id": result.item_id, "repetition": result.repetition, "success": result.success,
            "metrics": result.metrics or {}, "prompt_bucket": result.prompt_bucket, "passed": result.passed,
            "scores": result.scores or {}, "has_evaluators": has_evaluators}


def last_passing_run(run: RegressionRun) -> RegressionRun | None:
    return (RegressionRun.objects.filter(
        project_id=run.project_id, dataset_version__dataset_id=run.dataset_version.dataset_id, target=run.target,
        state=RunState.DONE, verdict=Verdict.PASS, id__lt=run.id).order_by("-id").first())


def _arm_summary(results: list[dict]) -> dict:
    total = len(results)
    errors = sum(1 for r in results if not r["success"])
    passed = [r["passed"] for r in results if r["passed"] is not None]
    out = {"requests": total, "errors": errors, "error_rate": (100.0 * errors / total) if total else None,
           "pass_rate": (100.0 * sum(passed) / len(passed)) if passed else None, "evaluated": len(passed)}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms"):
        values = [r["metrics"][metric] for r in results if r["success"] and r["metrics"].get(metric) is not None]
        out[metric] = gates_module._quantiles(values)
    return out


def analyse(run: RegressionRun, lease: Lease, rows: dict[str, dict] | None = None) -> None:
    """Join every result with its decomposed row, score the outputs, compare with the baseline, set the verdict."""
    from traces.store import get_store

    store = get_store()
    timings: dict[str, float] = {}
    clock = time.monotonic()
    results = list(run.results.filter(warmup=False).order_by("id"))
    trace_ids = [r.trace_id for r in results if r.trace_id and r.success]
    rows = _wait_for_rows(store, run, trace_ids, lease, rows)
    timings["rows_s"], clock = time.monotonic() - clock, time.monotonic()
    items = {item.item_id: item for item in run.dataset_version.items.all()}
    paired = run.baseline_target is not None
    baseline_run = None
    baseline_outputs: dict[tuple[str, int], str] = {}
    if paired:
        baseline_outputs = {(r.item_id, r.repetition): r.output for r in results
                            if r.arm == Arm.BASELINE and r.success}
    else:
        baseline_run = run.baseline_run or last_passing_run(run)
        if baseline_run is not None:
            baseline_outputs = {(r.item_id, r.repetition): r.output for r in baseline_run.results.filter(
                warmup=False, arm=Arm.CANDIDATE, success=True)}
    for result in results:
        row = rows.get(result.trace_id)
        if row is not None:
            result.prompt_bucket = row["prompt_bucket"] or ""
            result.row_found = row["service"] == runner.SERVICE_NAME
            for key in ROW_COLUMNS[1:11]:
                if row[key] is not None and not (isinstance(row[key], float) and math.isnan(row[key])):
                    result.metrics[key] = float(row[key])
        item = items.get(result.item_id)
        if item is None or not result.success:
            continue
        specs = evaluators_for(item.evaluators or [], item.expected, paired=paired or baseline_run is not None)
        reference = baseline_outputs.get((result.item_id, result.repetition)) if result.arm == Arm.CANDIDATE else None
        result.scores, result.passed = score_output(specs, result.output, expected=item.expected,
                                                    baseline_output=reference)
    timings["scores_s"], clock = time.monotonic() - clock, time.monotonic()
    lease.check()
    RunResult.objects.bulk_update(results, ["row_found", "prompt_bucket", "metrics", "scores", "passed"],
                                  batch_size=500)
    timings["write_s"], clock = time.monotonic() - clock, time.monotonic()
    has_evaluators = {item_id: bool(item.evaluators or item.expected is not None) for item_id, item in items.items()}
    candidate = [_as_dict(r, has_evaluators.get(r.item_id, False)) for r in results if r.arm == Arm.CANDIDATE]
    if paired:
        baseline = [_as_dict(r, has_evaluators.get(r.item_id, False)) for r in results if r.arm == Arm.BASELINE]
    elif baseline_run is not None:
        baseline = [_as_dict(r, has_evaluators.get(r.item_id, False))
                    for r in baseline_run.results.filter(warmup=False, arm=Arm.CANDIDATE)]
    else:
        baseline = None
    summary = dict(RegressionRun.objects.get(id=run.id).summary or {})
    summary["candidate"] = _arm_summary(candidate)
    summary["rows_found"] = sum(1 for r in results if r.row_found)  # with the run's client span as outermost hop
    if trace_ids and not any(_complete(row) for row in rows.values()):
        summary["untraced_note"] = (
            "no engine spans were found in this project for the run's requests: its figures are the client's and "
            "the gateway's only (an untraced target, or one whose spans go to another project: the managed "
            "fleet's go to the project of its ingest key)")
    summary["rows_expected"] = len(trace_ids)
    synthetic = simulated(store, run.project_id, trace_ids)
    if baseline is None:
        comparison = {"baseline": None, "gates": [], "metrics": [], "buckets": {}, "quality": [],
                      "note": "no baseline to compare with (no earlier passing run of this dataset and target): "
                              "this run's figures become the baseline once it passes"}
        error_rate = summary["candidate"]["error_rate"] or 0.0
        verdict = Verdict.FAIL if error_rate >= 50.0 else Verdict.PASS
        if verdict == Verdict.FAIL:
            comparison["gates"] = [{"metric": "error_rate", "verdict": "fail", "passed": False,
                                    "baseline": None, "candidate": error_rate,
                                    "reason": f"the candidate failed {error_rate:.0f}% of its requests"}]
    else:
        summary["baseline"] = _arm_summary(baseline)
        comparison = gates_module.compare(baseline, candidate, run.gates, paired=paired,
                                          seed=int(run.options.get("seed", 0)))
        comparison["baseline"] = ({"kind": "paired", "target": run.baseline_target} if paired
                                  else {"kind": "run", "run_id": baseline_run.id})
        verdict = comparison["verdict"]
    timings["compare_s"] = time.monotonic() - clock
    summary["analysis_timings"] = {k: round(v, 3) for k, v in timings.items()}
    if synthetic:
        summary["synthetic_note"] = ("outputs come from the engine simulator: their text is synthetic, so quality "
                                     "scores say nothing about a model; latencies are the simulator's model of "
                                     "vLLM on the configured GPU")
    _finish(run, RunState.DONE, verdict=verdict, comparison=comparison, summary=summary, synthetic=synthetic,
            baseline_run=baseline_run)
    log.info("regression run %s: %s", run.id, verdict)


def sweep() -> int:
    """Start queued runs nobody took and resume runs whose worker stopped beating; the number enqueued."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=cfg("STALE_SECONDS"))
    queued_for = now - dt.timedelta(seconds=cfg("QUEUED_GRACE_SECONDS"))
    ids = list(RegressionRun.objects.filter(
        Q(state=RunState.QUEUED, created_at__lt=queued_for)
        | Q(state__in=(RunState.RUNNING, RunState.ANALYSING), heartbeat_at__lt=stale),
        cancel_requested=False).values_list("id", flat=True)[:20])
    # A cancel asked of a run whose worker is gone: nobody else will finish it.
    RegressionRun.objects.filter(state__in=(RunState.RUNNING, RunState.ANALYSING), heartbeat_at__lt=stale,
                                 cancel_requested=True).update(state=RunState.CANCELLED, finished_at=now)
    for run_id in ids:
        enqueue_run(run_id)
    return len(ids)
