"""A regression run's execution by the worker that claimed it: the replay of what is left of it (the config targets'
replicas started for it, finished requests written as they end, their rows fetched as they settle, the heartbeat
kept, a cancel watched for), then its analysis (regressions.analysis) and its end. Every write holds the run's
lease; a worker that lost it stops, and a worker that is stopping leaves the run to resume after the restart."""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import statistics as pystats
import time

from django.conf import settings
from django.utils import timezone
from fleet.wiring import engine_ingest_key, platform_grpc_endpoint, platform_traces_url
from jobs import dispatch, leases
from jobs.leases import SHUTTING_DOWN, Lease, LeaseLost
from traces.store import get_store

from engine.launcher.config_replica import ConfigReplica, ReplicaStartError
from engine.telemetry import build_tracer_provider

from . import cache_sweep, runner
from .analysis import Interrupted, analyse, complete_row
from .models import Arm, RegressionRun, RunResult, RunState
from .queries import TRACES_PER_QUERY, request_rows
from .service import RUNS, cfg

log = logging.getLogger(__name__)

PREFETCH_SECONDS = 2.0  # while a run goes, the rows of requests finished this long ago are fetched every as often


def _update(run: RegressionRun, **fields) -> None:
    """A write of the execution holding the lease; LeaseLost when another worker has the run now."""
    leases.leased_update(run, RUNS.what, **fields)


def _finish(run: RegressionRun, state: str, **fields) -> None:
    _update(run, state=state, finished_at=timezone.now(), heartbeat_at=timezone.now(), **fields)


def execute(run_id: int) -> str | None:
    """Run (or resume) a run to its end; returns the final state, None when not claimed (or taken over)."""
    run = dispatch.claim(RUNS, run_id, log)
    if run is None:
        return None
    try:
        rows: dict[str, dict] = {}  # decomposed rows fetched while the run goes, so few are left to wait for
        with dispatch.lease(RUNS, run) as lease:
            if run.state == RunState.RUNNING:
                if not replay(run, lease, rows):
                    _finish(run, RunState.CANCELLED)
                    return RunState.CANCELLED
                _update(run, state=RunState.ANALYSING)
            fields = analyse(get_store(), run, lease, rows)
            _finish(run, RunState.DONE, **fields)
            log.info("regression run %s: %s", run.id, fields["verdict"])
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
        sent_at=dt.datetime.fromtimestamp(started, tz=dt.timezone.utc),
        served_from=cache_sweep.served_from_of(record.served_from) if record.success else "")


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


def _start_config_replicas(run: RegressionRun, targets: dict[str, dict]) -> list[ConfigReplica]:
    """Start the replica of each config target (simulated, or real vLLM when the target says so; its URL put in the
    target); the started ones."""
    started = []
    for arm, target in targets.items():
        if target["kind"] != "config":
            continue
        otlp_endpoint = cfg("OTLP_ENDPOINT") or platform_traces_url()
        if target.get("backend") == "vllm":
            otlp_endpoint = cfg("OTLP_GRPC_ENDPOINT") or platform_grpc_endpoint()  # vLLM exports over gRPC only
        replica = ConfigReplica(
            target["config"], group=f"run-{run.id}-{arm}", name=arm,
            directory=settings.DATA_DIR / "regressions" / f"run-{run.id}", otlp_endpoint=otlp_endpoint,
            otlp_headers={"authorization": f"Bearer {engine_ingest_key(run.project.name)}"},
            backend=target.get("backend") or "simulator", served_model_name=target.get("served_model_name"),
            seed=int(run.options.get("seed", 0)))
        try:
            target["url"] = replica.start()
        except Exception as exc:
            for other in started:
                other.stop()
            if isinstance(exc, ReplicaStartError):  # its backend is not installed here: the run ends in error
                raise runner.TargetError(str(exc)) from None
            raise
        started.append(replica)
    return started


def _sweep_endpoints(run: RegressionRun, candidate: runner.Endpoint, sweep: dict) -> dict[str, runner.Endpoint]:
    """A cache sweep's arms: the candidate's replay with the gateway's cache bypassed, and each threshold's pass
    under a namespace of its own, named by the run's id and creation time (no other run's, the same when the run
    resumes)."""
    key = f"llm-regression-run-{run.id}-{int(run.created_at.timestamp())}"
    endpoints = {Arm.CANDIDATE.value: runner.Endpoint(candidate.base_url, {
        **candidate.headers, **cache_sweep.BYPASS_HEADERS}, candidate.model)}
    for threshold in sweep["thresholds"]:
        endpoints[cache_sweep.arm_of(threshold)] = runner.Endpoint(candidate.base_url, {
            **candidate.headers, **cache_sweep.pass_headers(key, threshold)}, candidate.model)
    return endpoints


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
    if run.options.get("cache_sweep"):
        endpoints.update(_sweep_endpoints(run, endpoints[Arm.CANDIDATE.value], run.options["cache_sweep"]))
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
                wanted = [t for at, t in finished_at if at <= settled and not complete_row(rows.get(t))]
                if wanted:
                    rows.update(request_rows(get_store(), run.project_id, wanted[:TRACES_PER_QUERY]))
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
